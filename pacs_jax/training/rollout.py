"""How a step's rollout is scheduled between the two roles (the rollout engine, training/engine/, and the
learner, training/learner/; they meet in training/records.py): the one module that uses both.

Synchronous (``RolloutCollector``; docs/design.md section 3): a step samples its prompts, dispatches pi_old's
passes on the learner's programs while the host scores the rows, then waits for them:

    rollout = collector(params, prompts.next_batch, key, watch, step)   # Rollout: the update batch, metrics

With ``algorithm.filter_groups`` the engine collects gen batches until the step's groups are kept, then the
learner makes the update batch of them (``collect``, then ``finish``). Carry-over (``rollout.carry_over``;
``carry_over_source``): the engine keeps responses in flight between steps, and its prompt source
(training/engine/carry_over.py) samples each step's rows.

One step off (``OneStepOff``; ``train.off_policy_steps=1``; issue 50; docs/design.md section 3.2c): the rollout engine
samples and scores step s + 1's rows while the learner trains step s.

    ahead = OneStepOff(programs, collector, prompts, watch)     # the loop's, when train.off_policy_steps=1
    rollout = ahead.rollout(params, key, watch, s)   # step s: the engine's copy of params made, then pi_old
    ... dispatch step s's update (it donates params) ...
    ahead.sample(key_of(s + 1), s + 1)               # step s + 1's rows, with the weights step s started from
    ... wait for the update ...

Step s's rows are sampled with the weights step s - 1 started from (the sequential reference: sample
step s with the weights of step s - 1), pi_old is the learner's recompute with the weights step s
starts from, and the rollout correction weighs the stale tokens (token TIS 2.0 unless one is set:
``spec.run_algorithm``). The engine samples from its own copy of the weights (training/engine/weight_sync.py),
made before each update donates the learner's: on its own mesh (``mesh.rollout_devices``) the two
roles then run at once; on shared devices they take turns. A session's first step has no rows sampled
ahead: it samples them with the weights it starts from (after a resume too: a checkpoint holds no copy
of the weights before them), then one step off again.

A stop signal during the sampling ahead ends it (``interrupted``): its rows are dropped, the step under
way finishes and its checkpoint holds the prompt source's state from before them
(``state_before``), so a resume samples them again: no prompt is lost, none trained twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from pacs_jax.rewards import RewardPool, reward_for
from pacs_jax.training.engine.carry_over import CarryOverRollouts
from pacs_jax.training.engine.collect import RowCollector
from pacs_jax.training.learner.rollout_batch import OldPolicy, RolloutBatcher, wait_old_policy
from pacs_jax.training.progress import StepInterrupted, StepWatch
from pacs_jax.training.records import Collected, PhaseTimes, PromptBatch, Rollout, SampledRows
from pacs_jax.training.spec import FilterGroupsSpec, RunSpec
from pacs_jax.training.step_programs import StepPrograms


def carry_over_source(programs: StepPrograms, prompts, prompts_per_step: int) -> CarryOverRollouts | None:
    """Carry-over's prompt source over the run's ``prompts`` (its engine reset: no rows in flight), or None
    without ``rollout.carry_over``."""
    if programs.sampler.carry_over is None:
        return None
    programs.sampler.carry_over.reset()
    return CarryOverRollouts(prompts, programs.sampler.carry_over, prompts_per_step)


class RolloutCollector(RowCollector):
    """The engine's collection of rows (``RowCollector``: sample, score, collect) with the learner's update
    batch of them (``batcher``: pi_old, the checks, the rollout) over a step's ``programs``; called, a
    synchronous step's rollout."""

    def __init__(self, programs: StepPrograms, *, decode: Callable[[Sequence[int]], str], reward_pool: RewardPool,
                 reward_name: str, reward_deadline: float | None = None, max_unscored_fraction: float | None = None,
                 max_logprob_diff: float = 0.0, filter_groups: FilterGroupsSpec | None = None,
                 carry: CarryOverRollouts | None = None):
        super().__init__(programs.sampler, decode=decode, reward_pool=reward_pool, reward_name=reward_name,
                         reward_deadline=reward_deadline, max_unscored_fraction=max_unscored_fraction,
                         filter_groups=filter_groups, carry=carry, split=programs.split)
        self.programs, self.max_logprob_diff = programs, max_logprob_diff
        self.batcher = RolloutBatcher(programs.learner, n=programs.sampler.n, max_logprob_diff=max_logprob_diff,
                                      split=programs.split)

    @classmethod
    def from_spec(cls, spec: RunSpec, programs: StepPrograms, *, decode: Callable[[Sequence[int]], str],
                  reward_pool: RewardPool | None, carry: CarryOverRollouts | None = None) -> RolloutCollector:
        """The collector of ``spec.reward`` (the reward, its deadline and unscored fraction),
        ``rollout.max_logprob_diff`` and ``algorithm.filter_groups``; ``carry``: the run's carry-over
        prompt source (``carry_over_source``), which samples its steps."""
        rw = spec.reward
        return cls(programs, decode=decode, reward_pool=reward_pool, reward_name=reward_for(rw.name, rw.mode),
                   reward_deadline=rw.deadline, max_unscored_fraction=rw.max_unscored_fraction,
                   max_logprob_diff=spec.rollout.max_logprob_diff, filter_groups=spec.algorithm.filter_groups,
                   carry=carry)

    def old_policy(self, state: nnx.State, sampled: SampledRows):
        """The learner's pi_old passes on ``sampled`` (``RolloutBatcher.old_policy``)."""
        return self.batcher.old_policy(state, sampled)

    def finish(self, state: nnx.State, collected: Collected, watch: StepWatch) -> Rollout:
        """The learner's update batch of ``collect``'s rows (``RolloutBatcher.finish``)."""
        return self.batcher.finish(state, collected, watch)

    def _wait_old_policy(self, dispatched: OldPolicy, watch: StepWatch, started: bool = False
                         ) -> tuple[dict[str, float], float]:
        return wait_old_policy(dispatched, watch, bypass=self.programs.learner.bypass is not None,
                               max_logprob_diff=self.max_logprob_diff, started=started)

    def __call__(self, state: nnx.State, batches: Callable[[], PromptBatch], key: jax.Array,
                 watch: StepWatch | None = None, step: int = 0) -> Rollout:
        """One step's rollout of the prompts ``batches()`` gives (one batch; with ``algorithm.filter_groups``,
        as many as it takes: training/engine/dynamic_sampling.py), sampled and trained with the same weights
        ``state``; ``watch`` (training/progress.py): its phases' progress lines and stop boundaries
        (sampling, reward, pi_old); ``step`` names the step in errors. Unfiltered, pi_old runs on the
        device while the host scores."""
        watch = watch or StepWatch.silent()
        if self.filter_groups.enable:
            return self.finish(state, self.collect(state, batches, key, watch, step), watch)
        times = PhaseTimes()
        sampled = self._sample_phase(state, batches(), key, watch, times)
        watch.start("reward")
        t0 = time.perf_counter()
        dispatched = self.batcher.dispatch(state, sampled)  # on the device while the host scores
        scored = self.score(sampled, watch)
        times.reward += time.perf_counter() - t0
        watch.done(f"{len(sampled.local_rows)} responses scored")
        mismatch, times.old_logprob = self._wait_old_policy(dispatched, watch)
        scores = self.gather(sampled, scored)  # after pi_old: several processes' collective waits for it on the device
        return self.batcher.rollout(sampled, scores, dispatched, mismatch, {**sampled.metrics, **times.metrics()})


class OneStepOff:
    """The one-step-off schedule of a run (module docstring) over ``programs``, ``collector`` and the
    loop's prompt source ``prompts``; ``watch``: the sampling ahead's own (its lines name step s + 1,
    a stop signal ends it)."""

    def __init__(self, programs: StepPrograms, collector: RolloutCollector, prompts, watch: StepWatch):
        self.programs, self.collector, self.prompts, self.watch = programs, collector, prompts, watch
        self.engine_params: nnx.State | None = None  # the engine's copy of the weights the step under way started from
        self.rows: Collected | None = None  # the next step's, sampled ahead
        self.states: dict[int, dict] = {}  # step -> the prompt source's state before its batch
        self.interrupted = False

    def state_before(self, step: int) -> dict:
        """The prompt source's state before step ``step``'s batch (``step - 1``'s checkpoint holds it)."""
        if step not in self.states:
            self.states[step] = self.prompts.get_state()
        return self.states[step]

    def rollout(self, params: nnx.State, key: jax.Array, watch: StepWatch, step: int) -> Rollout:
        """Step ``step``'s rollout: the engine's copy of ``params`` (the weights the step starts from) made
        first; the rows sampled ahead, or at a session's first step sampled now with that copy; then
        pi_old with ``params`` (``RolloutCollector.finish``). Metrics ``rollout_staleness_mean``/``_max``:
        the steps the rows' weights are behind (1, or 0 for rows sampled now); ``weight_sync_bytes``: the
        bytes the engine's copy took this step (LoRA: the adapters alone after the first)."""
        self.engine_params = self.programs.weight_sync(params, previous=self.engine_params)
        rows, self.rows = self.rows, None
        staleness = 1.0
        if rows is None:
            rows = self.collector.collect(self.engine_params, self.prompts.next_batch, key, watch, step)
            staleness = 0.0
        self.states = {s: state for s, state in self.states.items() if s >= step}
        rollout = self.collector.finish(params, rows, watch)
        rollout.metrics.update(rollout_staleness_mean=staleness, rollout_staleness_max=staleness,
                               weight_sync_bytes=float(self.programs.weight_sync.moved_bytes))
        return rollout

    def sample(self, key: jax.Array, step: int) -> None:
        """Sample and score step ``step``'s rows with the engine's copy of the weights (those step - 1
        started from) while the learner's update runs; a stop signal ends it (``interrupted``, the rows
        dropped)."""
        self.state_before(step)
        self.watch.start_step(step)
        try:
            self.rows = self.collector.collect(self.engine_params, self.prompts.next_batch, key, self.watch, step)
        except StepInterrupted:
            self.rows, self.interrupted = None, True
