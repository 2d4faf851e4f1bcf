"""A stop signal that lands inside a garbage-collector callback still ends an immediate phase
(training/signals.py): Python prints and drops an exception raised there, so the handler raises the
signal again shortly after instead of losing it (a warm-start once ran on for ten minutes that way)."""

import gc
import os
import signal
import time

import pytest

from pacs_jax.errors import RESUME_NEEDED_STATUS
from pacs_jax.training.signals import StopSignals


def test_a_sigterm_inside_a_gc_callback_is_delivered_again_and_exits(capfd):
    def send_during_collection(phase, info):
        if phase == "start":
            os.kill(os.getpid(), signal.SIGTERM)  # handled here, inside the callback
            time.sleep(0.01)

    with StopSignals() as signals:
        signals.exit_at_once("the warm-start, which is not checkpointed")
        gc.callbacks.append(send_during_collection)
        try:
            with pytest.raises(SystemExit) as exited:
                gc.collect()
                gc.callbacks.remove(send_during_collection)
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline:  # ordinary Python frames: the second delivery lands here
                    time.sleep(0.01)
        finally:
            if send_during_collection in gc.callbacks:
                gc.callbacks.remove(send_during_collection)
    assert exited.value.code == RESUME_NEEDED_STATUS
    err = capfd.readouterr().err
    assert err.count("SIGTERM during the warm-start, which is not checkpointed; exiting") == 1
    assert "Exception ignored" not in err
