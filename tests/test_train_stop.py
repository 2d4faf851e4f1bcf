"""Issue 41 items 1 and 2: a step says what it is doing, and Ctrl-C ends it at its next phase boundary.

The trainer runs as a user runs it (``python -m pacs_jax.train``, the shrunk demo straight into RL, or
after its warm-start), in a wrapper that makes one step's sampler wait a long one: the sampling wait
(training/progress.py ``StepWatch.wait``) of that step announces itself and holds until a stop signal
is requested, as a sampler call of minutes would, then runs as usual. The Ctrl-C goes to the whole process group, as a
terminal sends it. launch/supervise.sh's reading of the resume status is checked with a stand-in
command.
"""

import json
import os
import shlex
import signal
import subprocess
import sys

import orbax.checkpoint as ocp
import pytest

from pacs_jax.errors import PERMANENT_ERROR_STATUS, RESUME_NEEDED_STATUS
from train_helpers import (FAST_DEMO_FLAGS, REPO, RL_ONLY_FLAGS, checkpoint_steps, compile_cache_dir, finish, logs, metrics_rows,
                           start_train, train_env, wait_for)

HELD_SAMPLING = """
import runpy, sys, time
from pacs_jax.training import progress
wait = progress.StepWatch.wait
def held_wait(self, arrays, detail):
    if self.step == {step} and self.phase == "sampling":
        print("step {step}'s sampling is held", flush=True)
        while not self.stop_requested():
            time.sleep(0.05)
    return wait(self, arrays, detail)
progress.StepWatch.wait = held_wait
sys.argv[0] = "pacs_jax.train"
runpy.run_module("pacs_jax.train", run_name="__main__")
"""


@pytest.mark.slow(seconds=90)
def test_ctrl_c_in_sampling_drops_the_step_exits_79_and_the_resume_runs_it(tmp_path_factory):
    """The held step 2 is dropped at Ctrl-C: status 79, step 1's checkpoint written (periodic ones are
    off) with the data position before step 2's batch; a resume with another prompts_per_step is
    refused (one line, 78, nothing written); the resume runs step 2 and says it compiles before step 2."""
    env = train_env(compile_cache_dir())
    workdir = tmp_path_factory.mktemp("stop") / "run"
    flags = (*RL_ONLY_FLAGS, "--config.train.checkpoint_every=0", "--config.rollout.micro_batches=2",
             "--config.train.progress_seconds=0")  # a line at every phase's end
    with open(workdir.parent / "held.out", "w") as out, open(workdir.parent / "held.err", "w") as err:
        process = subprocess.Popen([sys.executable, "-c", HELD_SAMPLING.format(step=2), f"--workdir={workdir}",
                                    *flags, "--config.train.steps=50"], cwd=REPO, env=env, stdout=out, stderr=err,
                                   start_new_session=True)
    wait_for(lambda: "step 2's sampling is held" in logs(workdir, "held"), process, "step 2's sampling")
    os.killpg(process.pid, signal.SIGINT)
    assert finish(process, timeout=120) == RESUME_NEEDED_STATUS, logs(workdir, "held")[-3000:]
    output = logs(workdir, "held")
    # progress inside step 1, one line a phase (progress_seconds=0)
    for phase in ("sampling", "reward", "pi_old", "update"):
        assert output.count(f"step 1: {phase} done in ") == 1, output[-3000:]
    assert "step 1: sampling done in " in output and " s (64 rows, " in output  # 8 prompts x 8 responses
    assert "SIGINT: stopping at the step's next phase boundary" in output
    assert ("SIGINT during step 2 (sampling): step 2 dropped, a resume runs it again with the same keys; "
            "checkpoint of step 1 written, exiting") in output
    assert "Traceback" not in output
    # step 1 finished and checkpointed (periodic checkpoints are off); step 2 left no row
    assert [row["step"] for row in metrics_rows(workdir)] == [1]
    assert checkpoint_steps(workdir) == [1]
    meta = ocp.CheckpointManager(workdir / "checkpoints", item_names=("meta",)).restore(
        1, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    assert meta["step"] == 1 and meta["data_state"] == {"next_index": 1}  # before step 2's batch
    stdout = (workdir.parent / "held.out").read_text()
    assert json.loads(stdout[stdout.index("{"):]) == {"stopped_at_step": 1, "dropped_step": 2}

    config_json = (workdir / "config.json").read_text()
    refused = start_train(workdir, *flags, "--config.train.steps=2", "--config.train.prompts_per_step=16", env=env,
                          log_name="refused")  # the saved data position counts batches of 8
    assert finish(refused) == PERMANENT_ERROR_STATUS
    errors = [line for line in logs(workdir, "refused").splitlines() if line.startswith("pacs_jax.train: error: ")]
    assert len(errors) == 1 and "train.prompts_per_step (checkpoint 8, this config 16: the data position counts " \
                                "batches of the checkpoint's)" in errors[0], logs(workdir, "refused")[-3000:]
    assert (workdir / "config.json").read_text() == config_json and checkpoint_steps(workdir) == [1]

    resume = start_train(workdir, *flags, "--config.train.steps=2", env=env, log_name="resume")
    assert finish(resume) == 0, logs(workdir, "resume")[-3000:]
    output = logs(workdir, "resume")
    assert "resumed from step 1 " in output and "training steps 2 to 2" in output
    assert "before step 2 (train.precompile" in output and "before step 1 " not in output
    assert [row["step"] for row in metrics_rows(workdir)] == [1, 2]


@pytest.mark.slow(seconds=40)
def test_ctrl_c_in_the_first_step_after_a_warm_start_finishes_it_to_keep_the_warm_start(tmp_path_factory):
    """The warm-start has no checkpoint of its own: a Ctrl-C in step 1's sampling finishes step 1 and writes
    its checkpoint (then exits 79), rather than dropping it and losing the warm-start."""
    workdir = tmp_path_factory.mktemp("warm_stop") / "run"
    flags = (*FAST_DEMO_FLAGS, "--config.train.checkpoint_every=0", "--config.train.steps=50")
    with open(workdir.parent / "held.out", "w") as out, open(workdir.parent / "held.err", "w") as err:
        process = subprocess.Popen([sys.executable, "-c", HELD_SAMPLING.format(step=1), f"--workdir={workdir}",
                                    *flags], cwd=REPO, env=train_env(compile_cache_dir()),
                                   stdout=out, stderr=err, start_new_session=True)
    wait_for(lambda: "step 1's sampling is held" in logs(workdir, "held"), process, "step 1's sampling")
    os.killpg(process.pid, signal.SIGINT)
    assert finish(process, timeout=120) == RESUME_NEEDED_STATUS, logs(workdir, "held")[-3000:]
    output = logs(workdir, "held")
    assert "warm-start: 5 steps" in output and (  # issue 67 item 7: where the signal came, why step 1 was finished
        "SIGINT during step 1 (sampling): step 1 finished rather than dropped: it keeps this session's warm-start, "
        "which has no checkpoint of its own; checkpoint of step 1 written, exiting") in output, output[-3000:]
    assert "step 1 dropped" not in output
    assert [row["step"] for row in metrics_rows(workdir)] == [1] and checkpoint_steps(workdir) == [1]


def _supervise(tmp_path, command: str, *, signal_supervisor: bool) -> tuple[subprocess.CompletedProcess, int]:
    """supervise.sh (--max_restarts 1, no delay) running ``command`` (bash) that counts its attempts;
    signal_supervisor: send supervise.sh a SIGTERM once the first attempt has made tmp_path/ready (after
    its trap is set)."""
    counter = tmp_path / "attempts"
    counter.write_text("")
    script = f"echo x >> {shlex.quote(str(counter))}; {command}"
    process = subprocess.Popen(["bash", str(REPO / "launch" / "supervise.sh"), "--max_restarts", "1", "--delay", "0",
                                "--", "bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    if signal_supervisor:
        wait_for(lambda: (tmp_path / "ready").exists(), process, "the first attempt's trap")
        process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), len(counter.read_text().split())


def test_supervise_resumes_after_the_trainer_s_own_signal_and_stops_after_its_own(tmp_path):
    assert f"resume_status={RESUME_NEEDED_STATUS}" in (REPO / "launch" / "supervise.sh").read_text()
    # the trainer alone was stopped (a preemption notice to it): supervise.sh resumes it
    run, attempts = _supervise(tmp_path, f"exit {RESUME_NEEDED_STATUS}", signal_supervisor=False)
    assert attempts == 2 and run.returncode == RESUME_NEEDED_STATUS
    assert f"stopped by a signal of its own (status {RESUME_NEEDED_STATUS}); resuming in 0 s" in run.stderr
    # supervise.sh got the stop (Ctrl-C, tpu_pod.sh stop): it passes it on and stops with the trainer's 79
    run, attempts = _supervise(tmp_path, f"sleep 60 & trap 'kill $!; exit {RESUME_NEEDED_STATUS}' TERM; "
                                         f"touch {shlex.quote(str(tmp_path / 'ready'))}; wait", signal_supervisor=True)
    assert attempts == 1 and run.returncode == RESUME_NEEDED_STATUS, run.stdout + run.stderr
    assert (f"stopped with status {RESUME_NEEDED_STATUS}: the last finished step is checkpointed; run the same "
            "command again to resume") in run.stdout


HELD_COMPILE = """
import runpy, sys, time
from pacs_jax.training import step_programs
compile = step_programs.StepPrograms.compile
def held_compile(self, *args, **kwargs):
    print("the compilation is held", flush=True)
    time.sleep(60)
    return compile(self, *args, **kwargs)
step_programs.StepPrograms.compile = held_compile
sys.argv[0] = "pacs_jax.train"
runpy.run_module("pacs_jax.train", run_name="__main__")
"""


def test_ctrl_c_while_compiling_before_step_1_exits_at_once(tmp_path):
    """The precompilation (minutes on a large model) is an immediate phase: no step of the session has
    started, so Ctrl-C exits there (status 79, as everywhere) with the phase's line, nothing checkpointed."""
    workdir = tmp_path / "run"
    with open(tmp_path / "held.out", "w") as out, open(tmp_path / "held.err", "w") as err:
        process = subprocess.Popen([sys.executable, "-c", HELD_COMPILE, f"--workdir={workdir}", *RL_ONLY_FLAGS],
                                   cwd=REPO, env=train_env(), stdout=out, stderr=err, start_new_session=True)
    wait_for(lambda: "the compilation is held" in logs(workdir, "held"), process, "the compilation")
    os.killpg(process.pid, signal.SIGINT)
    assert finish(process, timeout=30) == RESUME_NEEDED_STATUS  # not after the held minute
    output = logs(workdir, "held")
    assert ("SIGINT during the compilation before step 1, which a restart runs again (no step of this session had "
            "started); exiting") in output and "Traceback" not in output
    assert checkpoint_steps(workdir) == []
