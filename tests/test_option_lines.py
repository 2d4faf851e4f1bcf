"""Issue 67 item 4: the console says what the step-changing options did (training/option_lines.py).

With carry-over, dynamic sampling, one step off or a rollout correction on, the step lines and the progress
bar were those of a run without: nothing said that carry-over and one step off switch token TIS at 2 on, how
the devices were split, how stale the rows were, how many batches dynamic sampling drew (one step drew 10,
its limit, silently) or what the correction's weights were. A session now starts with a line of the options
on, and each step writes one of what they did, from its metrics row. The lines are made from a spec and a
metrics row here (no training): the loop writes ``step_line`` of each row (tests/test_train_carry_over.py
checks it in a run).
"""

import pytest

from pacs_jax.training.option_lines import options_line, step_line
from pacs_jax.training.spec import RunSpec
from train_helpers import load_config


def _spec(**fields) -> RunSpec:
    """The demo's spec with ``fields`` ({"section.field": value}, "a.b.c" for a subsection) set."""
    config = load_config("default.py")
    for dotted, value in fields.items():
        *sections, name = dotted.split(".")
        section = config
        for part in sections:
            section = section[part]
        section[name] = value
    return RunSpec.unplaced(config)


def test_the_start_line_names_the_correction_carry_over_and_one_step_off_switch_on():
    carry = options_line(_spec(**{"rollout.carry_over": True}), 1)
    assert carry.startswith("options on: carry-over (") and "rollout.max_staleness=1 " in carry
    assert ("rollout correction token TIS at 2, switched on by carry-over's default for its stale tokens "
            "(algorithm.rollout_correction sets none; set one to choose another)") in carry
    off = options_line(_spec(**{"train.off_policy_steps": 1, "mesh.rollout_devices": 4}), 8)
    assert "on the first 4 of the 8 devices while the learner trains step s on the other 4" in off
    assert "switched on by one step off's default" in off
    shared = options_line(_spec(**{"train.off_policy_steps": 1}), 8)
    assert "the two taking turns on the same 8 devices (mesh.rollout_devices=0)" in shared
    # the same correction set in the config is the config's, not a default
    chosen = options_line(_spec(**{"rollout.carry_over": True, "algorithm.rollout_correction.preset": "token_tis"}), 1)
    assert "rollout correction token TIS at 2;" in chosen and "switched on" not in chosen
    assert options_line(_spec(), 1) is None  # the demo as it is: no options, no line


def test_each_step_line_says_what_carry_over_dynamic_sampling_and_the_correction_did():
    spec = _spec(**{"rollout.carry_over": True, "algorithm.filter_groups.enable": True,
                    "algorithm.filter_groups.max_num_gen_batches": 10,
                    "algorithm.rollout_correction.preset": "seq_mis"})
    metrics = {"carried_rows": 169.0, "rollout_staleness_mean": 0.5312, "rollout_staleness_max": 1.0,
               "carry_over_dropped": 3.0, "num_gen_batches": 3.0, "filtered_fraction": 0.625, "time_sample": 8.04,
               "rollout_corr/rollout_is_mean": 0.9981, "rollout_corr/rollout_is_min": 0.2394,
               "rollout_corr/rollout_is_max": 2.0, "rollout_corr/rollout_is_ratio_fraction_high": 0.0052,
               "rollout_corr/rollout_rs_masked_fraction": 0.125, "loss": 0.7}
    prompts = spec.train.prompts_per_step
    line = step_line(spec, metrics)
    assert line.split("; ") == [
        "carry-over: 169 rows carried in, staleness mean 0.53 max 1 (rollout.max_staleness=1), 3 prompts dropped "
        "as stale",
        f"dynamic sampling: 3 batches drawn (limit 10) in 8.0 s of sampling, {round(3 * prompts * 0.375)} of their "
        f"{3 * prompts} groups with spread, {prompts} kept",
        "correction: IS weights mean 0.998, min 0.239, max 2, 0.52% of responses truncated at 2, 12.5% of tokens "
        "rejected"]
    assert step_line(_spec(), metrics) is None  # no option on: no line


def test_a_step_of_dynamic_sampling_at_its_limit_says_so():
    spec = _spec(**{"algorithm.filter_groups.enable": True, "algorithm.filter_groups.max_num_gen_batches": 4})
    metrics = {"num_gen_batches": 4.0, "filtered_fraction": 0.75, "time_sample": 8.0}
    assert step_line(spec, metrics).endswith(
        "; the limit reached: a step that needs one batch more stops the run (raise "
        "algorithm.filter_groups.max_num_gen_batches, or 0 for no limit)")
    assert "limit reached" not in step_line(spec, {**metrics, "num_gen_batches": 3.0})


@pytest.mark.parametrize("staleness, words", [(1.0, "rows sampled with the weights 1 step behind, during the "
                                                    "previous step's update"),
                                              (0.0, "rows sampled now, with the step's own weights (a session's "
                                                    "first step)")])
def test_one_step_offs_step_line_says_how_far_behind_its_rows_are(staleness, words):
    spec = _spec(**{"train.off_policy_steps": 1})
    metrics = {"rollout_staleness_mean": staleness, "rollout_staleness_max": staleness,
               "rollout_corr/rollout_is_mean": 1.0, "rollout_corr/rollout_is_min": 0.5,
               "rollout_corr/rollout_is_max": 2.0, "rollout_corr/rollout_is_ratio_fraction_high": 0.0}
    assert step_line(spec, metrics) == (f"one step off: {words}; correction: IS weights mean 1, min 0.5, max 2, 0% "
                                        "of tokens truncated at 2")


@pytest.mark.parametrize("fraction, shown", [(0.997, "99.7%"), (1.0, "100%"), (0.00004, "0.004%"), (0.0052, "0.52%"),
                                             (0.0, "0%")])
def test_a_share_is_a_plain_percentage_never_in_scientific_notation(fraction, shown):
    """A share over 99.5 % printed "1e+02%" (two significant digits in the format ``g``)."""
    spec = _spec(**{"algorithm.rollout_correction.preset": "token_tis"})
    metrics = {"rollout_corr/rollout_is_mean": 1.0, "rollout_corr/rollout_is_min": 0.5,
               "rollout_corr/rollout_is_max": 2.0, "rollout_corr/rollout_is_ratio_fraction_high": fraction}
    assert step_line(spec, metrics).endswith(f", {shown} of tokens truncated at 2")


def test_bypass_mode_alone_has_a_step_line_as_its_start_line_promises():
    """With only bypass mode on, the session's line said each step prints what it did, and no step printed a
    line (the step line read only a correction's weights or rejection): it says KL(sampler || learner) (k3:
    never negative, as the plain estimate can be), from the update's ``rollout_corr/`` metrics."""
    spec = _spec(**{"algorithm.rollout_correction.bypass_mode": True})
    assert options_line(spec, 1).endswith("; each step prints a line of what they did")
    assert step_line(spec, {"rollout_corr/kl": -0.0003, "rollout_corr/k3_kl": 0.001234, "loss": 0.7}) == (
        "correction: bypass mode, KL(sampler || learner) 0.00123 a token (k3 estimate; the sampler's log-probs are "
        "pi_old)")


def test_routing_replay_says_whose_experts_ran_and_how_far_the_learners_routers_strayed():
    moe = {"model.model_type": "qwen3_moe", "model.num_experts": 4, "model.num_experts_per_tok": 2,
           "model.moe_intermediate_size": 64}
    r3 = _spec(**moe, **{"train.router_replay": "R3"})
    assert "routing replay R3 (train.router_replay: pi_old and the update run every token through the experts the " \
           "sampler chose, gate weights from the learner's own routers)" in options_line(r3, 1)
    line = step_line(r3, {"routing_mismatch_tokens": 0.0937, "routing_mismatch_decisions": 0.0214})
    assert line == ("routing replay: the learner's routers would have sent 9.37% of the tokens (2.14% of their "
                    "layers' decisions) to other experts than the sampler's, which they ran on")
    r2 = _spec(**moe, **{"train.router_replay": "R2"})
    assert "the update runs every token through the experts pi_old chose" in options_line(r2, 1)
    assert step_line(r2, {}) == "routing replay: the update ran on the experts pi_old chose"  # nothing measured
    line = step_line(r2, {"routing_mismatch_tokens": 0.25, "routing_mismatch_decisions": 0.0625})
    assert line == ("routing: the learner's routers sent 25% of the tokens (6.25% of their layers' decisions) to "
                    "other experts than the sampler's (train.router_replay R2: the update ran on the experts pi_old "
                    "chose)")
    disabled = _spec(**moe)  # no replay: the sampler still records, each step says how far the learner's differ
    assert disabled.measures_routing(4) and r2.measures_routing(4) and not disabled.measures_routing(0)
    balanced = _spec(**moe, **{"train.router_aux_loss_coef": 0.001})
    assert "a load-balancing loss (0.001 x the routers' load_balancing_loss_func: train.router_aux_loss_coef)" in \
        options_line(balanced, 1)
    assert "load balance: the routers' load-balancing loss 2.042 (num_experts_per_tok when the experts share the " \
        "tokens evenly; x 0.001 in the loss)" in step_line(balanced, {
            "actor/router_aux_loss": 2.0417, "routing_mismatch_tokens": 0.0, "routing_mismatch_decisions": 0.0})
    carried = _spec(**moe, **{"train.router_replay": "R2", "rollout.carry_over": True})
    assert carried.measures_routing(4)  # carried rows' record travels with them (the calls that decoded them)
    bypass = _spec(**moe, **{"algorithm.rollout_correction.bypass_mode": True, "rollout.max_logprob_diff": 0})
    assert not bypass.measures_routing(4)  # no pi_old to measure against
    line = step_line(disabled, {"routing_mismatch_tokens": 0.5, "routing_mismatch_decisions": 0.125})
    assert line == ("routing: the learner's routers sent 50% of the tokens (12.5% of their layers' decisions) to "
                    "other experts than the sampler's (train.router_replay disabled: nothing replayed)")
