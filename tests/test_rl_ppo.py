"""PPO with a critic: GAE, the dual-clip policy loss on per-token advantages and the clipped value
loss, against float64 NumPy transcriptions of verl 0.3.1's formulas (token loops, no vectorisation);
the critic's against the verl copy the PACS authors bundle (src/verl, 0.3.1.dev): its value loss
without a 1/2, its mask shifted by one slot and its aggregation inherited from the actor."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import rl
from pacs_jax.training.spec import RunSpec
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


def verl_critic_mini_batch_loss(vpreds, values, returns, attention_mask, mode, micro_batch_size, ranks,
                                cliprange_value=0.5):
    """The loss whose gradient the authors' verl (src/verl, 0.3.1.dev) applies to its critic for one
    mini-batch, float64 and written out from its sources: dp_critic.update_critic gives each of
    ``ranks`` ranks a contiguous share, splits it into micro-batches of ``micro_batch_size``
    (critic.ppo_micro_batch_size_per_gpu) and back-propagates vf_loss / gradient_accumulation of each
    (the ranks' gradients are averaged); its mask is ``attention_mask[:, -R - 1:-1]``;
    core_algos.compute_value_loss is agg_loss(max((vpred - ret)^2, (clip(vpred, v -/+ 0.5) - ret)^2))
    with no 1/2; agg_loss's seq-mean-token-sum-norm divides by the mask's width."""
    vpreds, values, returns = (np.asarray(a, np.float64) for a in (vpreds, values, returns))
    R = vpreds.shape[1]
    response_mask = np.asarray(attention_mask, np.float64)[:, -R - 1:-1]
    per_rank = len(vpreds) // ranks
    gradient_accumulation = per_rank // micro_batch_size
    rank_losses = []
    for r in range(ranks):
        total = 0.0
        for start in range(r * per_rank, (r + 1) * per_rank, micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            vp, v, ret, m = vpreds[rows], values[rows], returns[rows], response_mask[rows]
            clipped = np.minimum(np.maximum(vp, v - cliprange_value), v + cliprange_value)
            losses = np.maximum((vp - ret) ** 2, (clipped - ret) ** 2)
            if mode == "token-mean":
                vf_loss = (losses * m).sum() / m.sum()
            elif mode == "seq-mean-token-sum":
                vf_loss = (losses * m).sum(axis=-1).mean()
            elif mode == "seq-mean-token-mean":
                vf_loss = ((losses * m).sum(axis=-1) / m.sum(axis=-1)).mean()
            else:  # seq-mean-token-sum-norm
                vf_loss = (losses * m).sum(axis=-1).sum() / m.shape[-1]
            total += vf_loss / gradient_accumulation
        rank_losses.append(total)
    return np.mean(rank_losses)


def critic_batch(seed, B=16, P=3):
    """A ragged update batch as the trainer lays it out: attention_mask [B, P + T] (left-padded prompts,
    right-padded responses, one of them of all T tokens, one of a single token), the rollout's values,
    returns and the current predictions [B, T] (some beyond the 0.5 value clip)."""
    mask, *_, old_values, returns, vpreds = ppo_batch(seed, B)
    prompt = np.zeros((B, P), np.int32)
    for i in range(B):
        prompt[i, P - 1 - i % P:] = 1
    return np.concatenate([prompt, mask.astype(np.int32)], axis=1), mask, old_values, returns, vpreds


@pytest.mark.parametrize("mode", rl.LOSS_AGG_MODES)
def test_value_loss_and_gradient_equal_the_authors_verl_critic(mode):
    """Issue 26 item 4: rl.value_loss over rl.value_mask, with no 1/2, equals the float64 statement of
    the authors' verl critic loss, value and gradient w.r.t. the predictions, for each aggregation at
    verl's scale (2 ranks x 2 micro-batches of 4 responses) and at the "mean" scale (verl with one
    micro-batch of the whole batch for token-mean; seq-mean-token-sum-norm then has a 1/B)."""
    attention_mask, response_mask, old_values, returns, vpreds = critic_batch(seed=5)
    critic_mask = attention_mask[:, -T - 1:-1].astype(np.float32)  # verl's (what rl.value_mask gives, below)
    assert (np.abs(vpreds - old_values)[critic_mask > 0] > 0.5).any()
    for scale, micro, ranks in (("verl", 4, 2), ("mean", 16, 1)):
        def ours(v):
            return rl.value_loss(v, jnp.asarray(old_values), jnp.asarray(returns), jnp.asarray(critic_mask),
                                 loss_agg_mode=mode, loss_scale=scale, verl_micro_batch_size=micro)[0]

        def reference(v):
            whole = verl_critic_mini_batch_loss(v, old_values, returns, attention_mask, mode, micro, ranks)
            return whole / len(v) if scale == "mean" and mode == "seq-mean-token-sum-norm" else whole

        loss, grad = jax.value_and_grad(ours)(jnp.asarray(vpreds))
        np.testing.assert_allclose(float(loss), reference(vpreds), rtol=2e-5, atol=1e-7, err_msg=scale)
        np.testing.assert_allclose(np.asarray(grad), numeric_gradient(reference, vpreds), rtol=1e-4, atol=1e-7,
                                   err_msg=scale)


def test_value_mask_is_verls_shifted_attention_mask():
    """rl.value_mask is verl's critic mask: the response mask shifted right by one slot with a 1 in
    front, so one slot more after each response shorter than T (the state after its last token; value
    read at that last token) and the response mask itself for a response of all T tokens."""
    attention_mask, response_mask, *_ = critic_batch(seed=5)
    critic_mask = np.asarray(rl.value_mask(jnp.asarray(attention_mask), T))
    np.testing.assert_array_equal(critic_mask, attention_mask[:, -T - 1:-1])
    lengths = response_mask.sum(axis=1).astype(int)
    np.testing.assert_array_equal(critic_mask, (np.arange(T)[None] <= np.minimum(lengths, T - 1)[:, None]))
    assert (lengths == T).any() and (lengths < T).any()


def test_value_loss_norm_length_is_verls_padded_width():
    """seq-mean-token-sum-norm over norm_length W equals verl's agg_loss on the batch padded to W (its
    divisor is the mask's width, data.max_response_length), where no response fills the T slots."""
    attention_mask, response_mask, old_values, returns, vpreds = critic_batch(seed=6)
    keep = response_mask.sum(axis=1) < T
    attention_mask, old_values, returns, vpreds = attention_mask[keep][:8], old_values[keep][:8], \
        returns[keep][:8], vpreds[keep][:8]
    W = 3 * T
    pad = lambda a: np.pad(a, ((0, 0), (0, W - T)))  # noqa: E731
    critic_mask = jnp.asarray(attention_mask[:, -T - 1:-1], jnp.float32)

    def ours(v):
        return rl.value_loss(v, jnp.asarray(old_values), jnp.asarray(returns), critic_mask,
                             loss_agg_mode="seq-mean-token-sum-norm", norm_length=W, loss_scale="verl",
                             verl_micro_batch_size=4)[0]

    def reference(v):
        return verl_critic_mini_batch_loss(pad(v), pad(old_values), pad(returns), pad(attention_mask),
                                           "seq-mean-token-sum-norm", 4, ranks=1)

    loss, grad = jax.value_and_grad(ours)(jnp.asarray(vpreds))
    np.testing.assert_allclose(float(loss), reference(vpreds), rtol=2e-5)
    np.testing.assert_allclose(np.asarray(grad), numeric_gradient(reference, vpreds), rtol=1e-4, atol=1e-7)


def test_value_loss_metrics_and_checks():
    attention_mask, _, old_values, returns, vpreds = critic_batch(seed=2)
    mask = attention_mask[:, -T - 1:-1].astype(np.float32)
    _, metrics = rl.value_loss(*map(jnp.asarray, (vpreds, old_values, returns, mask)))
    live = mask > 0
    unclipped = (vpreds - returns) ** 2
    clipped = (np.clip(vpreds, old_values - 0.5, old_values + 0.5) - returns) ** 2
    np.testing.assert_allclose(float(metrics["critic/value_clipfrac"]), (clipped > unclipped)[live].mean(), rtol=1e-6)
    residual, target = (returns - vpreds)[live].astype(np.float64), returns[live].astype(np.float64)
    np.testing.assert_allclose(float(metrics["critic/explained_variance"]), 1 - residual.var() / target.var(),
                               rtol=1e-4)
    with pytest.raises(ValueError, match="clip_range_value=0"):
        rl.value_loss(*map(jnp.asarray, (vpreds, old_values, returns, mask)), clip_range_value=0)


def ref_gae_verl(token_rewards, values, response_mask, critic_mask, gamma, lam):
    """The authors' verl core_algos.compute_gae_advantage_return in float64, on values as its critic
    hands them over (times attention_mask[:, -R - 1:-1]): the recursion over every slot, no mask in
    it, then masked_whiten over the response mask (unbiased variance)."""
    values = np.asarray(values, np.float64) * critic_mask
    B, R = values.shape
    adv = np.zeros((B, R))
    last = np.zeros(B)
    for t in reversed(range(R)):
        next_values = values[:, t + 1] if t < R - 1 else 0.0
        delta = token_rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last
    returns = adv + values
    live = adv[response_mask > 0]
    mean, var = live.mean(), live.var(ddof=1)
    return (adv - mean) / np.sqrt(var + 1e-8), returns


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8)])
def test_gae_on_the_critic_mask_equals_verl(gamma, lam):
    """With the critic's mask (value_mask) GAE equals verl's for any gamma, lam; the value of the state
    after the response only matters for lam < 1, and the return there is 0."""
    attention_mask, response_mask, *_ = critic_batch(seed=7)
    values = np.random.RandomState(7).randn(*response_mask.shape).astype(np.float32)
    rewards = (np.arange(len(values)) % 2).astype(np.float32)
    critic_mask = rl.value_mask(jnp.asarray(attention_mask), T)
    token_rewards = rl.last_token_rewards(jnp.asarray(rewards), jnp.asarray(response_mask))
    advantages, returns = rl.compute_gae(token_rewards, jnp.asarray(values), jnp.asarray(response_mask), gamma, lam,
                                         value_mask=critic_mask)
    want_adv, want_ret = ref_gae_verl(np.asarray(token_rewards, np.float64), values, response_mask,
                                      np.asarray(critic_mask), gamma, lam)
    live, critic_live = response_mask > 0, np.asarray(critic_mask) > 0
    np.testing.assert_allclose(np.asarray(advantages)[live], want_adv[live], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(returns)[critic_live], want_ret[critic_live], rtol=1e-5, atol=1e-5)
    after = critic_live & ~live  # the slot after each response: return 0
    assert after.any() and np.all(np.asarray(returns)[after] == 0.0)
    plain_adv, plain_ret = rl.compute_gae(token_rewards, jnp.asarray(values), jnp.asarray(response_mask), gamma, lam)
    same = np.allclose(np.asarray(plain_adv)[live], want_adv[live], atol=1e-5) and \
        np.allclose(np.asarray(plain_ret)[live], want_ret[live], atol=1e-5)
    assert same == (lam == 1.0)


def test_paper_ppo_critic_inherits_the_actors_aggregation():
    """The authors' configs/ppo_trainer.yaml: critic.loss_agg_mode: ${actor_rollout_ref.actor.loss_agg_mode};
    ppo.sh sets the actor's to seq-mean-token-sum-norm and critic.ppo_micro_batch_size_per_gpu=8. The paper's
    "ppo" config ends with the critic aggregating as its actor, at verl's scale over the width 4096; the
    demo's PPO with its actor's token-mean; an explicit critic.loss_agg_mode wins."""
    from configs import default, paper
    from pacs_jax.training.learner.critic_step import critic_options

    config = paper.get_config("qwen25_7b,ppo")
    options = critic_options(RunSpec.unplaced(config))
    assert config.critic.loss_agg_mode == "actor"
    assert config.algorithm.ppo.loss_agg_mode == "seq-mean-token-sum-norm"
    assert {k: options[k] for k in ("loss_agg_mode", "norm_length", "loss_scale", "verl_micro_batch_size")} == \
        dict(loss_agg_mode="seq-mean-token-sum-norm", norm_length=4096, loss_scale="verl", verl_micro_batch_size=8)
    demo = default.get_config()
    demo.algorithm.objective = "ppo"
    options = critic_options(RunSpec.unplaced(demo))
    assert (options["loss_agg_mode"], options["norm_length"]) == ("token-mean", None)
    demo.critic.loss_agg_mode = "seq-mean-token-mean"
    assert critic_options(RunSpec.unplaced(demo))["loss_agg_mode"] == "seq-mean-token-mean"
