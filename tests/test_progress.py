"""Issue 41 items 1 and 6: the interval progress output promises holds, on a clock the test drives.

``StepWatch`` (training/progress.py): a phase longer than ``interval_s`` writes a heartbeat every
``interval_s`` and its end; short phases' ends are written ``interval_s`` apart; ``StepInterrupted``
at a boundary once a stop is asked (none after the update's boundary). ``console.bar`` off a terminal: one line
every ``LOG_INTERVAL_S`` seconds, not one per update (tqdm read ``TQDM_MININTERVAL`` only at its
import), ending on one 100 % line.
"""

import io

import jax
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


class Pending:
    """A jax.Array stand-in whose result is ready after ``polls`` looks."""

    def __init__(self, polls: int):
        self.polls = polls

    def is_ready(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def test_several_processes_ask_only_where_every_process_passes(monkeypatch):
    """lockstep (several processes): the stop is asked at each phase's start and once a wait, never in a
    wait's or the reward's polls (each process polls as often as its own timing makes it); one process
    asks at every poll too."""
    monkeypatch.setattr(jax, "Array", Pending)  # the wait's isinstance test
    for lockstep, asks in ((True, 3), (False, 1 + 5 + 4 + 1)):
        calls = []
        watch = StepWatch(lambda line: None, 30.0, stop_requested=lambda: calls.append(1) and False,
                          lockstep=lockstep)
        watch.start_step(1)
        watch.start("sampling")  # one
        watch.wait(Pending(5), lambda: "a chunk")  # one (lockstep) or five, a poll each
        for _ in range(4):
            watch.poll()  # the reward's polls: none (lockstep) or four
        watch.start("reward")  # one
        assert len(calls) == asks, (lockstep, len(calls))
    stop = []
    watch = StepWatch(lambda line: None, 30.0, stop_requested=lambda: bool(stop), lockstep=True)
    watch.start_step(2)
    watch.start("sampling")
    stop.append(True)
    watch.poll()  # not a stop point of several processes
    with pytest.raises(StepInterrupted):
        watch.wait(Pending(0), lambda: "a chunk")  # one: even for a result already there


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


FINISHED = "step {s} finished rather than dropped: "
WARM = "it keeps this session's warm-start, which has no checkpoint of its own"


@pytest.mark.parametrize("phases, step, flags, said", [
    (("sampling",), 1, "warm", "SIGINT during step 1 (sampling): " + FINISHED.format(s=1) + WARM
     + "; checkpoint of step 1 written, exiting"),
    (("sampling", "reward", "pi_old", "update"), 2, "unsaved",
     "SIGINT during step 2 (update): " + FINISHED.format(s=2) + "its update had begun, and step 1 has no "
     "checkpoint to go back to; checkpoint of step 2 written, exiting"),
    # one step off: the sampling ahead caught the signal while the loop's watch was in step 2's update
    (("sampling", "reward", "pi_old", "update"), 2, "unsaved ahead",
     "SIGINT while step 3's rows were sampled ahead, during step 2's update: " + FINISHED.format(s=2)
     + "its update had begun, and step 1 has no checkpoint to go back to; step 3's rows sampled ahead dropped (a "
     "resume samples them again); checkpoint of step 2 written, exiting"),
    (("sampling", "reward", "pi_old", "update"), 2, "ahead",  # step 1's checkpoint on disk: the update was done
     "SIGINT while step 3's rows were sampled ahead, during step 2's update: " + FINISHED.format(s=2)
     + "its update was done by the time the signal was acted on; step 3's rows sampled ahead dropped (a resume "
     "samples them again); checkpoint of step 2 written, exiting"),
    (("sampling", "reward", "pi_old", "update"), 2, "",  # after the update's wait, before its end was noted
     "SIGINT during step 2 (update): " + FINISHED.format(s=2) + "its update was done by the time the signal was "
     "acted on; checkpoint of step 2 written, exiting"),
    (("sampling", "reward", "pi_old", "update", None), 2, "unsaved",
     "SIGINT during step 2, after its update: step 2 finished; checkpoint of step 2 written, exiting"),
    (None, 1, "warm", "SIGINT before step 1 began: " + FINISHED.format(s=1) + WARM
     + "; checkpoint of step 1 written, exiting"),
])
def test_a_stop_that_finishes_its_step_says_where_the_signal_came_and_why_the_step_was_not_dropped(
        phases, step, flags, said):
    """Issue 67 item 7: the line of a stop that finishes its step ("SIGINT: checkpoint of step 1 written, exiting")
    said neither where the signal came nor that the step was finished rather than dropped. The handler notes
    the loop's ``StepWatch.position`` as the signal comes (phases: the watch's in ``step``, None in a phase list:
    the last one ended; no list: before step 1, as while compiling); why the step was finished is what the loop
    tells (flags: "warm" it keeps a warm-start, "unsaved" step - 1 has no checkpoint, "ahead" one step off's
    sampling ahead was stopped), not guessed from the position (it said "its update had begun, and step 1 has no
    checkpoint" with step 1's on disk, and "during step 2 (update)" of a signal in step 3's sampling ahead)."""
    import signal

    from pacs_jax.training.signals import finished_line as _finished_line
    from pacs_jax.training.signals import StopSignals

    watch = StepWatch(lambda line: None, 30.0)
    with StopSignals() as signals, signals.deferred():
        signals.where = watch.position
        if phases is not None:
            watch.start_step(step, stoppable=False)
            for phase in phases:
                if phase is None:
                    watch.done()
                else:
                    watch.start(phase)
        signal.raise_signal(signal.SIGINT)
    assert signals.requested == "SIGINT"
    assert _finished_line(signals.requested, signals.requested_where, step, keeps_warm_start="warm" in flags,
                          previous_unsaved="unsaved" in flags, ahead_dropped="ahead" in flags) == said


def test_a_signal_while_compiling_before_a_warm_started_first_step_is_noted_as_before_it(tmp_path, monkeypatch):
    """A signal in the precompilation before a warm-started first step (deferred: step 1 keeps the warm-start)
    came before the loop noted where it was (its watch was made after the compilation and on_start), so its
    line lost "before step 1 began" and why the step was finished. A stand-in compilation raises it; on_start
    then ends the call."""
    import signal

    from flax import nnx

    from pacs_jax import models
    from pacs_jax.sharding import make_mesh
    from pacs_jax.training.loop import rl_train
    from pacs_jax.training.signals import finished_line as _finished_line
    from pacs_jax.training.signals import StopSignals
    from pacs_jax.training.spec import RunSpec
    from pacs_jax.training.step_programs import StepPrograms
    from train_helpers import ListPromptSource, load_config

    class Started(Exception):
        pass

    def on_start():
        raise Started

    config = load_config("default.py")
    config.train.precompile = True
    cfg = models.QwenConfig(model_type="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            attention_bias=False, bos_token_id=None, eos_token_id=1, max_position_embeddings=64)
    with jax.set_mesh(make_mesh(1, devices=jax.devices()[:1])), StopSignals() as signals:
        model = models.init_random(cfg, seed=0)
        programs = StepPrograms(RunSpec.unplaced(config), *nnx.split(model), (1,))
        monkeypatch.setattr(programs, "compile", lambda: signal.raise_signal(signal.SIGINT) or [])
        with pytest.raises(Started):
            rl_train(RunSpec.unplaced(config), tmp_path / "run", model, ListPromptSource([]), decode=str,
                     stop_token_ids=(1,), reward_pool=None, programs=programs, keep_first_step=True,
                     on_start=on_start)
    assert signals.requested == "SIGINT" and signals.requested_where == (0, "", False)
    assert _finished_line(signals.requested, signals.requested_where, 1, keeps_warm_start=True,
                          previous_unsaved=False, ahead_dropped=False).startswith(
        "SIGINT before step 1 began: " + FINISHED.format(s=1) + WARM)
