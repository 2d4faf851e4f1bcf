"""One step off (``train.off_policy_steps=1``; issue 50; docs/design.md section 3.2c): the rollout engine
samples and scores step s + 1's rows while the learner trains step s.

    ahead = OneStepOff(programs, collector, prompts, watch)     # the loop's, when train.off_policy_steps=1
    rollout = ahead.rollout(params, key, watch, s)   # step s: the engine's copy of params made, then pi_old
    ... dispatch step s's update (it donates params) ...
    ahead.sample(key_of(s + 1), s + 1)               # step s + 1's rows, with the weights step s started from
    ... wait for the update ...

Step s's rows are sampled with the weights step s - 1 started from (the sequential reference: sample
step s with the weights of step s - 1), pi_old is the learner's recompute with the weights step s
starts from, and the rollout correction weighs the stale tokens (token TIS 2.0 unless one is set:
``spec.run_algorithm``). The engine samples from its own copy of the weights (training/weight_sync.py),
made before each update donates the learner's: on its own mesh (``mesh.rollout_devices``) the two
roles then run at once; on shared devices they take turns. A session's first step has no rows sampled
ahead: it samples them with the weights it starts from (after a resume too: a checkpoint holds no copy
of the weights before them), then one step off again.

A stop signal during the sampling ahead ends it (``interrupted``): its rows are dropped, the step under
way finishes and its checkpoint holds the prompt source's state from before them
(``state_before``), so a resume samples them again: no prompt is lost, none trained twice.
"""

from __future__ import annotations

import jax
from flax import nnx

from pacs_jax.training.progress import StepInterrupted, StepWatch
from pacs_jax.training.rollout import Collected, Rollout, RolloutCollector
from pacs_jax.training.step_programs import StepPrograms


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
        the steps the rows' weights are behind (1, or 0 for rows sampled now)."""
        self.engine_params = self.programs.weight_sync(params, previous=self.engine_params)
        rows, self.rows = self.rows, None
        staleness = 1.0
        if rows is None:
            rows = self.collector.collect(self.engine_params, self.prompts.next_batch, key, watch, step)
            staleness = 0.0
        self.states = {s: state for s, state in self.states.items() if s >= step}
        rollout = self.collector.finish(params, rows, watch)
        rollout.metrics.update(rollout_staleness_mean=staleness, rollout_staleness_max=staleness)
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
