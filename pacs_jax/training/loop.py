"""The RL training loop (docs/design.md section 3), shared by the demo and the real configs.

    programs = StepPrograms(spec, ...)     every program of a step, compiled and memory-checked before step 1
                                           training/step_programs.py, training/memory_check.py
    for step in steps:
        prompts -> rollout (sample n each, reward, pi_old)                    training/rollout.py
        -> PPO only: the critic's values, GAE advantages, the critic's update   training/learner/critic_step.py
        -> `train.mini_batches` optimizer steps on mini-batches of whole groups  training/learner/update_step.py
        -> metrics; checkpoint every k steps and on SIGTERM / SIGINT          checkpoints.py, training/signals.py

The randomness of step s is ``fold_in(key(seed), s)``, and the prompt iterator's state is saved with
every checkpoint, so a restarted run repeats exactly what an uninterrupted one would have done (with
carry-over, the state holds the rows in flight too, read from the device only for a checkpoint that is
written, and a resume puts them back into the engine with their K/V recomputed in its first step's phase
"resume": training/engine/carry_over.py).
A step's phases write progress lines and are where a stop signal ends an unfinished step
(training/progress.py): one process drops the step under way if the signal comes before its update
begins (the previous step's checkpoint is written if it was not; a resume runs the step again with
the same keys), or during its update when the previous step's checkpoint is on disk (the update,
which donates the state, is abandoned: no half-updated state is saved), and finishes it otherwise. A
resumed run restores the newest intact checkpoint (``TrainCheckpointer.restore_latest``), says
"resumed from step N", and drops from metrics.jsonl the rows of the steps it runs again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import numpy as np
from etils import epath
from flax import nnx

from pacs_jax import distributed
from pacs_jax.checkpoints import TrainCheckpointer
from pacs_jax.models import Qwen
from pacs_jax.models import kernels
from pacs_jax.rewards import RewardPool
from pacs_jax.training import memory_check
from pacs_jax.training.compilations import compilations, start_counting, uncounted
from pacs_jax.training.engine.carry_over import CarryOverRollouts
from pacs_jax.training.learner.critic_step import PPOCritic, critic_step
from pacs_jax.training.learner.kl_reference import frozen_reference
from pacs_jax.training.learner.train_state import CriticTrainState, TrainState, restore_latest, save
from pacs_jax.training.learner.trainable import Trainable
from pacs_jax.training.metrics import MetricsLogger
from pacs_jax.training.option_lines import step_line
from pacs_jax.training.progress import StepInterrupted, StepWatch, dispatches_done
from pacs_jax.training.records import PromptBatch
from pacs_jax.training.records import Rollout
from pacs_jax.training.rollout import OneStepOff, RolloutCollector, carry_over_source
from pacs_jax.training.signals import finished_line, stop_signals
from pacs_jax.training.spec import RunSpec
from pacs_jax.training.step_programs import StepPrograms
from pacs_jax.training.warm_base import lora_base


class PromptSource(Protocol):
    """Batches of prompts with a JSON-able iterator state (saved in every checkpoint)."""

    def next_batch(self) -> PromptBatch: ...

    def get_state(self) -> dict: ...

    def set_state(self, state: dict) -> None: ...


@dataclasses.dataclass
class TrainResult:
    """The trained model, per-step metrics, the step's programs and collector (for benchmarks) and PPO's critic.

    history: this session's steps; earlier_history: a resumed run's rows of the steps before it, read
    back from metrics.jsonl (process 0; empty elsewhere and in a run that did not resume).
    dropped_step: the unfinished step a stop signal ended (its device programs may still run), or None."""

    model: Qwen
    history: list[dict]
    stopped_by_signal: bool
    final_step: int
    programs: StepPrograms
    collector: RolloutCollector
    opt_state: object
    critic: CriticTrainState | None  # objective "ppo" only
    earlier_history: list[dict] = dataclasses.field(default_factory=list)
    dropped_step: int | None = None


def _mean_metrics(per_minibatch: list[dict]) -> dict[str, float]:
    """The M mini-batch updates' metrics (a dict of [] arrays each) -> their means (``skipped``,
    ``critic_skipped``: the count)."""
    host = distributed.to_host(per_minibatch)
    return {k: float(np.sum(v) if k.endswith("skipped") else np.mean(v))
            for k, v in ((k, [m[k] for m in host]) for k in host[0])}


def rl_train(spec: RunSpec, workdir: str | os.PathLike, model: Qwen, prompts: PromptSource, *,
             decode: Callable[[Sequence[int]], str], stop_token_ids: Sequence[int], reward_pool: RewardPool,
             on_step: Callable[[int, Qwen, dict], None] | None = None,
             programs: StepPrograms | None = None, keep_first_step: bool = False,
             on_start: Callable[[], None] | None = None) -> TrainResult:
    """Run ``spec.train.steps`` RL steps on ``model`` (resuming from ``workdir/checkpoints``).

    decode: generated ids -> text for the reward. reward_pool: the caller's pool; it scores the
    rollouts and the caller's evaluations (one pool per run). on_step(step, model, metrics): called
    after each step (periodic evaluation hooks in here). programs: the run's StepPrograms
    (training/run.py makes them before the warm-start); None: made here. on_start(): called once the
    run is known to start: after the restore and (``train.precompile``) the memory check, before the
    first step (training/run.py: a resume's config.json and sessions.json are written then). Returns
    the trained model and the per-step metrics.

    SIGTERM / SIGINT (training/signals.py) from the start of this call stop the run
    (``stopped_by_signal``): one process ends the step under way at its next phase boundary before
    the update (``dropped_step``; the last finished step's checkpoint is written if it was not), or in
    the update when the last finished step's checkpoint is on disk (``dropped_step``: the update is
    abandoned), else finishes it and writes its checkpoint; several processes do the same together, at
    the first phase boundary that all of them reach after the signal (training/progress.py). keep_first_step: the first step of this call is always finished
    and checkpointed (training/run.py: it keeps a warm-start, which has no checkpoint of its own). A
    second signal ends the process at once.
    """
    with stop_signals(multiprocess=jax.process_count() > 1) as signals, signals.deferred():
        return _rl_train(spec, workdir, model, prompts, signals, decode=decode, stop_token_ids=stop_token_ids,
                         reward_pool=reward_pool, on_step=on_step, programs=programs,
                         keep_first_step=keep_first_step, on_start=on_start)


def _rl_train(spec: RunSpec, workdir: str | os.PathLike, model: Qwen, prompts: PromptSource,
              signals, *, decode: Callable[[Sequence[int]], str], stop_token_ids: Sequence[int],
              reward_pool: RewardPool, on_step: Callable[[int, Qwen, dict], None] | None,
              programs: StepPrograms | None, keep_first_step: bool, on_start: Callable[[], None] | None
              ) -> TrainResult:
    run = _Run.begin(spec, epath.Path(workdir), model, prompts, signals, decode=decode, stop_token_ids=stop_token_ids,
                     reward_pool=reward_pool, programs=programs, keep_first_step=keep_first_step)
    _compile_before_step_1(run)
    if on_start is not None:
        on_start()
    run.schedule_one_step_off()
    step = run.start
    for step in range(run.start + 1, spec.train.steps + 1):
        run.say_first_step(step)
        t_step = time.perf_counter()
        run.watch.start_step(step, stoppable=not (keep_first_step and step == run.start + 1))
        # before the step's batch: a checkpoint of step - 1 holds it, written here only if a stop drops the step
        data_state = _state_before_batch(run.prompts, run.carry, run.ahead, step)
        # the update donates the train state: a stop may abandon it only when the last finished step's
        # checkpoint is on disk, else the step runs to its end
        previous_unsaved = run.saved != step - 1
        try:
            rollout, critic_metrics, per_minibatch, t_update = _rollout_and_update(run, step, previous_unsaved)
        except StepInterrupted as interrupted:  # before the update, or in it with step - 1's checkpoint on disk
            _drop_step(interrupted, signals.requested, run.saved, run.checkpointer, run.logger, run.state,
                       lambda: {"step": step - 1, "seed": spec.seed, "data_state": data_state()},
                       run.programs.learner.trainable)
            return run.finish(step - 1, stopped=True, dropped_step=step)
        update_metrics = _mean_metrics(per_minibatch)
        time_update = time.perf_counter() - t_update
        run.watch.done()
        metrics = {**rollout.metrics, **critic_metrics, **update_metrics, "time_update": time_update,
                   "time_step": time.perf_counter() - t_step,
                   "lr": float(run.programs.learner.lr_schedule(step * spec.train.mini_batches)),
                   "tokens_per_second": rollout.metrics["generated_tokens"] / max(rollout.metrics["time_sample"], 1e-9),
                   "compilations": float(compilations())}
        run.history.append({"step": step, **metrics})
        run.logger.log(step, metrics)
        options = step_line(spec, metrics)  # what carry-over, dynamic sampling, one step off, a correction did
        if options is not None:
            run.logger.write(f"step {step}: {options}")
        if _checkpoint_and_stop(run, step, metrics, on_step, previous_unsaved):
            return run.finish(step, stopped=True)
    stopped = False
    if run.single_process and signals.requested is not None:  # no step was under way
        run.logger.write(f"{signals.requested}: no step left to run; exiting (the checkpoint of step {step} is the "
                         "latest)")
        stopped = True
    return run.finish(step, stopped)


@dataclasses.dataclass
class _Run:
    """What a call of ``rl_train`` holds from its start to its end: the step's programs and the schedule's
    parts (the prompt source, carry-over's, one step off's, the collector), the train state and where its
    checkpoints are, the metrics' logger and history, the steps' watch and the stop signals."""

    spec: RunSpec
    graphdef: nnx.GraphDef
    programs: StepPrograms
    prompts: PromptSource
    carry: CarryOverRollouts | None
    collector: RolloutCollector
    state: TrainState
    checkpointer: TrainCheckpointer
    logger: MetricsLogger
    watch: StepWatch
    signals: object
    start: int  # the step restored (0: none)
    saved: int  # the newest step with a checkpoint
    keep_first_step: bool
    history: list[dict] = dataclasses.field(default_factory=list)
    ahead: OneStepOff | None = None
    primary: bool = dataclasses.field(default_factory=lambda: jax.process_index() == 0)
    single_process: bool = dataclasses.field(default_factory=lambda: jax.process_count() == 1)

    @classmethod
    def begin(cls, spec: RunSpec, workdir: epath.Path, model: Qwen, prompts: PromptSource, signals, *,
              decode: Callable[[Sequence[int]], str], stop_token_ids: Sequence[int], reward_pool: RewardPool,
              programs: StepPrograms | None, keep_first_step: bool) -> _Run:
        """The run's programs (``programs``, or made here), its train state (the newest intact checkpoint's,
        restored straight into the programs' shardings whatever the process count that wrote it, and the
        prompt source's state with it), its metrics' logger and its steps' watch."""
        tc = spec.train
        graphdef, params = nnx.split(model)
        critic = PPOCritic.from_spec(spec, model) if spec.critic is not None else None  # the actor's copy as RL starts
        programs = programs or StepPrograms(spec, graphdef, params, stop_token_ids, critic=critic and critic.spec())
        carry = carry_over_source(programs, prompts, tc.prompts_per_step)  # the engine keeps rows in flight
        prompts = carry if carry is not None else prompts
        state = TrainState(params, programs.learner.init_optimizer(params), critic and critic.state())
        checkpointer = TrainCheckpointer(workdir / "checkpoints", model.cfg, every=tc.checkpoint_every,
                                         keep=tc.keep_checkpoints, with_critic=critic is not None,
                                         lora_base=lora_base(spec, workdir))
        primary = jax.process_index() == 0
        restored = restore_latest(checkpointer, state, warn=lambda line: print(line, flush=True) if primary else None,
                                  trainable=programs.learner.trainable)
        start = 0
        if restored is not None:
            start, state = restored.step, restored.state
            prompts.set_state(restored.meta["data_state"])
            if primary:
                print(f"resumed from step {start} (checkpoint {checkpointer.directory / str(start)}); "
                      + (f"training steps {start + 1} to {tc.steps}" if start < tc.steps else
                         f"all {tc.steps} steps of train.steps are trained"), flush=True)
        start_counting()
        logger = MetricsLogger(workdir, tc.steps, start)
        collector = RolloutCollector.from_spec(spec, programs, decode=decode, reward_pool=reward_pool, carry=carry)
        collector.batcher.hold_reference(frozen_reference(spec, workdir, state.params, resumed=start > 0))
        run = cls(spec, graphdef, programs, prompts, carry, collector, state, checkpointer, logger, None, signals,
                  start, start, keep_first_step)
        run.watch = run.new_watch()
        signals.where = run.watch.position  # where a signal came (step 0's start before step 1: the compilation's too)
        return run

    def write(self, line: str) -> None:
        """A line of the run's log (process 0's)."""
        if self.primary:
            self.logger.write(line)

    def new_watch(self) -> StepWatch:
        return StepWatch(self.write, self.spec.train.progress_seconds, stop_requested=self.signals.safe_point,
                         lockstep=not self.single_process)

    def schedule_one_step_off(self) -> None:
        """One step off (train.off_policy_steps=1): the rows of step s + 1 are sampled and scored by the engine,
        with its copy of the weights step s started from, while the learner trains step s
        (training/engine/weight_sync.py); the sampling ahead has a watch of its own."""
        tc = self.spec.train
        if not tc.off_policy_steps:
            return
        self.ahead = OneStepOff(self.programs, self.collector, self.prompts, self.new_watch())
        if self.start and self.primary and self.start < tc.steps:
            print(f"one step off: step {self.start + 1}'s rows are sampled with the weights it starts from (a "
                  "checkpoint keeps no copy of the ones before them), the steps after it with their previous "
                  "step's", flush=True)

    def say_first_step(self, step: int) -> None:
        """A long first step says what it is doing."""
        tc, rc = self.spec.train, self.spec.rollout
        if self.primary and step == self.start + 1:
            print(f"step {step}: sampling {tc.prompts_per_step} prompts x {rc.n} responses of up to "
                  f"{rc.max_new_tokens} tokens, scoring them, then the update; the progress bar moves at each "
                  f"step's end, a phase longer than {tc.progress_seconds:g} s prints a line that often "
                  "(train.progress_seconds)", flush=True)

    def finish(self, step: int, stopped: bool, dropped_step: int | None = None) -> TrainResult:
        """Close the checkpointer and the logger: the call's result, at ``step``."""
        self.checkpointer.close()
        self.logger.close()
        return TrainResult(nnx.merge(self.graphdef, self.state.params), self.history, stopped, step, self.programs,
                           self.collector, self.state.opt_state, self.state.critic,
                           earlier_history=self.logger.earlier, dropped_step=dropped_step)


def _compile_before_step_1(run: _Run) -> None:
    """train.precompile: every program of every bucket compiled, so that no step compiles, and XLA's memory
    of each checked, so that a step that cannot fit stops here."""
    tc = run.spec.train
    if not tc.precompile or run.start >= tc.steps:
        return
    if run.primary:
        print(f"compiling every program of a step, for every bucket, before step {run.start + 1} (train.precompile; "
              "minutes on a large model)", flush=True)
    # a signal while compiling exits there, unless a warm-start of this session waits for step 1's checkpoint
    compiling = (contextlib.nullcontext() if run.keep_first_step else
                 run.signals.immediate(f"the compilation before step {run.start + 1}, which a restart runs again (no "
                                       f"step of this session had started)"))
    with compiling:
        memory_check.check_fits(run.programs.compile(), memory_check.device_memory_limit())
    if run.primary:  # what the programs chose, once (models/kernels.py)
        print("kernels: " + "; ".join(map(str, kernels.chosen())), flush=True)


def _rollout_and_update(run: _Run, step: int, previous_unsaved: bool) -> tuple[Rollout, dict, list[dict], float]:
    """Step ``step``'s rollout (synchronous, or one step off's), then PPO's critic step and the actor's update
    (dispatched; ``run.state`` their results; one step off samples step + 1's rows meanwhile), waited for:
    (the rollout, the critic's metrics, the update's per mini-batch, when the actor's update began)."""
    key = jax.random.fold_in(jax.random.key(run.spec.seed), step)
    watch, learner = run.watch, run.programs.learner
    if run.carry is not None and step == run.start + 1:  # a checkpoint's rows in flight back into the engine
        run.carry.resume(run.state.params, run.start, watch)
    if run.ahead is None:
        rollout = run.collector(run.state.params, run.prompts.next_batch, key, watch, step)
    else:
        rollout = run.ahead.rollout(run.state.params, key, watch, step)
    watch.start("update", last_boundary=previous_unsaved)
    t0 = time.perf_counter()
    batch, critic_metrics = rollout.batch, {}
    if run.state.critic is not None:  # PPO: the critic's values and update; the actor's batch gains advantages
        critic_state, batch, per_minibatch = critic_step(learner.critic, run.state.critic, batch, rollout.packing)
        run.state = run.state.replace(critic=critic_state)
        watch.wait(per_minibatch, lambda: dispatches_done(per_minibatch, "mini-batches of the critic's update"))
        critic_metrics = {**_mean_metrics(per_minibatch), "time_critic": time.perf_counter() - t0}
        t0 = time.perf_counter()
    params, opt_state, per_minibatch = learner.update(run.state.params, run.state.opt_state, batch)
    run.state = run.state.replace(params=params, opt_state=opt_state)
    if run.ahead is not None and step < run.spec.train.steps:  # step + 1's rows, while the update runs
        run.ahead.sample(jax.random.fold_in(jax.random.key(run.spec.seed), step + 1), step + 1)
    watch.wait(per_minibatch, lambda: dispatches_done(per_minibatch, "mini-batches of the update"))
    return rollout, critic_metrics, per_minibatch, t0


def _checkpoint_and_stop(run: _Run, step: int, metrics: dict, on_step: Callable[[int, Qwen, dict], None] | None,
                         previous_unsaved: bool) -> bool:
    """After step ``step``: its checkpoint (every ``train.checkpoint_every`` steps, at the last, and when a stop
    signal came), then ``on_step``; whether a stop signal ends the run here (its line written)."""
    signals, ahead, tc = run.signals, run.ahead, run.spec.train
    # made only when a checkpoint is written (carry-over's reads the rows in flight from the device)
    meta = lambda: {"step": step, "seed": run.spec.seed,  # noqa: E731
                    "data_state": run.prompts.get_state() if ahead is None else ahead.state_before(step + 1)}
    preempted = signals.safe_point()  # several processes: the same step on every one
    preempted = preempted or (ahead is not None and ahead.interrupted)  # a stop while sampling step + 1
    if _save(run.checkpointer, step, run.state, meta, force=preempted or step == tc.steps,
             trainable=run.programs.learner.trainable):
        run.saved = step
    if on_step is not None:
        on_step(step, nnx.merge(run.graphdef, run.state.params), metrics)
    if run.single_process and not preempted and signals.requested is not None:  # arrived during on_step
        _save(run.checkpointer, step, run.state, meta, force=True, trainable=run.programs.learner.trainable)
        preempted = True
    if not preempted:
        return False
    if run.single_process:
        line = finished_line(signals.requested, signals.requested_where, step,
                              keeps_warm_start=run.keep_first_step and step == run.start + 1,
                              previous_unsaved=previous_unsaved, ahead_dropped=ahead is not None and ahead.interrupted)
    else:
        line = f"preemption (at the same step on every process): checkpoint of step {step} written, exiting"
    run.logger.write(line)
    if not run.primary:  # every host's log says where it stopped (the logger writes on process 0 only)
        print(f"process {jax.process_index()}: {line}", flush=True)
    return True


def _save(checkpointer: TrainCheckpointer, step: int, state: TrainState, meta, *, force: bool,
          trainable: Trainable) -> bool:
    """``train_state.save``, its compilations (Orbax's own) not in the steps' ``compilations`` metric."""
    with uncounted():
        return save(checkpointer, step, state, meta, force=force, trainable=trainable)


def _state_before_batch(prompts: PromptSource, carry: CarryOverRollouts | None, ahead: OneStepOff | None,
                        step: int) -> Callable[[], dict]:
    """The prompt source's state before step ``step``'s batch (a checkpoint of step - 1 holds it), as a function
    called only when a stop drops the step and that checkpoint is written: carry-over's reads the rows in
    flight then (``CarryOverRollouts.state_before_call``), the others' (a cursor) is taken now."""
    if carry is not None:
        return carry.state_before_call()
    state = prompts.get_state() if ahead is None else ahead.state_before(step)
    return lambda: state


def _drop_step(interrupted: StepInterrupted, signal_name: str, saved: int, checkpointer: TrainCheckpointer,
               logger: MetricsLogger, state: TrainState, meta: Callable[[], dict], trainable: Trainable) -> None:
    """A stop signal ended step S before its update (or in it, when step S - 1's checkpoint is on disk:
    then nothing is written, the update's donated state is abandoned): write the checkpoint of step
    S - 1 (``state`` and ``meta()`` are still its) unless it has one (``saved``) or is step 0, and say what
    a resume does."""
    last = interrupted.step - 1
    if last > saved:
        _save(checkpointer, last, state, meta, force=True, trainable=trainable)
        kept = f"checkpoint of step {last} written"
    else:
        kept = (f"the checkpoint of step {last} is the latest" if last else
                "no RL step had finished (a resume starts RL at step 1)")
    line = (f"{signal_name} during step {interrupted.step} ({interrupted.phase}): step {interrupted.step} dropped, "
            f"a resume runs it again with the same keys; {kept}, exiting")
    logger.write(line)
    if jax.process_index() != 0:  # every host's log says where it stopped (the logger writes on process 0 only)
        print(f"process {jax.process_index()}: {line}", flush=True)
