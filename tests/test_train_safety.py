"""A user's run is safe (issue 28, items 4 to 8): signals, the workdir lock, resumes that do not fit,
damaged checkpoints, a full disk, and the bookkeeping of a resumed run. Issue 53 item 3: a resume with
another model.path (of the same shapes) is refused naming both paths.

The trainer runs in subprocesses (the shrunk demo, tests/train_helpers.py); the lock, the metrics
rewrite and the storage-error line are also checked in-process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pacs_jax.errors import RESUME_NEEDED_STATUS
from pacs_jax.files import storage_error
from pacs_jax.training import metrics as metrics_lib
from pacs_jax.training.spec import ConfigError, RunSpec
from pacs_jax.training.workdir import CONFIG_FILE, check_resume, recorded_config
from pacs_jax.training.workdir_lock import LOCK_FILE, WorkdirLock, WorkdirLockedError
from train_helpers import (FAST_DEMO_FLAGS, REPO, RL_ONLY_FLAGS, ListPromptSource, checkpoint_steps, compile_cache_dir,
                           finish, logs, load_config, metrics_rows, start_train, train_env, wait_for)

LONG = 200  # train.steps of runs that are stopped long before


def _log_has(workdir, log_name: str, text: str):
    return lambda: text in logs(workdir, log_name)


# ---------------------------------------------------------------------------------------------- signals
# The trainer with its forced saves (the one a stop signal asks for, or the last step's) announced and held
# for a minute before they run: a signal sent after the announcement lands inside that save, however loaded
# the machine is.
SLOW_FORCED_SAVE = """
import runpy, sys, time
from pacs_jax import checkpoints
save = checkpoints.TrainCheckpointer.save
def slow_save(self, step, *args, force=False, **kwargs):
    if force:
        print(f"forced save of step {step} begins", flush=True)
        time.sleep(60)
    return save(self, step, *args, force=force, **kwargs)
checkpoints.TrainCheckpointer.save = slow_save
sys.argv[0] = "pacs_jax.train"
runpy.run_module("pacs_jax.train", run_name="__main__")
"""


@pytest.mark.slow(seconds=45)
def test_sigint_checkpoints_the_step_and_a_second_sigint_during_that_checkpoint_aborts(tmp_path_factory):
    """One workdir, two sessions: Ctrl-C once writes the checkpoint of the last finished step and exits 79; the
    resume (its programs from the first session's compilation cache), Ctrl-C'd again, then once more
    inside the checkpoint that asked for, aborts at once and writes nothing."""
    env = train_env(compile_cache_dir())
    workdir = tmp_path_factory.mktemp("sigint") / "run"
    flags = (*RL_ONLY_FLAGS, f"--config.train.steps={LONG}", "--config.train.checkpoint_every=0")

    process = start_train(workdir, *flags, env=env, log_name="once", new_session=True)
    wait_for(lambda: len(metrics_rows(workdir)) >= 1, process, "the first RL step")
    os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C: the whole foreground group, reward workers too
    assert finish(process) == RESUME_NEEDED_STATUS, logs(workdir, "once")
    output = logs(workdir, "once")
    last = metrics_rows(workdir)[-1]["step"]
    assert checkpoint_steps(workdir) == [last] and last < LONG
    assert "SIGINT: stopping at the step's next phase boundary" in output
    assert "exiting with status 79 (send SIGTERM or press Ctrl-C again to abort at once" in output
    assert f"checkpoint of step {last} written, exiting" in output
    assert not (workdir / LOCK_FILE).exists()  # released on the way out

    with open(workdir.parent / "twice.out", "w") as out, open(workdir.parent / "twice.err", "w") as err:
        process = subprocess.Popen([sys.executable, "-c", SLOW_FORCED_SAVE, f"--workdir={workdir}", *flags],
                                   cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
    wait_for(lambda: len(metrics_rows(workdir)) > last, process, "a step after the resume")
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the last finished step's checkpoint
    wait_for(_log_has(workdir, "twice", "forced save of step"), process, "the checkpoint after the first SIGINT")
    sent = time.monotonic()
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C again, inside that save: abort
    assert finish(process, timeout=30) == -signal.SIGINT
    assert time.monotonic() - sent < 10  # at once, not after the held save
    output = logs(workdir, "twice")
    assert f"resumed from step {last} " in output and "SIGINT: stopping at the step's next phase boundary" in output
    assert checkpoint_steps(workdir) == [last] and "checkpoint of step" not in output


@pytest.mark.slow(seconds=40)
def test_ctrl_c_during_the_warm_start_says_it_is_not_checkpointed_and_exits_79(tmp_path_factory):
    """Issue 53 item 7: a graceful stop exits 79 in the warm-start too (it exited 128 + SIGINT = 130 there,
    79 in RL)."""
    workdir = tmp_path_factory.mktemp("warm_signal") / "run"
    flags = (*[f for f in FAST_DEMO_FLAGS if not f.startswith("--config.warmstart.steps")],
             "--config.warmstart.steps=100000", "--config.warmstart.target_accuracy=0.0")
    process = start_train(workdir, *flags, env=train_env(compile_cache_dir()), log_name="run",
                          new_session=True)
    wait_for(_log_has(workdir, "run", "warm-start: "), process, "the warm-start", poll=0.2)  # its progress bar
    os.kill(process.pid, signal.SIGINT)  # Ctrl-C, to the trainer (its reward workers are still importing)
    assert finish(process) == RESUME_NEEDED_STATUS
    output = logs(workdir, "run")
    assert ("SIGINT during the warm-start, which is not checkpointed: a restart runs it again from its first "
            "step; exiting") in output
    assert "Traceback" not in output
    assert checkpoint_steps(workdir) == [] and not (workdir / LOCK_FILE).exists()


# ---------------------------------------------------------------------------------------------- one workdir, many sessions
@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """One workdir through: a run killed with SIGKILL with steps logged past its latest checkpoint K (and,
    while it runs, a second trainer on the same workdir); a resume to step end = K + 4; a rerun with
    train.steps end and one with end - 1; a resume with other model shapes and objective; two damaged
    checkpoints (end, end - 1) and a resume to end + 1. {name: (exit code, output)} plus what was on
    disk between."""
    env = train_env(compile_cache_dir())
    workdir = tmp_path_factory.mktemp("sessions") / "run"
    flags = (*RL_ONLY_FLAGS, "--config.train.keep_checkpoints=10")  # the sessions need RL steps only
    out = {"workdir": workdir}

    first = start_train(workdir, *flags, f"--config.train.steps={LONG}", "--config.train.checkpoint_every=3",
                        env=env, log_name="first", new_session=True)
    wait_for(_log_has(workdir, "first", "RL prompts: "), first, "the first run's start", poll=0.1)  # it holds the lock
    second = start_train(workdir, *flags, "--config.train.steps=5", env=env, log_name="second")
    out["second"] = (finish(second), logs(workdir, "second"))
    out["first_pid"] = first.pid

    def past_a_checkpoint() -> bool:  # a step logged after the latest checkpoint (2 more come before the next)
        steps = checkpoint_steps(workdir)
        return bool(steps) and len(metrics_rows(workdir)) > steps[-1]

    wait_for(past_a_checkpoint, first, "a step logged after a checkpoint")
    os.killpg(first.pid, signal.SIGKILL)
    finish(first)
    out["killed_rows"] = [row["step"] for row in metrics_rows(workdir)]
    out["killed_checkpoints"] = checkpoint_steps(workdir)

    def run(name: str, *extra: str):
        process = start_train(workdir, *flags, "--config.train.checkpoint_every=1", *extra, env=env, log_name=name)
        out[name] = (finish(process), logs(workdir, name))

    end = max(out["killed_checkpoints"]) + 4  # train.steps of the resume
    out["end"] = end
    run("resume", f"--config.train.steps={end}")
    out["summary"] = json.loads((workdir / "summary.json").read_text())
    out["rows_after_resume"] = metrics_rows(workdir)
    run("again", f"--config.train.steps={end}")
    run("below", f"--config.train.steps={end - 1}")
    config_before = (workdir / "config.json").read_bytes()
    sessions_before = (workdir / "sessions.json").read_bytes()
    run("changed", f"--config.train.steps={end + 2}", "--config.model.num_hidden_layers=2",
        "--config.algorithm.objective=ppo")
    out["config_unchanged"] = (workdir / "config.json").read_bytes() == config_before
    out["sessions_unchanged"] = (workdir / "sessions.json").read_bytes() == sessions_before

    # the last step: an array file cut short; the one before: its metadata (the meta item's JSON) corrupt
    arrays = [p for p in (workdir / "checkpoints" / str(end) / "params").rglob("*") if p.is_file() and "/d/" in str(p)]
    largest = max(arrays, key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 3)
    (workdir / "checkpoints" / str(end - 1) / "meta" / "metadata").write_text("{not json")
    run("damaged", f"--config.train.steps={end + 1}")
    return out


@pytest.mark.slow(seconds=45)  # the fixture's seven runs
def test_a_second_trainer_on_the_workdir_is_refused_naming_the_holder(sessions):
    code, output = sessions["second"]
    assert code == 78, output
    assert f"another trainer is using this workdir: pid {sessions['first_pid']} on host {socket.gethostname()}" \
           in output
    assert "Traceback" not in output


@pytest.mark.slow(seconds=5)  # the fixture's runs: counted on the first test above
def test_a_stale_lock_is_taken_over_and_the_resume_says_where_it_resumed(sessions):
    code, output = sessions["resume"]
    assert code == 0, output
    assert f"taking over the lock of a trainer that is gone (pid {sessions['first_pid']} on host " \
           f"{socket.gethostname()}: process {sessions['first_pid']} is not running)" in output
    resumed_from = max(sessions["killed_checkpoints"])
    assert f"resumed from step {resumed_from} " in output


@pytest.mark.slow(seconds=5)  # the fixture's runs: counted on the first test above
def test_metrics_have_no_duplicate_steps_and_wall_time_covers_every_session(sessions):
    killed_rows, resumed_from = sessions["killed_rows"], max(sessions["killed_checkpoints"])
    assert max(killed_rows) > resumed_from  # steps were logged past the checkpoint, then run again
    rows = sessions["rows_after_resume"]
    assert [row["step"] for row in rows] == list(range(1, sessions["end"] + 1))
    summary = sessions["summary"]
    times = json.loads((sessions["workdir"] / "sessions.json").read_text())["sessions"]
    assert summary["sessions"] == 2 and len(times) >= 2  # the killed session counted up to its last update
    assert summary["wall_seconds"] > summary["wall_seconds_this_session"] > 0
    assert summary["wall_seconds"] == pytest.approx(times[0]["seconds"] + summary["wall_seconds_this_session"],
                                                    rel=0.05)
    # the time split (and curves.png, from the same rows) covers every step, the killed session's too
    assert summary["rl_time_split_seconds"]["time_update"] == pytest.approx(sum(r["time_update"] for r in rows))


@pytest.mark.slow(seconds=5)  # the fixture's runs: counted on the first test above
def test_train_steps_at_or_below_the_checkpoint_says_there_is_nothing_to_train(sessions):
    end = sessions["end"]
    code, output = sessions["again"]
    assert code == 0, output
    assert "nothing to train: " in output and f"finished at step {end} = train.steps" in output
    assert "eval final" not in output  # no silent re-evaluation
    code, output = sessions["below"]
    assert code == 78, output
    assert f"config.train.steps: {end - 1} is below the step of the checkpoint" in output and f"({end})" in output


@pytest.mark.slow(seconds=5)  # the fixture's runs: counted on the first test above
def test_a_resume_with_other_model_shapes_or_objective_is_refused_before_writing(sessions):
    code, output = sessions["changed"]
    assert code == 78, output
    error = [line for line in output.splitlines() if "pacs_jax.train: error:" in line]
    assert len(error) == 1, output
    assert "model.num_hidden_layers (checkpoint 1, this config 2)" in error[0]
    assert "algorithm.objective (checkpoint 'pacs', this config 'ppo')" in error[0]
    assert "the critic (the checkpoint has no PPO critic" in error[0]
    assert "Traceback" not in output
    assert sessions["config_unchanged"] and sessions["sessions_unchanged"]


@pytest.mark.slow(seconds=5)  # the fixture's runs: counted on the first test above
def test_damaged_checkpoints_fall_back_to_the_newest_intact_step(sessions):
    code, output = sessions["damaged"]
    assert code == 0, output
    root, end = sessions["workdir"] / "checkpoints", sessions["end"]
    assert f"warning: checkpoint step {end} in {root} is damaged" in output
    assert f"warning: checkpoint step {end - 1} in {root} is damaged (JSONDecodeError" in output
    assert f"resumed from step {end - 2} " in output
    assert (root / f"{end}.damaged").is_dir() and (root / f"{end - 1}.damaged").is_dir()
    assert checkpoint_steps(sessions["workdir"])[-1] == end + 1
    assert [row["step"] for row in metrics_rows(sessions["workdir"])] == list(range(1, end + 2))


# ---------------------------------------------------------------------------------------------- a full disk
@pytest.mark.slow(seconds=30)
def test_a_full_disk_is_one_line_naming_the_file(tmp_path_factory):
    assert os.path.exists("/dev/full"), "the test needs Linux's /dev/full (every write: ENOSPC)"
    workdir = tmp_path_factory.mktemp("full") / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    process = start_train(workdir, *RL_ONLY_FLAGS, "--config.train.steps=2",  # the first write: step 1's row
                          env=train_env(compile_cache_dir()), log_name="run")
    assert finish(process) == 78
    output = logs(workdir, "run")
    assert f"pacs_jax.train: error: {workdir / 'metrics.jsonl'}: No space left on device (while writing" in output
    assert "Traceback" not in output


def test_orbax_storage_errors_are_recognised_and_their_logs_left_out():
    orbax_error = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "a/0" in OCDBT database at local file "/w/checkpoints/1.orbax-checkpoint-tmp/'
        'params/": Failed writing: "/w/checkpoints/1.orbax-checkpoint-tmp/params/d/ab12": Failed to write 84612 bytes '
        "to file 4: No space left on device [os_error_code='28']")
    assert storage_error(orbax_error) == "/w/checkpoints/1.orbax-checkpoint-tmp/params/d/ab12: No space left on device"
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = PermissionError(13, "Permission denied", "/w/summary.json")
    assert storage_error(wrapped) == "/w/summary.json: Permission denied"
    assert storage_error(ValueError("OUT_OF_RANGE: Requested byte range")) is None

    from pacs_jax.checkpoints import _QUIET
    record = logging.LogRecord("absl", logging.ERROR, __file__, 1, "save thread failed", (),
                               (ValueError, orbax_error, None))
    assert not _QUIET.filter(record)
    record.exc_info = (ValueError, ValueError("other"), None)
    assert _QUIET.filter(record)


# ---------------------------------------------------------------------------------------------- in-process
def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid}))
        with pytest.raises(WorkdirLockedError, match=f"pid {holder.pid} on host {socket.gethostname()}"):
            WorkdirLock(tmp_path).acquire()
        (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "another-host", "pid": os.getpid()}))
        with pytest.raises(WorkdirLockedError, match="on host another-host"):  # a fresh heartbeat: not stale
            WorkdirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid}))
    with WorkdirLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(WorkdirLockedError):
            WorkdirLock(tmp_path).acquire()  # a second lock, same process: refused too
    assert f"taking over the lock of a trainer that is gone (pid {holder.pid}" in capsys.readouterr().out
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_from_another_host_is_stale_once_its_heartbeat_stops(tmp_path, capsys):
    """The holder refreshes the lock file's mtime every `heartbeat` seconds; another host's lock whose last
    refresh is older than `stale_after` is taken over, naming its host, pid and age (issue 28 item 7)."""
    lock_file = tmp_path / LOCK_FILE
    lock_file.write_text(json.dumps({"host": "node-7", "pid": 4242, "since": "2026-01-01T00:00:00"}))
    os.utime(lock_file, (time.time() - 500, time.time() - 500))
    with pytest.raises(WorkdirLockedError, match=r"pid 4242 on host node-7 .*its last heartbeat was 50\d s ago, and "
                                                 r"its lock is taken over once that is over 600 s"):
        WorkdirLock(tmp_path).acquire()
    os.utime(lock_file, (time.time() - 700, time.time() - 700))
    with WorkdirLock(tmp_path, heartbeat=0.05) as lock:
        assert lock.held and json.loads(lock_file.read_text())["pid"] == os.getpid()
        os.utime(lock_file, (time.time() - 1000, time.time() - 1000))
        deadline = time.monotonic() + 10
        while time.time() - lock_file.stat().st_mtime > 60 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.time() - lock_file.stat().st_mtime < 60  # the holder's heartbeat refreshed it
    assert ("taking over the lock of a trainer that is gone (pid 4242 on host node-7: no heartbeat for 70"
            in capsys.readouterr().out)
    assert not lock_file.exists() and lock._beating is None  # released: the heartbeat thread ended


def test_metrics_rewrite_keeps_the_last_row_of_each_step_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 3.0}, {"step": 2, "loss": 2.5},
             {"step": 3, "loss": "nan"}, {"step": 4, "loss": 4.0}]
    path.write_text("".join(json.dumps(row) + "\n" for row in lines) + '{"step": 5, "lo')  # cut by a kill
    kept = metrics_lib.keep_rows_up_to(path, 3)
    assert [(r["step"], r["loss"]) for r in kept][:2] == [(1, 1.0), (2, 2.5)]
    assert kept[2]["step"] == 3 and kept[2]["loss"] != kept[2]["loss"]  # nan, read back as a float
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": "nan"}]


def test_a_resume_with_another_model_path_is_refused_naming_both_paths(tmp_path, monkeypatch):
    """A workdir whose config.json records model.path A and holds a checkpoint (check_resume looks for
    its step folder only): resuming it with model.path B is refused in one line naming A and B (the
    resume would train the checkpoint's weights, not B's); the same folder, given as a relative path,
    resumes."""
    model_a, model_b = tmp_path / "model_a", tmp_path / "model_b"
    config = load_config("default.py")
    config.model.path = str(model_a)
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "3").mkdir(parents=True)
    (workdir / CONFIG_FILE).write_text(json.dumps(recorded_config(config, None)))

    config.model.path = str(model_b)
    with pytest.raises(ConfigError) as refused:
        check_resume(RunSpec.unplaced(config), workdir, None)
    line = str(refused.value)
    assert "\n" not in line and f"model.path (checkpoint run {str(model_a)!r}, this config {str(model_b)!r}" in line
    assert not (workdir / LOCK_FILE).exists()

    monkeypatch.chdir(tmp_path)
    config.model.path = "model_a"
    assert check_resume(RunSpec.unplaced(config), workdir, None) == 3


def _save_meta(workdir, step: int, data_state: dict) -> None:
    """A checkpoint of ``step`` in ``workdir/checkpoints`` holding only its meta item (as TrainCheckpointer
    writes it: step, seed, data_state), enough for check_resume; its restore fails (no params)."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(workdir / "checkpoints", item_names=("meta",))
    manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave({"step": step, "seed": 0,
                                                                        "data_state": data_state})))
    manager.wait_until_finished()
    manager.close()


def test_a_resume_that_switches_carry_over_or_clipping_is_refused_naming_the_checkpoint_s(tmp_path):
    """Issue 67 item 1: carry-over's data state (its source's, the queue, the rows in flight) and a plain
    source's cursor do not restore into each other (the resume died with KeyError 'next_index' after
    rewriting config.json): switching rollout.carry_over is refused in one line, read from the checkpoint
    itself (config.json may be one that resume rewrote); one step off's state is a plain cursor and resumes
    either way. Gradient clipping switched on or off changes the optimizer state's structure: refused too."""
    from types import SimpleNamespace

    from pacs_jax.training.engine.carry_over import CarryOverRollouts

    config = load_config("default.py")
    plain = ListPromptSource([])
    engine = SimpleNamespace(export=lambda: None, settings=SimpleNamespace(record_routing=False))  # nothing in flight
    carried = CarryOverRollouts(ListPromptSource([]), engine, prompts_per_step=8)
    for saved, data_state in ((True, carried.get_state()), (False, plain.get_state())):
        workdir = tmp_path / f"carry_over_{saved}"
        _save_meta(workdir, 3, data_state)
        (workdir / CONFIG_FILE).write_text(json.dumps(recorded_config(config, None)))  # carry_over False either way
        config.rollout.carry_over = not saved
        with pytest.raises(ConfigError) as refused:
            check_resume(RunSpec.unplaced(config), workdir, None)
        line = str(refused.value)
        assert "\n" not in line and "differs from their run in 1 field(s): " in line
        assert f"rollout.carry_over (checkpoint {saved}, this config {not saved}: the checkpoint's data state " in line
        config.rollout.carry_over = saved
        assert check_resume(RunSpec.unplaced(config), workdir, None) == 3
        config.rollout.carry_over = False

    config.train.off_policy_steps = 1  # the plain checkpoint's cursor is one step off's too
    assert check_resume(RunSpec.unplaced(config), workdir, None) == 3
    config.train.off_policy_steps = 0

    config.optim.grad_clip = 0.0  # config.json's is the demo's 1.0
    with pytest.raises(ConfigError, match=r"1 field\(s\): optim\.grad_clip \(checkpoint 1\.0, this config 0\.0: "
                                          r"clipping on one side only"):
        check_resume(RunSpec.unplaced(config), workdir, None)
    config.optim.grad_clip = 0.5  # another threshold: the same state
    assert check_resume(RunSpec.unplaced(config), workdir, None) == 3


def test_a_resume_is_checked_on_process_0_alone_and_every_process_raises_its_line(tmp_path, monkeypatch):
    """check_resume reads the workdir on process 0 only, and every process takes its step and refusal: a
    host whose read of the checkpoint's meta item fails (it skipped that check and resumed, while process 0
    refused and exited 78, leaving it waiting in the next collective) raises process 0's line. Two
    processes stood in for: process 0's broadcasts recorded, then replayed to process 1 (same shapes)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from pacs_jax.training import workdir as workdir_lib

    config = load_config("default.py")
    workdir = tmp_path / "run"
    _save_meta(workdir, 3, ListPromptSource([]).get_state())
    config.rollout.carry_over = True  # the checkpoint's data state is a plain cursor: refused
    sent = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: sent.append(np.asarray(x)) or x)
    with pytest.raises(ConfigError, match=r"rollout\.carry_over \(checkpoint False, this config True") as on_0:
        check_resume(RunSpec.unplaced(config), workdir, None)

    def unreadable(*args):
        raise OSError("transient")

    def replayed(x):
        sending = sent.pop(0)
        assert np.shape(x) == sending.shape and np.asarray(x).dtype == sending.dtype
        return sending

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(workdir_lib, "read_meta", unreadable)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", replayed)
    with pytest.raises(ConfigError) as on_1:
        check_resume(RunSpec.unplaced(config), workdir, None)
    assert str(on_1.value) == str(on_0.value) and not sent


def test_a_resume_whose_checkpoint_does_not_restore_leaves_config_json_and_sessions_json_as_they_were(tmp_path):
    """Issue 67 item 1: a resume writes config.json and its session in sessions.json only once its checkpoint
    has restored (it wrote them first, so a resume that failed left a record of a run that never trained): one
    whose only checkpoint passes check_resume but does not restore (its arrays missing) stops with
    CheckpointError and the two files as they were, and so is the last session's skipped_rows.txt (the resume,
    whose data skips no row, removed it before its checkpoint restored)."""
    import jax

    from pacs_jax.checkpoints import CheckpointError
    from pacs_jax.sharding import make_mesh
    from pacs_jax.training.run import SKIPPED_ROWS_FILE, run_training
    from pacs_jax.training.workdir import SESSIONS_FILE

    config = load_config("default.py")
    config.warmstart.steps, config.eval.before_rl, config.eval.sets = 0, False, ""
    config.model.num_hidden_layers, config.train.steps, config.train.prompts_per_step = 1, 4, 8
    config.data.arithmetic.problems, config.data.warmstart_problems, config.data.held_out_problems = 40, 0, 0
    workdir = tmp_path / "run"
    _save_meta(workdir, 2, {"next_index": 2})
    recorded = json.dumps(recorded_config(config, None))
    (workdir / CONFIG_FILE).write_text(recorded)
    sessions = json.dumps({"sessions": [{"started": "2026-01-01T00:00:00", "seconds": 60.0}]})
    (workdir / SESSIONS_FILE).write_text(sessions)
    skipped = "train.jsonl:5: missing field 'answer'\n"
    (workdir / SKIPPED_ROWS_FILE).write_text(skipped)
    config.rollout.n = 4  # what a resume may change: config.json would record it
    with pytest.raises(CheckpointError, match="no checkpoint restores: step 2: "):
        with jax.set_mesh(make_mesh(8, 1, 1)):
            run_training(config, workdir)
    assert (workdir / CONFIG_FILE).read_text() == recorded
    assert (workdir / SESSIONS_FILE).read_text() == sessions
    assert (workdir / SKIPPED_ROWS_FILE).read_text() == skipped
