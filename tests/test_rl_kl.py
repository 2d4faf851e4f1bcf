"""The KL loss (pacs_jax/rl/kl.py) against float64 NumPy statements of verl 0.9.1's ``kl_penalty`` /
``kl_penalty_forward`` (its wheel's verl/trainer/ppo/core_algos.py lines 2188-2251) and of its actor's
``policy_loss += kl_loss * kl_loss_coef`` (verl/workers/utils/losses.py lines 131-141), through the
update's loss (rl/loss_and_grad.py) on a tiny random Qwen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import models
from pacs_jax.rl import loss_and_grad_fn, response_logprobs
from pacs_jax.rl.kl import KL_LOSS_TYPES, kl_penalty
from pacs_jax.rl.loss_and_grad import KLLoss
from pacs_jax.rl.update_batch import UpdateBatch


def verl_kl_penalty_forward(logprob: np.ndarray, ref_logprob: np.ndarray, kind: str) -> np.ndarray:
    """verl 0.9.1 core_algos.kl_penalty_forward, float64, line for line."""
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return np.abs(logprob - ref_logprob)
    if kind in ("mse", "k2"):
        return 0.5 * np.square(logprob - ref_logprob)
    if kind in ("low_var_kl", "k3"):
        kl = np.clip(ref_logprob - logprob, -20, 20)
        ratio = np.exp(kl)
        return np.clip(ratio - kl - 1, -10, 10)
    raise NotImplementedError(kind)


def verl_kl_penalty(logprob, ref_logprob, kind):
    """verl 0.9.1 core_algos.kl_penalty's value (the "+" forms' value is their forward estimator's)."""
    return verl_kl_penalty_forward(logprob, ref_logprob, kind[:-1] if kind.endswith("+") else kind)


def _pair(seed=0, shape=(4, 9)):
    rng = np.random.default_rng(seed)
    ref = np.log(rng.uniform(0.01, 1.0, shape))
    logp = ref + rng.normal(0, 0.7, shape)
    logp[0, :3] = ref[0, :3] - 30.0  # far apart: k3's clamps at 20 and 10 bind
    logp[1, :2] = ref[1, :2] + 25.0
    return logp, ref


@pytest.mark.parametrize("kind", KL_LOSS_TYPES)
def test_kl_penalty_is_verls_for_every_type(kind):
    logp, ref = _pair()
    got = np.asarray(kl_penalty(jnp.asarray(logp, jnp.float32), jnp.asarray(ref, jnp.float32), kind), np.float64)
    want = verl_kl_penalty(logp, ref, kind)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", [k for k in KL_LOSS_TYPES if k.endswith("+")])
def test_the_straight_through_forms_take_k2s_gradient(kind):
    """verl's "+": backward_score - backward_score.detach() + forward_score.detach(): d/dlogp is k2's, logp - ref."""
    logp, ref = _pair(seed=1)
    grad = jax.grad(lambda x: jnp.sum(kl_penalty(x, jnp.asarray(ref, jnp.float32), kind)))(jnp.asarray(logp, jnp.float32))
    np.testing.assert_allclose(np.asarray(grad, np.float64), logp - ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny():
    cfg = models.QwenConfig(model_type="qwen3", vocab_size=512, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            tie_word_embeddings=True, attention_bias=False)
    return nnx.split(models.init_random(cfg, seed=0))


def _logprobs(graphdef, params, batch) -> jax.Array:
    """The policy's log-probs of ``batch``'s 6 response tokens [B, 6] (rl.response_logprobs), jitted."""
    return jax.jit(lambda params, ids, attention: response_logprobs(nnx.merge(graphdef, params), ids, attention, 6))(
        params, batch.input_ids, batch.attention_mask)


def _update_batch(seed=0, B=8, P=4, R=6):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 512, (B, P + R)).astype(np.int32)
    response_mask = (np.arange(R)[None] < rng.integers(2, R + 1, B)[:, None]).astype(np.float32)
    attention = np.concatenate([np.ones((B, P), np.int32), response_mask.astype(np.int32)], axis=1)
    return UpdateBatch(input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(attention),
                       response_mask=jnp.asarray(response_mask), old_logp=jnp.zeros((B, R), jnp.float32),
                       rewards=jnp.asarray(rng.integers(0, 2, B).astype(np.float32)))


@pytest.mark.parametrize("objective, agg, kind", [("pacs", "token-mean", "low_var_kl"),
                                                 ("grpo", "seq-mean-token-sum-norm", "k1+")])
def test_every_objectives_loss_gains_coef_times_its_aggregated_kl(tiny, objective, agg, kind):
    """verl's actor: policy_loss + kl_loss_coef * agg_loss(kld, response_mask, loss_agg_mode); PACS, which has no
    loss_agg_mode, as verl's actor default (token-mean). Two micro-batches: normalised by the whole batch."""
    graphdef, params = tiny
    batch = _update_batch()
    logp = np.asarray(_logprobs(graphdef, params, batch), np.float64)
    ref = logp + np.random.default_rng(2).normal(0, 0.3, logp.shape)
    batch = batch.replace(old_logp=jnp.asarray(logp, jnp.float32), ref_logp=jnp.asarray(ref, jnp.float32))
    mask = np.asarray(batch.response_mask, np.float64)
    coef = 0.05
    plain = loss_and_grad_fn(graphdef, objective, group_size=2, num_micro_batches=2)
    with_kl = loss_and_grad_fn(graphdef, objective, group_size=2, num_micro_batches=2, kl=KLLoss(kind, coef))
    # both updates' losses in one program (the trainer jits its update; op by op, they compiled 120 programs)
    (loss0, _, _), (loss1, metrics, _) = jax.jit(lambda params, batch: (plain(params, batch), with_kl(params, batch)))(
        params, batch)
    kld = verl_kl_penalty(logp, ref, kind)
    if agg == "token-mean":
        want = np.sum(kld * mask) / mask.sum()
    else:  # ours and verl 0.3.1's: token sums over the batch's rows x R
        want = np.sum(kld * mask) / (mask.shape[0] * mask.shape[1])
    np.testing.assert_allclose(float(metrics["actor/kl_loss"]), want, rtol=1e-4)
    np.testing.assert_allclose(float(loss1) - float(loss0), coef * want, rtol=1e-3, atol=1e-7)
    assert float(metrics["actor/kl_coef"]) == pytest.approx(coef)


def test_the_kl_loss_is_zero_when_the_policy_is_the_reference(tiny):
    """LoRA's first step: B = 0, so pi_theta is the reference (the adapters off) and every estimator gives 0 (to
    float32 round-off: the update's forward and the reference pass are two programs)."""
    graphdef, params = tiny
    batch = _update_batch(seed=3)
    logp = _logprobs(graphdef, params, batch)
    batch = batch.replace(old_logp=logp, ref_logp=logp)
    update = jax.jit(loss_and_grad_fn(graphdef, "grpo", group_size=2, kl=KLLoss("low_var_kl", 1.0)))
    _, metrics, _ = update(params, batch)
    assert abs(float(metrics["actor/kl_loss"])) < 1e-6  # through the update's loss (one program)
    for kind in KL_LOSS_TYPES:  # every estimator of the same log-probs: exactly 0
        assert not np.any(np.asarray(kl_penalty(logp, logp, kind))), kind
