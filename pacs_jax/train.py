"""python -m pacs_jax.train --config=configs/FILE.py[:ARG] --config.a.b=VALUE --workdir=DIR

With no flags it runs the embedded CPU demo (configs/default.py). The whole config is validated
before anything compiles; a restarted run resumes from its workdir's checkpoints by itself.
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_DEFAULT_CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.py")
_CONFIG = config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG,
    "ml_collections config file, optionally FILE.py:ARG (e.g. configs/paper.py:qwen25_7b,pacs_beta1).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (checkpoints, metrics, exports). "
                                                "Default: the config's workdir field.")
_MULTIHOST = flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() first (TPU pods, multi-node GPU).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (auto-detected on TPU).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (auto-detected on TPU).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (auto-detected on TPU).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO
    import jax  # after flag parsing, so --help is fast

    if _MULTIHOST.value:
        jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)

    from pacs_jax.sharding import config_mesh
    from pacs_jax.training.config_check import ConfigError, validate_config

    config = _CONFIG.value
    workdir = pathlib.Path(_WORKDIR.value or config.workdir)
    try:
        validate_config(config)
    except ConfigError as e:
        raise app.UsageError(str(e)) from None
    mesh = config_mesh(config.mesh)
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    if config.demo.enabled:
        from pacs_jax.demo.run import run_demo

        summary = run_demo(config, workdir, mesh)
    else:
        from pacs_jax.training.real_run import run_training

        summary = run_training(config, workdir, mesh)
    if jax.process_index() == 0:
        print(json.dumps(summary, indent=2))


def cli() -> None:
    app.run(main, argv=sys.argv)


if __name__ == "__main__":
    cli()
