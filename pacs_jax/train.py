"""python -m pacs_jax.train --config=configs/FILE.py[:ARG] --config.a.b=VALUE --workdir=DIR

With no flags it runs the CPU demo (configs/default.py: the same trainer on a generated arithmetic
task). The whole config and every input it names (the model folder's config and weight headers, the
training data, the evaluation sets: training/config_check.py ``check_inputs``) are checked before the
workdir is created or anything compiles; a restarted run resumes from its workdir's checkpoints by itself.

Exit status: 0 on success; 78 (pacs_jax/errors.py ``PERMANENT_ERROR_STATUS``) with one line on stderr
for an error a restart cannot fix: a config value (``ConfigError``), a flag, malformed data
(``DataError``); launch/supervise.sh stops on it. 79 (``RESUME_NEEDED_STATUS``): SIGTERM or SIGINT
stopped the run before train.steps, in any phase (the warm-start too), its last finished RL step
checkpointed: the same command resumes it
(supervise.sh restarts it, unless it got the signal too). Anything else (a crash) exits non-zero otherwise.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

from pacs_jax import console
from pacs_jax.data import paths
from pacs_jax.errors import RESUME_NEEDED_STATUS, UsageError, exit_on_unknown_config_field, run_cli


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


_DEFAULT_CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.py")
# With the default file, config_flags applies the command line's --config.* overrides here, at import:
# a misspelled field is one line and exit status 78 (errors.exit_on_unknown_config_field), as it is when
# --config names a file (run_cli, while the flags are parsed).
_CONFIG = exit_on_unknown_config_field("pacs_jax.train", lambda: config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG,
    "ml_collections config file, optionally FILE.py:ARG (e.g. configs/paper.py:qwen25_7b,pacs_beta1).",
    lock_config=True))
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (checkpoints, metrics, exports). "
                                                "Default: the config's workdir field.")
_MULTIHOST = flags.DEFINE_bool(
    "multihost", False, "Start JAX's multi-process runtime with the cluster it detects (Cloud TPU pods, SLURM). "
                        "Implied by --coordinator.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", os.environ.get("JAX_COORDINATOR_ADDRESS"),
    "host:port of process 0 for a multi-process run without auto-detection (GPU nodes, local runs); "
    "port + 1 must be free too (start-up barrier). Default: $JAX_COORDINATOR_ADDRESS.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", _env_int("JAX_NUM_PROCESSES"),
                                      "Number of processes, with --coordinator. Default: $JAX_NUM_PROCESSES.")
_PROCESS_ID = flags.DEFINE_integer("process_id", _env_int("JAX_PROCESS_ID"),
                                   "This process's index in [0, num_processes), with --coordinator. "
                                   "Default: $JAX_PROCESS_ID.")
_STARTUP_TIMEOUT = flags.DEFINE_float("startup_timeout", 300.0,
                                      "Seconds to wait for every process to start before exiting with an "
                                      "error naming the missing ones.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.setup()  # Orbax's INFO lines off unless --verbosity; plain progress lines in a log file
    import jax  # after flag parsing, so --help is fast

    from etils import epath

    from pacs_jax import distributed
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)

    if _COORDINATOR.value or _NUM_PROCESSES.value is not None or _PROCESS_ID.value is not None:
        try:
            distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                                   timeout_s=_STARTUP_TIMEOUT.value)
        except ValueError as e:
            raise app.UsageError(f"--coordinator / --num_processes / --process_id: {e}") from None
        except distributed.StartupError as e:
            sys.exit(f"error: process {_PROCESS_ID.value}: {e}")
    elif _MULTIHOST.value:
        distributed.initialize()

    from pacs_jax.sharding import config_mesh, rollout_mesh
    from pacs_jax.training.config_check import check_inputs

    config = _CONFIG.value
    workdir = epath.Path(_WORKDIR.value or config.workdir)  # a local folder or gs://...
    spec = check_inputs(config)  # every input read, before the workdir exists: a ConfigError is one line, status 78
    try:
        mesh = config_mesh(config.mesh)
        rollout_mesh(config.mesh, mesh.shape["tensor"])  # one step off's engine mesh, if any, can be built here
    except ValueError as e:  # a shape the slice's physical topology cannot take
        raise app.UsageError(f"config.{e}") from None
    if jax.process_index() == 0:
        _check_workdir(workdir, "--workdir" if _WORKDIR.value else "config.workdir")
    from pacs_jax.training.run import run_training

    with jax.set_mesh(mesh):  # the one place the mesh is set; everything under the run reads it
        summary = run_training(config, workdir, spec)
    if jax.process_index() == 0:
        print(json.dumps(summary, indent=2))
    if "stopped_at_step" in summary:  # a stop signal: unfinished, resume needed
        sys.stdout.flush()
        sys.stderr.flush()
        if "dropped_step" in summary:  # the dropped step's device program may still run: do not wait for it
            os._exit(RESUME_NEEDED_STATUS)
        sys.exit(RESUME_NEEDED_STATUS)


def _check_workdir(workdir, field: str) -> None:
    """Create ``workdir`` and check that files can be written in it; a path that is a file, a parent that
    is one, or a folder this user cannot write is a ``UsageError`` naming the path (one line, status 78)."""
    if workdir.exists() and not workdir.is_dir():
        raise UsageError(f"{field}={workdir}: is a file, not a folder")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{field}={workdir}: cannot create the folder ({e.strerror or e})") from None
    probe = workdir / f".write_test.{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{field}={workdir}: cannot write in it ({e.strerror or e})") from None


def config_files() -> str:
    """What ``--help`` lists of the config files the trainer runs, with their arguments as the files define them."""
    import inspect
    import textwrap

    from configs import algorithms, default, demo_objectives, paper

    def choices(name: str, values) -> str:
        return textwrap.fill(", ".join(values), width=118, initial_indent=f"  {name + ':':<11}",
                             subsequent_indent=" " * 13)

    setup = inspect.signature(default.get_config).parameters["algorithm"].default
    return "\n".join([
        "\nconfig files (--config=FILE.py[:ARG], the path from the working directory or the repository's root):",
        f"  configs/default.py[:SETUP]            the CPU demo, the default (SETUP: {setup})",
        "  configs/demo_objectives.py:OBJECTIVE  the demo with another objective's setup, at the same budget",
        "  configs/paper.py:MODEL,ALGO[,cpu]     the PACS paper's setups (cpu: shrunk to a CPU smoke test)",
        choices("SETUP", sorted(algorithms.setups(default.MAX_NEW_TOKENS))),
        choices("OBJECTIVE", demo_objectives.SETUPS),
        choices("MODEL", paper.MODELS),
        choices("ALGO", paper.ALGORITHMS)])


def cli() -> None:
    """Run ``main``; config, flag and data errors print one line and exit with status 78
    (``errors.PERMANENT_ERROR_STATUS``), which launch/supervise.sh does not retry."""
    run_cli("pacs_jax.train", main, sys.argv, prepare=paths.config_file_args, config_files=config_files)


if __name__ == "__main__":
    cli()
