"""Rollout correction (docs/design.md section 6.7): importance weights and rejection masks for the gap
between the sampler's log-probs and the trainer's pi_old, as verl 0.9.1 defines them
(``verl/trainer/ppo/rollout_corr_helper.py`` of its wheel, ``algorithm.rollout_correction``).

Shapes: B responses, T response tokens, m = response_mask [B, T]. With the log-ratio
l_t = log pi_old(o_t) - log pi_rollout(o_t) (pi_old: the trainer's log-probs, "old_log_prob";
pi_rollout: the sampler's) and verl's safety clamp l~ = clip(l, -20, 20):

Importance weights (``rollout_is``; no gradient flows through them):
  "token"     w_t = exp(l~_t)                                  one weight per token
  "sequence"  w_t = exp(clip(sum_s m_s l_s, -20, 20))          one weight per response, on its tokens
  then, by ``rollout_is_threshold``:
  a number U  w = min(w, U)                                    truncated IS (TIS)
  "L_U"       w = w if L <= w <= U else 0                      IcePop: a weight outside [L, U] is masked
  ``rollout_is_batch_normalize``: w / mean(w) (token: the mean over the batch's tokens; sequence: over
  its responses), unless that mean is <= 1e-8. Padding has w = 0.

Rejection (``rollout_rs``, a comma list; a token is kept when every option keeps it), per token
  k1_t = -l~_t (= log pi_rollout / pi_old: k1 bounds the inverse ratio), k2_t = l~_t^2 / 2,
  k3_t = exp(l~_t) - 1 - l~_t,
  token_kX     k_t itself              seq_sum_kX   sum_t m k_t     seq_mean_kX  sum_t m k_t / (sum_t m + 1e-8)
  seq_max_kX   max over the response's tokens (0 for an empty response; k2, k3 only)
  kept when k <= U (k2, k3) or log L <= k <= log U (k1, threshold "L_U"; a number U means L = 1 / U);
  a sequence option keeps or rejects every token of its response. ``rollout_rs_threshold``: one
  threshold for every option, or one per option (a comma list).
The returned mask is m times the kept tokens: it replaces the response mask of the loss.

Metrics (``rollout_corr/`` + verl's names), as verl 0.9.1's: the statistics of the weights the loss uses
(after truncation or IcePop's band, before batch normalisation: ``rollout_is_mean``, ``_std``,
``_eff_sample_size``, ``_seq_mean/std/min/max/max_deviation``; token level ``_min``, ``_max``), the
fractions outside the bounds over the raw weights (``_ratio_fraction_high/low``,
``_seq_fraction_high/low``; IcePop's ``_oob_ratio``), a sequence level's ``_min``, ``_max`` over its
unclamped log-ratios, ``_batch_norm_factor``; each
rejection option's (``rollout_rs_<option>_mean/std/min/max/fraction_high/fraction_low/masked_fraction/
seq_masked_fraction/seq_*``, and ``rollout_rs_masked_fraction``, ``rollout_rs_seq_masked_fraction``),
and the off-policy diagnostics (``kl``, ``k3_kl``, ``training_ppl``, ``training_log_ppl``,
``rollout_ppl``, ``rollout_log_ppl``, ``log_ppl_diff``, ``log_ppl_abs_diff``, ``log_ppl_diff_max/min``,
``ppl_ratio``, ``chi2_token``, ``chi2_seq``). Every statistic is over the whole [B, T] batch: called
inside ``jax.jit`` on arrays sharded over the mesh, the reductions are global (XLA inserts the
collectives), never one shard's rows. Where verl raises on a batch without any response token, the
statistics here are 0 (a jitted program cannot raise).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pacs_jax.errors import did_you_mean

SAFETY_BOUND = 20.0  # verl's clamp of every log-ratio before an exp
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
_EPS = 1e-8  # verl_F.masked_mean's
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")

# verl's presets by name (RolloutCorrectionConfig's class methods, at their default thresholds; IcePop at the
# IcePop paper's band [0.5, 5]): the fields each sets.
PRESETS = {
    "token_tis": dict(rollout_is="token", rollout_is_threshold=2.0),
    "seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0),
    "seq_mis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
                    rollout_rs_threshold="0.5_2.0"),
    "geo_rs": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "k3_rs": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
}


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A threshold read from the config: ``upper`` and, for "L_U" forms, ``lower`` (None: none given)."""

    lower: float | None
    upper: float


def _number(text: str, field: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{field}: {text!r} must be a positive number")
    return value


def _bounds(spec, field: str, *, pair_allowed: bool) -> Bounds:
    """A threshold: a positive number, or (``pair_allowed``) "L_U" with 0 < L <= U."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{field}: expected a number or an 'L_U' string, got {spec!r}")
    text = str(spec).strip()
    if "_" not in text:
        return Bounds(None, _number(text, field))
    if not pair_allowed:
        raise ValueError(f"{field}: {text!r} is a lower_upper pair, but this option takes one upper bound")
    lower, upper = (_number(part, field) for part in text.split("_", 1))
    if lower > upper:
        raise ValueError(f"{field}: {text!r} has its lower bound above its upper bound")
    return Bounds(lower, upper)


def parse_is_threshold(spec, field: str = "rollout_is_threshold") -> Bounds:
    """``rollout_is_threshold``: a number U (truncation at U) or "L_U" (IcePop's band [L, U])."""
    return _bounds(spec, field, pair_allowed=True)


def parse_rs_options(rollout_rs: str, field: str = "rollout_rs") -> tuple[str, ...]:
    """The comma list ``rollout_rs`` -> its options, in order, duplicates dropped; ValueError names an unknown one."""
    if not isinstance(rollout_rs, str) or not rollout_rs.strip(","):
        raise ValueError(f"{field}: expected a comma list of {list(ROLLOUT_RS_OPTIONS)}, got {rollout_rs!r}")
    options = []
    for option in (part.strip() for part in rollout_rs.split(",") if part.strip()):
        if option not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"{field}: {option!r} is not one of {list(ROLLOUT_RS_OPTIONS)}"
                             f"{did_you_mean(option, ROLLOUT_RS_OPTIONS)}")
        if option not in options:
            options.append(option)
    return tuple(options)


def parse_rs_thresholds(options: tuple[str, ...], spec, field: str = "rollout_rs_threshold") -> tuple[Bounds, ...]:
    """One ``Bounds`` per rejection option from ``rollout_rs_threshold``: one threshold for all, or one
    per option (a comma list). k1 options take "L_U" ratio bounds (a number U: L = 1 / U); the others
    one upper bound."""
    if spec is None:
        raise ValueError(f"{field}: rejection ({', '.join(options)}) needs a threshold")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()] if isinstance(spec, str) else [spec]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"{field}: {len(parts)} thresholds for {len(options)} rejection options "
                         f"({', '.join(options)}): give one for all or one per option")
    parts = parts * len(options) if len(parts) == 1 else parts
    out = []
    for option, part in zip(options, parts):
        bounds = _bounds(part, f"{field} ({option})", pair_allowed=option.endswith("k1"))
        if option.endswith("k1") and bounds.lower is None:
            bounds = Bounds(1.0 / bounds.upper, bounds.upper)
        out.append(bounds)
    return tuple(out)


def _masked_sum(x, mask, axis=None):
    return jnp.sum(jnp.where(mask > 0, x, 0.0) * mask, axis=axis)


def _masked_mean(x, mask, axis=None):
    return _masked_sum(x, mask, axis) / (jnp.sum(mask, axis=axis) + _EPS)


def _masked_max(x, mask):
    return jnp.max(jnp.where(mask > 0, x, -jnp.inf))


def _masked_min(x, mask):
    return jnp.min(jnp.where(mask > 0, x, jnp.inf))


def _guard(value, any_valid):
    """0 where there is nothing to take a statistic of (verl raises there)."""
    return jnp.where(any_valid, value, 0.0)


def _clamped_std(x, mask, low, high):
    """verl's std of ``x`` clamped to [low, high] over the mask (0 for one token or fewer); verl's
    E[x^2] - E[x]^2 taken as E[(x - E[x])^2], its equal without float32's cancellation."""
    clamped = jnp.clip(x, low, high)
    mean = _masked_mean(clamped, mask)
    var = _masked_mean(jnp.square(clamped - mean), mask) + jnp.square(mean) * (1.0 - _masked_mean(1.0, mask))
    return jnp.where(jnp.sum(mask) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)


def _std_ddof1(x, valid):
    """The unbiased std of x [B] over the rows where ``valid`` (0 for one row or fewer)."""
    count = jnp.sum(valid)
    mean = jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(count, 1.0)
    var = jnp.sum(jnp.where(valid, jnp.square(x - mean), 0.0)) / jnp.maximum(count - 1.0, 1.0)
    return jnp.where(count > 1, jnp.sqrt(var), 0.0)


def _is_weights(log_ratio, mask, level: str, bounds: Bounds, batch_normalize: bool):
    """The IS weights [B, T] (no gradient) and their metrics, as verl 0.9.1's
    ``compute_rollout_correction_weights`` (rollout_corr_helper.py lines 522-657) and
    ``compute_is_metrics`` (lines 660-783): the statistics are those of the weights the loss uses
    (after TIS's truncation or IcePop's band, before batch normalisation); only the fractions outside
    the bounds (and IcePop's ``rollout_is_oob_ratio``, lines 617-621) are taken over the raw weights,
    and a sequence level's max / min over its unclamped log-ratios (lines 704-710)."""
    if level == "token":
        raw = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * mask
    else:
        log_seq = _masked_sum(log_ratio, mask, axis=-1)[:, None]  # [B, 1], unclamped for the metrics
        raw = jnp.exp(jnp.clip(log_seq, -SAFETY_BOUND, SAFETY_BOUND)) * mask
    upper = bounds.upper
    lower = 1.0 / upper if bounds.lower is None else bounds.lower
    if bounds.lower is None:  # TIS: truncate (lines 595-596)
        weights = jnp.minimum(raw, upper)
    else:  # IcePop: a weight outside [L, U] is masked (lines 597-605)
        weights = jnp.where((raw >= bounds.lower) & (raw <= upper), raw, 0.0)
    weights = jax.lax.stop_gradient(weights)
    any_valid = jnp.sum(mask) > 0
    metrics = {"rollout_is_mean": _masked_mean(weights, mask)}
    if level == "sequence":  # lines 704-718
        metrics["rollout_is_max"] = jnp.exp(jnp.minimum(jnp.max(log_seq), SAFETY_BOUND))
        metrics["rollout_is_min"] = jnp.exp(jnp.min(log_seq))
        metrics["rollout_is_ratio_fraction_high"] = jnp.mean((log_seq > math.log(upper)).astype(jnp.float32))
        metrics["rollout_is_ratio_fraction_low"] = jnp.mean((log_seq < math.log(lower)).astype(jnp.float32))
    else:  # lines 720-738
        metrics["rollout_is_ratio_fraction_high"] = _masked_mean((raw > upper).astype(jnp.float32), mask)
        metrics["rollout_is_ratio_fraction_low"] = _masked_mean((raw < lower).astype(jnp.float32), mask)
        metrics["rollout_is_max"] = _guard(_masked_max(weights, mask), any_valid)
        metrics["rollout_is_min"] = _guard(_masked_min(weights, mask), any_valid)
    metrics["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)  # lines 742-751
    for_ess = jnp.clip(weights, 0.0, upper)  # lines 753-759
    normalised = for_ess / (_masked_mean(for_ess, mask) + _EPS)
    metrics["rollout_is_eff_sample_size"] = _guard(1.0 / _masked_mean(jnp.square(normalised), mask), any_valid)
    seq = _masked_mean(weights, mask, axis=-1)  # [B], every row (lines 762-772)
    raw_seq = _masked_mean(raw, mask, axis=-1)  # [B], the fractions' (lines 774-781)
    every_row = jnp.ones(seq.shape, bool)
    metrics.update({"rollout_is_seq_mean": jnp.mean(seq), "rollout_is_seq_std": _std_ddof1(seq, every_row),
                    "rollout_is_seq_max": jnp.max(seq), "rollout_is_seq_min": jnp.min(seq),
                    "rollout_is_seq_max_deviation": jnp.max(jnp.abs(seq - 1.0)),
                    "rollout_is_seq_fraction_high": jnp.mean((raw_seq > upper).astype(jnp.float32)),
                    "rollout_is_seq_fraction_low": jnp.mean((raw_seq < lower).astype(jnp.float32))})
    if bounds.lower is not None:  # IcePop's share of tokens outside [L, U] (lines 617-621)
        outside = (raw < bounds.lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = _masked_mean(outside.astype(jnp.float32), mask)
    if batch_normalize:  # lines 628-655
        if level == "token":
            mean = _masked_mean(weights, mask)
        else:
            has_tokens = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
            mean = jnp.sum(_masked_mean(weights, mask, axis=-1) * has_tokens) / jnp.maximum(jnp.sum(has_tokens), _EPS)
        usable = mean > _EPS
        weights = jnp.where(usable, weights / jnp.where(usable, mean, 1.0), weights)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(usable, mean, 1.0)
    return weights, metrics


def _rejection(log_ratio, mask, options: tuple[str, ...], thresholds: tuple[Bounds, ...]):
    """The kept tokens [B, T] (0 / 1, before the response mask) and the rejection metrics: verl 0.9.1's
    ``compute_rollout_rejection_mask`` and ``compute_rs_metrics`` (rollout_corr_helper.py lines 197-413,
    416-519)."""
    safe = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * jnp.square(safe), "k3": jnp.exp(safe) - 1.0 - safe}
    valid_rows = jnp.sum(mask, axis=-1) > 0  # [B]
    any_valid = jnp.any(valid_rows)
    num_valid = jnp.maximum(jnp.sum(valid_rows), 1.0)
    keep_all = jnp.ones(mask.shape, bool)
    metrics = {}
    for option, bounds in zip(options, thresholds):
        estimator = per_token[option[-2:]]
        k1 = option.endswith("k1")
        upper = math.log(bounds.upper) if k1 else bounds.upper
        lower = math.log(bounds.lower) if k1 else 0.0
        if option.startswith("token"):
            stat, seq = estimator, _masked_mean(estimator, mask, axis=-1)
        else:
            if option.startswith("seq_sum"):
                seq = _masked_sum(estimator, mask, axis=-1)
            elif option.startswith("seq_mean"):
                seq = _masked_mean(estimator, mask, axis=-1)
            else:  # seq_max: 0 for an empty response
                seq = jnp.where(valid_rows, jnp.max(jnp.where(mask > 0, estimator, -jnp.inf), axis=-1), 0.0)
            stat = jnp.broadcast_to(seq[:, None], mask.shape)
        keep = (stat <= upper) & (stat >= lower) if k1 else stat <= upper
        keep_all = keep_all & keep
        name = f"rollout_rs_{option}"
        metrics[f"{name}_mean"] = _masked_mean(stat, mask)
        if option.startswith("token"):
            metrics[f"{name}_max"] = _guard(_masked_max(stat, mask), any_valid)
            metrics[f"{name}_min"] = _guard(_masked_min(stat, mask), any_valid)
            high = _masked_mean((stat > upper).astype(jnp.float32), mask)
            low = _masked_mean((stat < lower).astype(jnp.float32), mask) if k1 else 0.0
        else:
            metrics[f"{name}_max"] = _guard(jnp.max(jnp.where(valid_rows, seq, -jnp.inf)), any_valid)
            metrics[f"{name}_min"] = _guard(jnp.min(jnp.where(valid_rows, seq, jnp.inf)), any_valid)
            high = jnp.sum(valid_rows & (seq > upper)) / num_valid
            low = jnp.sum(valid_rows & (seq < lower)) / num_valid if k1 else 0.0
        metrics[f"{name}_fraction_high"] = jnp.asarray(high, jnp.float32)
        metrics[f"{name}_fraction_low"] = jnp.asarray(low, jnp.float32)
        metrics[f"{name}_std"] = _clamped_std(stat, mask, lower, upper)
        valid_seq = jnp.where(valid_rows, seq, 0.0)
        metrics[f"{name}_seq_mean"] = jnp.sum(valid_seq) / num_valid
        metrics[f"{name}_seq_std"] = _std_ddof1(seq, valid_rows)
        metrics[f"{name}_seq_max"] = metrics[f"{name}_max"] if not option.startswith("token") else _guard(
            jnp.max(jnp.where(valid_rows, seq, -jnp.inf)), any_valid)
        metrics[f"{name}_seq_min"] = metrics[f"{name}_min"] if not option.startswith("token") else _guard(
            jnp.min(jnp.where(valid_rows, seq, jnp.inf)), any_valid)
        metrics[f"{name}_seq_max_deviation"] = _guard(jnp.max(jnp.where(valid_rows, jnp.abs(seq), -jnp.inf)),
                                                      any_valid)
        metrics[f"{name}_seq_fraction_high"] = jnp.sum(valid_rows & (seq > upper)) / num_valid
        if k1:
            metrics[f"{name}_seq_fraction_low"] = jnp.sum(valid_rows & (seq < lower)) / num_valid
        rejected = (~keep) & (mask > 0)
        metrics[f"{name}_masked_fraction"] = _masked_mean((~keep).astype(jnp.float32), mask)
        metrics[f"{name}_seq_masked_fraction"] = jnp.sum(valid_rows & jnp.any(rejected, axis=-1)) / num_valid
    kept = keep_all.astype(jnp.float32)
    metrics["rollout_rs_masked_fraction"] = _masked_mean(1.0 - kept, mask)
    metrics["rollout_rs_seq_masked_fraction"] = jnp.mean(jnp.any((~keep_all) & (mask > 0), axis=-1)
                                                         .astype(jnp.float32))
    return kept, metrics


def offpolicy_metrics(old_log_prob: jax.Array, rollout_log_prob: jax.Array, response_mask: jax.Array
                      ) -> dict[str, jax.Array]:
    """verl 0.9.1's off-policy diagnostics (``compute_offpolicy_metrics``, rollout_corr_helper.py lines
    904-1010) of pi_old against the sampler, [B, T] each -> scalars (unprefixed)."""
    mask = response_mask.astype(jnp.float32)
    old, rollout = old_log_prob.astype(jnp.float32), rollout_log_prob.astype(jnp.float32)
    mean_old = _masked_mean(old, mask, axis=-1)  # [B]
    mean_rollout = _masked_mean(rollout, mask, axis=-1)
    log_ratio = old - rollout
    diff = mean_rollout - mean_old
    log_seq = jnp.clip(_masked_sum(log_ratio, mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    return {"training_ppl": jnp.mean(jnp.exp(-mean_old)), "training_log_ppl": jnp.mean(-mean_old),
            "kl": _masked_mean(rollout - old, mask),
            "k3_kl": _masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, mask),
            "rollout_ppl": jnp.mean(jnp.exp(-mean_rollout)), "rollout_log_ppl": jnp.mean(-mean_rollout),
            "log_ppl_diff": jnp.mean(diff), "log_ppl_abs_diff": jnp.mean(jnp.abs(diff)),
            "log_ppl_diff_max": jnp.max(diff), "log_ppl_diff_min": jnp.min(diff),
            "ppl_ratio": jnp.mean(jnp.exp(diff)),
            "chi2_token": _masked_mean(jnp.square(jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))), mask)
            - 1.0,
            "chi2_seq": jnp.mean(jnp.exp(2.0 * log_seq)) - 1.0}


def correction_and_rejection_mask(old_log_prob: jax.Array, rollout_log_prob: jax.Array, response_mask: jax.Array, *,
                                  rollout_is: str | None = None, rollout_is_threshold: float | str = 2.0,
                                  rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
                                  rollout_rs_threshold: float | str | None = None
                                  ) -> tuple[jax.Array | None, jax.Array, dict[str, jax.Array]]:
    """verl's ``compute_rollout_correction_and_rejection_mask`` (see the module docstring).

    old_log_prob (pi_old, the trainer's), rollout_log_prob (the sampler's), response_mask: [B, T].
    rollout_is: None, "token" or "sequence"; rollout_is_threshold: U (truncation) or "L_U" (IcePop);
    rollout_rs: None or a comma list of ROLLOUT_RS_OPTIONS; rollout_rs_threshold: one threshold, or
    one per option. The options are Python values (static under ``jax.jit``); ValueError names a bad one.

    Returns (weights [B, T] float32 without gradient, or None when ``rollout_is`` is None; the mask
    [B, T] float32: the response mask less the rejected tokens; metrics: {"rollout_corr/<name>": []}).
    """
    if not old_log_prob.shape == rollout_log_prob.shape == response_mask.shape or old_log_prob.ndim != 2:
        raise ValueError(f"old_log_prob, rollout_log_prob and response_mask must share one [B, T] shape, got "
                         f"{old_log_prob.shape}, {rollout_log_prob.shape} and {response_mask.shape}")
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is: {rollout_is!r} is not one of {ROLLOUT_IS_LEVELS} (or None)")
    is_bounds = parse_is_threshold(rollout_is_threshold) if rollout_is is not None else None
    if rollout_rs is not None:
        options = parse_rs_options(rollout_rs)
        thresholds = parse_rs_thresholds(options, rollout_rs_threshold)
    mask = response_mask.astype(jnp.float32)
    old = jax.lax.stop_gradient(old_log_prob.astype(jnp.float32))
    rollout = jax.lax.stop_gradient(rollout_log_prob.astype(jnp.float32))
    log_ratio = old - rollout
    metrics = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = _is_weights(log_ratio, mask, rollout_is, is_bounds, bool(rollout_is_batch_normalize))
        metrics.update(is_metrics)
    kept_mask = mask
    if rollout_rs is not None:
        kept, rs_metrics = _rejection(log_ratio, mask, options, thresholds)
        kept_mask = mask * kept
        metrics.update(rs_metrics)
    metrics.update(offpolicy_metrics(old, rollout, mask))
    metrics = {f"rollout_corr/{k}": jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return weights, kept_mask, metrics


def response_weights(rollout_is_weights: jax.Array, response_mask: jax.Array) -> jax.Array:
    """One weight per response [B] for a loss taken per response (PACS): the mean of the token weights
    [B, T] over the response's tokens of ``response_mask`` [B, T] (the rejection mask); 0 for a
    response with no token kept. A sequence weight is its own mean; section 6.7 says why."""
    mask = response_mask.astype(jnp.float32)
    return jnp.sum(rollout_is_weights * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
