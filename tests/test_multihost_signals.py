"""Ctrl-C on a local multi-process run (issue 28): launch/local.sh passes the SIGINT on to every process,
each trainer hands it to JAX's preemption service (training/signals.py), and every process stops at
the same safe point: during RL, the same RL step, which they checkpoint together (a resume continues
from it); during the warm-start, the same warm-start step, where each exits as a single process
does (the warm-start is not checkpointed).

Two processes x 1 CPU device (launch/local.sh, gloo collectives, as tests/test_multihost.py starts
them) train the shrunk demo without evaluations, straight into RL or into a warm-start far longer
than the test. Each process has a
compilation cache folder of its own (one cache read by a process while another writes it is what
tests/test_multihost.py avoids): JAX writes entries from process 0 only, so the resume's process 0
compiles nothing; process 1 compiles again (it did not find its programs in a copy of process 0's).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from pacs_jax.errors import RESUME_NEEDED_STATUS
from pacs_jax.training.workdir import LOCK_FILE
from train_helpers import FAST_DEMO_FLAGS, checkpoint_steps, finish, metrics_rows, train_env, wait_for

LOCAL = REPO / "launch" / "local.sh"
LONG = 200  # train.steps of the first session, which the SIGINT stops long before
FLAGS = (*[f for f in FAST_DEMO_FLAGS if not f.startswith("--config.warmstart.steps=")], "--config.eval.sets=",
         "--config.train.checkpoint_every=0")
NO_WARM_START = ("--config.warmstart.steps=0", "--config.data.warmstart_problems=0")
WARM_STEPS = 100_000  # a warm-start (without probes) that the SIGINT stops long before
LONG_WARM_START = (f"--config.warmstart.steps={WARM_STEPS}", "--config.warmstart.target_accuracy=0.0")
# each process's own compilation cache (not the suite's): local.sh gives it JAX_PROCESS_ID
TRAIN = 'JAX_COMPILATION_CACHE_DIR="$CACHE/$JAX_PROCESS_ID" exec "$0" -m pacs_jax.train "$@"'


def _start(workdir, cache, log, *flags: str) -> subprocess.Popen:
    """launch/local.sh with 2 processes of ``python -m pacs_jax.train``, in a session of its own (as a terminal
    runs it); its output (prefixed lines) and local.sh's own lines go to ``log``."""
    env = {**train_env(), "CACHE": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    with open(log, "w") as out:
        return subprocess.Popen([str(LOCAL), "--processes", "2", "--devices_per_process", "1", "--", "bash", "-c",
                                 TRAIN, sys.executable, f"--workdir={workdir}", *FLAGS, *flags], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_terminal_signals)


def _terminal_signals() -> None:
    """SIGINT and SIGTERM at their default action in the child, as a terminal starts local.sh: bash cannot
    trap a signal ignored when it started, and this test's process may have inherited them ignored (one
    full suite run lost local.sh's SIGINT that way: the run trained all its steps)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.slow(seconds=60)
def test_ctrl_c_on_local_sh_stops_every_process_at_one_checkpointed_step_and_the_run_resumes_there(tmp_path):
    workdir, cache = tmp_path / "run", tmp_path / "cache"
    first = _start(workdir, cache, tmp_path / "first.log", *NO_WARM_START, f"--config.train.steps={LONG}")
    wait_for(lambda: len(metrics_rows(workdir)) >= 1, first, "the first RL step")
    os.kill(first.pid, signal.SIGINT)  # Ctrl-C in local.sh's terminal (its processes have groups of their own)
    assert finish(first, timeout=300) == RESUME_NEEDED_STATUS, (tmp_path / "first.log").read_text()[-5000:]
    output = (tmp_path / "first.log").read_text()

    assert "local.sh: INT: passed on to the 2 processes" in output
    for i in (0, 1):  # each trainer got it and handed it to JAX's preemption service
        assert f"[{i}] SIGINT: every process stops together at the next warm-start or RL step" in output, output[-5000:]
    stopped = r"preemption \(at the same step on every process\): checkpoint of step (\d+) written, exiting$"
    # process 0's line comes through its progress bar (after the bar's carriage returns, often not prefixed),
    # process 1's as a line of its own
    stops = [re.findall(rf"(?:^|\r)(?:\[0\] )?[ \t]*{stopped}", output, re.MULTILINE),
             re.findall(rf"^\[1\] process 1: {stopped}", output, re.MULTILINE)]
    assert [len(s) for s in stops] == [1, 1] and stops[0] == stops[1], output[-5000:]  # one step, the same
    step = int(stops[0][0])
    assert 1 <= step < LONG and checkpoint_steps(workdir) == [step]
    assert [row["step"] for row in metrics_rows(workdir)] == list(range(1, step + 1))
    # local.sh waited for the processes, their output still flowing: the summary printed last, no broken pipe
    assert f'[0]   "stopped_at_step": {step}' in output and "Broken pipe" not in output and "Traceback" not in output

    resume = _start(workdir, cache, tmp_path / "resume.log", *NO_WARM_START, f"--config.train.steps={step + 1}")
    assert finish(resume, timeout=300) == 0, (tmp_path / "resume.log").read_text()[-5000:]
    output = (tmp_path / "resume.log").read_text()
    assert f"[0] resumed from step {step} " in output
    assert checkpoint_steps(workdir)[-1] == step + 1
    assert [row["step"] for row in metrics_rows(workdir)] == list(range(1, step + 2))


@pytest.mark.slow(seconds=25)
def test_ctrl_c_during_the_warm_start_stops_every_process_there_with_the_phase_s_line_and_status(tmp_path):
    workdir, cache, log = tmp_path / "run", tmp_path / "cache", tmp_path / "warm.log"
    run = _start(workdir, cache, log, *LONG_WARM_START, "--config.train.steps=2")
    # the warm-start's step compiled (its progress bar, with no line end, is held back by local.sh's sed)
    wait_for(lambda: any((cache / "0").glob("jit_step-*")), run, "the warm-start's first step", timeout=180, poll=0.2)
    time.sleep(1)  # some steps later
    os.kill(run.pid, signal.SIGINT)  # Ctrl-C in local.sh's terminal
    code = _finish(run, timeout=60)  # the warm-start would have run for hours
    output = log.read_text()
    assert code == 128 + signal.SIGINT, output[-5000:]  # local.sh's status: its processes'

    for i in (0, 1):  # every process stops at the same warm-start step and exits as a single process does
        assert f"[{i}] SIGINT: every process stops together at the next warm-start or RL step" in output
        assert (f"[{i}] SIGINT during the warm-start, which is not checkpointed: a restart runs it again from its "
                f"first step; exiting") in output, output[-5000:]
        assert f"local.sh: process {i} exited with status {128 + signal.SIGINT}" in output
    assert "stopping the others" not in output and "Traceback" not in output
    assert checkpoint_steps(workdir) == [] and metrics_rows(workdir) == []  # RL never started
    assert not (workdir / LOCK_FILE).exists()  # released on the way out


def _finish(run: subprocess.Popen, timeout: float) -> int:
    """local.sh's exit status within ``timeout`` seconds; else Ctrl-C again (its processes abort) and fail."""
    try:
        return run.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(run.pid, signal.SIGINT)
        run.wait(timeout=60)
        raise AssertionError(f"local.sh did not exit within {timeout} s of the SIGINT") from None
