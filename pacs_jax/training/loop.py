"""The RL training loop (docs/design.md section 3), shared by the demo and the real configs.

    programs = StepPrograms(spec, ...)     every program of a step, compiled and memory-checked before step 1
                                           training/step_programs.py, training/memory_check.py
    for step in steps:
        prompts -> rollout (sample n each, reward, pi_old)                    training/rollout.py
        -> PPO only: the critic's values, GAE advantages, the critic's update   training/critic_step.py
        -> `train.mini_batches` optimizer steps on mini-batches of whole groups  training/update_step.py
        -> metrics; checkpoint every k steps and on SIGTERM / SIGINT          checkpoints.py, training/signals.py

The randomness of step s is ``fold_in(key(seed), s)``, and the prompt iterator's state is saved with
every checkpoint, so a restarted run repeats exactly what an uninterrupted one would have done (with
carry-over, the state holds the rows in flight too, read from the device only for a checkpoint that is
written, and a resume puts them back into the engine with their K/V recomputed in its first step's phase
"resume": training/carry_over.py).
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
from pacs_jax.models import Qwen
from pacs_jax.rewards import RewardPool
from pacs_jax.checkpoints import TrainCheckpointer
from pacs_jax.models import kernels
from pacs_jax.training import memory_check
from pacs_jax.training.carry_over import CarryOverRollouts
from pacs_jax.training.compilations import compilations, start_counting, uncounted
from pacs_jax.training.critic_step import PPOCritic, critic_step
from pacs_jax.training.metrics import MetricsLogger
from pacs_jax.training.one_step_off import OneStepOff
from pacs_jax.training.option_lines import step_line
from pacs_jax.training.progress import Position, StepInterrupted, StepWatch, dispatches_done
from pacs_jax.training.prompt_batch import PromptBatch
from pacs_jax.training.rollout import RolloutCollector
from pacs_jax.training.signals import stop_signals
from pacs_jax.training.spec import RunSpec
from pacs_jax.training.step_programs import StepPrograms
from pacs_jax.training.train_state import CriticTrainState, TrainState, restore_latest, save


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
    workdir = epath.Path(workdir)
    tc = spec.train
    graphdef, params = nnx.split(model)
    critic = PPOCritic.from_spec(spec, model) if spec.critic is not None else None  # a copy of the actor as RL starts
    programs = programs or StepPrograms(spec, graphdef, params, stop_token_ids, critic=critic and critic.spec())
    carry = None
    if programs.sampler.carry_over is not None:  # the engine keeps responses in flight between steps
        programs.sampler.carry_over.reset()
        prompts = carry = CarryOverRollouts(prompts, programs.sampler.carry_over, tc.prompts_per_step)
    state = TrainState(params, programs.learner.init_optimizer(params), critic and critic.state())

    checkpointer = TrainCheckpointer(workdir / "checkpoints", model.cfg, every=tc.checkpoint_every,
                                     keep=tc.keep_checkpoints, with_critic=critic is not None)
    primary = jax.process_index() == 0
    # the newest intact step, restored straight into those shardings, whatever the process count that wrote it
    restored = restore_latest(checkpointer, state, warn=lambda line: print(line, flush=True) if primary else None)
    start = saved = 0  # saved: the newest step with a checkpoint
    if restored is not None:
        start, state = restored.step, restored.state
        saved = start
        prompts.set_state(restored.meta["data_state"])
        if primary:
            print(f"resumed from step {start} (checkpoint {checkpointer.directory / str(start)}); "
                  + (f"training steps {start + 1} to {tc.steps}" if start < tc.steps else
                     f"all {tc.steps} steps of train.steps are trained"), flush=True)
    start_counting()
    logger = MetricsLogger(workdir, tc.steps, start)
    history: list[dict] = []
    base_key = jax.random.key(spec.seed)
    stopped = False
    single_process = jax.process_count() == 1
    collector = RolloutCollector.from_spec(spec, programs, decode=decode, reward_pool=reward_pool, carry=carry)
    rc = spec.rollout
    write = logger.write if primary else lambda line: None
    watch = StepWatch(write, tc.progress_seconds, stop_requested=signals.safe_point, lockstep=not single_process)
    signals.where = watch.position  # where a signal came (step 0's start before step 1: the compilation's too)
    if tc.precompile and start < tc.steps:  # every program of every bucket: no step compiles, and a step that
        if primary:                         # cannot fit stops here
            print(f"compiling every program of a step, for every bucket, before step {start + 1} (train.precompile; "
                  "minutes on a large model)", flush=True)
        # a signal while compiling exits there, unless a warm-start of this session waits for step 1's checkpoint
        compiling = (contextlib.nullcontext() if keep_first_step else
                     signals.immediate(f"the compilation before step {start + 1}, which a restart runs again (no "
                                       f"step of this session had started)"))
        with compiling:
            memory_check.check_fits(programs.compile(), memory_check.device_memory_limit())
        if primary:  # what the programs chose, once (models/kernels.py)
            print("kernels: " + "; ".join(map(str, kernels.chosen())), flush=True)
    if on_start is not None:
        on_start()
    # one step off (train.off_policy_steps=1): the rows of step s + 1 are sampled and scored by the engine,
    # with its copy of the weights step s started from, while the learner trains step s (training/weight_sync.py)
    ahead = OneStepOff(programs, collector, prompts, StepWatch(write, tc.progress_seconds,
                                                               stop_requested=signals.safe_point,
                                                               lockstep=not single_process)) if tc.off_policy_steps else None
    if ahead is not None and start and primary and start < tc.steps:
        print(f"one step off: step {start + 1}'s rows are sampled with the weights it starts from (a checkpoint keeps "
              f"no copy of the ones before them), the steps after it with their previous step's", flush=True)
    step = start
    for step in range(start + 1, tc.steps + 1):
        if primary and step == start + 1:  # a long first step says what it is doing
            print(f"step {step}: sampling {tc.prompts_per_step} prompts x {rc.n} responses of up to "
                  f"{rc.max_new_tokens} tokens, scoring them, then the update; the progress bar moves at each "
                  f"step's end, a phase longer than {tc.progress_seconds:g} s prints a line that often "
                  "(train.progress_seconds)", flush=True)
        t_step = time.perf_counter()
        watch.start_step(step, stoppable=not (keep_first_step and step == start + 1))
        # before the step's batch: a checkpoint of step - 1 holds it, written here only if a stop drops the step
        data_state = _state_before_batch(prompts, carry, ahead, step)
        key = jax.random.fold_in(base_key, step)
        try:
            if carry is not None and step == start + 1:  # a checkpoint's rows in flight back into the engine
                carry.resume(state.params, start, watch)
            if ahead is None:
                rollout = collector(state.params, prompts.next_batch, key, watch, step)
            else:
                rollout = ahead.rollout(state.params, key, watch, step)
            # the update donates params and opt_state (and PPO's critic state): a stop may abandon it only
            # when the last finished step's checkpoint is on disk, else the step runs to its end
            previous_unsaved = saved != step - 1
            watch.start("update", last_boundary=previous_unsaved)
            t0 = time.perf_counter()
            batch, critic_metrics = rollout.batch, {}
            if state.critic is not None:  # PPO: the critic's values and update; the actor's batch gains advantages
                critic_state, batch, per_minibatch = critic_step(programs.learner.critic, state.critic, batch,
                                                                 rollout.packing)
                state = state.replace(critic=critic_state)
                watch.wait(per_minibatch, lambda: dispatches_done(per_minibatch, "mini-batches of the critic's update"))
                critic_metrics = {**_mean_metrics(per_minibatch), "time_critic": time.perf_counter() - t0}
                t0 = time.perf_counter()
            params, opt_state, per_minibatch = programs.learner.update(state.params, state.opt_state, batch)
            state = state.replace(params=params, opt_state=opt_state)
            if ahead is not None and step < tc.steps:  # step + 1's rows, while the update runs
                ahead.sample(jax.random.fold_in(base_key, step + 1), step + 1)
            watch.wait(per_minibatch, lambda: dispatches_done(per_minibatch, "mini-batches of the update"))
        except StepInterrupted as interrupted:  # before the update, or in it with step - 1's checkpoint on disk
            _drop_step(interrupted, signals.requested, saved, checkpointer, logger, state,
                       lambda: {"step": step - 1, "seed": spec.seed, "data_state": data_state()})
            checkpointer.close()
            logger.close()
            return TrainResult(nnx.merge(graphdef, state.params), history, True, step - 1, programs, collector,
                               state.opt_state, state.critic, earlier_history=logger.earlier, dropped_step=step)
        update_metrics = _mean_metrics(per_minibatch)
        time_update = time.perf_counter() - t0
        watch.done()
        wall = time.perf_counter() - t_step
        metrics = {**rollout.metrics, **critic_metrics, **update_metrics, "time_update": time_update,
                   "time_step": wall,
                   "lr": float(programs.learner.lr_schedule(step * tc.mini_batches)),
                   "tokens_per_second": rollout.metrics["generated_tokens"] / max(rollout.metrics["time_sample"], 1e-9),
                   "compilations": float(compilations())}
        history.append({"step": step, **metrics})
        logger.log(step, metrics)
        options = step_line(spec, metrics)  # what carry-over, dynamic sampling, one step off, a correction did
        if options is not None:
            logger.write(f"step {step}: {options}")
        # made only when a checkpoint is written (carry-over's reads the rows in flight from the device)
        meta = lambda: {"step": step, "seed": spec.seed,
                        "data_state": prompts.get_state() if ahead is None else ahead.state_before(step + 1)}
        preempted = signals.safe_point()  # several processes: the same step on every one
        preempted = preempted or (ahead is not None and ahead.interrupted)  # a stop while sampling step + 1
        if _save(checkpointer, step, state, meta, force=preempted or step == tc.steps):
            saved = step
        if on_step is not None:
            on_step(step, nnx.merge(graphdef, state.params), metrics)
        if single_process and not preempted and signals.requested is not None:  # arrived during on_step
            _save(checkpointer, step, state, meta, force=True)
            preempted = True
        if preempted:
            if single_process:
                line = _finished_line(signals.requested, signals.requested_where, step,
                                      keeps_warm_start=keep_first_step and step == start + 1,
                                      previous_unsaved=previous_unsaved,
                                      ahead_dropped=ahead is not None and ahead.interrupted)
            else:
                line = f"preemption (at the same step on every process): checkpoint of step {step} written, exiting"
            logger.write(line)
            if not primary:  # every host's log says where it stopped (the logger writes on process 0 only)
                print(f"process {jax.process_index()}: {line}", flush=True)
            stopped = True
            break
    if single_process and not stopped and signals.requested is not None:  # no step was under way
        logger.write(f"{signals.requested}: no step left to run; exiting (the checkpoint of step {step} is the latest)")
        stopped = True
    checkpointer.close()
    logger.close()
    return TrainResult(nnx.merge(graphdef, state.params), history, stopped, step, programs, collector, state.opt_state,
                       state.critic, earlier_history=logger.earlier)


def _finished_line(signal_name: str, where: Position | None, step: int, *, keeps_warm_start: bool,
                   previous_unsaved: bool, ahead_dropped: bool) -> str:
    """The line of a stop signal that let step ``step`` finish and wrote its checkpoint: where it came
    (``where``: the loop's position then, ``StepWatch.position``; one of a step before ``step``, or step 0's
    before the first, when it came before this step began, as in the compilation before it; None: not
    known) and why the step was finished rather than dropped, from what the loop knows: it keeps this
    session's warm-start (``keeps_warm_start``), or its update had begun with no checkpoint of step - 1 on
    disk (``previous_unsaved``: the update could not be abandoned), or else its update was done by the time
    the signal was acted on (it came as the update ended, or while step + 1 was sampled ahead: the
    update's last stop point found it done); nothing to say when it came after the update.
    ``ahead_dropped``: one step off's rows of step + 1, sampled ahead, were dropped (a resume samples them
    again); a signal in step ``step``'s update then came while they were sampled."""
    if where is None:
        during = ""
    elif ahead_dropped and where == (step, "update", False):
        during = f" while step {step + 1}'s rows were sampled ahead, during step {step}'s update"
    else:
        during = f" during {where}" if where.step == step else f" before step {step} began"
    if where == (step, "update", True):
        why = ""
    elif keeps_warm_start:
        why = " rather than dropped: it keeps this session's warm-start, which has no checkpoint of its own"
    elif previous_unsaved:
        why = f" rather than dropped: its update had begun, and step {step - 1} has no checkpoint to go back to"
    else:
        why = " rather than dropped: its update was done by the time the signal was acted on"
    ahead = f"; step {step + 1}'s rows sampled ahead dropped (a resume samples them again)" if ahead_dropped else ""
    return f"{signal_name}{during}: step {step} finished{why}{ahead}; checkpoint of step {step} written, exiting"


def _save(checkpointer: TrainCheckpointer, step: int, state: TrainState, meta, *, force: bool) -> bool:
    """``train_state.save``, its compilations (Orbax's own) not in the steps' ``compilations`` metric."""
    with uncounted():
        return save(checkpointer, step, state, meta, force=force)


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
               logger: MetricsLogger, state: TrainState, meta: Callable[[], dict]) -> None:
    """A stop signal ended step S before its update (or in it, when step S - 1's checkpoint is on disk:
    then nothing is written, the update's donated state is abandoned): write the checkpoint of step
    S - 1 (``state`` and ``meta()`` are still its) unless it has one (``saved``) or is step 0, and say what
    a resume does."""
    last = interrupted.step - 1
    if last > saved:
        _save(checkpointer, last, state, meta, force=True)
        kept = f"checkpoint of step {last} written"
    else:
        kept = (f"the checkpoint of step {last} is the latest" if last else
                "no RL step had finished (a resume starts RL at step 1)")
    line = (f"{signal_name} during step {interrupted.step} ({interrupted.phase}): step {interrupted.step} dropped, "
            f"a resume runs it again with the same keys; {kept}, exiting")
    logger.write(line)
    if jax.process_index() != 0:  # every host's log says where it stopped (the logger writes on process 0 only)
        print(f"process {jax.process_index()}: {line}", flush=True)
