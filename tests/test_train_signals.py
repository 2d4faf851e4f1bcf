"""Preemption: SIGTERM in the middle of the RL phase makes the trainer stop at the step's next phase
boundary (dropping the step if its update had not begun, finishing it otherwise), write the checkpoint
of the last finished step (even with periodic checkpoints off) and exit 79 (resume needed) without
running the other steps. The run is the shrunk demo straight into RL (no warm-start, no evaluation):
the signal needs only RL steps. (tests/test_train_stop.py holds a step in its sampling for the
dropped step's lines and its resume.)

The signal goes to the trainer's whole process group, reward workers included, as a preempted
machine's init system or a cluster scheduler sends it."""

import json
import os
import signal
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from pacs_jax.errors import RESUME_NEEDED_STATUS
from train_helpers import (RL_ONLY_FLAGS, checkpoint_steps, compile_cache_dir, finish, logs, metrics_rows,
                           start_train, train_env, wait_for)

pytestmark = pytest.mark.slow

STEPS = 50  # far more than run before the signal


def test_sigterm_mid_step_writes_a_checkpoint_and_exits_79(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sigterm") / "run"
    process = start_train(workdir, *RL_ONLY_FLAGS, f"--config.train.steps={STEPS}",
                          "--config.train.checkpoint_every=0",  # only the SIGTERM checkpoint
                          env=train_env(compile_cache_dir()), log_name="run", new_session=True)
    wait_for(lambda: len(metrics_rows(workdir)) >= 1, process, "the first RL step")
    time.sleep(0.3)  # let step 2 begin (a step takes seconds here), so that the signal lands inside it
    os.killpg(process.pid, signal.SIGTERM)
    code = finish(process)
    output = logs(workdir, "run")
    assert code == RESUME_NEEDED_STATUS, output

    rows = metrics_rows(workdir)
    last = rows[-1]["step"]
    assert [row["step"] for row in rows] == list(range(1, last + 1))
    assert 1 <= last < STEPS  # the step under way was finished, the rest were not run
    assert checkpoint_steps(workdir) == [last]
    step_dir = workdir / "checkpoints" / str(last)
    assert (step_dir / "params").is_dir() and (step_dir / "opt_state").is_dir()
    meta = ocp.CheckpointManager(workdir / "checkpoints", item_names=("meta",)).restore(
        last, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    assert meta["step"] == last
    assert meta["data_state"] == {"next_index": last}  # the grain iterator after `last` batches
    params = ocp.StandardCheckpointer().restore(step_dir / "params")
    assert params and all(np.isfinite(np.asarray(v)).all() for v in params.values())

    assert f"checkpoint of step {last} written" in output and "SIGTERM" in output
    stdout = (workdir.parent / "run.out").read_text()  # the summary JSON printed last
    assert json.loads(stdout[stdout.index("{"):])["stopped_at_step"] == last
    assert not (workdir / "summary.json").exists()  # stopped: no final evaluation or export
