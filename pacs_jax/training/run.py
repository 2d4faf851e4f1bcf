"""One training run of any config (``python -m pacs_jax.train``; the CPU demo is configs/default.py).

    tokenizer (data.tokenizer; "": model.path's own) and model (model.path, model.preset, or config.model's
    fields at random init)
    -> training problems (data.source: files | arithmetic), minus the held-out split (data.held_out_problems);
       each malformed row that data.allow_skips skipped named in the log and in workdir/skipped_rows.txt
    -> supervised warm-start (warmstart.steps > 0) on the problems data.warmstart_problems sets aside
       from RL (0: on RL's problems), stopped early at a greedy accuracy on RL's first prompts
       (warmstart.target_accuracy)                                              training/learner/warmstart.py
    -> evaluation before RL (eval.before_rl, with the final settings)
    -> RL (training/loop.py rl_train), evaluated every eval.periodic.every steps
    -> final evaluation (eval.final settings) -> HF export (with the run's tokenizer files), summary.json,
       curves.png (training/curves.py)
Every evaluation's metrics also go to TensorBoard: eval/<set>/pass_at_<k> and mean_at_<n> (the
periodic ones), eval_final/... (before RL at step 0, final at the last step) and eval_final_greedy/...

A restarted run resumes RL from its checkpoints; the warm-start and the evaluation before RL are not
run again (their results are kept in workdir/warmstart.json). Evaluation outputs go to
workdir/eval/<name>/ (before_rl, step_<k>, final, final_greedy).

Around all of it (docs/design.md section 3.7): the workdir lock (training/workdir_lock.py), the resume
check, made before anything is written (a checkpoint of other model shapes, model.path, objective,
critic, gradient clipping or carry-over, or ``train.steps`` below the checkpoint's step, is refused naming
the fields; so is a workdir/hf_export holding files the export at the end would delete, naming them),
then config.json and the session's entry in sessions.json (a resume's once its checkpoint has restored
and its programs fit: one refused before leaves the record as it was); the
run's SIGTERM / SIGINT handling by phase (training/signals.py); the wall time of every session
(sessions.json; summary.json's ``wall_seconds`` is their sum). A workdir whose run has finished at
``train.steps`` says there is nothing to train and returns its summary; one whose checkpoint is at
``train.steps`` without a summary runs the final evaluation and export the last session did not
finish. A run stopped by a signal in RL returns {"stopped_at_step": N} (and "dropped_step": the
unfinished step it left, whose device programs may still run); ``python -m pacs_jax.train`` then
exits with status 79 (errors.RESUME_NEEDED_STATUS). model.path, data.tokenizer and the data files may be ``gs://`` paths: an HF model folder or
a tokenizer on ``gs://`` is copied to the host's cache once (data/remote.py), data files are read
from the store; a ``gs://`` workdir is written through etils.epath and Orbax. A full disk or a
permission error while writing is a ``StorageError`` naming the path.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_collections
from etils import epath
from flax import nnx

from pacs_jax import checkpoints, data, evaluation, models, sharding
from pacs_jax.data import paths
from pacs_jax.data.char_tokenizer import NO_HF_TOKENIZER
from pacs_jax.files import StorageError, atomic_write_text, storage_error
from pacs_jax.models.hf_weights import NotAnExportError, no_tokenizer_line
from pacs_jax.models import lora
from pacs_jax.models.peft_export import export_peft
from pacs_jax.rewards import RewardPool, reward_for
from pacs_jax.training import run_summary
from pacs_jax.training.curves import plot_curves
from pacs_jax.training.learner.critic_step import abstract_critic
from pacs_jax.training.learner.warmstart import WarmStartResult, warm_start
from pacs_jax.training.loop import rl_train
from pacs_jax.training.metrics import EvalScalars
from pacs_jax.training.model_spec import lora_options, model_config, run_options
from pacs_jax.training.warm_base import has_warm_base, keep_warm_base, resumed_base
from pacs_jax.training.option_lines import options_line
from pacs_jax.training.progress import planned_step_warning
from pacs_jax.training.records import PromptBatch
from pacs_jax.training.signals import StopSignals
from pacs_jax.training.spec import ConfigError, EvalSpec, RunSpec
from pacs_jax.training.step_programs import StepPrograms, placed_on
from pacs_jax.training.workdir import (EXPORT_FOLDER, PEFT_FOLDER, SessionClock, check_export_folder, check_resume,
                                       finished_summary, write_config)
from pacs_jax.training.workdir_lock import WorkdirLock, agree

HELD_OUT = "held_out"  # the evaluation set of the problems data.held_out_problems sets aside
SKIPPED_ROWS_FILE = "skipped_rows.txt"  # the malformed rows data.allow_skips skipped, "FILE:LINE: why" a line


class GrainPromptSource:
    """Adapts the grain prompt iterator (pacs_jax.data.pipeline) to the trainer's PromptSource."""

    def __init__(self, examples: list[data.PromptExample], batch_size: int, seed: int):
        self.examples = examples
        self.config = data.PipelineConfig(batch_size=batch_size, seed=seed, num_epochs=None)
        self.iterator = data.prompt_iterator(examples, self.config)

    def next_batch(self) -> PromptBatch:
        batch = next(self.iterator)
        return PromptBatch([list(e.prompt_ids) for e in batch], [e.problem.ground_truth for e in batch],
                           [e.problem.data_source for e in batch])

    def get_state(self) -> dict:
        return self.iterator.get_state()

    def set_state(self, state: dict) -> None:
        self.iterator = data.prompt_iterator(self.examples, self.config, state=state)


def prompt_source(spec: RunSpec, tokenizer
                  ) -> tuple[GrainPromptSource, list[data.PromptExample], list[data.Problem], dict]:
    """The run's RL prompts (data.source minus the warm-start's and the held-out splits, through the
    tokenizer's chat template), the warm-start's prompts (RL's when data.warmstart_problems is 0), the
    held-out problems, and counts (rows, skipped, held_out, warmstart, dropped_overlong; skipped_rows: the
    skipped rows' messages)."""
    dc = spec.data
    train, warm, held_out, counts = data.training_problems(dataclasses.asdict(dc), seed=spec.seed)
    examples, dropped = data.build_prompts(train, tokenizer, dc.max_prompt_length, dc.instruction)
    warm_examples, warm_dropped = data.build_prompts(warm, tokenizer, dc.max_prompt_length, dc.instruction)
    return (GrainPromptSource(examples, spec.train.prompts_per_step, dc.shuffle_seed),
            warm_examples if warm else examples, held_out, dict(counts, dropped_overlong=dropped + warm_dropped))


def build_model(spec: RunSpec, tokenizer) -> models.Qwen:
    """The model of a run: model.path (HF dir or checkpoint), else model.preset at random init, else
    the architecture fields of ``spec.model`` at random init (the demo; tests: a tiny model with the
    real vocabulary); with model.lora_rank > 0, that base with fresh adapters (B = 0: its logits)."""
    if spec.model.path:
        base = checkpoints.from_pretrained(spec.model.path, **run_options(spec))
    else:
        architecture = {} if spec.model.preset else {"eos_token_id": tokenizer.eos_token_id}
        cfg = model_config(spec, vocab_size=len(tokenizer), **architecture)
        base = models.init_random(cfg.without_adapters(), seed=spec.seed)
    return with_adapters(spec, base)


def with_adapters(spec: RunSpec, base: models.Qwen) -> models.Qwen:
    """``base`` with the run's fresh LoRA adapters (drawn from the seed, B = 0), or ``base`` itself without LoRA."""
    adapters = lora_options(spec, base.cfg)
    if not adapters:
        return base
    return lora.attach(base, rank=adapters["lora_rank"], alpha=adapters["lora_alpha"],
                       targets=adapters["lora_targets"], modules_to_save=adapters["lora_saved"], seed=spec.seed)


def eval_sets(spec: RunSpec, held_out: list[data.Problem]) -> list[evaluation.EvalSet]:
    """eval.sets: entries of eval.set_files, and "held_out" (scored by the training reward)."""
    ec, rw = spec.eval, spec.reward
    files = [n for n in ec.sets if n != HELD_OUT]
    sets = evaluation.load_eval_sets(files, ec.set_files, ec.data_dir, ec.max_problems, rw.mode) if files else []
    if HELD_OUT in ec.sets:
        problems = [dataclasses.replace(p, data_source=HELD_OUT) for p in held_out]
        problems = problems[:ec.max_problems] if ec.max_problems > 0 else problems
        sets.append(evaluation.EvalSet(HELD_OUT, problems, reward_for(rw.name, rw.mode)))
    return sets


def _with_local_model(spec: RunSpec, say) -> RunSpec:
    """``spec``, or a copy whose model.path is the local copy of an HF model folder on ``gs://``
    (data/remote.py; every process copies to its host's cache). A pacs_jax checkpoint on ``gs://`` stays
    as it is: Orbax reads the store."""
    path = spec.model.path
    if not (path and paths.is_remote(path) and (paths.path(path) / "config.json").is_file()):
        return spec
    local = dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=str(data.local_folder(path))))
    say(f"model.path {path}: read from its copy in {local.model.path} (copied once; refreshed when the store's "
        f"files change)")
    return local


def _planned_model(spec: RunSpec, tokenizer) -> models.QwenConfig | None:
    """The model config the run will build (None: not known before loading the model)."""
    try:
        return model_config(spec, vocab_size=len(tokenizer))
    except (OSError, ValueError):
        return None


def run_training(config: ml_collections.ConfigDict, workdir: str | os.PathLike, spec: RunSpec | None = None) -> dict:
    """Train per ``config`` on the mesh in context (``jax.set_mesh``, set by ``python -m pacs_jax.train``);
    returns the summary written to workdir/summary.json (see the module docstring). spec: the run's
    ``RunSpec`` (``python -m pacs_jax.train``: the one its check built; None: built here, without the
    mesh checks, which the mesh in context has passed), which everything below reads; ``config`` itself
    is only recorded (config.json).

    Holds the workdir lock and the run's signal handling throughout; a full disk or a permission
    error while writing becomes a ``StorageError`` (one line naming the path)."""
    workdir = epath.Path(workdir)
    clock = SessionClock(workdir)
    try:
        with WorkdirLock(workdir), StopSignals(multiprocess=jax.process_count() > 1) as signals:
            return _run(config, spec or RunSpec.unplaced(config), workdir, signals, clock)
    except Exception as e:
        message = storage_error(e)
        if message is None:
            raise
        raise StorageError(f"{message} (while writing; free space or fix the permission, then run it again: "
                           f"training resumes from the last checkpoint)") from None


def _run(recorded: ml_collections.ConfigDict, spec: RunSpec, workdir: epath.Path, signals: StopSignals,
         clock: SessionClock) -> dict:
    primary = jax.process_index() == 0
    say = (lambda line: print(line, flush=True)) if primary else (lambda line: None)
    signals.exit_at_once("the start-up (this session has trained nothing yet)")
    configured, spec = spec, _with_local_model(spec, say)  # config.json keeps the gs:// model.path
    dc, ec, wc = spec.data, spec.eval, spec.warmstart
    tokenizer_source = data.run_tokenizer(dataclasses.asdict(dc), spec.model.path)  # "char" or a folder ("": model.path's own)
    tokenizer = data.load_tokenizer(tokenizer_source)
    planned = _planned_model(spec, tokenizer)
    latest = check_resume(configured, workdir, planned)  # reads only; model.path as config.json records it
    if latest and latest == spec.train.steps:
        done = finished_summary(workdir, latest)
        if agree(done is not None):
            say(f"nothing to train: {workdir} holds a run finished at step {latest} = train.steps (its "
                f"summary.json is written); set train.steps above {latest} to train further")
            return done or {"final_step": latest}
        say(f"all {latest} steps of train.steps are checkpointed in {workdir / 'checkpoints'}, but the last "
            f"session stopped before the end: running the final evaluation and the export")
    check_export_folder(workdir)  # the export at the end replaces workdir/hf_export: refused now, not then

    def record_session() -> None:
        """config.json and this session in sessions.json: a fresh run's now, a resume's once its checkpoint
        has restored and its programs fit (rl_train's on_start), so that one refused there leaves the
        record of the run that wrote the checkpoints."""
        write_config(recorded, workdir, planned)
        clock.update(force=True)

    if not latest:
        record_session()
    model = build_model(resumed_base(spec, workdir) if latest else spec, tokenizer)  # LoRA: a warm-started base
    prompts, warm_prompts, held_out, counts = prompt_source(spec, tokenizer)
    if primary:
        print(f"RL prompts: {len(prompts.examples)} of {counts['rows']} problems read ({counts['warmstart']} for the "
              f"warm-start only, {counts['held_out']} held out, {counts['skipped']} malformed rows skipped, "
              f"{counts['dropped_overlong']} prompts too long)", flush=True)
        for message in counts["skipped_rows"]:
            print(f"skipped (data.allow_skips): {message}", flush=True)
        if not latest:  # a resume's with its session's record (rl_train's on_start)
            _record_skipped_rows(counts["skipped_rows"], workdir, say)
        if model.cfg.lora_rank:
            print(lora.summary(model), flush=True)
        options = options_line(spec, spec.devices or jax.device_count())
        if options is not None:
            print(options, flush=True)
        warning = planned_step_warning(spec, jax.devices()[0].platform)
        if warning:
            print(warning, flush=True)

    def record_resume() -> None:
        """A resume's record once it is known to start: ``record_session``'s, and this session's skipped rows
        (so that a resume refused earlier leaves the last session's)."""
        record_session()
        if primary:
            _record_skipped_rows(counts["skipped_rows"], workdir, say)

    sets = eval_sets(spec, held_out)
    stop_ids = evaluation.default_stop_ids(model, tokenizer)
    # every program of the run's steps; the engine's on a mesh of its own with mesh.rollout_devices
    graphdef, params = nnx.split(model)
    mesh = placed_on(params)
    programs = StepPrograms(spec, graphdef, params, stop_ids, mesh=mesh, critic=abstract_critic(spec, model.cfg),
                            rollout_mesh=sharding.rollout_mesh(dataclasses.asdict(spec.mesh), mesh.shape["tensor"]))
    reward_name = reward_for(spec.reward.name, spec.reward.mode)

    def evaluate(name: str, step: int, current: models.Qwen, pool: RewardPool, n: int, temperature: float,
                 top_p: float, per_set: dict | None = None) -> dict[str, dict[str, float]]:
        """Evaluate every set at (n, temperature, top_p), or at its own settings in ``per_set``; the
        metrics go to workdir/eval/<name>/ and TensorBoard (``board``, at RL step ``step``)."""
        rows, metrics = evaluation.evaluate_per_set(
            current, tokenizer, sets, per_set or {}, evaluation.EvalSettings(n, temperature, top_p, ec.max_new_tokens),
            seed=spec.seed, batch_size=ec.batch_size, **ec.sampler.call_settings(),
            reward_pool=pool, instruction=dc.instruction,
            stop_token_ids=stop_ids, progress=primary)
        if primary:
            evaluation.write_outputs(workdir / "eval" / name, rows, metrics)
            board.write(_board_tag(name), step, metrics)
            means = ", ".join(f"{s} {'%s %.3f' % run_summary.mean_reward(m)}" for s, m in sorted(metrics.items()))
            print(f"eval {name}: accuracy {run_summary.accuracy(metrics):.3f} (mean sample reward at "
                  f"T={temperature}: {means})",
                  flush=True)
        return metrics

    def evaluate_final(name: str, step: int, current: models.Qwen, pool: RewardPool) -> dict[str, dict]:
        f = ec.final
        out = {"sampled": evaluate(name, step, current, pool, f.n, f.temperature, f.top_p, ec.per_set_settings)}
        if ec.greedy:
            out["greedy"] = evaluate(f"{name}_greedy", step, current, pool, 1, 0.0, 1.0)
        return out

    warm_file = workdir / "warmstart.json"
    with (RewardPool(spec.reward.workers or None, spec.reward.item_timeout) as pool,  # rollouts and evaluation
          EvalScalars(workdir) as board):
        if latest:  # resuming: rl_train restores the RL state
            before = json.loads(warm_file.read_text()) if warm_file.exists() else {}
        else:
            before = {}
            if wc.steps > 0:
                signals.exit_at_once("the warm-start, which is not checkpointed: a restart runs it again from its "
                                     "first step")
                # the model without adapters (LoRA's fresh ones drawn again after it): decision 0014
                base, warm = warm_start(lora.base(model) if spec.model.lora_rank else model, warm_prompts, tokenizer,
                                        wc, program=programs.learner.warmstart,
                                        probe=prompts.examples[:wc.probe_problems],
                                        prompt_length=dc.max_prompt_length,
                                        seed=spec.seed, pool=pool, reward_name=reward_name,
                                        probe_max_new_tokens=spec.rollout.max_new_tokens, stop_token_ids=stop_ids,
                                        safe_point=signals.safe_point)
                before["warmstart"] = {"steps": warm.steps, "probe_accuracy": warm.probe_accuracy,
                                       "seconds": warm.seconds}
                model = with_adapters(spec, base)
                if has_warm_base(spec):  # the base LoRA's adapters train on, for the resume and the export
                    keep_warm_base(base, workdir)
                if primary:
                    print(_warm_start_line(warm, wc.target_accuracy), flush=True)
            if sets and ec.before_rl:
                signals.exit_at_once("the evaluation before RL: the warm-start is not checkpointed, so a restart "
                                     "runs the warm-start and this evaluation again")
                before["eval"] = evaluate_final("before_rl", 0, model, pool)
            if primary:
                atomic_write_text(warm_file, json.dumps(before, indent=2))

        def on_step(step: int, current: models.Qwen, metrics: dict) -> None:
            if sets and ec.every and step % ec.every == 0:
                evaluate(f"step_{step}", step, current, pool, ec.periodic.n, ec.periodic.temperature,
                         ec.periodic.top_p)
            clock.update()

        result = rl_train(spec, workdir, model, prompts,  # a signal: its step's checkpoint, then stop
                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          stop_token_ids=stop_ids, reward_pool=pool, on_step=on_step, programs=programs,
                          keep_first_step=not latest and wc.steps > 0,  # step 1 keeps the warm-start
                          on_start=record_resume if latest else None)
        if result.stopped_by_signal:
            clock.update(force=True)
            if result.dropped_step is None:
                return {"stopped_at_step": result.final_step}
            return {"stopped_at_step": result.final_step, "dropped_step": result.dropped_step}
        signals.exit_at_once(f"the final evaluation or the export: all {result.final_step} steps are checkpointed, "
                             f"and a restart runs only the final evaluation and the export again")
        after = evaluate_final("final", result.final_step, result.model, pool) if sets else {}
    tokenizer_dir = (None if tokenizer_source == data.CHAR_TOKENIZER  # "char": no files; gs://: the local copy
                     else data.local_folder(tokenizer_source))
    try:
        if result.model.cfg.lora_rank:  # the adapters as PEFT loads them, and the merged model as the HF export
            export_peft(result.model, workdir / PEFT_FOLDER, base_model=spec.model.path or spec.model.preset or "random",
                        overwrite=True)
            say(f"{PEFT_FOLDER}: the LoRA adapters as a PEFT folder ({workdir / PEFT_FOLDER}); {EXPORT_FOLDER}: the "
                f"model with them merged")
        exported = lora.merge(result.model) if result.model.cfg.lora_rank else result.model
        export = models.export_hf(exported, workdir / EXPORT_FOLDER, tokenizer_dir=tokenizer_dir, overwrite=True,
                                  no_tokenizer=NO_HF_TOKENIZER)
    except NotAnExportError as e:  # files put there during the run (check_export_folder passed at its start)
        raise ConfigError(f"{e}; all {result.final_step} steps are checkpointed: once the files are moved, the same "
                          f"command runs the final evaluation and the export") from None
    if tokenizer_dir is None:
        say(f"hf_export: {no_tokenizer_line(export, NO_HF_TOKENIZER)}")
    history = result.earlier_history + result.history  # every step of the run, earlier sessions' too
    summary = run_summary.summary(before, after, history, _accuracy_metric(ec, sets))
    clock.update(force=True)
    summary.update(final_step=result.final_step, wall_seconds=clock.total_seconds,
                   wall_seconds_this_session=clock.session_seconds, sessions=len(clock.earlier) + 1,
                   hf_export=str(export))
    if primary:
        if history:
            evaluated = before.get("eval", {})
            per_set = run_summary.per_set
            plot_curves(history, per_set(evaluated.get("sampled", {})), per_set(after.get("sampled", {})),
                        workdir / "curves.png", run_summary.periodic_evals(workdir), algorithm=spec.algorithm,
                        greedy=(per_set(evaluated.get("greedy", {})), per_set(after.get("greedy", {}))))
        atomic_write_text(workdir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _record_skipped_rows(messages: list[str], workdir: epath.Path, say) -> None:
    """Record each malformed row that data.allow_skips skipped ("FILE:LINE: why"; the log names them as the
    prompts are read) in workdir/SKIPPED_ROWS_FILE (removed when a later session skips none: the file is
    this session's data), written with the session's record (a resume's once it is known to start)."""
    record = workdir / SKIPPED_ROWS_FILE
    if not messages:
        if record.exists():
            record.unlink()
        return
    atomic_write_text(record, "".join(f"{m}\n" for m in messages))
    say(f"the {len(messages)} skipped rows are listed in {record}")


def _warm_start_line(warm: WarmStartResult, target: float) -> str:
    """What the warm-start did, in one line: steps, seconds, and the probe against its target."""
    line = f"warm-start: {warm.steps} steps in {warm.seconds:.0f} s"
    if warm.probe_accuracy is None:
        return line
    reached = (f"reached the target {target}" if warm.probe_accuracy >= target
               else f"target {target} not reached within warmstart.steps")
    return f"{line}, greedy accuracy {warm.probe_accuracy:.3f} on the probe ({reached})"


def _board_tag(name: str) -> str:
    """TensorBoard's section of an evaluation: "eval" (the periodic ones, eval.periodic's settings),
    "eval_final" (before_rl at step 0 and final, eval.final's), "eval_final_greedy"."""
    if name.startswith("step_"):
        return "eval"
    return "eval_final_greedy" if name.endswith("_greedy") else "eval_final"


def _accuracy_metric(ec: EvalSpec, sets: list[evaluation.EvalSet]) -> str:
    """What accuracy_{before,after}_rl are, set by set as evaluated: each set's samples per problem and
    temperature (eval.final, or the set's own in eval.final.per_set)."""
    f, own = ec.final, ec.per_set

    def described(s: evaluation.EvalSet) -> str:
        n, temperature, where = ((own[s.name].n, own[s.name].temperature, ", eval.final.per_set") if s.name in own
                                 else (f.n, f.temperature, ""))
        return f"{s.name}: {len(s.problems)} problems, {n} samples at temperature {temperature}{where}"

    return ("mean reward of the samples per problem, averaged over the eval sets ("
            + "; ".join(described(s) for s in sets) + ")")
