"""SIGTERM (preemption) and SIGINT (Ctrl-C) during a run (docs/design.md section 3.7).

One process: both signals are handled alike, by the phase the run is in.

- RL steps (``deferred``): the first signal sets ``requested``; the loop finishes the step under way,
  writes its checkpoint and exits with a line saying so. The handlers then go back to the default
  action, so a second SIGTERM or SIGINT ends the process at once (losing the steps since the last
  checkpoint), even inside a long XLA call.
- Every other phase (``immediate(what_is_lost)``): start-up, the warm-start and the evaluation before
  RL (neither is checkpointed), the final evaluation and the export. The first signal prints one
  line naming the phase and what a restart redoes, and exits (``SystemExit``, status 128 + the
  signal's number, so the run's cleanup code runs: reward workers, the workdir lock). A signal that
  lands inside a garbage-collector callback, where Python would print and drop the ``SystemExit``
  (a warm-start once ran on for ten minutes that way), is raised again 50 ms later.

Several processes: JAX's preemption service owns SIGTERM (every process stops at the same RL step,
``TrainCheckpointer.reached_preemption``); the first SIGINT is passed to it as a SIGTERM to the
process itself, so Ctrl-C on a local multi-process run (launch/local.sh) stops it the same way; a
second SIGINT takes the default action.

Handlers are installed only from the main thread; elsewhere nothing is handled. Messages go to
stderr through ``os.write``, which is safe inside a signal handler.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading

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
    or None. multiprocess: several processes (only SIGINT is handled, as described above).
    """

    def __init__(self, *, multiprocess: bool = False):
        self.multiprocess = multiprocess
        self.requested: str | None = None
        self._lost: str | None = None  # immediate phase: what a restart redoes; None: deferred
        self._previous: dict[int, object] = {}

    # -------------------------------------------------------------------- install / uninstall
    def __enter__(self) -> StopSignals:
        global _active
        if threading.current_thread() is not threading.main_thread():
            return self
        handled = (signal.SIGINT,) if self.multiprocess else _HANDLED
        if self.multiprocess and not _preemption_service():
            handled = ()
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
        and exits at once. lost: the phase and what a restart redoes."""
        self._lost = lost

    @contextlib.contextmanager
    def immediate(self, lost: str):
        """Within: a signal prints "SIGNAL during ``lost``; exiting" and exits at once.

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

    # -------------------------------------------------------------------- the handler
    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.multiprocess:  # SIGINT: ask JAX's preemption service for an agreed stop
            self.requested = name
            _say(f"{name}: every process stops at the same RL step (the first that all of them reach after "
                 f"this notice) and writes its checkpoint (press Ctrl-C again to abort at once, losing the "
                 f"steps since the last checkpoint)")
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self._lost is not None:
            if _in_gc_callback(frame):  # Python ignores exceptions there: deliver the signal again shortly
                threading.Timer(0.05, signal.raise_signal, (signum,)).start()
                return
            _say(f"{name} during {self._lost}; exiting")
            raise SystemExit(128 + signum)
        if self.requested is None:
            self.requested = name
            _say(f"{name}: finishing the current step, then writing its checkpoint and exiting (send "
                 f"SIGTERM or press Ctrl-C again to abort at once, losing the steps since the last checkpoint)")
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
