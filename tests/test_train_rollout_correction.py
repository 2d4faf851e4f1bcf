"""The rollout correction in the trainer (algorithm.rollout_correction, docs/design.md 6.7).

With the sampler made to differ from pi_old (its log-probs those of another temperature, as a sampler
whose numerics drift would be), the step's correction program fires: its weights, rejection mask and
``rollout_corr/`` metrics equal the float64 reference of tests/test_rollout_correction.py on pi_old as
the trainer computed it, and the update's loss at pi_theta = pi_old equals a float64 statement of each
objective's loss with those weights and that mask. Bad settings are one line naming the field, status
78, before anything is written."""

from __future__ import annotations

import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import REPO
from pacs_jax.errors import PERMANENT_ERROR_STATUS
from pacs_jax.training.config_check import ConfigError, validate_config
from pacs_jax.rewards import STATUSES
from pacs_jax.training.progress import StepWatch
from pacs_jax.training.records import Collected, PhaseTimes, Scores
from pacs_jax.training.rollout import RolloutCollector
from pacs_jax.training.spec import RunSpec
from pacs_jax.training.step_programs import StepPrograms
from test_rollout_correction import reference as correction_reference
from test_train_temperature import N, TEMPERATURE, models_and_batch, reference_logprobs, trainer_config  # noqa: F401
from train_helpers import load_config, train_env

REWARDS = np.array([1, 0, 0, 1, 0, 1, 1, 1], np.float32)
CORRECTION = dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1,seq_mean_k3",
                  rollout_rs_threshold="0.5_2,0.5")


def _grpo_advantages(rewards):
    g = rewards.astype(np.float64).reshape(-1, N)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)


def _loss_at_pi_old(objective: str, weights: np.ndarray, kept: np.ndarray, old: np.ndarray) -> float:
    """Each objective's loss where pi_theta = pi_old (every ratio 1, PACS's scores 0), float64; old: log pi_old."""
    if objective == "pacs":  # (1/B) sum_i w_i rho_i softplus(0): rho_i the response's mean weight over kept tokens
        labels = REWARDS.reshape(-1, N)
        positives = labels.sum(1, keepdims=True)
        same = np.where(labels > 0.5, positives, N - positives)
        mixed = (positives > 0) & (positives < N)
        w = np.where(mixed, N / (2.0 * same), 1.0).reshape(-1)
        rho = (weights * kept).sum(1) / np.maximum(kept.sum(1), 1.0)
        return float(np.sum(w * rho * np.log(2.0)) / len(REWARDS))
    token_loss = -_grpo_advantages(REWARDS)[:, None] * weights  # grpo, gspo at ratio 1
    if objective == "cispo":  # -sg[clip(1)] A w log pi_theta
        token_loss = token_loss * old
    if objective == "gspo":  # seq-mean-token-mean over the kept tokens, / every row (verl 0.9.1's global_batch_size)
        return float(np.mean(np.sum(token_loss * kept, axis=1) / np.maximum(kept.sum(1), 1.0)))
    return float(np.sum(token_loss * kept) / kept.sum())  # token-mean over the kept tokens


@pytest.mark.parametrize("objective, packing", [("grpo", True), ("pacs", True), ("gspo", True), ("cispo", True),
                                               ("grpo", False), ("gspo", False), ("cispo", False)])
def test_a_drifting_sampler_is_corrected_as_the_float64_reference(models_and_batch, objective, packing):  # noqa: F811
    """The correction program and then the update program of the trainer (packed passes or padded
    micro-batches), for PACS, GRPO, GSPO and CISPO."""
    hf_model, model, sampled = models_and_batch
    graphdef, params = nnx.split(model)
    config = trainer_config(TEMPERATURE)
    config.train.packing = packing
    config.algorithm.objective = objective  # trainer_config's grpo at token-mean; the others read none of it
    if objective != "grpo":
        config.algorithm.grpo.loss_agg_mode = load_config("default.py").algorithm.grpo.loss_agg_mode
    config.algorithm.rollout_correction.update(CORRECTION)
    spec = RunSpec.unplaced(config)
    programs = StepPrograms(spec, graphdef, params, ())
    batch, *_ = RolloutCollector.from_spec(spec, programs, decode=lambda ids: "", reward_pool=None).old_policy(
        params, sampled)
    live = np.asarray(batch.response_mask, np.float64)
    # The sampler's log-probs: those of temperature 1 where the trainer's pi_old is at 0.6.
    R = live.shape[1]
    drifted = np.zeros((live.shape[0], R + 3), np.float32)  # a sampler call's width is max_new_tokens (>= R)
    drifted[:, :R] = reference_logprobs(hf_model, sampled, 1.0)
    weights, kept, metrics = programs.learner.rollout_correction((drifted[:4], drifted[4:]), batch.old_logp,
                                                         batch.response_mask)
    old = np.asarray(batch.old_logp, np.float64)
    want_w, want_kept, want_metrics = correction_reference(old, drifted[:, :R].astype(np.float64), live,
                                                            **CORRECTION)
    np.testing.assert_array_equal(np.asarray(kept), want_kept)
    np.testing.assert_allclose(np.asarray(weights), want_w * want_kept, rtol=1e-5, atol=1e-6)
    assert sorted(metrics) == sorted(want_metrics)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-4, atol=1e-5, err_msg=key)
    # the drift shows: weights far from 1 and tokens rejected, and the metrics say so (pi_old, at the lower
    # temperature, gives these random tokens less probability than the sampler)
    assert float(metrics["rollout_corr/rollout_is_ratio_fraction_low"]) > 0
    assert 0 < float(metrics["rollout_corr/rollout_rs_masked_fraction"]) < 1
    assert float(metrics["rollout_corr/kl"]) != 0

    update_batch = batch.replace(rewards=jax.numpy.asarray(REWARDS), rollout_is_weights=weights, response_mask=kept)
    fresh = jax.tree.map(np.array, params)  # the update donates its inputs
    _, _, (step_metrics,) = programs.learner.update(fresh, jax.jit(programs.learner.optimizer.init)(fresh), update_batch)
    np.testing.assert_allclose(float(step_metrics["loss"]), _loss_at_pi_old(objective, np.asarray(weights, np.float64),
                                                                            want_kept, old),
                               rtol=2e-4, atol=1e-6)


def _ppo_clip_token_losses(logp, old, adv):
    ratio = np.exp(np.clip(logp - old, -20, 20))
    a = adv[:, None]
    losses = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.2))
    return np.where(a < 0, np.minimum(losses, -a * 3.0), losses)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_takes_the_samplers_log_probs_as_pi_old_and_corrects_in_the_loss(models_and_batch,  # noqa: F811
                                                                                   loss_type):
    """No pi_old pass: the update batch's old_logp are the sampler's; the loss corrects pi_theta against
    them (verl's bypass): PPO-clip over the rejection mask without weights, or REINFORCE with them. The
    step's metrics have no entropy (no pass measures it; issue 67 item 2: it was NaN every step) and no
    value that is not finite."""
    hf_model, model, sampled = models_and_batch
    graphdef, params = nnx.split(model)
    config = trainer_config(TEMPERATURE)
    config.algorithm.rollout_correction.update(CORRECTION, bypass_mode=True, loss_type=loss_type)
    spec = RunSpec.unplaced(config)
    programs = StepPrograms(spec, graphdef, params, ())
    names = {p.name for p in programs.programs()}
    assert "sampler_as_pi_old" in names and not names & {"pi_old", "rollout_consistency", "rollout_correction"}
    R = sampled.tokens.shape[1]
    drifted = np.zeros((len(sampled.tokens), R + 3), np.float32)
    drifted[:, :R] = reference_logprobs(hf_model, sampled, 1.0)  # the sampler's: temperature 1, pi_theta's 0.6
    B = len(sampled.tokens)
    rows = types.SimpleNamespace(**vars(sampled), sampler_logprobs=(drifted[:4], drifted[4:]), response_bucket=R,
                                 prompt_bucket=sampled.prompt_tokens.shape[1], stopped=np.ones(B, bool),
                                 decode_steps=R, slot_utilisation=1.0)
    scores = Scores(REWARDS, [STATUSES[0]] * B, np.zeros(B, np.int32), 0, 0.0, 0)
    rollout = RolloutCollector.from_spec(spec, programs, decode=lambda ids: "", reward_pool=None).finish(
        params, Collected(rows, scores, {}, PhaseTimes()), StepWatch.silent())
    assert "entropy" not in rollout.metrics  # no pass measured it
    assert all(np.isfinite(value) for value in rollout.metrics.values()), rollout.metrics
    batch = update_batch = rollout.batch
    np.testing.assert_array_equal(np.asarray(batch.old_logp), drifted[:, :R])

    fresh = jax.tree.map(np.array, params)
    _, _, (metrics,) = programs.learner.update(fresh, jax.jit(programs.learner.optimizer.init)(fresh), update_batch)
    live = np.asarray(batch.response_mask, np.float64)
    logp = reference_logprobs(hf_model, sampled, TEMPERATURE)  # pi_theta at the rollout temperature
    weights, kept, want = correction_reference(logp, drifted[:, :R].astype(np.float64), live, **CORRECTION)
    adv = _grpo_advantages(REWARDS)
    if loss_type == "ppo_clip":  # the objective (grpo at token-mean) with pi_old = the sampler, no weights
        token_losses = _ppo_clip_token_losses(logp, drifted[:, :R].astype(np.float64), adv)
    else:
        token_losses = -adv[:, None] * weights * logp
    # over the kept tokens, divided by the mini-batch's response tokens (its totals are taken before the loss
    # rejects any, as verl's global batch info)
    np.testing.assert_allclose(float(metrics["loss"]), np.sum(token_losses * kept) / live.sum(), rtol=5e-4)
    assert 0 < float(metrics["rollout_corr/rollout_rs_masked_fraction"]) < 1
    np.testing.assert_allclose(float(metrics["rollout_corr/rollout_rs_masked_fraction"]),
                               want["rollout_corr/rollout_rs_masked_fraction"], atol=1e-6)


def test_bypass_modes_pi_old_phase_waits_for_its_batch_and_says_so():
    """Bypass mode runs no pi_old pass: the phase's heartbeat read "0/0 passes done", and it waited for nothing
    (no pass, no comparison). It waits for the update batch of the sampler's log-probs and says that is what it
    does. The collector and the watch are stand-ins: the wait records what it waits for and its detail."""
    import jax.numpy as jnp

    from pacs_jax.training.learner.rollout_batch import OldPolicy

    waits = []
    watch = types.SimpleNamespace(start=lambda phase: None, done=lambda: None,
                                  wait=lambda arrays, detail: waits.append((jax.tree.leaves(arrays), detail())))
    collector = types.SimpleNamespace(programs=types.SimpleNamespace(learner=types.SimpleNamespace(bypass=object())),
                                      max_logprob_diff=0.0)
    old_logp = jnp.zeros((4, 3))
    dispatched = OldPolicy(types.SimpleNamespace(old_logp=old_logp), [], {}, {}, {})
    RolloutCollector._wait_old_policy(collector, dispatched, watch, {})
    ((arrays, detail),) = waits
    assert arrays == [old_logp] and detail == "the sampler's log-probs as pi_old (bypass mode, no pass)"


def test_correction_off_leaves_the_update_batch_as_it_was(models_and_batch):  # noqa: F811
    _, model, sampled = models_and_batch
    graphdef, params = nnx.split(model)
    spec = RunSpec.unplaced(trainer_config(TEMPERATURE))
    programs = StepPrograms(spec, graphdef, params, ())
    assert programs.learner.rollout_correction is None
    assert programs.learner.abstract_batch(5, 6).rollout_is_weights is None
    assert "rollout_correction" not in {p.name for p in programs.programs()}


@pytest.mark.parametrize("settings, field", [
    (dict(preset="tis"), "preset"),
    (dict(rollout_is="tokens"), "rollout_is"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0), "rollout_rs"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2"), "rollout_rs_threshold (token_k2)"),
    (dict(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.5_2,0.1,0.2"), "rollout_rs_threshold"),
    (dict(rollout_rs="seq_mean_k3"), "rollout_rs_threshold"),
    (dict(rollout_is="token", rollout_is_threshold="2_0.5"), "rollout_is_threshold"),
    (dict(loss_type="ppo"), "loss_type"),
    (dict(bypass_mode=True, loss_type="reinforce"), "loss_type"),
    (dict(bypass_mode=True, max_logprob_diff=0.5), "bypass_mode"),  # no pi_old for rollout.max_logprob_diff  # the default objective, PACS, has no REINFORCE form
])
def test_bad_settings_name_their_field(settings, field):
    config = load_config("default.py")
    settings = dict(settings)
    config.rollout.max_logprob_diff = settings.pop("max_logprob_diff", 0.0)
    config.algorithm.rollout_correction.update(settings)
    with pytest.raises(ConfigError, match=r"^config\.algorithm\.rollout_correction\." + field.replace("(", r"\(")
                       .replace(")", r"\)")):
        validate_config(config)


def test_presets_set_verls_fields_under_those_given():
    config = load_config("default.py")
    config.algorithm.rollout_correction.preset = "seq_mis"
    spec = RunSpec.unplaced(config).algorithm.rollout_correction
    assert (spec.rollout_is, spec.rollout_is_threshold, spec.rollout_rs, spec.rollout_rs_threshold) == (
        "sequence", 2.0, "seq_sum_k1", "0.5_2.0")
    config.algorithm.rollout_correction.rollout_is_threshold = 3.0  # a field set wins over the preset's
    assert RunSpec.unplaced(config).algorithm.rollout_correction.rollout_is_threshold == 3.0


def test_the_cli_refuses_a_lower_bound_above_the_upper_in_one_line_writing_nothing(tmp_path):
    workdir = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "pacs_jax.train", f"--workdir={workdir}",
                          "--config.algorithm.rollout_correction.preset=icepop",
                          "--config.algorithm.rollout_correction.rollout_is_threshold=5.0_0.5"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=train_env())
    assert run.returncode == PERMANENT_ERROR_STATUS, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("pacs_jax.train: error: ")]
    assert lines == ["pacs_jax.train: error: config.algorithm.rollout_correction.rollout_is_threshold: '5.0_0.5' has its "
                     "lower bound above its upper bound"], run.stderr[-2000:]
    assert not workdir.exists()


def test_the_run_record_names_the_correction_that_ran():
    """config.json (workdir.recorded_config) holds the correction's fields as they run, a preset's filled in;
    off, the record is as it was."""
    from pacs_jax.training.workdir import recorded_config

    config = load_config("default.py")
    assert "rollout_correction" not in recorded_config(config, None)["algorithm"]
    config.algorithm.rollout_correction.preset = "geo_rs"
    assert recorded_config(config, None)["algorithm"]["rollout_correction"] == dict(
        rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.999_1.001", bypass_mode=False, loss_type="ppo_clip")
