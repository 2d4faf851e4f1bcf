"""What a step is doing while it runs: progress lines by phase, and the phase boundaries where a
stop signal ends an unfinished step (docs/design.md section 3.7).

A step's phases (training/loop.py, training/rollout.py): with carry-over, a resumed session's first
step begins with ``resume`` (the rows in flight put back into the engine, their K/V recomputed:
training/engine/carry_over.py), then ``sampling`` (the sampler's
``rollout.micro_batches`` calls, each a program per chunk of decode steps: rows done and tokens so far
are read between two), ``reward`` (decoding and scoring, while the device computes pi_old),
``pi_old`` (waiting for it) and ``update`` (PPO's critic update with it). ``StepWatch``:

- lines, by ``interval_s`` (``train.progress_seconds``): a phase that runs longer than it writes a
  heartbeat every ``interval_s`` while it waits on the device (naming what is done, e.g. "sampler
  call 1/2: 40/64 rows done, 1234 tokens, 30 s so far") and a line when it ends ("reward done in 41 s"); a shorter
  phase's end line is written when nothing was for ``interval_s`` (so a step of many short phases
  still says where it is). A step shorter than the interval prints none (its bar line says enough);
  a slow step prints a line per phase, so a slow step can be told from a hung one.
  ``interval_s=0``: a line at every phase's end, no heartbeats.
- stops: ``boundary()`` raises ``StepInterrupted`` once ``stop_requested()`` is true. Waits on the
  device poll (``jax.Array.is_ready``; 1 ms apart at first, doubling up to ``POLL_S``) rather than
  block, so a signal's handler runs within ``POLL_S`` and the wait ends at once, the device program
  still running (the caller does not wait for it: pacs_jax/train.py ends the process without it).
  One process asks at each phase's start, at every poll (``poll()``: of a wait, of the reward's
  scoring) and after each chunk of decode steps even when its result is in at the first look
  (``wait_after_program``: a device that returns from the next chunk's dispatch only once this one
  has run leaves nothing to poll). Several processes (``lockstep``) must stop at the same point, so
  they ask only where every process passes in the same order: each phase's start and each ``wait``
  (one a chunk of decode steps, pi_old's, the update's), never in a poll; ``stop_requested`` is then
  JAX's preemption sync point (training/signals.py), True at the same point on every process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import jax

POLL_S = 0.05  # the most seconds between two looks at an unfinished device result
CPU_STEP_TOKENS = 100_000  # prompt + response tokens of a step above which a CPU run is warned (the ,cpu smoke
#                            test's 8 x 8 x (512 + 64) = 37 k take about 55 s on 2 cores; the paper's step 38 M)


class StepInterrupted(Exception):
    """A stop signal came before the step's update began, or in it when the last finished step's
    checkpoint is on disk: the step is left unfinished (its results are dropped; a resume runs it
    again with the same keys)."""

    def __init__(self, step: int, phase: str):
        super().__init__(f"step {step} interrupted during {phase}")
        self.step, self.phase = step, phase


class Position(NamedTuple):
    """Where a run is in its step (``StepWatch.position``): the step, its phase ("" before the first) and
    whether that phase has ended."""

    step: int
    phase: str
    ended: bool

    def __str__(self) -> str:
        if not self.phase:
            return f"step {self.step} (its start)"
        return f"step {self.step}, after its {self.phase}" if self.ended else f"step {self.step} ({self.phase})"


class StepWatch:
    """Progress lines and stop boundaries of the steps of one run (see the module docstring).

    write(line): where lines go (the metrics logger's ``write``: above the progress bar).
    interval_s: see the module docstring. stop_requested(): whether a stop signal came (with
    ``lockstep``, whether every process stops here). lockstep: several processes (see the module
    docstring). clock: seconds (``time.monotonic``; tests pass their own).
    """

    def __init__(self, write: Callable[[str], None], interval_s: float, stop_requested: Callable[[], bool] = bool,
                 clock: Callable[[], float] = time.monotonic, lockstep: bool = False):
        self.write, self.interval_s, self.stop_requested, self.clock = write, interval_s, stop_requested, clock
        self.lockstep = lockstep
        self.step, self.phase, self.stoppable, self.ended = 0, "", True, False
        self._phase_start = self._last_line = clock()

    @classmethod
    def silent(cls) -> StepWatch:
        """A watch that writes nothing and never stops a step (a rollout outside the training loop)."""
        return cls(lambda line: None, float("inf"))

    def start_step(self, step: int, stoppable: bool = True) -> None:
        """Begin step ``step``; stoppable: whether a stop signal may end it (False: it runs to its end)."""
        self.step, self.phase, self.stoppable, self.ended = step, "", stoppable, False
        self._phase_start = self._last_line = self.clock()

    def start(self, phase: str, last_boundary: bool = False) -> None:
        """Begin ``phase`` (a boundary: raises ``StepInterrupted`` if a stop was asked).
        last_boundary: from here on the step runs to its end (its update has no way back)."""
        self.boundary()
        self.phase, self._phase_start, self.ended = phase, self.clock(), False
        self.stoppable = self.stoppable and not last_boundary

    def boundary(self) -> None:
        """Raise ``StepInterrupted`` if a stop signal came (and the step may still stop). With
        ``lockstep``, every process must call it at the same points, in the same order."""
        if self.stoppable and self.stop_requested():
            raise StepInterrupted(self.step, self.phase or "its start")

    def poll(self) -> None:
        """A stop check while work is unfinished (a wait's polls, the reward's scoring): ``boundary()``
        on one process; nothing with ``lockstep``, whose processes poll different numbers of times."""
        if not self.lockstep:
            self.boundary()

    def done(self, detail: str = "", always: bool = False) -> None:
        """End the current phase: a line "step S: PHASE done in T s (detail)" when it ran ``interval_s``
        or nothing was written for that long (``always``: in any case)."""
        self.ended = True
        now = self.clock()
        seconds = now - self._phase_start
        if always or seconds >= self.interval_s or now - self._last_line >= self.interval_s:
            self._write(f"{self.phase} done in {seconds:.0f} s" + (f" ({detail})" if detail else ""))

    def position(self) -> Position:
        """Where the watched step is now (read by the stop signal's handler: training/signals.py)."""
        return Position(self.step, self.phase, self.ended)

    def say(self, text: str) -> None:
        """A line "step S: text" now (what a long phase is about to do)."""
        self._write(text)

    def heartbeat(self, detail: str) -> None:
        """Within the current phase: a line "step S: PHASE, detail, T s so far" every ``interval_s`` of
        the phase (none with ``interval_s=0``)."""
        now = self.clock()
        if self.interval_s > 0 and now - max(self._phase_start, self._last_line) >= self.interval_s:
            self._write(f"{self.phase}, {detail}, {now - self._phase_start:.0f} s so far")

    def wait(self, arrays, detail: Callable[[], str]) -> None:
        """Wait until every jax.Array in the pytree ``arrays`` is computed, writing heartbeats
        (``detail()`` says what is done) and stopping at a signal (``StepInterrupted``)."""
        pending = [x for x in jax.tree.leaves(arrays) if isinstance(x, jax.Array)]
        if self.lockstep:  # one point a wait, the same on every process
            self.boundary()
        delay = 0.001  # doubling up to POLL_S: a short wait ends within a millisecond or two of its result
        while pending:
            pending = [x for x in pending if not x.is_ready()]
            if not pending:
                return
            self.poll()
            self.heartbeat(detail())
            time.sleep(delay)
            delay = min(2 * delay, POLL_S)

    def wait_after_program(self, arrays, detail: Callable[[], str]) -> None:
        """``wait`` for one of a call's programs that more of the call follows (a chunk of decode steps, a
        resume's program): a stop point and a heartbeat even when ``arrays`` are computed at the first look,
        as they are wherever dispatching the next program returns only once the program before it has run
        (emulated in tests/test_sampling_stop.py; not measured on a device); ``wait`` would then neither poll nor
        stop, and the call would run to its end. One process asks here; several in ``wait``."""
        self.poll()
        self.heartbeat(detail())
        self.wait(arrays, detail)

    def _write(self, text: str) -> None:
        self.write(f"step {self.step}: {text}")
        self._last_line = self.clock()


def dispatches_done(results: list, what: str) -> str:
    """"K/N WHAT done": of N dispatches' ``results`` (each a pytree of device arrays), those whose
    arrays are all computed (no wait): the update's mini-batches, pi_old's passes."""
    done = sum(all(x.is_ready() for x in jax.tree.leaves(r)) for r in results)
    return f"{done}/{len(results)} {what} done"


def planned_step_warning(spec, platform: str) -> str | None:
    """A warning line when a step is planned far beyond the machine: on a CPU, more than
    ``CPU_STEP_TOKENS`` prompt and response tokens (prompts_per_step x rollout.n x (the largest
    prompt bucket + rollout.max_new_tokens)); else None. Accelerators are checked by the memory
    check (training/memory_check.py), which compiles the step's programs against their memory. spec: the
    run's ``RunSpec``."""
    tc, rc = spec.train, spec.rollout
    tokens = spec.responses * spec.row_width
    if platform != "cpu" or tokens <= CPU_STEP_TOKENS:
        return None
    return (f"warning: a step of {tc.prompts_per_step} prompts x {rc.n} responses of up to {rc.max_new_tokens} tokens "
            f"({tokens / 1e6:.1f} M prompt and response tokens) is planned on a CPU: expect hours a step. A paper "
            f"setup's CPU smoke test is configs/paper.py:MODEL,ALGO,cpu; else lower train.prompts_per_step, "
            f"rollout.n or rollout.max_new_tokens")
