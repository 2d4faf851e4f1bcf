"""What the step-changing options did, on the console: a line when a session starts naming the options
that are on (and what they switched on by default), and a line a step of what each one did, made from
the step's metrics row (host floats already: no device read of its own).

    options_line(spec, devices)   "options on: carry-over (...); rollout correction token TIS at 2, switched
                                  on by carry-over's default (...)"; None when none is on
    step_line(spec, metrics)      "carry-over: 193 rows carried in, ...; correction: IS weights mean 0.999,
                                  ..."; None when none is on

The options: carry-over (``rollout.carry_over``: rows carried in from earlier calls, the returned tokens'
staleness, prompts dropped as stale), routing replay (``train.router_replay``: R3, the share of tokens and of
routing decisions the learner's routers would have sent elsewhere), dynamic sampling (``algorithm.filter_groups``: batches drawn of
its limit, the groups with spread, the sampling's seconds; the step that reaches the limit says so), one
step off (``train.off_policy_steps``: the device split at the start, each step's lag) and the rollout
correction (``algorithm.rollout_correction``: the IS weights' mean, min and max and the share truncated or
masked, the share rejected; training/learner/rollout_correction_step.py's ``rollout_corr/`` metrics; bypass mode's
KL(sampler || learner), from the update's).
"""

from __future__ import annotations

import numpy as np

from pacs_jax.rl.loss_and_grad import AUX_METRIC
from pacs_jax.rl.rollout_correction import parse_is_threshold
from pacs_jax.training.spec import RolloutCorrectionSpec, RunSpec


def correction_name(correction: RolloutCorrectionSpec) -> str:
    """A rollout correction in words: "token TIS at 2", "token IcePop in [0.5, 5]", "rejection seq_mean_k3
    at 0.01", "bypass mode (ppo_clip)", joined by ", "."""
    parts = []
    if correction.rollout_is is not None:
        bounds = parse_is_threshold(correction.rollout_is_threshold)
        parts.append(f"{correction.rollout_is} TIS at {bounds.upper:g}" if bounds.lower is None else
                     f"{correction.rollout_is} IcePop in [{bounds.lower:g}, {bounds.upper:g}]")
        if correction.rollout_is_batch_normalize:
            parts[-1] += ", batch-normalised"
    if correction.rollout_rs is not None:
        parts.append(f"rejection {correction.rollout_rs} at {correction.rollout_rs_threshold}")
    if correction.bypass_mode:
        parts.append(f"bypass mode ({correction.loss_type}: the sampler's log-probs as pi_old)")
    return ", ".join(parts)


def options_line(spec: RunSpec, devices: int) -> str | None:
    """The session's line of the options on (``spec``'s, on ``devices`` devices), or None: each with its
    settings, one step off with the devices each role runs on, a rollout correction the run switched on
    by default saying so."""
    tc, rc, algorithm = spec.train, spec.rollout, spec.algorithm
    fg, correction = algorithm.filter_groups, algorithm.rollout_correction
    on = []
    if rc.carry_over:
        on.append(f"carry-over (rows still decoding go on in the next step's call; a prompt batch unfinished "
                  f"rollout.max_staleness={rc.max_staleness} steps after its call is dropped and sampled again)")
    if fg.enable:
        limit = f"up to {fg.max_num_gen_batches}" if fg.max_num_gen_batches else "any number of"
        on.append(f"dynamic sampling ({limit} batches of {tc.prompts_per_step} prompts a step, keeping the "
                  f"groups whose {fg.metric!r} differs: algorithm.filter_groups)")
    if tc.off_policy_steps:
        split = spec.mesh.rollout_devices
        shared = "the one device" if devices == 1 else f"the same {devices} devices"
        where = (f"on the first {split} of the {devices} devices while the learner trains step s on the other "
                 f"{devices - split}" if split else
                 f"while the learner trains step s, the two taking turns on {shared} (mesh.rollout_devices=0)")
        on.append(f"one step off (the rollout engine samples step s + 1 with the weights step s started from, {where})")
    if tc.router_replay != "disabled":
        on.append(f"routing replay {tc.router_replay} (train.router_replay: "
                  + ("pi_old and the update run every token through the experts the sampler chose" if
                     tc.router_replay == "R3" else "the update runs every token through the experts pi_old chose")
                  + ", gate weights from the learner's own routers)")
    if tc.router_aux_loss_coef:
        on.append(f"a load-balancing loss ({tc.router_aux_loss_coef:g} x the routers' load_balancing_loss_func: "
                  "train.router_aux_loss_coef)")
    if correction.enabled or correction.bypass_mode:
        because = ""
        if algorithm.correction_by_default:
            cause = "carry-over" if rc.carry_over else "one step off"
            because = (f", switched on by {cause}'s default for its stale tokens (algorithm.rollout_correction sets "
                       "none; set one to choose another)")
        on.append(f"rollout correction {correction_name(correction)}{because}")
    if not on:
        return None
    return "options on: " + "; ".join(on) + "; each step prints a line of what they did"


def _percent(fraction: float) -> str:
    """A fraction as a percentage of up to three significant digits, never in scientific notation ("0.52%",
    "99.7%", "100%", "0.004%")."""
    return np.format_float_positional(100 * fraction, precision=3, fractional=False, trim="-") + "%"


def step_line(spec: RunSpec, metrics: dict[str, float]) -> str | None:
    """What the options on did in one step, from its ``metrics`` row (``rl_train``'s), or None when none is on."""
    tc, rc, algorithm = spec.train, spec.rollout, spec.algorithm
    fg, correction = algorithm.filter_groups, algorithm.rollout_correction
    parts = []
    if rc.carry_over:
        parts.append(f"carry-over: {metrics['carried_rows']:.0f} rows carried in, staleness mean "
                     f"{metrics['rollout_staleness_mean']:.2f} max {metrics['rollout_staleness_max']:.0f} "
                     f"(rollout.max_staleness={rc.max_staleness}), {metrics['carry_over_dropped']:.0f} prompts "
                     "dropped as stale")
    if fg.enable:
        batches, limit = round(metrics["num_gen_batches"]), fg.max_num_gen_batches
        drawn = batches * tc.prompts_per_step
        spread = round(drawn * (1.0 - metrics["filtered_fraction"]))
        line = (f"dynamic sampling: {batches} {'batch' if batches == 1 else 'batches'} drawn "
                f"({f'limit {limit}' if limit else 'no limit'}) in {metrics['time_sample']:.1f} s of sampling, "
                f"{spread} of their {drawn} groups with spread, {tc.prompts_per_step} kept")
        if limit and batches == limit:
            line += ("; the limit reached: a step that needs one batch more stops the run (raise "
                     "algorithm.filter_groups.max_num_gen_batches, or 0 for no limit)")
        parts.append(line)
    if tc.off_policy_steps:
        lag = round(metrics["rollout_staleness_max"])
        parts.append(f"one step off: rows sampled with the weights {lag} step behind, during the previous step's "
                     "update" if lag else "one step off: rows sampled now, with the step's own weights (a "
                     "session's first step)")
    if "routing_mismatch_tokens" in metrics:  # R3, or measured without replaying it (RunSpec.measures_routing)
        would, ran = {"R3": ("would have sent", ", which they ran on"),
                      "R2": ("sent", " (train.router_replay R2: the update ran on the experts pi_old chose)"),
                      "disabled": ("sent", " (train.router_replay disabled: nothing replayed)")}[tc.router_replay]
        parts.append(f"routing{' replay' if tc.router_replay == 'R3' else ''}: the learner's routers {would} "
                     f"{_percent(metrics['routing_mismatch_tokens'])} of the tokens "
                     f"({_percent(metrics['routing_mismatch_decisions'])} of their layers' decisions) to other experts "
                     f"than the sampler's{ran}")
    elif tc.router_replay == "R2":
        parts.append("routing replay: the update ran on the experts pi_old chose")
    if tc.router_aux_loss_coef:
        parts.append(f"load balance: the routers' load-balancing loss {metrics[AUX_METRIC]:.4g} "
                     f"(num_experts_per_tok when the experts share the tokens evenly; x {tc.router_aux_loss_coef:g} in the loss)")
    if correction.enabled or correction.bypass_mode:
        parts.append("correction: " + _correction_stats(correction, metrics))
    return "; ".join(parts) or None


def _correction_stats(correction: RolloutCorrectionSpec, metrics: dict[str, float]) -> str:
    """Bypass mode's KL(sampler || learner) (the loss's pi_old against its pi_theta), the correction's
    weights (mean, min, max and the share truncated or masked) and the share of tokens its rejection masks,
    from the step's ``rollout_corr/`` metrics (bypass mode's: the update's, its mini-batches' mean)."""
    m = {k.removeprefix("rollout_corr/"): v for k, v in metrics.items() if k.startswith("rollout_corr/")}
    stats = []
    if correction.bypass_mode:
        stats.append(f"bypass mode, KL(sampler || learner) {m['k3_kl']:.3g} a token (k3 estimate; the sampler's "
                     "log-probs are pi_old)")
    if correction.rollout_is is not None:
        bounds = parse_is_threshold(correction.rollout_is_threshold)
        rows = "tokens" if correction.rollout_is == "token" else "responses"
        stats.append(f"IS weights mean {m['rollout_is_mean']:.3g}, min {m['rollout_is_min']:.3g}, max "
                     f"{m['rollout_is_max']:.3g}, " + (
                         f"{_percent(m['rollout_is_ratio_fraction_high'])} of {rows} truncated at {bounds.upper:g}"
                         if bounds.lower is None else
                         f"{_percent(m['rollout_is_oob_ratio'])} of tokens masked outside [{bounds.lower:g}, "
                         f"{bounds.upper:g}]"))
    if correction.rollout_rs is not None:
        stats.append(f"{_percent(m['rollout_rs_masked_fraction'])} of tokens rejected")
    return ", ".join(stats)
