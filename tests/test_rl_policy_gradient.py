"""GRPO / RLOO / Dr.GRPO (dual-clip PPO objective, every aggregation, KL) vs float64 NumPy."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import rl


# ---------------------------------------------------------------- float64 NumPy reference

def ref_advantages(rewards, n, estimator):
    y = np.asarray(rewards, np.float64)
    adv = np.zeros_like(y)
    for start in range(0, len(y), n):
        g = y[start:start + n]
        for k in range(n):
            if estimator == "grpo":
                std = np.sqrt(np.sum((g - g.mean()) ** 2) / (n - 1))
                adv[start + k] = (g[k] - g.mean()) / (std + 1e-6)
            elif estimator == "rloo":
                adv[start + k] = g[k] - (g.sum() - g[k]) / (n - 1)
            else:  # drgrpo
                adv[start + k] = g[k] - g.mean()
    return adv


def ref_token_loss(logp, old_logp, adv, eps_low=0.2, eps_high=0.2, c=3.0):
    """Dual-clip PPO token losses, one token at a time."""
    out = np.zeros(logp.shape)
    for i, t in itertools.product(range(logp.shape[0]), range(logp.shape[1])):
        ratio = np.exp(float(logp[i, t]) - float(old_logp[i, t]))
        a = adv[i]
        loss = max(-a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high))
        if a < 0:
            loss = min(loss, -a * c)
        out[i, t] = loss
    return out


def ref_aggregate(loss, mask, mode, norm_length=None):
    mask = np.asarray(mask, np.float64)
    B, T = loss.shape
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return np.mean([(loss[i] * mask[i]).sum() / mask[i].sum() for i in range(B)])
    if mode == "seq-mean-token-sum":
        return np.mean([(loss[i] * mask[i]).sum() for i in range(B)])
    return np.mean([(loss[i] * mask[i]).sum() for i in range(B)]) / (norm_length or T)


ESTIMATOR = {"grpo": "grpo", "rloo": "rloo", "drgrpo": "drgrpo"}


def ref_objective(name, logp, old_logp, mask, rewards, n, *, loss_agg_mode, norm_length=None):
    adv = ref_advantages(rewards, n, ESTIMATOR[name])
    return ref_aggregate(ref_token_loss(logp, old_logp, adv), mask, loss_agg_mode, norm_length)


def make_batch(seed, n, groups=3, T=9, spread=0.6):
    """Ratios spread wide enough to hit both PPO clips and the dual clip; ragged masks; group 0
    all correct (zero advantages), real-valued rewards elsewhere."""
    rs = np.random.RandomState(seed)
    B = n * groups
    logp = -rs.exponential(1.0, (B, T)).astype(np.float32)
    old_logp = (logp + spread * rs.randn(B, T)).astype(np.float32)
    old_logp[::2, 0] = logp[::2, 0] - 1.5  # ratio e^1.5 > 3 on live tokens: the dual clip's territory
    lengths = rs.randint(1, T + 1, B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rs.randint(0, 2, B).astype(np.float32)
    rewards[:n] = 1.0
    rewards[-1] = 0.25  # non-binary rewards are fine for policy gradients
    return logp, old_logp, mask, rewards


@pytest.mark.parametrize("n", [2, 4, 8])
def test_objectives_match_numpy_for_every_aggregation(n):
    logp, old_logp, mask, rewards = make_batch(seed=n, n=n)
    # the batch exercises both clip branches and the dual clip
    adv = ref_advantages(rewards, n, "grpo")[:, None]
    ratio = np.exp(logp.astype(np.float64) - old_logp)
    live = mask > 0
    assert ((ratio > 1.2) & live).any() and ((ratio < 0.8) & live).any() and ((adv < 0) & (ratio > 3) & live).any()
    for name, mode in itertools.product(("grpo", "rloo", "drgrpo"), rl.LOSS_AGG_MODES):
        got, _ = rl.get_objective(name, loss_agg_mode=mode)(*map(jnp.asarray, (logp, old_logp, mask, rewards)), n)
        want = ref_objective(name, logp, old_logp, mask, rewards, n, loss_agg_mode=mode)
        np.testing.assert_allclose(float(got), want, rtol=2e-5, atol=1e-6, err_msg=f"{name} {mode}")


def test_defaults_and_norm_length():
    n = 4
    logp, old_logp, mask, rewards = make_batch(seed=11, n=n)
    args = [jnp.asarray(a) for a in (logp, old_logp, mask, rewards)]
    for fn, name, mode in ((rl.grpo_loss, "grpo", "seq-mean-token-sum-norm"), (rl.rloo_loss, "rloo", "token-mean"),
                           (rl.drgrpo_loss, "drgrpo", "seq-mean-token-sum-norm")):
        want = ref_objective(name, logp, old_logp, mask, rewards, n, loss_agg_mode=mode)
        np.testing.assert_allclose(float(fn(*args, n)[0]), want, rtol=2e-5, err_msg=name)
    got, _ = rl.drgrpo_loss(*args, n, norm_length=4096)
    want = ref_objective("drgrpo", logp, old_logp, mask, rewards, n, loss_agg_mode="seq-mean-token-sum-norm",
                         norm_length=4096)
    np.testing.assert_allclose(float(got), want, rtol=2e-5)


def test_gradient_wrt_token_logprobs_is_clipped_ratio_times_advantage():
    # token-mean: d L / d logp_it = -A_i ratio_it m_it / sum(m) on unclipped tokens, 0 on clipped ones.
    n = 4
    logp, old_logp, mask, rewards = make_batch(seed=7, n=n)
    grad = jax.grad(lambda lp: rl.grpo_loss(lp, jnp.asarray(old_logp), jnp.asarray(mask), jnp.asarray(rewards), n,
                                            loss_agg_mode="token-mean")[0])(jnp.asarray(logp))
    adv = ref_advantages(rewards, n, "grpo")
    ratio = np.exp(logp.astype(np.float64) - old_logp)
    want = np.zeros(logp.shape)
    for i, t in itertools.product(range(logp.shape[0]), range(logp.shape[1])):
        a, r = adv[i], ratio[i, t]
        active = (a > 0 and r < 1.2) or (a < 0 and 0.8 < r < 3.0)  # the unclipped branch is the max
        want[i, t] = -a * r * mask[i, t] / mask.sum() if active else 0.0
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-7)
    assert (want == 0).sum() > (mask == 0).sum()  # some live tokens were clipped


def test_micro_batch_totals_add_up_for_every_aggregation():
    n = 2
    logp, old_logp, mask, rewards = (jnp.asarray(a) for a in make_batch(seed=8, n=n, groups=4))
    totals = rl.BatchTotals(num_sequences=len(rewards), num_tokens=jnp.sum(mask))
    for mode in rl.LOSS_AGG_MODES:
        full, _ = rl.grpo_loss(logp, old_logp, mask, rewards, n, loss_agg_mode=mode)
        halves = [rl.grpo_loss(logp[s:s + 4], old_logp[s:s + 4], mask[s:s + 4], rewards[s:s + 4], n,
                               loss_agg_mode=mode, totals=totals)[0] for s in (0, 4)]
        np.testing.assert_allclose(float(sum(halves)), float(full), rtol=1e-6, err_msg=mode)


def test_bad_input_raises():
    z = np.zeros((4, 3), np.float32)
    m = np.ones((4, 3), np.float32)
    for name in ("rloo", "grpo", "drgrpo"):
        with pytest.raises(ValueError, match="group_size=1"):
            rl.get_objective(name)(z, z, m, np.ones(4, np.float32), 1)
    grpo = rl.get_objective("grpo")
    with pytest.raises(ValueError, match="not divisible by group_size=3"):
        grpo(z, z, m, np.ones(4, np.float32), 3)
    with pytest.raises(ValueError, match="rewards must be finite"):
        grpo(z, z, m, np.array([1, np.nan, 0, 1], np.float32), 2)
    with pytest.raises(ValueError, match="old_logp must have logp's shape"):
        grpo(z, np.zeros((4, 2), np.float32), m, np.ones(4, np.float32), 2)
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        rl.get_objective("grpo", loss_agg_mode="mean")
    with pytest.raises(ValueError, match="objective .grpo.: no option"):
        rl.get_objective("grpo", beta=1.0)


# ---------------------------------------------------------------- verl 0.3.1's scale, micro-batch by micro-batch

def verl_agg_loss(loss_mat, loss_mask, mode):
    """verl 0.3.1 core_algos.agg_loss on one micro-batch, in float64."""
    loss_mat, loss_mask = np.asarray(loss_mat, np.float64), np.asarray(loss_mask, np.float64)
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    seq_sums = (loss_mat * loss_mask).sum(axis=-1)
    if mode == "seq-mean-token-sum":
        return seq_sums.mean()
    if mode == "seq-mean-token-mean":
        return (seq_sums / loss_mask.sum(axis=-1)).mean()
    return seq_sums.sum() / loss_mask.shape[-1]  # seq-mean-token-sum-norm


def verl_mini_batch_loss(token_loss, mask, mode, micro_batch_size, ranks):
    """The loss whose gradient verl 0.3.1's dp_actor.update_policy applies for one mini-batch: each of
    ``ranks`` data-parallel ranks takes a contiguous share, splits it into micro-batches of
    ``micro_batch_size`` (ppo_micro_batch_size_per_gpu), back-propagates agg_loss / gradient_accumulation
    of each, and the ranks' gradients are averaged."""
    per_rank = len(mask) // ranks
    gradient_accumulation = per_rank // micro_batch_size
    rank_losses = []
    for r in range(ranks):
        rows = slice(r * per_rank, (r + 1) * per_rank)
        loss_r, mask_r = token_loss[rows], mask[rows]
        rank_losses.append(sum(verl_agg_loss(loss_r[s:s + micro_batch_size], mask_r[s:s + micro_batch_size], mode)
                               / gradient_accumulation for s in range(0, per_rank, micro_batch_size)))
    return np.mean(rank_losses)


def verl_objective(name, logp, old_logp, mask, rewards, n, mode, micro_batch_size, ranks):
    adv = ref_advantages(rewards, n, ESTIMATOR[name])
    return verl_mini_batch_loss(ref_token_loss(logp, old_logp, adv), mask, mode, micro_batch_size, ranks)


def numeric_gradient(f, x, eps=1e-6):
    """Central differences of a float64 function of an array, entry by entry."""
    x = np.asarray(x, np.float64)
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += eps
        down[index] -= eps
        grad[index] = (f(up) - f(down)) / (2 * eps)
    return grad


@pytest.mark.parametrize("name", ["grpo", "rloo", "drgrpo"])
def test_verl_scale_losses_and_gradients_match_verl_micro_batching(name):
    n, S = 4, 4  # verl micro-batches of 4 responses: 16 responses = 2 ranks x 2 micro-batches
    logp, old_logp, mask, rewards = make_batch(seed=21, n=n, groups=4, T=7)
    mask[3] = 0.0
    mask[3, 0] = 1.0  # one verl micro-batch much shorter than the others: token-mean's micro means differ
    args = [jnp.asarray(a) for a in (old_logp, mask, rewards)]
    for mode in rl.LOSS_AGG_MODES:
        fn = rl.get_objective(name, loss_agg_mode=mode, loss_scale="verl", verl_micro_batch_size=S)
        loss, grad = jax.value_and_grad(lambda lp: fn(lp, *args, n)[0])(jnp.asarray(logp))
        want = verl_objective(name, logp, old_logp, mask, rewards, n, mode, S, ranks=2)
        np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-7, err_msg=f"{name} {mode}")
        want_grad = numeric_gradient(lambda lp: verl_objective(name, lp, old_logp, mask, rewards, n, mode, S, 2), logp)
        np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7, err_msg=f"{name} {mode}")
        # the rank split does not matter, only the micro-batch size
        np.testing.assert_allclose(want, verl_objective(name, logp, old_logp, mask, rewards, n, mode, S, 4), rtol=1e-12)
    # verl's seq-mean-token-sum-norm is S times the mean over responses; token-mean differs from the mean
    mean = {mode: float(rl.get_objective(name, loss_agg_mode=mode)(jnp.asarray(logp), *args, n)[0])
            for mode in ("seq-mean-token-sum-norm", "token-mean")}
    verl = {mode: verl_objective(name, logp, old_logp, mask, rewards, n, mode, S, 2) for mode in mean}
    np.testing.assert_allclose(verl["seq-mean-token-sum-norm"], S * mean["seq-mean-token-sum-norm"], rtol=2e-5)
    assert abs(verl["token-mean"] - mean["token-mean"]) > 1e-3 * abs(mean["token-mean"])


def test_verl_scale_adds_up_over_update_micro_batches():
    # An update micro-batch (whole groups, pacs_jax.rl.loss_and_grad) holds whole verl micro-batches; with the
    # mini-batch totals their losses add up to the loss of verl's micro-batch partition of the rows.
    n, S = 2, 2
    logp, old_logp, mask, rewards = make_batch(seed=22, n=n, groups=4, T=6)
    totals = rl.BatchTotals(num_sequences=len(rewards), num_tokens=jnp.asarray(mask.sum()))
    for mode in rl.LOSS_AGG_MODES:
        fn = rl.get_objective("grpo", loss_agg_mode=mode, loss_scale="verl", verl_micro_batch_size=S)
        halves = [fn(*(jnp.asarray(a[s:s + 4]) for a in (logp, old_logp, mask, rewards)), n, totals=totals)[0]
                  for s in (0, 4)]
        want = verl_objective("grpo", logp, old_logp, mask, rewards, n, mode, S, ranks=1)
        np.testing.assert_allclose(float(sum(halves)), want, rtol=2e-5, err_msg=mode)


def test_verl_scale_needs_a_dividing_micro_batch_size():
    z, m, y = np.zeros((8, 3), np.float32), np.ones((8, 3), np.float32), np.ones(8, np.float32)
    with pytest.raises(ValueError, match="verl_micro_batch_size >= 1"):
        rl.grpo_loss(z, z, m, y, 4, loss_scale="verl")
    with pytest.raises(ValueError, match="verl_micro_batch_size=3 must divide the 8 responses"):
        rl.grpo_loss(z, z, m, y, 4, loss_scale="verl", verl_micro_batch_size=3)
    with pytest.raises(rl.OptionError, match="loss_scale='sum'"):
        rl.get_objective("grpo", loss_scale="sum")
