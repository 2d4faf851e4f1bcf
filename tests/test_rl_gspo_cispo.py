"""GSPO and CISPO against float64 NumPy statements of verl 0.9.1's compute_policy_loss_gspo / _cispo and
agg_loss as its trainer calls it (its wheel's verl/trainer/ppo/core_algos.py, ray_trainer.py and the
engine's workers, lines cited at each step: a seq-mean divides by every row of the mini-batch, its
global_batch_size): loss and gradient with respect to log pi_theta in every aggregation mode 0.9.1 takes,
with and without rollout-correction weights, with padding, an empty row and |log r| up to 30, inside jit,
sharded over the data axis and in micro-batches, through the public losses and the registry's objectives
(GRPO's group advantages); and under a sequence-level rejection the seq-means scale with the kept rows
while token-mean divides by the kept tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import rl, sharding
from pacs_jax.rl import rollout_correction as rc
from pacs_jax.rl.micro_batches import mini_batch_totals
from pacs_jax.rl.policy_gradient import VERL091_LOSS_AGG_MODES

B, T, N = 8, 10, 4
LENGTHS = np.array([10, 6, 1, 3, 10, 8, 0, 5])  # row 6: no response token


def _batch(seed=0, spread=0.3):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.2, 0.6, (B, T))
    old = logp + rng.normal(0.0, spread, (B, T))
    old[1, 2], old[3, 0] = logp[1, 2] + 30.0, logp[3, 0] - 30.0  # |log r| = 30: CISPO's +-20 clamp acts
    mask = (np.arange(T)[None, :] < LENGTHS[:, None]).astype(np.float64)
    rewards = np.array([1, 0, 0, 1, 1, 1, 0, 0], np.float64)
    weights = rng.uniform(0.0, 2.0, (B, T)) * mask
    return logp, old, mask, rewards, weights


def grpo_advantages(rewards):
    g = rewards.reshape(-1, N)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)


def agg_loss(loss_mat, loss_mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    """verl 0.9.1's agg_loss (core_algos.py lines 1140-1206) in float64, line for line."""
    if mode == "token-mean":  # lines 1170-1175
        if batch_num_tokens is None:
            assert dp_size == 1
            batch_num_tokens = loss_mask.sum()
        return np.sum(loss_mat * loss_mask) / batch_num_tokens * dp_size
    if mode == "token-sum":  # lines 1176-1180
        return np.sum(loss_mat * loss_mask) * dp_size
    n = loss_mask.sum(-1)
    seq_losses = np.sum(loss_mat * loss_mask, -1)  # lines 1182, 1196
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (n + 1e-8)
    seq_mask = (n > 0).astype(np.float64)  # lines 1183, 1197: fully masked rows leave the sum
    if global_batch_size is None:  # lines 1184-1187, 1198-1201: standalone, only the rows with a token
        assert dp_size == 1
        global_batch_size = seq_mask.sum()
    loss = np.sum(seq_losses * seq_mask) / global_batch_size * dp_size  # lines 1188, 1202
    if mode == "seq-mean-token-sum-norm":  # lines 1189-1193
        loss /= loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return loss


def trainer_loss(loss_mat, mask, mode, dp_size=1, micro_batches=1):
    """The loss verl 0.9.1's trainer backpropagates for one mini-batch (its rows: this batch's), as the sum over
    data-parallel ranks and micro-batches that the gradient is: ray_trainer.py lines 1352-1362 set
    global_batch_size = ppo_mini_batch_size * rollout.n, every row of the mini-batch; engine_workers.py lines
    266-270 give each of the dp_size ranks 1/dp_size of the rows; fsdp/transformer_impl.py lines 729-735 set
    batch_num_tokens, the mini-batch's loss_mask summed over ranks (= response_mask after the rejection:
    padding.py line 71, rollout_corr_helper.py line 1061), and dp_size; losses.py lines 64-67 hand them to
    agg_loss as config.global_batch_info (core_algos.py lines 1605-1607, 2093-2095); each micro-batch's loss
    is backpropagated (transformer_impl.py lines 749-767), so they add; the ranks average their gradients."""
    chunks = np.array_split(np.arange(len(mask)), dp_size * micro_batches)
    info = dict(dp_size=dp_size, batch_num_tokens=mask.sum(), global_batch_size=len(mask))
    return sum(agg_loss(loss_mat[c], mask[c], mode, **info) for c in chunks) / dp_size


def agg_coefficients(mask, mode, dp_size=1, micro_batches=1):
    """d(trainer_loss)/d(token loss) [B, T]: the loss is linear in the token losses."""
    unit = np.zeros(mask.shape)
    coef = np.zeros(mask.shape)
    for i, t in np.ndindex(*mask.shape):
        unit[i, t] = 1.0
        coef[i, t] = trainer_loss(unit, mask, mode, dp_size, micro_batches)
        unit[i, t] = 0.0
    return coef


def gspo_reference(logp, old, mask, adv, weights, lo, hi, mode="seq-mean-token-mean", **trainer):
    """(loss, dloss/dlogp) of compute_policy_loss_gspo (core_algos.py lines 1545-1618): s_i the masked mean
    log-ratio (lines 1583-1584); the token ratio's value exp(min(s_i, 10)), its gradient rho through the
    token's own log-prob (lines 1589-1593); PPO-clip without a dual clip (lines 1595-1597); times the
    weights (lines 1600-1601), aggregated by ``mode`` as the trainer does (lines 1605-1607, ``trainer_loss``;
    ``trainer``: its dp_size and micro_batches)."""
    s = np.sum((logp - old) * mask, -1) / np.maximum(mask.sum(-1), 1.0)
    rho = np.broadcast_to(np.exp(np.minimum(s, 10.0))[:, None], logp.shape)
    a = adv[:, None]
    unclipped, clipped = -a * rho, -a * np.clip(rho, 1 - lo, 1 + hi)
    losses = np.maximum(unclipped, clipped)
    dlosses = np.where(clipped > unclipped, 0.0, -a * rho) * (s[:, None] < 10.0)
    w = np.ones_like(logp) if weights is None else weights
    coef = agg_coefficients(mask, mode, **trainer)
    return np.sum(coef * w * losses), coef * w * dlosses


def cispo_reference(logp, old, mask, adv, weights, lo, hi, mode, **trainer):
    """(loss, dloss/dlogp) of compute_policy_loss_cispo (core_algos.py lines 2047-2105): rho of the log-ratio
    clamped to +-20 (lines 2069-2072), l = -sg(clip(rho)) A log pi_theta (lines 2079-2084), times the
    weights (lines 2090-2091), aggregated by ``mode`` as the trainer does (lines 2093-2095, ``trainer_loss``)."""
    rho = np.exp(np.clip(logp - old, -20, 20))
    c = np.clip(rho, 1 - lo, 1 + hi)
    a = adv[:, None]
    w = np.ones_like(logp) if weights is None else weights
    coef = agg_coefficients(mask, mode, **trainer)
    return np.sum(coef * w * (-c * a * logp)), coef * w * (-c * a)


def _loss_and_grad(fn, logp, *args, **kwargs):
    (loss, metrics), grad = jax.value_and_grad(lambda lp: fn(lp, *args, **kwargs), has_aux=True)(
        jnp.asarray(logp, jnp.float32))
    return float(loss), np.asarray(grad, np.float64), metrics


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("mode", VERL091_LOSS_AGG_MODES)
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_policy_loss(clip, mode, with_weights):
    logp, old, mask, rewards, weights = _batch()
    adv = grpo_advantages(rewards)
    w = weights if with_weights else None
    loss, grad, metrics = _loss_and_grad(
        jax.jit(rl.gspo_policy_loss, static_argnames=("loss_agg_mode", "clip_ratio_low", "clip_ratio_high")),
        logp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32),
        loss_agg_mode=mode, clip_ratio_low=clip[0], clip_ratio_high=clip[1],
        rollout_is_weights=None if w is None else jnp.asarray(w, jnp.float32))
    f32 = [np.asarray(x, np.float32).astype(np.float64) for x in (logp, old)]
    want_loss, want_grad = gspo_reference(*f32, mask, adv, w, *clip, mode)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    assert 0.0 <= float(metrics["clipfrac"]) <= 1.0


def test_gspo_and_cispo_refuse_a_mode_verl_lacks():
    logp, old, mask, rewards, _ = (jnp.asarray(x, jnp.float32) for x in _batch())
    for loss in (rl.gspo_policy_loss, rl.cispo_policy_loss):
        with pytest.raises(ValueError, match="token-sum"):
            loss(logp, old, rewards, mask, loss_agg_mode="seq-sum")
    for name in ("gspo", "cispo"):
        with pytest.raises(rl.OptionError, match="loss_agg_mode"):
            rl.get_objective(name, loss_agg_mode="seq-sum")
        rl.get_objective(name, loss_agg_mode="token-sum")


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("mode", VERL091_LOSS_AGG_MODES)
def test_cispo_policy_loss(mode, with_weights):
    logp, old, mask, rewards, weights = _batch(spread=0.5)
    adv = grpo_advantages(rewards)
    w = weights if with_weights else None
    loss, grad, metrics = _loss_and_grad(
        jax.jit(rl.cispo_policy_loss, static_argnames=("loss_agg_mode", "clip_ratio_low", "clip_ratio_high")),
        logp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
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


def test_approx_kl_old_is_verl_091s_ppo_kl():
    """"approx_kl_old" is 0.9.1's actor/ppo_kl, the token mean of -(log pi_theta - log pi_old): CISPO's over the
    log-ratio clamped to +-20 (core_algos.py lines 2071-2073), GSPO's unclamped (lines 1578, 1613): two tokens
    at log r = -30 and -25 tell the two apart."""
    logp, old, mask, rewards, _ = _batch()
    old[3, 0] = logp[3, 0] + 25.0  # the batch's log r = +30 there would cancel row 1's -30
    args = [jnp.asarray(x, jnp.float32) for x in (logp, old, grpo_advantages(rewards), mask)]
    f32 = [np.asarray(x, np.float32).astype(np.float64) for x in (logp, old)]
    log_ratio = f32[0] - f32[1]
    clamped = np.sum(-np.clip(log_ratio, -20.0, 20.0) * mask) / mask.sum()
    unclamped = np.sum(-log_ratio * mask) / mask.sum()
    assert abs(clamped - unclamped) > 0.1
    for loss_fn, want in ((rl.cispo_policy_loss, clamped), (rl.gspo_policy_loss, unclamped)):
        got = jax.jit(lambda *xs: loss_fn(*xs)[1]["approx_kl_old"])(*args)
        np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-6)


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


def test_the_reference_is_verl_091s_trainer_not_agg_loss_alone():
    """The reference's loss does not depend on how the trainer cuts the mini-batch (2 ranks x 2 micro-batches
    or 1 x 1), and on a batch with an empty row its seq-means are agg_loss standalone's (which divides by the
    rows with a token, lines 1184-1187) times (B - 1) / B."""
    logp, old, mask, _, weights = _batch()
    losses = weights * (logp - old)
    for mode in VERL091_LOSS_AGG_MODES:
        one = trainer_loss(losses, mask, mode)
        np.testing.assert_allclose(trainer_loss(losses, mask, mode, dp_size=2, micro_batches=2), one, rtol=1e-12)
        standalone = agg_loss(losses, mask, mode)
        np.testing.assert_allclose(one, standalone * ((B - 1) / B if mode.startswith("seq-mean") else 1.0),
                                   rtol=1e-7)


@pytest.mark.parametrize("mode", VERL091_LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_sharded_over_the_data_axis_and_in_micro_batches(name, mode):
    """On the 8-device mesh with the rows sharded over "data", in jit: the whole batch's loss equals verl 0.9.1's
    trainer over 2 ranks x 2 micro-batches; and two micro-batches with the mini-batch's totals
    (rl.mini_batch_totals) add up to it."""
    logp, old, mask, rewards, weights = _batch()
    adv = grpo_advantages(rewards)
    loss_fn = rl.gspo_policy_loss if name == "gspo" else rl.cispo_policy_loss
    f32 = [np.asarray(x, np.float32).astype(np.float64) for x in (logp, old)]
    reference = gspo_reference if name == "gspo" else cispo_reference
    want = reference(*f32, mask, adv, weights, 0.2, 0.28, mode, dp_size=2, micro_batches=2)[0]
    arrays = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask, weights)]
    kwargs = dict(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28)
    mesh = sharding.make_mesh(8, 1, 1)
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, P("data"))
        sharded = [jax.device_put(x, rows) for x in arrays]
        got = jax.jit(lambda lp, o, a, m, w: loss_fn(lp, o, a, m, rollout_is_weights=w, **kwargs)[0])(*sharded)
    np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-7)
    totals = mini_batch_totals(type("Rows", (), {"response_mask": arrays[3]})())
    halves = [jax.jit(lambda *xs: loss_fn(*xs[:4], totals=totals, rollout_is_weights=xs[4], **kwargs)[0])(
        *(x[k::2] for x in arrays)) for k in (0, 1)]
    np.testing.assert_allclose(float(halves[0] + halves[1]), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("preset", ["seq_mis", "geo_rs", "seq_mean_k3"])
@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_a_sequence_level_rejection_scales_seq_means_by_the_kept_rows(name, preset):
    """As verl 0.9.1's trainer (and the authors' verl): a sequence-level rejection (seq_mis, geo_rs, a seq_*
    option) empties whole rows of the mask, which stay in the seq-mean's denominator (global_batch_size, every
    row of the mini-batch): a seq-mean loss is the kept rows' sum over all B rows, the loss of the kept rows
    alone times the kept fraction; token-mean divides by the kept tokens, the loss of the kept rows alone."""
    logp, old, mask, rewards, _ = _batch(spread=0.05)
    sampler = old + np.random.default_rng(7).normal(0.0, 1e-4, old.shape)
    sampler[2, 0] = old[2, 0] + 3.0  # rows that every option rejects
    sampler[5, :3] = old[5, :3] - 1.0
    options = (dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=1e-3) if preset == "seq_mean_k3"
               else rc.PRESETS[preset])
    _, kept, _ = rl.correction_and_rejection_mask(jnp.asarray(old, jnp.float32), jnp.asarray(sampler, jnp.float32),
                                                  jnp.asarray(mask, jnp.float32), **options)
    kept = np.asarray(kept, np.float64)
    rejected = (mask.sum(-1) > 0) & (kept.sum(-1) == 0)
    assert 0 < rejected.sum() < B - 1 and ((kept.sum(-1) == 0) | (kept == mask).all(-1)).all()
    keep = ~rejected  # the kept rows, the empty row 6 among them
    adv = grpo_advantages(rewards)
    loss_fn = rl.gspo_policy_loss if name == "gspo" else rl.cispo_policy_loss
    reference = gspo_reference if name == "gspo" else cispo_reference
    f32 = [np.asarray(x, np.float32).astype(np.float64) for x in (logp, old)]
    for mode in VERL091_LOSS_AGG_MODES:
        kwargs = dict(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28)
        with_rejection = float(loss_fn(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv, kept)), **kwargs)[0])
        alone = float(loss_fn(*(jnp.asarray(x[keep], jnp.float32) for x in (logp, old, adv, mask)), **kwargs)[0])
        scale = keep.sum() / B if mode.startswith("seq-mean") else 1.0
        np.testing.assert_allclose(with_rejection, alone * scale, rtol=1e-5, atol=1e-7, err_msg=mode)
        want = reference(*f32, kept, adv, None, 0.2, 0.28, mode, dp_size=2, micro_batches=2)[0]
        np.testing.assert_allclose(with_rejection, want, rtol=1e-5, atol=1e-7, err_msg=mode)
