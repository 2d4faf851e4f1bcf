"""Mistakes are caught before they cost slice time (issue 28, item 9).

The trainer reports errors a restart cannot fix (config, flags, data) with exit status 78 and one
line, and launch/supervise.sh stops on it instead of retrying 20 times; launch/tpu_pod.sh checks its
arguments before it creates anything and remembers how a slice was created (a queued resource stays
one when `run --keep-alive` re-creates it, and `delete` deletes it as one). The tpu_pod.sh tests read
--dry-run output; one runs `create` for real against a stand-in gcloud that only logs its arguments.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO
from pacs_jax.errors import PERMANENT_ERROR_STATUS, UNREACHABLE_STORE_STATUS

SUPERVISE = REPO / "launch" / "supervise.sh"
TPU_POD = REPO / "launch" / "tpu_pod.sh"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


# ----------------------------------------------------------------------------------- supervise.sh
def _supervise(tmp_path, exit_status: int, *options: str) -> tuple[subprocess.CompletedProcess, int]:
    counter = tmp_path / f"attempts_{exit_status}"
    command = f"echo x >> {shlex.quote(str(counter))}; echo 'the error' >&2; exit {exit_status}"
    run = subprocess.run(["bash", str(SUPERVISE), *options, "--", "bash", "-c", command], capture_output=True,
                         text=True, timeout=60)
    return run, len(counter.read_text().splitlines())


def test_supervise_stops_at_once_on_a_permanent_error_and_retries_the_others(tmp_path):
    assert PERMANENT_ERROR_STATUS == 78
    assert f"permanent_status={PERMANENT_ERROR_STATUS}" in SUPERVISE.read_text()
    started = time.monotonic()
    permanent, attempts = _supervise(tmp_path, 78, "--max_restarts", "3", "--delay", "30")
    assert time.monotonic() - started < 20  # no 30 s wait before giving up
    assert permanent.returncode == 78 and attempts == 1
    assert "status 78: a permanent error" in permanent.stderr and "not restarting" in permanent.stderr
    transient, attempts = _supervise(tmp_path, 3, "--max_restarts", "2", "--delay", "0")
    assert transient.returncode == 3 and attempts == 3  # the first attempt and 2 restarts
    assert "giving up after 2 restarts (last status 3)" in transient.stderr


# ----------------------------------------------------------------------------------- the trainer's status
def _train(tmp_path, *flags: str, supervised: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pacs_jax.train", f"--workdir={tmp_path / 'workdir'}", *flags]
    if supervised:
        command = ["bash", str(SUPERVISE), "--delay", "0", "--max_restarts", "2", "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=_env())


def _one_error_line(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == PERMANENT_ERROR_STATUS, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "--workdir: Output directory" not in run.stderr  # no flag listing
    errors = [line for line in run.stderr.splitlines() if line.startswith("pacs_jax.train: error: ")]
    assert len(errors) == 1, run.stderr
    return errors[0]


def test_a_config_error_exits_78_with_one_line_and_is_not_retried(tmp_path):
    run = _train(tmp_path, "--config.train.steps=0", supervised=True)
    assert _one_error_line(run) == "pacs_jax.train: error: config.train.steps: must be an integer >= 1, got 0"
    assert run.stdout.count("attempt ") == 1 and "not restarting" in run.stderr


def test_a_bad_flag_exits_78(tmp_path):
    line = _one_error_line(_train(tmp_path, "--no_such_flag=1"))
    assert "no_such_flag" in line
    line = _one_error_line(_train(tmp_path, "unexpected"))
    assert line == "pacs_jax.train: error: unexpected arguments: ['unexpected']"


def test_malformed_training_data_exits_78(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "1 + 1", "a": "2"}\n')
    run = _train(tmp_path, "--config.data.source=files", f"--config.data.train_files=('{bad}',)",
                 f"--config.data.tokenizer={REPO / 'data' / 'tokenizers' / 'qwen3'}", "--config.warmstart.steps=0",
                 "--config.data.warmstart_problems=0")
    assert _one_error_line(run).startswith(f"pacs_jax.train: error: config.data.train_files: {bad}:1: cannot tell the "
                                           "dataset format")


def test_evaluate_reports_a_usage_error_with_78(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pacs_jax.evaluate", f"--config={REPO / 'configs' / 'eval.py'}",
                          f"--checkpoint={tmp_path}", "--config.eval.sets=amc23",
                          f"--config.eval.data_dir={REPO / 'data'}"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=_env())
    assert run.returncode == PERMANENT_ERROR_STATUS and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (f"pacs_jax.evaluate: error: --checkpoint: {tmp_path}: not a model: "
                                                    "no config.json (an HF model folder), no params/ (a pacs_jax "
                                                    "checkpoint) and no <step>/params/ (a trainer's checkpoints/)")


def test_run_cli_reports_permanent_errors_and_leaves_crashes_alone(tmp_path):
    """Issue 35 item 6: a store that does not answer (a gs:// path with no network: gcsfs's connection
    error, after its retries) is one line saying how long it tried, status 75, which supervise.sh
    restarts; a connection error elsewhere (a worker's pipe) stays a crash."""
    script = ("import sys; from pacs_jax.errors import run_cli; from pacs_jax.data import DataError\n"
              "exec(compile('def read():\\n    raise ConnectionRefusedError(111, \"Connect call failed\")\\n',\n"
              "             '/venv/lib/python3.11/site-packages/gcsfs/core.py', 'exec'))  # as if gcsfs raised it\n"
              "def main(argv):\n"
              "    if sys.argv[-1] == 'data': raise DataError('rows.jsonl:3: field problem is empty')\n"
              "    if sys.argv[-1] == 'store': read()\n"
              "    if sys.argv[-1] == 'pipe': raise BrokenPipeError('a worker')\n"
              "    raise RuntimeError('a crash')\n"
              "run_cli('prog', main, sys.argv[:1])\n")
    data = subprocess.run([sys.executable, "-c", script, "data"], capture_output=True, text=True, timeout=60)
    assert data.returncode == 78 and data.stderr == "prog: error: rows.jsonl:3: field problem is empty\n"
    store = subprocess.run([sys.executable, "-c", script, "store"], capture_output=True, text=True, timeout=60)
    assert store.returncode == UNREACHABLE_STORE_STATUS and store.stderr == (
        "prog: error: a store (gs://) did not answer; gave up after 0 s (ConnectionRefusedError: [Errno 111] Connect "
        "call failed): check the network and the credentials (gcloud auth application-default login)\n")
    for case, error in (("crash", "RuntimeError: a crash"), ("pipe", "BrokenPipeError: a worker")):
        crash = subprocess.run([sys.executable, "-c", script, case], capture_output=True, text=True, timeout=60)
        assert crash.returncode == 1 and "Traceback" in crash.stderr and error in crash.stderr


# ----------------------------------------------------------------------------------- tpu_pod.sh
MODEL_ON_WORKERS = ("--", "--config.model.path=/home/me/Qwen2.5-7B")  # not on this machine: left to the trainer


def _pod_env(env: dict | None = None, **more: str) -> dict:
    """The environment of a tpu_pod.sh run: its config check runs with this Python (PACS_PYTHON)."""
    return {**(env or os.environ), "PACS_PYTHON": sys.executable, **more}


def _tpu_pod(state_dir, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(TPU_POD), *args], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=_pod_env(env, PACS_TPU_POD_STATE_DIR=str(state_dir)))


def _gcloud_lines(run: subprocess.CompletedProcess) -> list[list[str]]:
    return [shlex.split(line) for line in run.stdout.splitlines() if line.startswith("gcloud ")]


@pytest.mark.parametrize("args, message", [
    (["run", "--name", "n", "--zone", "z"], "--config is required for run"),
    (["run", "--name", "n", "--zone", "z", "--config", "configs/paper.py:qwen25_7b,pacs_beta1",
      "--repo", "https://example.org/p.git", "--mode", "sometimes"], "--mode must be on-demand, spot or queued"),
    (["setup", "--name", "n", "--zone", "z", "--repo", "https://example.org/p.git", "--accelerator", "v9-8"],
     "--accelerator 'v9-8'"),
])
def test_tpu_pod_checks_every_argument_before_creating_anything(tmp_path, args, message):
    run = _tpu_pod(tmp_path, args[0], "--dry-run", *args[1:])
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert _gcloud_lines(run) == []  # not even the describe of the slice
    assert not any(tmp_path.iterdir())  # nothing recorded


def test_tpu_pod_run_needs_a_repo_before_creating_the_slice(tmp_path):
    bare = tmp_path / "checkout"  # a copy of the launch scripts in a checkout without an 'origin' remote
    shutil.copytree(REPO / "launch", bare / "launch")
    subprocess.run(["git", "init", "-q", str(bare)], check=True, timeout=60)
    run = subprocess.run(["bash", str(bare / "launch" / "tpu_pod.sh"), "run", "--dry-run", "--name", "n", "--zone", "z",
                          "--config", "configs/paper.py:qwen25_7b,pacs_beta1"], capture_output=True, text=True,
                         timeout=60, cwd=bare, env={**os.environ, "PACS_TPU_POD_STATE_DIR": str(tmp_path / "state")})
    assert run.returncode == 2 and "--repo is required" in run.stderr and _gcloud_lines(run) == []


def test_tpu_pod_usage_example_passes_local_model_paths():
    header = TPU_POD.read_text().split("\nset -euo")[0]
    example = header[header.index("# Example"):]
    assert "--config.model.path=/" in example and "--config.data.tokenizer=/" in example
    assert "refuses" not in header  # gs:// model paths are read (issue 35 item 4: the help said otherwise)


def test_tpu_pod_run_checks_the_config_on_this_machine_before_asking_gcloud(tmp_path):
    """Issue 35 item 4: `run` checked only that --config was given, then created and set up a slice for a
    misspelled setup name or override. Now the trainer's check runs here first: one line, status 78, no
    gcloud command, nothing recorded; a path that is only on the workers is left to the trainer."""
    base = ["run", "--dry-run", "--name", "n", "--zone", "z", "--repo", "https://example.org/p.git"]
    for config, flags, line in (
            ("configs/paper.py:qwen25_7b,pacs_bet1", MODEL_ON_WORKERS,
             "pacs_jax.check_config: error: flag --config=configs/paper.py:qwen25_7b,pacs_bet1: config arg algorithm "
             "'pacs_bet1': expected one of ['cispo', 'grpo', 'gspo', "),
            ("configs/paper.py:qwen25_7b,pacs_beta1", (*MODEL_ON_WORKERS, "--config.rollout.slotz=0"),
             "pacs_jax.check_config: error: --config.rollout.slotz: config.rollout has no field 'slotz'; did you mean "
             "--config.rollout.slots?"),
    ):  # a value that cannot work (rollout.slots=0) is the trainer's line: tests/test_cli_errors.py
        run = _tpu_pod(tmp_path, *base, "--config", config, *flags)
        assert run.returncode == PERMANENT_ERROR_STATUS and run.stderr.startswith(line), run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and _gcloud_lines(run) == [], run.stderr
    assert not any(tmp_path.iterdir())


def _fake_gcloud(tmp_path) -> dict:
    """PATH with a stand-in gcloud first: it logs its arguments, says ACTIVE / READY to describe."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gcloud"
    fake.write_text("#!/usr/bin/env bash\n"
                    f"printf '%q ' gcloud \"$@\" >> {shlex.quote(str(tmp_path / 'gcloud.log'))}; echo >> "
                    f"{shlex.quote(str(tmp_path / 'gcloud.log'))}\n"
                    'case "$*" in *queued-resources\\ describe*) echo ACTIVE ;; *tpu-vm\\ describe*) echo READY ;; esac\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    assert shutil.which("gcloud", path=env["PATH"]) == str(fake)
    return env


def test_tpu_pod_remembers_a_queued_spot_slice_for_keep_alive_and_delete(tmp_path):
    state = tmp_path / "state"
    env = _fake_gcloud(tmp_path)
    created = _tpu_pod(state, "create", "--name", "pacs-7b", "--zone", "us-east5-a", "--accelerator", "v6e-64",
                       "--mode", "queued", "--spot", env=env)
    assert created.returncode == 0, created.stderr
    log = [shlex.split(line) for line in (tmp_path / "gcloud.log").read_text().splitlines()]
    assert [c[3:5] for c in log] == [["queued-resources", "create"], ["queued-resources", "describe"]]
    assert "--spot" in log[0]
    records = list(state.iterdir())
    assert [p.name for p in records] == ["default_us-east5-a_pacs-7b"]

    # run --keep-alive without --mode: a re-created slice (here: not found) is a queued spot resource again
    run = _tpu_pod(state, "run", "--dry-run", "--keep-alive", "--name", "pacs-7b", "--zone", "us-east5-a",
                   "--config", "configs/paper.py:qwen25_7b_v6e,pacs_beta1", "--repo", "https://example.org/p.git",
                   *MODEL_ON_WORKERS)
    assert run.returncode == 0, run.stderr
    assert "pacs-7b was created with --mode queued --spot --accelerator v6e-64" in run.stderr
    create = [c for c in _gcloud_lines(run) if c[3:5] == ["queued-resources", "create"]]
    assert len(create) == 1 and "--spot" in create[0]
    assert "--accelerator-type=v6e-64" in create[0] and "--runtime-version=v2-alpha-tpuv6e" in create[0]
    assert not any(c[3:5] == ["tpu-vm", "create"] for c in _gcloud_lines(run))

    # delete without --mode deletes the queued resource (the dry run keeps the record)
    delete = _tpu_pod(state, "delete", "--dry-run", "--name", "pacs-7b", "--zone", "us-east5-a")
    assert delete.returncode == 0 and [c[3:5] for c in _gcloud_lines(delete)] == [["queued-resources", "delete"]]
    assert records[0].exists()
    # another slice, or an explicit --mode, is not affected by the record
    other = _tpu_pod(state, "delete", "--dry-run", "--name", "other", "--zone", "us-east5-a")
    assert [c[3:5] for c in _gcloud_lines(other)] == [["tpu-vm", "delete"]]
    # a real delete removes the record
    deleted = _tpu_pod(state, "delete", "--name", "pacs-7b", "--zone", "us-east5-a", env=env)
    assert deleted.returncode == 0, deleted.stderr
    last = shlex.split((tmp_path / "gcloud.log").read_text().splitlines()[-1])
    assert last[3:5] == ["queued-resources", "delete"] and not records[0].exists()


def test_tpu_pod_dry_run_create_says_what_it_would_record(tmp_path):
    run = _tpu_pod(tmp_path, "create", "--dry-run", "--name", "n", "--zone", "z", "--mode", "queued")
    assert run.returncode == 0
    assert f"would record in {tmp_path / 'default_z_n'}: mode=queued spot=0 accelerator=v5p-64" in run.stderr
    assert not any(tmp_path.iterdir())


def _checkout(tmp_path, origin: str | None) -> pathlib.Path:
    """A copy of the launch scripts in a fresh git checkout whose 'origin' remote is ``origin``."""
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "launch", checkout / "launch")
    subprocess.run(["git", "init", "-q", str(checkout)], check=True, timeout=60)
    if origin is not None:
        subprocess.run(["git", "-C", str(checkout), "remote", "add", "origin", origin], check=True, timeout=60)
    return checkout


def _setup_command(run: subprocess.CompletedProcess) -> str:
    """The script `setup` runs on every worker (the --command of its `ssh --worker=all`)."""
    (ssh,) = [c for c in _gcloud_lines(run) if c[3:5] == ["tpu-vm", "ssh"] and "uv venv" in " ".join(c)]
    assert "--worker=all" in ssh
    (command,) = [arg.split("=", 1)[1] for arg in ssh if arg.startswith("--command=")]
    return command


@pytest.mark.parametrize("command", ["setup", "run"])
def test_tpu_pod_does_not_default_repo_to_a_local_origin(tmp_path, command):
    """Issue 28 item 9: an 'origin' that is a path on this machine cannot be cloned by the workers; the
    error says to pass --repo URL, before anything is created. A URL origin is still the default."""
    args = ["--dry-run", "--name", "n", "--zone", "z", "--config", "configs/paper.py:qwen25_7b,pacs_beta1"]
    state = _pod_env(PACS_TPU_POD_STATE_DIR=str(tmp_path / "state"))
    for local in ("/home/me/src/pacs_jax", "../pacs_jax", "file:///home/me/pacs_jax.git"):
        checkout = _checkout(tmp_path / local.replace("/", "_"), local)
        run = subprocess.run(["bash", str(checkout / "launch" / "tpu_pod.sh"), command, *args], capture_output=True,
                             text=True, timeout=60, cwd=checkout, env=state)
        assert run.returncode == 2 and _gcloud_lines(run) == [], run.stderr
        assert (f"--repo is required: this checkout's 'origin' remote is a local path ({local}), which the workers "
                "cannot clone; pass --repo URL") in run.stderr
    checkout = _checkout(tmp_path / "url", "git@github.com:org/pacs_jax.git")
    run = subprocess.run(["bash", str(checkout / "launch" / "tpu_pod.sh"), command, *args, *MODEL_ON_WORKERS],
                         capture_output=True, text=True, timeout=60, cwd=checkout, env=state)
    assert run.returncode == 0, run.stderr
    assert "git clone git@github.com:org/pacs_jax.git ~/pacs_jax" in _setup_command(run)
    given = _tpu_pod(tmp_path / "state", command, *args, "--repo", "/home/me/src/pacs_jax")
    assert given.returncode == 2 and "--repo '/home/me/src/pacs_jax': not a URL the workers can clone" in given.stderr
    assert _gcloud_lines(given) == []


def test_tpu_pod_setup_puts_the_training_data_on_every_worker(tmp_path):
    """Issue 28 item 9: the README's pod commands never made data/deepscaler/train.jsonl on the workers,
    so every host stopped with a config error. `setup` (also when `run` creates the slice) now makes it
    with tools/prepare_data.py where it is missing, or copies --data gs://...; --dry-run shows the step."""
    base = ["--dry-run", "--name", "n", "--zone", "z", "--repo", "https://example.org/p.git"]
    made = _setup_command(_tpu_pod(tmp_path, "setup", *base))
    step = "[ -f data/deepscaler/train.jsonl ] || .venv/bin/python tools/prepare_data.py deepscaler"
    assert made.endswith(step + "; ") and made.index("uv pip install") < made.index(step)
    run = _tpu_pod(tmp_path, "run", *base, "--config", "configs/paper.py:qwen25_7b,pacs_beta1", *MODEL_ON_WORKERS)
    assert run.returncode == 0 and step in _setup_command(run)  # a new slice is set up with its data
    assert ("the config and its inputs pass the trainer's check for v5p-64 (32 devices); not on this machine, left "
            "to the trainer on the workers: model.path=/home/me/Qwen2.5-7B") in run.stderr  # its check ran first
    copied = _setup_command(_tpu_pod(tmp_path, "setup", *base, "--data", "gs://bucket/deep scaler/train.jsonl"))
    assert "gcloud storage cp gs://bucket/deep\\ scaler/train.jsonl data/deepscaler/train.jsonl" in copied
    assert "prepare_data" not in copied
    none = _setup_command(_tpu_pod(tmp_path, "setup", *base, "--data", "none"))
    assert "prepare_data" not in none and "gcloud storage" not in none
    bad = _tpu_pod(tmp_path, "run", *base, "--config", "configs/paper.py:qwen25_7b,pacs_beta1", "--data", "s3://b/x")
    assert bad.returncode == 2 and "--data must be deepscaler, none or gs://" in bad.stderr and _gcloud_lines(bad) == []
    assert not any(tmp_path.iterdir())


def _pinned_jax() -> str:
    """The JAX version requirements.txt pins, which the launchers install the accelerator build of."""
    pins = [line.split("==")[1].split()[0] for line in (REPO / "requirements.txt").read_text().splitlines()
            if line.startswith("jax==")]
    assert len(pins) == 1, pins
    return pins[0]


@pytest.mark.parametrize("cuda_jax", [False, True])
def test_gpu_node_installs_cuda_jax_into_an_existing_cpu_venv(tmp_path, cuda_jax):
    """Issue 28 item 9: an existing .venv (made for the tests or the demo: requirements.txt's CPU JAX)
    was used as it was, and the run trained on the CPU. Now jax[cuda12] is installed unless .venv's JAX
    has a CUDA plugin of its version, and the GPU backend is checked before the trainer starts."""
    checkout = _checkout(tmp_path, None)
    python = checkout / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/usr/bin/env bash\nexit {0 if cuda_jax else 1}\n")  # the plugin check's answer
    python.chmod(0o755)
    run = subprocess.run(["bash", str(checkout / "launch" / "gpu_node.sh"), "--dry-run", "--config",
                          "configs/paper.py:qwen25_3b,grpo"], capture_output=True, text=True, timeout=60,
                         env=_env(SLURM_NTASKS="1"))
    assert run.returncode == 0, run.stderr
    lines = [shlex.split(line) for line in run.stdout.splitlines()]
    installs = [line for line in lines if line[:2] == [".venv/bin/pip", "install"]]
    assert installs == ([] if cuda_jax else [[".venv/bin/pip", "install", "-q", "-r", "requirements.txt", "-e", ".",
                                              f"jax[cuda12]=={_pinned_jax()}"]])
    check, train = lines[-2], lines[-1]
    assert check[:2] == [".venv/bin/python", "-c"] and "jax.default_backend()" in check[2] and "'gpu'" in check[2]
    assert train[:4] == ["bash", "launch/supervise.sh", "--", ".venv/bin/python"]
    assert not any(line[:3] == ["sh", "tools/make_venv.sh", ".venv"] for line in lines)  # the .venv is kept
