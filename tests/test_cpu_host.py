"""Issue 51 item 5: a CPU process of the tools prints its own lines, not libtpu's start-up complaints.

libtpu is installed with the test requirements (for the AOT planners); with ``JAX_PLATFORMS`` unset,
JAX's backend discovery initialised it in every process, which printed "could not determine TPU
accelerator type" and an ``INVALID_ARGUMENT ... TPU_WORKER_HOSTNAMES`` error with a source trace before
the process's own lines. These processes run as a user starts them on this CPU host: without
``JAX_PLATFORMS`` (conftest.py sets it for the test processes) and without the simulated device count.
"""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO
from pacs_jax.errors import PERMANENT_ERROR_STATUS

LIBTPU_LINES = ("could not determine TPU accelerator type", "TPU_WORKER_HOSTNAMES")


def _user_env() -> dict[str, str]:
    """This process's environment less conftest.py's platform and device count. libtpu's lock lets one
    process a host initialise it (/tmp/libtpu_lockfile): a second fails before printing anything, so
    these processes ignore the lock, to speak as a lone process does whatever else runs here."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return {**env, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_user_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_libtpu_speaks_in_a_plain_jax_process_here():
    """The premise of the tests below: on this host, a process that lets JAX choose its platforms
    prints libtpu's lines (were it quiet, the tests below would pass for nothing)."""
    result = _run("-c", "import jax; print(jax.default_backend())")
    assert result.stdout == "cpu\n" and all(line in result.stderr for line in LIBTPU_LINES), result.stderr


def test_the_trainer_on_a_cpu_host_prints_only_its_own_error_line(tmp_path):
    """The trainer CLI up to its first JAX call (the mesh needs 3 devices, the host has 1): one line."""
    result = _run("-m", "pacs_jax.train", "--config=configs/default.py", "--config.mesh.data=3",
                  f"--workdir={tmp_path / 'run'}")
    assert result.returncode == PERMANENT_ERROR_STATUS, result.stderr
    assert result.stderr.splitlines() == [
        "pacs_jax.train: error: config.mesh (data, fsdp, tensor)=(3, 1, 1) needs 3 devices, 1 are available"]


def test_the_planners_tpu_devices_keep_libtpu_quiet_unless_it_fails():
    """Compile-only TPU devices load libtpu whatever the platform: made, nothing is printed; not made
    (a layout libtpu refuses), libtpu's lines come out before the error."""
    made = _run("-c", "from pacs_jax import topologies; print(len(topologies.abstract_devices('v5p-8')))")
    assert (made.returncode, made.stdout, made.stderr) == (0, "4\n", "")
    refused = _run("-c", "import dataclasses; from pacs_jax import topologies; "
                         "topologies.abstract_devices(dataclasses.replace(topologies.get_topology('v5p-8'), "
                         "topology='v5p:3x5x7'))")
    assert refused.returncode == 1 and all(line in refused.stderr for line in LIBTPU_LINES), refused.stderr
    assert refused.stderr.index(LIBTPU_LINES[1]) < refused.stderr.index(
        "RuntimeError: libtpu could not make topology 'v5p:3x5x7' (v5p-8)"), refused.stderr


def test_a_chosen_platform_a_tpu_asked_for_or_a_gpu_present_is_left_to_jax():
    """use_cpu_without_accelerator changes nothing but where no platform is chosen and no accelerator is
    there (in order: each case that must not choose the CPU, then the one that must)."""
    script = """
import os
import jax
from jax._src import hardware_utils
from pacs_jax.cpu_host import use_cpu_without_accelerator

seen = []
os.environ["JAX_PLATFORMS"] = ""
seen.append(use_cpu_without_accelerator())
del os.environ["JAX_PLATFORMS"]
os.environ["TPU_ACCELERATOR_TYPE"] = "v5p-8"
seen.append(use_cpu_without_accelerator())
del os.environ["TPU_ACCELERATOR_TYPE"]
has_gpu = hardware_utils.has_visible_nvidia_gpu
hardware_utils.has_visible_nvidia_gpu = lambda: True
seen.append(use_cpu_without_accelerator())
hardware_utils.has_visible_nvidia_gpu = has_gpu
seen.append(jax.config.values["jax_platforms"])
seen.append(use_cpu_without_accelerator())
seen.append(jax.config.values["jax_platforms"])
seen.append(use_cpu_without_accelerator())
print(seen)
"""
    result = _run("-c", script)
    assert result.stdout == "[False, False, False, None, True, 'cpu', False]\n", result.stdout + result.stderr
