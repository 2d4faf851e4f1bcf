"""GSPO and CISPO (verl's compute_policy_loss_gspo / _cispo) against float64 NumPy statements of their
formulas: loss and gradient with respect to log pi_theta, in every aggregation mode CISPO takes (GSPO's
is pinned to seq-mean-token-mean), with and without rollout-correction weights, through the public
losses and the registry's objectives (GRPO's group advantages)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import rl

B, T, N = 8, 10, 4
LENGTHS = np.array([10, 6, 1, 3, 10, 8, 0, 5])  # row 6: no response token


def _batch(seed=0, spread=0.3):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.2, 0.6, (B, T))
    old = logp + rng.normal(0.0, spread, (B, T))
    mask = (np.arange(T)[None, :] < LENGTHS[:, None]).astype(np.float64)
    rewards = np.array([1, 0, 0, 1, 1, 1, 0, 0], np.float64)
    weights = rng.uniform(0.0, 2.0, (B, T)) * mask
    return logp, old, mask, rewards, weights


def grpo_advantages(rewards):
    g = rewards.reshape(-1, N)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)


def agg_coefficients(mask, mode, norm_length=None):
    """d(aggregate)/d(token loss) [B, T] of verl's agg_loss over one batch (loss_scale "mean")."""
    n = mask.sum(-1, keepdims=True)
    if mode == "token-mean":
        return mask / max(mask.sum(), 1.0)
    if mode == "seq-mean-token-mean":
        return mask / np.maximum(n, 1.0) / B
    if mode == "seq-mean-token-sum":
        return mask / B
    return mask / (B * (norm_length or T))  # seq-mean-token-sum-norm


def gspo_reference(logp, old, mask, adv, weights, lo, hi):
    """(loss, dloss/dlogp): s_i the masked mean log-ratio; the token ratio's value exp(min(s_i, 10)),
    its gradient rho through the token's own log-prob; PPO-clip without a dual clip."""
    s = np.sum((logp - old) * mask, -1) / np.maximum(mask.sum(-1), 1.0)
    rho = np.broadcast_to(np.exp(np.minimum(s, 10.0))[:, None], logp.shape)
    a = adv[:, None]
    unclipped, clipped = -a * rho, -a * np.clip(rho, 1 - lo, 1 + hi)
    losses = np.maximum(unclipped, clipped)
    dlosses = np.where(clipped > unclipped, 0.0, -a * rho) * (s[:, None] < 10.0)
    w = np.ones_like(logp) if weights is None else weights
    coef = agg_coefficients(mask, "seq-mean-token-mean")
    return np.sum(coef * w * losses), coef * w * dlosses


def cispo_reference(logp, old, mask, adv, weights, lo, hi, mode):
    """(loss, dloss/dlogp): l = -sg(clip(rho)) A log pi_theta, aggregated by ``mode``."""
    rho = np.exp(np.clip(logp - old, -20, 20))
    c = np.clip(rho, 1 - lo, 1 + hi)
    a = adv[:, None]
    w = np.ones_like(logp) if weights is None else weights
    coef = agg_coefficients(mask, mode)
    return np.sum(coef * w * (-c * a * logp)), coef * w * (-c * a)


def _loss_and_grad(fn, logp, *args, **kwargs):
    (loss, metrics), grad = jax.value_and_grad(lambda lp: fn(lp, *args, **kwargs), has_aux=True)(
        jnp.asarray(logp, jnp.float32))
    return float(loss), np.asarray(grad, np.float64), metrics


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_policy_loss(with_weights, clip):
    logp, old, mask, rewards, weights = _batch()
    adv = grpo_advantages(rewards)
    w = weights if with_weights else None
    loss, grad, metrics = _loss_and_grad(
        rl.gspo_policy_loss, logp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
        jnp.asarray(mask, jnp.float32), clip_ratio_low=clip[0], clip_ratio_high=clip[1],
        rollout_is_weights=None if w is None else jnp.asarray(w, jnp.float32))
    f32 = [np.asarray(x, np.float32).astype(np.float64) for x in (logp, old)]
    want_loss, want_grad = gspo_reference(*f32, mask, adv, w, *clip)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    assert 0.0 <= float(metrics["clipfrac"]) <= 1.0


def test_gspo_refuses_another_aggregation():
    logp, old, mask, rewards, _ = (jnp.asarray(x, jnp.float32) for x in _batch())
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        rl.gspo_policy_loss(logp, old, rewards, mask, loss_agg_mode="token-mean")
    with pytest.raises(rl.OptionError, match="loss_agg_mode"):
        rl.get_objective("gspo", loss_agg_mode="token-mean")


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("mode", rl.LOSS_AGG_MODES)
def test_cispo_policy_loss(mode, with_weights):
    logp, old, mask, rewards, weights = _batch(spread=0.5)
    adv = grpo_advantages(rewards)
    w = weights if with_weights else None
    loss, grad, metrics = _loss_and_grad(
        rl.cispo_policy_loss, logp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
        jnp.asarray(mask, jnp.float32), loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28,
        rollout_is_weights=None if w is None else jnp.asarray(w, jnp.float32))
    f32 = [np.asarray(x, np.float32).astype(np.float64) for x in (logp, old)]
    want_loss, want_grad = cispo_reference(*f32, mask, adv, w, 0.2, 0.28, mode)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    rho = np.exp(f32[0] - f32[1])
    clipped = (rho < 0.8) | (rho > 1.28)
    np.testing.assert_allclose(float(metrics["clipfrac"]), (clipped * mask).sum() / mask.sum(), rtol=1e-5)
    assert 0 < float(metrics["clipfrac"]) < 1  # the clip acts on this batch, and the gradient still flows there


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_registry_objectives_use_grpo_advantages(name):
    logp, old, mask, rewards, weights = _batch()
    objective = rl.get_objective(name)
    args = [jnp.asarray(x, jnp.float32) for x in (old, mask, rewards)]
    loss, grad, metrics = _loss_and_grad(objective, logp, args[0], args[1], args[2], N,
                                         rollout_is_weights=jnp.asarray(weights, jnp.float32))
    adv = grpo_advantages(rewards)
    f32 = [np.asarray(x, np.float32).astype(np.float64) for x in (logp, old)]
    if name == "gspo":
        want_loss, want_grad = gspo_reference(*f32, mask, adv, weights, 3e-4, 4e-4)
    else:
        want_loss, want_grad = cispo_reference(*f32, mask, adv, weights, 10.0, 0.2, "token-mean")
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(float(metrics["pg/advantage_mean"]), adv.mean(), atol=1e-6)
