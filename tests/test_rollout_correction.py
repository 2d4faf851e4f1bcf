"""rl.correction_and_rejection_mask (verl's rollout correction) against a float64 NumPy statement of verl
0.9.1's functions, written here from its wheel's verl/trainer/ppo/rollout_corr_helper.py (lines cited at
each step): every IS level and threshold form, every rejection option (alone and chained), batch
normalisation, padding, an empty response and |log r| up to 30, inside jit and with the batch sharded
over the mesh's data axis; and the bad options it refuses."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import rl, sharding
from pacs_jax.rl import rollout_correction as rc

B, T = 8, 12
LENGTHS = np.array([12, 7, 1, 0, 12, 4, 9, 2])  # row 3: no response token


def _batch(scale: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 1.0, (B, T))
    rollout = old + rng.normal(0.0, scale, (B, T))
    rollout[0, 3], rollout[4, 5] = old[0, 3] + 30.0, old[4, 5] - 30.0  # |log r| = 30: the +-20 clamp acts
    mask = (np.arange(T)[None, :] < LENGTHS[:, None]).astype(np.float64)
    return old, rollout, mask


# ------------------------------------------------------------------ float64 reference (verl's formulas)
def mmean(x, m, axis=None):
    return np.sum(np.where(m > 0, x, 0.0) * m, axis=axis) / (np.sum(m, axis=axis) + 1e-8)


def ref_is(lr, m, level, threshold, normalize):
    """verl 0.9.1's compute_rollout_correction_weights (verl/trainer/ppo/rollout_corr_helper.py lines 522-657)
    and compute_is_metrics (lines 660-783), in float64."""
    upper_lower = str(threshold).split("_")
    icepop = len(upper_lower) == 2
    lower, upper = (float(upper_lower[0]), float(upper_lower[1])) if icepop else (1 / float(threshold),
                                                                                   float(threshold))
    if level == "token":  # lines 572-576, 592
        raw = np.exp(np.clip(lr, -20, 20)) * m
    else:  # lines 578-586, 592
        log_seq = np.sum(lr * m, axis=-1, keepdims=True)
        raw = np.exp(np.clip(log_seq, -20, 20)) * m
    if icepop:  # lines 597-605
        weights = np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    else:  # lines 595-596
        weights = np.minimum(raw, upper)
    out = {"rollout_is_mean": mmean(weights, m)}  # lines 713, 723
    if level == "sequence":  # lines 704-718
        out["rollout_is_max"] = math.exp(min(log_seq.max(), 20))
        out["rollout_is_min"] = math.exp(log_seq.min())
        out["rollout_is_ratio_fraction_high"] = np.mean(log_seq > math.log(upper))
        out["rollout_is_ratio_fraction_low"] = np.mean(log_seq < math.log(lower))
    else:  # lines 720-738
        out["rollout_is_ratio_fraction_high"] = mmean(raw > upper, m)
        out["rollout_is_ratio_fraction_low"] = mmean(raw < lower, m)
        out["rollout_is_max"] = weights[m > 0].max()
        out["rollout_is_min"] = weights[m > 0].min()
    clamped = np.clip(weights, 0.0, upper)  # lines 742-751 (std) and 753-759 (ESS)
    out["rollout_is_std"] = math.sqrt(max(mmean(clamped ** 2, m) - mmean(clamped, m) ** 2, 0.0))
    normalised = clamped / (mmean(clamped, m) + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / mmean(normalised ** 2, m)
    seq, raw_seq = mmean(weights, m, axis=-1), mmean(raw, m, axis=-1)  # lines 762-781, every row
    out.update(rollout_is_seq_mean=seq.mean(), rollout_is_seq_std=seq.std(ddof=1), rollout_is_seq_max=seq.max(),
               rollout_is_seq_min=seq.min(), rollout_is_seq_max_deviation=np.abs(seq - 1).max(),
               rollout_is_seq_fraction_high=np.mean(raw_seq > upper),
               rollout_is_seq_fraction_low=np.mean(raw_seq < lower))
    if icepop:  # lines 617-621
        out["rollout_is_oob_ratio"] = mmean((raw < lower) | (raw > upper), m)
    if normalize:  # lines 628-655
        if level == "token":
            mean = mmean(weights, m)
        else:
            has = m.sum(-1) > 0
            mean = mmean(weights, m, axis=-1)[has].mean()
        weights = weights / mean
        out["rollout_is_batch_norm_factor"] = mean
    return weights, out


def ref_rs(lr, m, options, thresholds):
    safe = np.clip(lr, -20, 20)
    est = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": np.exp(safe) - 1 - safe}
    valid = m.sum(-1) > 0
    keep_all = np.ones_like(m, bool)
    out = {}
    for option, spec in zip(options, thresholds):
        k = est[option[-2:]]
        k1 = option.endswith("k1")
        if k1:
            parts = str(spec).split("_")
            lo, up = (float(parts[0]), float(parts[1])) if len(parts) == 2 else (1 / float(spec), float(spec))
            lo, up = math.log(lo), math.log(up)
        else:
            lo, up = 0.0, float(spec)
        if option.startswith("token"):
            stat, seq = k, mmean(k, m, axis=-1)
        else:
            if option.startswith("seq_sum"):
                seq = np.sum(k * m, axis=-1)
            elif option.startswith("seq_mean"):
                seq = mmean(k, m, axis=-1)
            else:
                seq = np.where(valid, np.where(m > 0, k, -np.inf).max(-1), 0.0)
            stat = np.broadcast_to(seq[:, None], m.shape)
        keep = (stat >= lo) & (stat <= up) if k1 else stat <= up
        keep_all &= keep
        p = f"rollout_rs_{option}"
        out[f"{p}_mean"] = mmean(stat, m)
        if option.startswith("token"):
            out[f"{p}_max"], out[f"{p}_min"] = stat[m > 0].max(), stat[m > 0].min()
            out[f"{p}_fraction_high"] = mmean(stat > up, m)
            out[f"{p}_fraction_low"] = mmean(stat < lo, m) if k1 else 0.0
        else:
            out[f"{p}_max"], out[f"{p}_min"] = seq[valid].max(), seq[valid].min()
            out[f"{p}_fraction_high"] = np.mean(seq[valid] > up)
            out[f"{p}_fraction_low"] = np.mean(seq[valid] < lo) if k1 else 0.0
        clamped = np.clip(stat, lo, up)
        out[f"{p}_std"] = math.sqrt(max(mmean(clamped ** 2, m) - mmean(clamped, m) ** 2, 0.0))
        sv = seq[valid]
        out.update({f"{p}_seq_mean": sv.mean(), f"{p}_seq_std": sv.std(ddof=1), f"{p}_seq_max": sv.max(),
                    f"{p}_seq_min": sv.min(), f"{p}_seq_max_deviation": np.abs(sv).max(),
                    f"{p}_seq_fraction_high": np.mean(sv > up)})
        if k1:
            out[f"{p}_seq_fraction_low"] = np.mean(sv < lo)
        out[f"{p}_masked_fraction"] = mmean(~keep, m)
        out[f"{p}_seq_masked_fraction"] = np.mean(((~keep) & (m > 0)).any(-1)[valid])
    out["rollout_rs_masked_fraction"] = mmean(~keep_all, m)
    out["rollout_rs_seq_masked_fraction"] = np.mean(((~keep_all) & (m > 0)).any(-1))
    return m * keep_all, out


def ref_offpolicy(old, rollout, m):
    mo, mr = mmean(old, m, axis=-1), mmean(rollout, m, axis=-1)
    lr = old - rollout
    diff = mr - mo
    return {"training_ppl": np.exp(-mo).mean(), "training_log_ppl": (-mo).mean(), "kl": mmean(rollout - old, m),
            "k3_kl": mmean(np.exp(lr) - lr - 1, m), "rollout_ppl": np.exp(-mr).mean(),
            "rollout_log_ppl": (-mr).mean(), "log_ppl_diff": diff.mean(), "log_ppl_abs_diff": np.abs(diff).mean(),
            "log_ppl_diff_max": diff.max(), "log_ppl_diff_min": diff.min(), "ppl_ratio": np.exp(diff).mean(),
            "chi2_token": mmean(np.exp(np.clip(lr, -20, 20)) ** 2, m) - 1,
            "chi2_seq": np.mean(np.exp(2 * np.clip(np.sum(lr * m, -1), -20, 20))) - 1}


def reference(old, rollout, m, rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
              rollout_rs=None, rollout_rs_threshold=None):
    lr = old - rollout
    weights, out, mask = None, {}, m
    if rollout_is is not None:
        weights, out = ref_is(lr, m, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
    if rollout_rs is not None:
        options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",")))
        specs = str(rollout_rs_threshold).split(",")
        mask, rs = ref_rs(lr, m, options, specs * len(options) if len(specs) == 1 else specs)
        out.update(rs)
    out.update(ref_offpolicy(old, rollout, m))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in out.items()}


CASES = [
    dict(rollout_is="token", rollout_is_threshold=2.0),
    dict(rollout_is="sequence", rollout_is_threshold=2.0),
    dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),  # IcePop
    dict(rollout_is="sequence", rollout_is_threshold="0.5_2"),
    dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True),
    *[dict(rollout_rs=option, rollout_rs_threshold=threshold) for option, threshold in (
        ("token_k1", "0.6_1.5"), ("token_k1", 1.5), ("token_k2", 0.05), ("token_k3", 0.05),
        ("seq_sum_k1", "0.2_5"), ("seq_sum_k2", 0.5), ("seq_sum_k3", 0.5),
        ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k2", 0.04), ("seq_mean_k3", 0.045),
        ("seq_max_k2", 0.1), ("seq_max_k3", 0.1))],
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1,token_k3,seq_mean_k1",
         rollout_rs_threshold="0.8_1.25,0.2"),  # a repeated option counts once
    dict(rollout_is="sequence", rollout_is_threshold="0.3_3", rollout_rs="seq_max_k2,seq_sum_k3",
         rollout_rs_threshold="0.5"),
]


def _check(got, want):
    weights, mask, metrics = got
    want_w, want_mask, want_metrics = want
    assert (weights is None) == (want_w is None)
    if want_w is not None:
        np.testing.assert_allclose(np.asarray(weights), want_w, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(mask), want_mask)
    assert sorted(metrics) == sorted(want_metrics)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=5e-5, atol=2e-6, err_msg=key)


@pytest.fixture(scope="module")
def jitted_cases():
    """Every case of CASES on _batch(0.3) in float32, inside one jitted program (one compilation, not one a case)."""
    old, rollout, mask = (jnp.asarray(x, jnp.float32) for x in _batch(0.3))
    return jax.jit(lambda a, b, c: [rl.correction_and_rejection_mask(a, b, c, **options) for options in CASES])(
        old, rollout, mask)


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(str(v) for v in o.values()))
def test_matches_float64_reference_in_jit(jitted_cases, options):
    old, rollout, mask = _batch(0.3)
    got = jitted_cases[CASES.index(options)]
    old32, rollout32 = (np.asarray(x, np.float32).astype(np.float64) for x in (old, rollout))
    _check(got, reference(old32, rollout32, mask, **options))
    if "rollout_rs" in options:  # the masks fire on this batch, and keep something
        assert 0 < float(np.asarray(got[1]).sum()) < mask.sum()


def test_sharded_batch_gives_the_whole_batch_statistics():
    """On the 8-device mesh with the rows sharded over "data", every statistic is the whole batch's."""
    options = dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                   rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.7_1.4,0.02")
    old, rollout, mask = _batch(0.3, seed=3)
    mesh = sharding.make_mesh(8, 1, 1)
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, P("data"))
        args = [jax.device_put(jnp.asarray(x, jnp.float32), rows) for x in (old, rollout, mask)]
        got = jax.jit(lambda a, b, c: rl.correction_and_rejection_mask(a, b, c, **options))(*args)
    old32, rollout32 = (np.asarray(x, np.float32).astype(np.float64) for x in (old, rollout))
    _check(got, reference(old32, rollout32, mask, **options))


def test_weights_carry_no_gradient():
    old, rollout, mask = (jnp.asarray(x, jnp.float32) for x in _batch(0.3))
    grad = jax.grad(lambda o: jnp.sum(rl.correction_and_rejection_mask(o, rollout, mask, rollout_is="token")[0]))(old)
    assert not np.any(np.asarray(grad))


def test_equal_log_probs_give_unit_weights_and_keep_everything():
    old, _, mask = _batch(0.0)
    weights, kept, metrics = rl.correction_and_rejection_mask(
        jnp.asarray(old), jnp.asarray(old), jnp.asarray(mask), rollout_is="token", rollout_rs="seq_mean_k3",
        rollout_rs_threshold=1e-3)
    np.testing.assert_allclose(np.asarray(weights), mask, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(kept), mask)
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == 0.0


@pytest.mark.parametrize("options, field", [
    (dict(rollout_is="tokens"), "rollout_is"),
    (dict(rollout_is="token", rollout_is_threshold="2_0.5"), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=-1.0), "rollout_is_threshold"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0), "rollout_rs"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2"), "rollout_rs_threshold (token_k2)"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="2_0.5"), "rollout_rs_threshold (token_k1)"),
    (dict(rollout_rs="token_k1,token_k2,token_k3", rollout_rs_threshold="1.5,0.1"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k3"), "rollout_rs_threshold"),
])
def test_bad_options_name_their_field(options, field):
    old, rollout, mask = (jnp.asarray(x, jnp.float32) for x in _batch(0.3))
    with pytest.raises(ValueError, match=r"^" + __import__("re").escape(field)):
        rc.correction_and_rejection_mask(old, rollout, mask, **options)
