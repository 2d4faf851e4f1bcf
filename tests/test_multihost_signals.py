"""Ctrl-C on a local multi-process run (issue 28): launch/local.sh passes the SIGINT on to every process,
each trainer hands it to JAX's preemption service (training/signals.py), and every process stops at
the same safe point: during RL, the same phase boundary of the step under way, which they drop together,
writing the last finished step's checkpoint (a resume runs the dropped step); during the warm-start, the same warm-start step, where each exits as a single process
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
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from pacs_jax.errors import RESUME_NEEDED_STATUS
from pacs_jax.training.workdir_lock import LOCK_FILE
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
TRAIN_HELD = 'JAX_COMPILATION_CACHE_DIR="$CACHE/$JAX_PROCESS_ID" exec "$0" -c "$HELD" "$@"'  # HELD_SAMPLING below


def _start(workdir, cache, log, *flags: str, train: str = TRAIN) -> subprocess.Popen:
    """launch/local.sh with 2 processes of ``python -m pacs_jax.train`` (``train``: the command each runs), in
    a session of its own (as a terminal runs it); its output (prefixed lines) and local.sh's own lines go
    to ``log``."""
    env = {**train_env(), "CACHE": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "HELD": HELD_SAMPLING}
    with open(log, "w") as out:
        return subprocess.Popen([str(LOCAL), "--processes", "2", "--devices_per_process", "1", "--", "bash", "-c",
                                 train, sys.executable, f"--workdir={workdir}", *FLAGS, *flags], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_terminal_signals)


def _terminal_signals() -> None:
    """SIGINT and SIGTERM at their default action in the child, as a terminal starts local.sh: bash cannot
    trap a signal ignored when it started, and this test's process may have inherited them ignored (one
    full suite run lost local.sh's SIGINT that way: the run trained all its steps)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


# Responses of up to 384 tokens (the demo's random model rarely ends one early): a sampler call of 24 chunks
# of decode steps, seconds long, so that the preemption service's notice is shared among the processes
# while step 2 still samples
LONG_SAMPLING = ("--config.rollout.max_new_tokens=384", "--config.rollout.response_buckets=(384,)")
# Step 2's sampling held on every process until its own SIGINT handler ran (a stop asked with a sampler call
# under way, whatever the machine's speed); the hold then lets the wait go on to its stop point, each chunk of
# step 2's decode steps 0.5 s late, so that the preemption notice is shared among the processes before the
# sampler's last chunk even on a loaded machine (it once reached them only in pi_old or the reward)
HELD_SAMPLING = """
import runpy, sys, time
from pacs_jax.training import progress, signals
wait = progress.StepWatch.wait
def held_wait(self, arrays, detail):
    if self.step == 2 and self.phase == "sampling":
        if signals._active is None or signals._active.requested is None:
            print("step 2's sampling is held", flush=True)
        while signals._active is None or signals._active.requested is None:
            time.sleep(0.05)
        time.sleep(0.5)  # each chunk after the signal: the notice is shared before the sampler's last chunk on a loaded machine
    return wait(self, arrays, detail)
progress.StepWatch.wait = held_wait
sys.argv[0] = "pacs_jax.train"
runpy.run_module("pacs_jax.train", run_name="__main__")
"""


@pytest.mark.slow(seconds=60)
def test_ctrl_c_on_local_sh_drops_the_step_under_way_on_every_process_and_the_run_resumes_it(tmp_path):
    """Ctrl-C while step 2 samples: every process stops at the same phase boundary (the chunk of decode
    steps under way), drops step 2, writes step 1's checkpoint together and exits 79; the resume runs step 2."""
    workdir, cache = tmp_path / "run", tmp_path / "cache"
    first = _start(workdir, cache, tmp_path / "first.log", *NO_WARM_START, f"--config.train.steps={LONG}",
                   *LONG_SAMPLING, train=TRAIN_HELD)
    wait_for(lambda: (tmp_path / "first.log").read_text().count("step 2's sampling is held") == 2, first,
             "step 2's sampling on both processes")
    os.kill(first.pid, signal.SIGINT)  # Ctrl-C in local.sh's terminal (its processes have groups of their own)
    assert finish(first, timeout=300) == RESUME_NEEDED_STATUS, (tmp_path / "first.log").read_text()[-5000:]
    output = (tmp_path / "first.log").read_text()

    assert "local.sh: INT: passed on to the 2 processes" in output
    for i in (0, 1):  # each trainer got it and handed it to JAX's preemption service
        assert (f"[{i}] SIGINT: every process stops together at the next warm-start step or RL phase boundary"
                in output), output[-5000:]
    dropped = ("SIGINT during step 2 (sampling): step 2 dropped, a resume runs it again with the same keys; "
               "checkpoint of step 1 written, exiting")
    # process 0's line comes through its progress bar (after the bar's carriage returns, often not prefixed),
    # process 1's as a line of its own
    assert output.count(dropped) == 2 and f"[1] process 1: {dropped}" in output, output[-5000:]
    assert checkpoint_steps(workdir) == [1] and [row["step"] for row in metrics_rows(workdir)] == [1]
    # local.sh waited for the processes, their output still flowing: the summary printed last, no broken pipe
    assert '[0]   "dropped_step": 2' in output and "Broken pipe" not in output and "Traceback" not in output

    resume = _start(workdir, cache, tmp_path / "resume.log", *NO_WARM_START, "--config.train.steps=2", *LONG_SAMPLING)
    assert finish(resume, timeout=300) == 0, (tmp_path / "resume.log").read_text()[-5000:]
    output = (tmp_path / "resume.log").read_text()
    assert "[0] resumed from step 1 " in output
    assert checkpoint_steps(workdir)[-1] == 2
    assert [row["step"] for row in metrics_rows(workdir)] == [1, 2]


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
    assert code == RESUME_NEEDED_STATUS, output[-5000:]  # local.sh's status: its processes'

    for i in (0, 1):  # every process stops at the same warm-start step and exits as a single process does
        assert f"[{i}] SIGINT: every process stops together at the next warm-start step or RL phase boundary" in output
        assert (f"[{i}] SIGINT during the warm-start, which is not checkpointed: a restart runs it again from its "
                f"first step; exiting") in output, output[-5000:]
        assert f"local.sh: process {i} exited with status {RESUME_NEEDED_STATUS}" in output
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
