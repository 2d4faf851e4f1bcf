"""SIGTERM (preemption) and SIGINT (Ctrl-C) during a run (docs/design.md section 3.7).

One process: both signals are handled alike, by the phase the run is in.

- RL steps (``deferred``): the first signal sets ``requested``; the loop stops at the step's next
  phase boundary (training/progress.py: between chunks of decode steps, while the reward scores,
  while it waits for pi_old or the update; within a fraction of a second of the signal, the device's
  program left running): a step whose update has not begun, or whose update began after the last
  finished step's checkpoint was on disk, is dropped (the last finished step's checkpoint is written
  if it was not; a resume runs the dropped step again with the same keys), another step in its
  update (which donates the weights) is finished and checkpointed, and so is a run's first step when it keeps a
  warm-start. The run exits with status 79 (errors.RESUME_NEEDED_STATUS), without waiting for the
  device. The handlers then go back to the default action, so a second SIGTERM or SIGINT ends the
  process at once (losing the steps since the last checkpoint), even inside a long XLA call.
- Every other phase (``immediate(what_is_lost)``): start-up, the warm-start and the evaluation before
  RL (neither is checkpointed), the compilation before a session's first RL step (training/loop.py;
  not when that step keeps a warm-start), the final evaluation and the export. The first signal prints one
  line naming the phase and what a restart redoes, and exits (``SystemExit``, so the run's cleanup code
  runs: reward workers, the workdir lock) with status 79 as well: every graceful stop by a signal
  exits with it (the same command resumes the run, redoing the phase), whatever the phase. A signal that
  lands inside a garbage-collector callback, where Python would print and drop the ``SystemExit``
  (a warm-start once ran on for ten minutes that way), is raised again 50 ms later.

Several processes: no process may stop alone (the others would wait for it in their next collective),
so they stop together at a safe point: ``safe_point()``, which every process calls in the same order
before each warm-start step, at each phase boundary of an RL step (training/progress.py: each phase's
start, each chunk of decode steps, the waits for pi_old and the update) and after each RL step. JAX's preemption service owns SIGTERM: a SIGTERM
to any process is a notice to all of them, and its sync point, asked with the count of this
session's safe points (1, 2, ...), answers True on every process at the same one (the first that
none of them has passed when the notice is shared). The first SIGINT is passed to it as a SIGTERM to
the process itself, so Ctrl-C on a local multi-process run (launch/local.sh) stops it the same way;
a second SIGINT takes the default action. At that safe point a warm-start step exits as a single
process does (the phase's line, status 79; a process that received no signal itself names SIGTERM,
the notice's), and an RL step ends as one process's does, on every process: dropped
at a phase boundary (the last finished step's checkpoint written if it was not, status 79), or, at the
step's end, checkpointed.
A signal during the evaluation before RL stops at the first RL step (which keeps the warm-start), one
after the last RL step (the final evaluation, the export) lets the run finish. The sync point's
counter must be the safe points' alone: checkpoints.py keeps Orbax's own calls with step numbers
away from it.

Handlers are installed only from the main thread; elsewhere nothing is handled. Messages go to
stderr through ``os.write``, which is safe inside a signal handler.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from pacs_jax.errors import RESUME_NEEDED_STATUS

if TYPE_CHECKING:
    from pacs_jax.training.progress import Position

_HANDLED = (signal.SIGTERM, signal.SIGINT)
_active: StopSignals | None = None


def _say(message: str) -> None:
    try:
        os.write(2, f"\n{message}\n".encode())
    except OSError:
        pass


def _preemption_service() -> bool:
    """Whether JAX's multi-process preemption service runs (it turns SIGTERM into an agreed stop)."""
    try:
        from jax._src import distributed
    except ImportError:
        return False
    return getattr(distributed.global_state, "preemption_sync_manager", None) is not None


class StopSignals:
    """The run's SIGTERM / SIGINT handling (see the module docstring); a context manager.

    ``requested``: the name of the first signal received in a deferred phase ("SIGTERM", "SIGINT"),
    or None; ``requested_where``: what ``where()`` (set by the RL loop: its step and phase) returned as it
    came, for the line the loop writes when it stops (one process; None otherwise). multiprocess: several
    processes (only SIGINT is handled, as described above).
    """

    def __init__(self, *, multiprocess: bool = False):
        self.multiprocess = multiprocess
        self.requested: str | None = None
        self.where: Callable[[], object] | None = None
        self.requested_where: object = None
        self._lost: str | None = None  # immediate phase: what a restart redoes; None: deferred
        self._previous: dict[int, object] = {}
        self._synced = multiprocess and _preemption_service()  # several processes stop at the sync point
        self._safe_points = 0  # safe points passed in this session: the sync point's counter

    # -------------------------------------------------------------------- install / uninstall
    def __enter__(self) -> StopSignals:
        global _active
        if threading.current_thread() is not threading.main_thread():
            return self
        handled = _HANDLED if not self.multiprocess else (signal.SIGINT,) if self._synced else ()
        for signum in handled:
            self._previous[signum] = signal.signal(signum, self._handle)
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        if _active is self:
            _active = None

    # -------------------------------------------------------------------- phases
    def exit_at_once(self, lost: str) -> None:
        """From now on (until a ``deferred`` block), a signal prints "SIGNAL during ``lost``; exiting"
        and exits at once (several processes: see the module docstring). lost: the phase and what a
        restart redoes."""
        self._lost = lost

    @contextlib.contextmanager
    def immediate(self, lost: str):
        """Within: a signal prints "SIGNAL during ``lost``; exiting" and exits at once (several
        processes: see the module docstring).

        lost: the phase and what a restart redoes, e.g. "the warm-start (not checkpointed: a restart
        runs it again)".
        """
        previous, self._lost = self._lost, lost
        try:
            yield self
        finally:
            self._lost = previous

    @contextlib.contextmanager
    def deferred(self):
        """Within: the first signal sets ``requested`` (the loop stops after its step's checkpoint)."""
        previous, self._lost = self._lost, None
        try:
            yield self
        finally:
            self._lost = previous

    # -------------------------------------------------------------------- safe points
    def safe_point(self) -> bool:
        """A point where the run may stop, called by every process in the same order (before each
        warm-start step, at each phase boundary of an RL step, after each RL step): whether to stop here.

        One process: whether a signal came (in an immediate phase the handler has exited already).
        Several: whether JAX's preemption sync point is this one (the same on every process); in an
        immediate phase it prints "SIGNAL during ``lost``; exiting" and exits here instead.
        """
        if not self._synced:
            return self.requested is not None
        from jax.experimental import multihost_utils

        self._safe_points += 1
        if not multihost_utils.reached_preemption_sync_point(self._safe_points):
            return False
        self.requested = self.requested or "SIGTERM"
        if self._lost is not None:
            _say(f"{self.requested} during {self._lost}; exiting")
            raise SystemExit(RESUME_NEEDED_STATUS)
        return True

    # -------------------------------------------------------------------- the handler
    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.multiprocess:  # SIGINT: ask JAX's preemption service for an agreed stop
            self.requested = name
            _say(f"{name}: every process stops together at the next warm-start step or RL phase boundary that all "
                 f"of them reach after this notice (an RL step whose update has not begun is dropped and run again "
                 f"on resume, the last finished step's checkpoint written; press Ctrl-C again to abort at once, "
                 f"losing the steps since the last checkpoint)")
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self._lost is not None:
            if _in_gc_callback(frame):  # Python ignores exceptions there: deliver the signal again shortly
                threading.Timer(0.05, signal.raise_signal, (signum,)).start()
                return
            _say(f"{name} during {self._lost}; exiting")
            raise SystemExit(RESUME_NEEDED_STATUS)
        if self.requested is None:
            self.requested = name
            self.requested_where = None if self.where is None else self.where()
            _say(f"{name}: stopping at the step's next phase boundary (a step whose update has not begun is "
                 f"dropped and run again on resume; one in its update too when the last finished step's "
                 f"checkpoint is on disk, else it is finished), writing the checkpoint of the "
                 f"last finished step and exiting with status 79 (send SIGTERM or press Ctrl-C again to abort "
                 f"at once, losing the steps since the last checkpoint)")
            for other in self._previous:  # a second signal: the default action, at once
                signal.signal(other, signal.SIG_DFL)


def _in_gc_callback(frame) -> bool:
    """Whether the interrupted ``frame`` runs inside a garbage-collector callback (JAX registers one),
    where an exception raised by a signal handler is printed and ignored."""
    codes = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def stop_signals(*, multiprocess: bool = False):
    """The run's ``StopSignals``: the active one when a caller installed it (training/run.py does, for
    the whole run), else a new one installed for the duration."""
    if _active is not None:
        yield _active
        return
    with StopSignals(multiprocess=multiprocess) as stop:
        yield stop


def finished_line(signal_name: str, where: Position | None, step: int, *, keeps_warm_start: bool,
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
