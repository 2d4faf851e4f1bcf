"""Issue 41 item 2 in the reward and update phases: Ctrl-C ends the step while the reward scores (the
pool's poll) and while the update runs when the last finished step's checkpoint is on disk, the step
dropped (no half-updated state saved), status 79, and the resume runs it again with the same keys.

The trainer runs as a user runs it (``python -m pacs_jax.train``, the shrunk demo straight into RL) in
a wrapper that holds step 2 in the phase: the reward pool's poll (rewards/pool.py, called between two
looks at the workers) holds until the stop is requested and then lets the real one raise; the update's
wait holds the same way, as an update of minutes would. The Ctrl-C goes to the whole process group,
as a terminal sends it.
"""

import os
import signal
import subprocess
import sys

import pytest

from pacs_jax.errors import RESUME_NEEDED_STATUS
from train_helpers import (REPO, RL_ONLY_FLAGS, checkpoint_steps, compile_cache_dir, finish, logs, metrics_rows,
                           start_train, train_env, wait_for)

HELD = """
import runpy, sys, time
from pacs_jax.rewards import pool
from pacs_jax.training import progress, rollout
watch = None
score, wait, collect = pool.RewardPool.score, progress.StepWatch.wait, rollout.RolloutCollector.__call__
def held_score(self, *args, poll=None, **kwargs):
    def held_poll():
        if watch.step == 2 and {phase!r} == "reward":
            print("step 2's reward is held", flush=True)
            while not watch.stop_requested():
                time.sleep(0.05)
        poll()
    return score(self, *args, poll=held_poll if poll else None, **kwargs)
def held_wait(self, arrays, detail):
    global watch
    watch = self
    if self.step == 2 and self.phase == {phase!r} == "update":
        print("step 2's update is held", flush=True)
        while not self.stop_requested():
            time.sleep(0.05)
    return wait(self, arrays, detail)
def told_collect(self, *args):
    result = collect(self, *args)
    print("rollout checksum", result.metrics["sampled_tokens_checksum"], flush=True)
    return result
pool.RewardPool.score, progress.StepWatch.wait, rollout.RolloutCollector.__call__ = held_score, held_wait, told_collect
sys.argv[0] = "pacs_jax.train"
runpy.run_module("pacs_jax.train", run_name="__main__")
"""


def _held_run(workdir, phase: str, *flags: str) -> tuple[int, str]:
    """The trainer held in step 2's ``phase``, then Ctrl-C: (status, its output)."""
    workdir.parent.mkdir(parents=True, exist_ok=True)
    with open(workdir.parent / "held.out", "w") as out, open(workdir.parent / "held.err", "w") as err:
        process = subprocess.Popen([sys.executable, "-c", HELD.format(phase=phase), f"--workdir={workdir}", *flags,
                                    "--config.train.steps=50"], cwd=REPO, env=train_env(compile_cache_dir()),
                                   stdout=out, stderr=err, start_new_session=True)
    wait_for(lambda: f"step 2's {phase} is held" in logs(workdir, "held"), process, f"step 2's {phase}")
    os.killpg(process.pid, signal.SIGINT)
    return finish(process, timeout=120), logs(workdir, "held")


@pytest.mark.slow(seconds=60)
def test_ctrl_c_while_the_reward_scores_drops_the_step(tmp_path):
    """Step 2's scoring is stopped at the pool's next poll: step 2 dropped, step 1's checkpoint written
    (periodic ones are off), no traceback."""
    workdir = tmp_path / "run"
    status, output = _held_run(workdir, "reward", *RL_ONLY_FLAGS, "--config.train.checkpoint_every=0")
    assert status == RESUME_NEEDED_STATUS, output[-3000:]
    assert ("SIGINT during step 2 (reward): step 2 dropped, a resume runs it again with the same keys; checkpoint "
            "of step 1 written, exiting") in output and "Traceback" not in output
    assert [row["step"] for row in metrics_rows(workdir)] == [1] and checkpoint_steps(workdir) == [1]


@pytest.mark.slow(seconds=90)
def test_ctrl_c_in_the_update_after_a_checkpoint_drops_the_step_and_the_resume_redoes_it(tmp_path):
    """With step 1's checkpoint on disk (checkpoint_every=1) step 2's update is abandoned at Ctrl-C: no
    checkpoint of step 2 (its state would be half-updated), status 79; the resume runs step 2 from
    step 1's checkpoint and samples the very tokens the dropped step had (the same keys and batch)."""
    workdir = tmp_path / "run"
    flags = (*RL_ONLY_FLAGS, "--config.train.checkpoint_every=1")
    status, output = _held_run(workdir, "update", *flags)
    assert status == RESUME_NEEDED_STATUS, output[-3000:]
    assert ("SIGINT during step 2 (update): step 2 dropped, a resume runs it again with the same keys; the "
            "checkpoint of step 1 is the latest, exiting") in output and "Traceback" not in output
    assert [row["step"] for row in metrics_rows(workdir)] == [1] and checkpoint_steps(workdir) == [1]
    dropped_checksum = float(output.split("rollout checksum ")[2].split()[0])  # step 2's

    resume = start_train(workdir, *flags, "--config.train.steps=2", env=train_env(compile_cache_dir()),
                         log_name="resume")
    assert finish(resume) == 0, logs(workdir, "resume")[-3000:]
    assert "resumed from step 1 " in logs(workdir, "resume")
    rows = metrics_rows(workdir)
    assert [row["step"] for row in rows] == [1, 2] and checkpoint_steps(workdir) == [1, 2]
    assert rows[1]["sampled_tokens_checksum"] == dropped_checksum
