"""PPO with a critic: GAE, the dual-clip policy loss on per-token advantages and the clipped value
loss, against float64 NumPy transcriptions of verl 0.3.1's formulas (token loops, no vectorisation)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import rl
from test_rl_policy_gradient import numeric_gradient, verl_agg_loss, verl_mini_batch_loss

T = 9


def ragged_batch(seed, B=6):
    """Right-padded responses of different lengths (one of a single token, one full), values that are
    non-zero on the padding too (compute_gae must not read them), 0/1 rewards."""
    rs = np.random.RandomState(seed)
    lengths = rs.randint(1, T + 1, B)
    lengths[0], lengths[1] = 1, T
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    values = rs.randn(B, T).astype(np.float32)
    rewards = rs.randint(0, 2, B).astype(np.float32)
    rewards[:2] = (1.0, 0.0)
    return mask, values, rewards, lengths


def ref_gae(rewards, values, lengths, gamma, lam):
    """Advantages (whitened over all response tokens, unbiased variance) and returns, float64: the
    reward on the last token, V = 0 after it, A_t = sum_k (gamma lam)^k delta_{t+k}."""
    B = len(rewards)
    adv, ret = np.zeros((B, T)), np.zeros((B, T))
    for i in range(B):
        L = lengths[i]
        v = [float(values[i, t]) for t in range(L)] + [0.0]
        r = [0.0] * (L - 1) + [float(rewards[i])]
        deltas = [r[t] + gamma * v[t + 1] - v[t] for t in range(L)]
        for t in range(L):
            adv[i, t] = sum((gamma * lam) ** k * deltas[t + k] for k in range(L - t))
            ret[i, t] = adv[i, t] + v[t]
    live = [adv[i, t] for i in range(B) for t in range(lengths[i])]
    mean, var = np.mean(live), np.var(live, ddof=1)
    return (adv - mean) / np.sqrt(var + 1e-8), ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_compute_gae_matches_the_float64_recursion_on_ragged_masks(gamma, lam):
    mask, values, rewards, lengths = ragged_batch(seed=int(100 * gamma + 10 * lam))
    token_rewards = rl.last_token_rewards(jnp.asarray(rewards), jnp.asarray(mask))
    want_tokens = np.zeros((len(rewards), T))
    want_tokens[np.arange(len(rewards)), lengths - 1] = rewards
    np.testing.assert_array_equal(np.asarray(token_rewards), want_tokens)
    advantages, returns = jax.jit(rl.compute_gae, static_argnums=(3, 4))(token_rewards, jnp.asarray(values),
                                                                         jnp.asarray(mask), gamma, lam)
    want_adv, want_ret = ref_gae(rewards, values, lengths, gamma, lam)
    live = mask > 0
    np.testing.assert_allclose(np.asarray(advantages)[live], want_adv[live], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(returns)[live], want_ret[live], rtol=1e-5, atol=1e-5)
    whitened = np.asarray(advantages, np.float64)[live]
    assert abs(whitened.mean()) < 1e-5 and abs(whitened.std(ddof=1) - 1.0) < 1e-4


def test_gae_padding_does_not_leak():
    mask, values, rewards, _ = ragged_batch(seed=3)
    out = rl.compute_gae(rl.last_token_rewards(jnp.asarray(rewards), jnp.asarray(mask)), jnp.asarray(values),
                         jnp.asarray(mask), 0.99, 0.95)
    noisy = np.where(mask > 0, values, 1e3 * np.random.RandomState(0).randn(*values.shape)).astype(np.float32)
    again = rl.compute_gae(rl.last_token_rewards(jnp.asarray(rewards), jnp.asarray(mask)), jnp.asarray(noisy),
                           jnp.asarray(mask), 0.99, 0.95)
    for a, b in zip(out, again):
        np.testing.assert_allclose(np.asarray(a)[mask > 0], np.asarray(b)[mask > 0], rtol=1e-6)
    with pytest.raises(ValueError, match="lam=1.5"):
        rl.compute_gae(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)), 1.0, 1.5)
    with pytest.raises(ValueError, match="must all be \\[B, T\\]"):
        rl.compute_gae(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)), 1.0, 1.0)


def ref_ppo_token_losses(logp, old_logp, adv, eps_low=0.2, eps_high=0.2, c=3.0):
    """verl compute_policy_loss's pg_losses, token by token, with per-token advantages."""
    out = np.zeros(logp.shape)
    for i, t in itertools.product(*map(range, logp.shape)):
        ratio = np.exp(float(logp[i, t]) - float(old_logp[i, t]))
        a = float(adv[i, t])
        loss = max(-a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high))
        out[i, t] = min(loss, -a * c) if a < 0 else loss
    return out


def ref_value_token_losses(vpreds, values, returns, clip=0.5):
    """verl compute_value_loss's max of the unclipped and clipped squared errors, token by token."""
    out = np.zeros(vpreds.shape)
    for i, t in itertools.product(*map(range, vpreds.shape)):
        v, v_old, r = float(vpreds[i, t]), float(values[i, t]), float(returns[i, t])
        clipped = min(max(v, v_old - clip), v_old + clip)
        out[i, t] = max((v - r) ** 2, (clipped - r) ** 2)
    return out


def ppo_batch(seed, B=8):
    rs = np.random.RandomState(seed)
    mask, old_values, rewards, _ = ragged_batch(seed, B)
    logp = -rs.exponential(1.0, (B, T)).astype(np.float32)
    old_logp = (logp + 0.6 * rs.randn(B, T)).astype(np.float32)
    old_logp[::2, 0] = logp[::2, 0] - 1.5  # ratio e^1.5 > 3: where A < 0, the dual clip
    advantages = rs.randn(B, T).astype(np.float32)
    returns = (old_values + rs.randn(B, T)).astype(np.float32)
    vpreds = (old_values + 0.8 * rs.randn(B, T)).astype(np.float32)  # some beyond the 0.5 value clip
    return mask, logp, old_logp, advantages, old_values, returns, vpreds


@pytest.mark.parametrize("mode", rl.LOSS_AGG_MODES)
def test_ppo_policy_loss_matches_numpy(mode):
    mask, logp, old_logp, adv, *_ = ppo_batch(seed=1)
    ratio = np.exp(logp.astype(np.float64) - old_logp)
    live = mask > 0
    assert ((adv < 0) & (ratio > 3) & live).any() and ((adv > 0) & (ratio > 1.2) & live).any()
    for options, micro in ((dict(), None), (dict(loss_scale="verl", verl_micro_batch_size=4), 4)):
        fn = lambda lp: rl.ppo_policy_loss(lp, jnp.asarray(old_logp), jnp.asarray(adv), jnp.asarray(mask),  # noqa: E731
                                           loss_agg_mode=mode, **options)[0]
        loss, grad = jax.value_and_grad(fn)(jnp.asarray(logp))

        def reference(lp):
            losses = ref_ppo_token_losses(lp, old_logp, adv)
            if micro:  # verl's scale: micro-batches of 4 responses
                return verl_mini_batch_loss(losses, mask, mode, micro, ranks=1)
            whole = verl_agg_loss(losses, mask, mode)  # "mean": the batch at once, and a mean over responses
            return whole / len(mask) if mode == "seq-mean-token-sum-norm" else whole

        np.testing.assert_allclose(float(loss), reference(logp), rtol=2e-5, atol=1e-7, err_msg=str(options))
        np.testing.assert_allclose(np.asarray(grad), numeric_gradient(reference, logp), rtol=1e-4, atol=1e-7)
    _, metrics = rl.ppo_policy_loss(*map(jnp.asarray, (logp, old_logp, adv, mask)))
    assert 0 < float(metrics["ppo/clipfrac"]) < 1 and 0 < float(metrics["ppo/clipfrac_dual"]) < 1


def test_value_loss_matches_numpy():
    mask, *_, old_values, returns, vpreds = ppo_batch(seed=2)
    assert (np.abs(vpreds - old_values)[mask > 0] > 0.5).any()
    fn = lambda v: rl.value_loss(v, jnp.asarray(old_values), jnp.asarray(returns), jnp.asarray(mask))  # noqa: E731
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(vpreds))

    def reference(v):  # 0.5 * masked token mean (verl 0.3.1)
        losses = ref_value_token_losses(v, old_values, returns)
        return 0.5 * (losses * mask).sum() / mask.sum()

    np.testing.assert_allclose(float(loss), reference(vpreds), rtol=2e-5)
    np.testing.assert_allclose(np.asarray(grad), numeric_gradient(reference, vpreds), rtol=1e-4, atol=1e-7)
    live = mask > 0
    unclipped = (vpreds - returns) ** 2
    clipped = (np.clip(vpreds, old_values - 0.5, old_values + 0.5) - returns) ** 2
    np.testing.assert_allclose(float(metrics["critic/value_clipfrac"]), (clipped > unclipped)[live].mean(), rtol=1e-6)
    residual, target = (returns - vpreds)[live].astype(np.float64), returns[live].astype(np.float64)
    np.testing.assert_allclose(float(metrics["critic/explained_variance"]), 1 - residual.var() / target.var(),
                               rtol=1e-4)
    with pytest.raises(ValueError, match="clip_range_value=0"):
        rl.value_loss(*map(jnp.asarray, (vpreds, old_values, returns, mask)), clip_range_value=0)
