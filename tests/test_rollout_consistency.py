"""The sampler / pi_old mismatch metrics of every step (training/rollout_consistency.py) against numpy,
and the refusal of a step above ``rollout.max_logprob_diff``. The metrics of real runs: the demo in
float32 (tests/test_train_real_config.py: below 1e-4), the paper setups in bfloat16
(tests/test_train_paper_setups.py) and the PPO demo (tests/test_train_ppo_resume.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pacs_jax.training.learner.rollout_consistency import METRICS, RolloutMismatchError, check, consistency_program


def test_metrics_cover_the_response_tokens_only_and_match_numpy():
    rng = np.random.default_rng(0)
    B, N, R, K = 4, 6, 5, 2
    sampler = -rng.uniform(0.1, 3.0, size=(B, N)).astype(np.float32)
    old = (sampler[:, :R] + rng.normal(0, 0.1, size=(B, R))).astype(np.float32)
    mask = (np.arange(R)[None, :] < np.array([5, 2, 0, 3])[:, None]).astype(np.float32)
    old[mask == 0] = 7.0  # whatever pi_old holds off the responses is not compared
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        out = consistency_program()(tuple(np.split(sampler, K)), old, mask)
    assert set(out) == set(METRICS)
    log_ratio = (old - sampler[:, :R])[mask == 1]
    np.testing.assert_allclose(float(out["rollout_logprob_diff_mean"]), np.abs(log_ratio).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(out["rollout_logprob_diff_max"]), np.abs(log_ratio).max(), rtol=1e-5)
    np.testing.assert_allclose(float(out["rollout_kl"]), np.mean(np.exp(log_ratio) - 1 - log_ratio), rtol=1e-4)


def test_a_step_above_the_limit_is_refused_in_one_line_and_zero_only_reports():
    metrics = {"rollout_logprob_diff_mean": 0.01, "rollout_logprob_diff_max": 0.5, "rollout_kl": 0.001}
    check(metrics, 0.0)
    check(metrics, 0.5)
    with pytest.raises(RolloutMismatchError, match=r"^rollout.max_logprob_diff: .* up to 0.5 .* above the 0.1 allowed"):
        check(metrics, 0.1)
    with pytest.raises(RolloutMismatchError):
        check({**metrics, "rollout_logprob_diff_max": float("nan")}, 0.1)


def test_the_kl_estimate_of_tiny_differences_is_their_square_not_rounding_noise():
    """float32 differences of 1e-7 (the CPU demo's): k3 = x^2 / 2 to float32 precision, never below 0."""
    x = np.array([[1e-7, -2e-7, 3e-3, -0.5]], np.float32)
    sampler = np.zeros((1, 4), np.float32)
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        out = consistency_program()((sampler,), x, np.ones((1, 4), np.float32))
        small = consistency_program()((sampler[:, :2],), x[:, :2], np.ones((1, 2), np.float32))
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(float(out["rollout_kl"]), np.mean(np.expm1(x64) - x64), rtol=1e-6)
    np.testing.assert_allclose(float(small["rollout_kl"]), np.mean(x64[:, :2] ** 2 / 2), rtol=1e-5)
