"""python -m pacs_jax.check_config --config=FILE.py[:ARG] --accelerator=v5p-64 [--config.a.b=VALUE ...]

The trainer's check before step 1 (training/config_check.py ``check_for_slice``) for a run on a TPU
slice, run on the machine that launches it: ``launch/tpu_pod.sh run`` runs it before it asks gcloud
for anything, so a misspelled setup name or override, a value that cannot work, data or a model
folder that does not load never costs a slice. The config loads as the trainer loads it; the mesh is
checked against the slice's devices (``--accelerator``, as tpu_pod.sh names it); local paths that are
not on this machine (the workers' disks hold them) are listed as left to the trainer, everything
else (``gs://`` paths included) is read. Exit status 0 when it passes; 78 with one line on stderr
naming the field or file otherwise (pacs_jax/errors.py).
"""

from __future__ import annotations

import re
import sys

from absl import app, flags
from ml_collections import config_flags

from pacs_jax import console
from pacs_jax.data import paths
from pacs_jax.errors import UsageError, run_cli

def slice_devices(accelerator: str) -> int:
    """JAX devices of a TPU slice named as gcloud names it: a chip each; v4-N and v5p-N count TensorCores
    (2 a chip), v5e-N (v5litepod-N) and v6e-N chips."""
    match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", accelerator)
    if not match:
        raise UsageError(f"--accelerator={accelerator}: expected v4-N, v5p-N, v5e-N (v5litepod-N) or v6e-N")
    count = int(match.group(2))
    return count // 2 if match.group(1) in ("v4", "v5p") else count


def _cli() -> None:
    """Flags are defined here, not at import, so importing this module defines none."""
    config_flag = config_flags.DEFINE_config_file("config", None, "trainer config file, FILE.py[:ARG]",
                                                  lock_config=True)
    accelerator_flag = flags.DEFINE_string("accelerator", "v5p-64", "the slice: v4-N, v5p-N (N TensorCores, 2 a "
                                                                    "chip), v5e-N / v5litepod-N or v6e-N (N chips)")
    flags.mark_flag_as_required("config")

    def main(argv: list[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        console.setup()
        from pacs_jax.training.config_check import check_for_slice
        from pacs_jax.training.spec import RunSpec

        devices = slice_devices(accelerator_flag.value)
        _, elsewhere = check_for_slice(RunSpec.unplaced(config_flag.value), devices)
        note = f"; not on this machine, left to the trainer on the workers: {', '.join(elsewhere)}" if elsewhere else ""
        print(f"pacs_jax.check_config: the config and its inputs pass the trainer's check for {accelerator_flag.value} "
              f"({devices} devices){note}", flush=True)

    run_cli("pacs_jax.check_config", main, sys.argv, prepare=paths.config_file_args)


if __name__ == "__main__":
    _cli()
