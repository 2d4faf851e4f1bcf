"""A command-line process on a host without an accelerator runs JAX on the CPU only, quietly.

libtpu is installed beside JAX for the AOT planners (requirements-test.txt; ``jax[tpu]``), and its
presence registers JAX's TPU backend. With no platform chosen (``JAX_PLATFORMS`` unset), JAX's backend
discovery (the first ``jax.devices()``) initialises every registered backend, and on a host without a
TPU libtpu's initialisation prints its complaints before the process's own lines ("could not determine
TPU accelerator type", an ``INVALID_ARGUMENT`` error about ``TPU_WORKER_HOSTNAMES`` with a source trace):
a user reads them as failures. Asking for the CPU platform keeps JAX from initialising the TPU backend.

The AOT planners' compile-only TPU devices (``pacs_jax.topologies.abstract_devices``) load libtpu
themselves, whatever platform is chosen here, and keep its start-up lines unless it fails.
"""

from __future__ import annotations

import glob
import os

# A TPU asked for by the environment although JAX's PCI scan may not see one (a container without
# /sys/bus/pci): JAX's own switch, and the variable libtpu reads for the chip
_TPU_REQUESTED = ("JAX_FORCE_TPU_INIT", "TPU_ACCELERATOR_TYPE")
# The TPU chips' device files libtpu opens (/dev/accel* on v4 and v5e, /dev/vfio/<n> on v5p and v6e)
_TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")


def use_cpu_without_accelerator() -> bool:
    """Sets JAX's platforms to the CPU when nothing on this host needs another platform; returns whether it did.

    Nothing changes when a platform was chosen (``JAX_PLATFORMS`` in the environment, even empty, or
    ``jax_platforms`` set in this process: JAX sets it itself on a Cloud TPU VM), when JAX's backends are
    initialised already, when a TPU is asked for (``JAX_FORCE_TPU_INIT``, ``TPU_ACCELERATOR_TYPE``) or
    attached (JAX's PCI scan, or a TPU's device file), or when a GPU device is visible (NVIDIA or AMD):
    JAX then chooses as it always does. Call it before the process's first JAX computation (a CLI's
    start)."""
    import jax
    from jax._src import hardware_utils, xla_bridge

    if ("JAX_PLATFORMS" in os.environ or jax.config.values["jax_platforms"] is not None
            or xla_bridge.backends_are_initialized() or any(name in os.environ for name in _TPU_REQUESTED)):
        return False
    if (hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0 or any(map(glob.glob, _TPU_DEVICE_FILES))
            or hardware_utils.has_visible_nvidia_gpu() or hardware_utils.num_available_amd_gpus(stop_at=1) > 0):
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
