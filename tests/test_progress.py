"""Issue 41 items 1 and 6: the interval progress output promises holds, on a clock the test drives.

``StepWatch`` (training/progress.py): a phase longer than ``interval_s`` writes a heartbeat every
``interval_s`` and its end; short phases' ends are written ``interval_s`` apart; ``StepInterrupted``
at a boundary once a stop is asked (none after the update's boundary). ``console.bar`` off a terminal: one line
every ``LOG_INTERVAL_S`` seconds, not one per update (tqdm read ``TQDM_MININTERVAL`` only at its
import), ending on one 100 % line.
"""

import io

import jax.numpy as jnp
import pytest
import tqdm.std

from pacs_jax import console
from pacs_jax.training.progress import StepInterrupted, StepWatch


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_watch_writes_a_long_phase_s_heartbeats_and_end_and_short_phases_an_interval_apart():
    clock, lines, stop = Clock(), [], []
    watch = StepWatch(lines.append, 30.0, stop_requested=lambda: bool(stop), clock=clock)
    watch.start_step(7)
    watch.start("sampling")
    clock.now = 10
    watch.heartbeat("1/4 sampler calls done")
    assert lines == []  # 10 s: too soon
    clock.now = 31
    watch.heartbeat("2/4 sampler calls done")
    clock.now = 50
    watch.heartbeat("3/4 sampler calls done")  # 19 s after the last heartbeat: none
    clock.now = 55
    watch.done("64 rows")  # a phase longer than the interval: its end
    for phase, seconds in (("reward", 10), ("pi_old", 10), ("update", 12)):  # short ones: the one 30 s on
        watch.start(phase)
        clock.now += seconds
        watch.done()
    assert lines == ["step 7: sampling, 2/4 sampler calls done, 31 s so far",
                     "step 7: sampling done in 55 s (64 rows)",
                     "step 7: update done in 12 s"]
    watch.start_step(8)  # a short step: nothing
    watch.start("sampling")
    clock.now += 5
    watch.done()
    assert len(lines) == 3

    stop.append(True)  # a stop signal: the next boundary ends the step, unless the update has begun
    with pytest.raises(StepInterrupted) as interrupted:
        watch.start("reward")
    assert (interrupted.value.step, interrupted.value.phase) == (8, "sampling")
    watch.start_step(9)
    watch.wait(jnp.ones(3), lambda: "waiting")  # a result already computed: nothing to stop
    with pytest.raises(StepInterrupted):
        watch.boundary()
    stop.clear()
    watch.start("update", last_boundary=True)
    stop.append(True)
    watch.boundary()  # past the last boundary: the step runs to its end
    watch.start_step(10, stoppable=False)  # a step that keeps the warm-start
    watch.start("sampling")


def test_interval_zero_writes_every_phase_end_and_no_heartbeat():
    clock, lines = Clock(), []
    watch = StepWatch(lines.append, 0.0, clock=clock)
    watch.start_step(1)
    watch.start("sampling")
    watch.heartbeat("0/1 sampler calls done")
    watch.done("8 rows")
    watch.start("update")
    watch.done()
    assert lines == ["step 1: sampling done in 0 s (8 rows)", "step 1: update done in 0 s"]


def test_a_bar_in_a_log_writes_a_line_every_log_interval_and_one_last_line(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(tqdm.std, "time", clock)
    monkeypatch.setattr(tqdm.std.tqdm, "monitor_interval", 0)  # no refresh thread on the real clock
    out = io.StringIO()
    assert not console.terminal()  # pytest captures stderr
    bar = console.bar(total=100, desc="evaluate", file=console.PlainLines(out), leave=False)
    for _ in range(100):
        clock.now += 1.0  # 100 s, an update a second
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert 3 <= len(lines) <= 1 + 100 // console.LOG_INTERVAL_S + 1, lines  # first, one per 30 s, last
    assert lines[-1].startswith("evaluate: 100%|") and sum("100/100" in line for line in lines) == 1, lines

    out = io.StringIO()  # the last update falls on a refresh (60 s): close writes no second 100 % line
    bar = console.bar(total=60, desc="train", file=console.PlainLines(out))
    for _ in range(60):
        clock.now += 1.0
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert sum("60/60" in line for line in lines) == 1 and lines[-1].startswith("train: 100%|"), lines
