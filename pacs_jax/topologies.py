"""Target hardware for ahead-of-time (AOT) compilation on a machine without it.

``abstract_devices`` returns compile-only JAX devices for a named TPU slice or GPU node. A mesh
built on them lets ``jax.jit(f).lower(*args).compile()`` run the real TPU / GPU compiler on a CPU
host, so a config can be checked to fit (``compiled.memory_analysis()``, bytes per device) before
any accelerator is rented. Nothing can be executed on these devices.

Usage (any machine; TPU targets need libtpu, GPU targets the CUDA plugin, see below)::

    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from pacs_jax import sharding, topologies

    topo = topologies.get_topology("v5p-64")
    devices = topologies.abstract_devices(topo)        # 32 compile-only "TPU v5" devices
    mesh = sharding.make_mesh(data=1, fsdp=8, tensor=4, devices=devices)
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    compiled = jax.jit(step).lower(x).compile()
    mem = compiled.memory_analysis()                   # per device
    print(mem.peak_memory_in_bytes / topo.hbm_bytes)   # also argument_/output_/temp_/alias_size_in_bytes

Compare ``peak_memory_in_bytes`` with ``hbm_bytes``: on TPU ``temp_size_in_bytes`` can read 0 while
the peak is well above arguments + outputs.

Installing the compilers (a separate virtualenv is advisable; neither needs an accelerator):

* TPU: ``pip install "jax[tpu]==<jax version>"`` (brings ``libtpu``, about 210 MB). On a host without a
  TPU libtpu complains about TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES as it starts (harmless to
  compiling): ``abstract_devices`` holds those lines back and prints them only when it fails.
* GPU: ``pip install "jax-cuda12-plugin==<jax version>" "jax-cuda12-pjrt==<jax version>"`` (about
  180 MB; the NVIDIA wheels of ``jax[cuda12]``, about 3 GB, are not needed to compile). Without a GPU the
  CUDA plugin fails its driver check and does not register; set ``JAX_PLATFORMS=cpu`` or
  ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` before JAX initializes (``abstract_devices`` sets the
  latter itself when JAX has not initialized yet). The GPU target is described to XLA by a
  ``GpuTargetConfigProto`` (text below, from XLA's ``xla/backends/gpu/target_config/specs``);
  no GPU means no autotuning, so the numbers are those of a GPU compile with
  ``--xla_gpu_autotune_level=0``; an autotuned run can need more (cuBLAS workspaces and f32 GEMM
  outputs: +544 MiB temp for a 4096x16384 MLP step on one H100, checked on the hardware).

Pallas TPU kernels (e.g. splash attention) compile this way too: libtpu's Mosaic compiler runs at
``.compile()`` and reports scoped-VMEM overflows as it would on the TPU. XLA's ``cost_analysis()``
counts no FLOPs for such custom calls.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from pacs_jax import native_stderr

__all__ = ["Topology", "TOPOLOGIES", "PEAKS", "get_topology", "abstract_devices"]

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Topology:
    """One slice (TPU) or node group (GPU). Counts are JAX devices: on TPU v4 / v5p the two
    TensorCores of a chip form one "megacore" device, so ``v5p-64`` (64 TensorCores) is 32 devices."""

    name: str
    platform: str  # "tpu" or "gpu"
    num_devices: int
    num_hosts: int
    hbm_bytes: int  # per device
    device_kind: str = ""  # what jax.Device.device_kind reports for this device
    # TPU: libtpu's "<chip>:<shape>" name; GPU: "<slices>x<hosts per slice>x<devices per host>".
    topology: str = ""
    chips_per_host_bounds: tuple[int, int, int] | None = None  # TPU: chips of one host, per axis
    wrap: tuple[bool, bool, bool] | None = None  # TPU: torus wraparound links per axis (full cubes)
    # Peaks of one device (``PEAKS`` below, with their sources): dense bf16 FLOP/s, HBM bytes/s, and
    # the interconnect's bytes/s out of one device (TPU ICI; GPU NVLink within a node)
    bf16_flops: float = 0.0
    hbm_bandwidth: float = 0.0
    ici_bandwidth: float = 0.0

    @property
    def devices_per_host(self) -> int:
        return self.num_devices // self.num_hosts


# Peak rates of one JAX device by device_kind: (dense bf16 FLOP/s, HBM bytes/s, interconnect bytes/s).
# TPU: the Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v4, /v5p, /v5e, /v6e, "chip
# specifications"; a v4 / v5p device is one chip, its two TensorCores as a megacore): v4 275 TFLOP/s,
# 1,200 GB/s HBM, ICI 6 links x 50 GB/s (Jouppi et al., ISCA 2023, "TPU v4"); v5p 459 TFLOP/s,
# 2,765 GB/s, ICI 4,800 Gbps = 600 GB/s; v5e 197 TFLOP/s, 819 GB/s, ICI 1,600 Gbps = 200 GB/s; v6e
# 918 TFLOP/s, 1,640 GB/s, ICI 3,584 Gbps = 448 GB/s. GPU: NVIDIA's H100 and H200 datasheets (SXM,
# dense bf16 989 TFLOP/s, the "with sparsity" figure halved; HBM3 3.35 TB/s, HBM3e 4.8 TB/s; NVLink
# 900 GB/s a GPU within a node; across nodes of h100x16 the network is slower, not modelled here).
PEAKS = {
    "TPU v4": (275e12, 1200e9, 300e9),
    "TPU v5": (459e12, 2765e9, 600e9),
    "TPU v5 lite": (197e12, 819e9, 200e9),
    "TPU v6 lite": (918e12, 1640e9, 448e9),
    "NVIDIA H100 80GB HBM3": (989e12, 3350e9, 900e9),
    "NVIDIA H200 141GB HBM3e": (989e12, 4800e9, 900e9),
}


def _tpu(name, kind, topology, devices, hosts, hbm, per_host=(2, 2, 1), wrap=(False, False, False)):
    return Topology(name, "tpu", devices, hosts, hbm, kind, topology, per_host, wrap, *PEAKS[kind])


def _gpu(name, kind, nodes, per_node, hbm):
    return Topology(name, "gpu", nodes * per_node, nodes, hbm, kind, f"1x{nodes}x{per_node}", None, None,
                    *PEAKS[kind])


# Sources. Chips / hosts / shapes: Cloud TPU docs (cloud.google.com/tpu/docs/v4, v5p, v5e, v6e:
# "v5p-N" and "v4-N" count TensorCores, 2 per chip; v5e / v6e names count chips, one TensorCore
# each; multi-host v4/v5p/v5e/v6e slices have 4 chips per host VM, v6e-8 is one 8-chip host) and
# MaxText's accelerator_to_spec_map.py (libtpu topology names, (2, 2, 1) chips per host, wraparound
# for v4/v5p slices of a full 4x4x4 cube or more). HBM per chip: the same TPU docs (v4 32 GiB, v5p
# 95 GB, v5e 16 GB, v6e 32 GB; taken as GiB here, the runtime keeps a little of it). device_kind:
# what libtpu 0.0.42 reports for these topologies (checked with get_topology_desc). GPU HBM: the
# device_memory_size of XLA's h100_sxm / h200 target configs (what the compiler plans against;
# nvidia-smi shows 81559 MiB on an H100 80GB HBM3).
TOPOLOGIES: dict[str, Topology] = {t.name: t for t in (
    _tpu("v4-8", "TPU v4", "v4:2x2x1", 4, 1, 32 * GiB),
    _tpu("v4-32", "TPU v4", "v4:2x2x4", 16, 4, 32 * GiB),
    _tpu("v5p-8", "TPU v5", "v5p:2x2x1", 4, 1, 95 * GiB),
    _tpu("v5p-16", "TPU v5", "v5p:2x2x2", 8, 2, 95 * GiB),
    _tpu("v5p-32", "TPU v5", "v5p:2x2x4", 16, 4, 95 * GiB),
    _tpu("v5p-64", "TPU v5", "v5p:2x4x4", 32, 8, 95 * GiB),
    _tpu("v5p-128", "TPU v5", "v5p:4x4x4", 64, 16, 95 * GiB, wrap=(True, True, True)),
    _tpu("v5p-256", "TPU v5", "v5p:4x4x8", 128, 32, 95 * GiB, wrap=(True, True, True)),
    _tpu("v5e-8", "TPU v5 lite", "v5e:2x4", 8, 1, 16 * GiB, per_host=(2, 4, 1)),
    _tpu("v5e-16", "TPU v5 lite", "v5e:4x4", 16, 4, 16 * GiB),
    _tpu("v5e-64", "TPU v5 lite", "v5e:8x8", 64, 16, 16 * GiB),
    _tpu("v6e-8", "TPU v6 lite", "v6e:2x4", 8, 1, 32 * GiB, per_host=(2, 4, 1)),
    _tpu("v6e-16", "TPU v6 lite", "v6e:4x4", 16, 4, 32 * GiB),
    _tpu("v6e-64", "TPU v6 lite", "v6e:8x8", 64, 16, 32 * GiB),
    _tpu("v6e-256", "TPU v6 lite", "v6e:16x16", 256, 64, 32 * GiB, wrap=(True, True, False)),
    _gpu("h100x1", "NVIDIA H100 80GB HBM3", 1, 1, 84942979072),
    _gpu("h100x8", "NVIDIA H100 80GB HBM3", 1, 8, 84942979072),
    _gpu("h100x16", "NVIDIA H100 80GB HBM3", 2, 8, 84942979072),
    _gpu("h200x1", "NVIDIA H200 141GB HBM3e", 1, 1, 151397597184),
    _gpu("h200x8", "NVIDIA H200 141GB HBM3e", 1, 8, 151397597184),
)}


def get_topology(name: str) -> Topology:
    """The entry of ``TOPOLOGIES`` called ``name`` (e.g. "v5p-64", "h100x8")."""
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}") from None


def abstract_devices(topology: Topology | str, num_slices: int = 1) -> list:
    """Compile-only devices of ``topology`` (``num_slices`` TPU slices joined over DCN).

    Raises RuntimeError, with the pip command to run, when the compiler for the platform is not
    installed (TPU: libtpu; GPU: the CUDA plugin).
    """
    topo = get_topology(topology) if isinstance(topology, str) else topology
    if num_slices < 1:
        raise ValueError(f"num_slices={num_slices} must be >= 1")
    if topo.platform == "tpu":
        devices = _tpu_devices(topo, num_slices)
    elif topo.platform == "gpu":
        if num_slices != 1:
            raise ValueError("num_slices is for TPU topologies; pick a GPU topology with more nodes")
        devices = _gpu_devices(topo)
    else:
        raise ValueError(f"{topo.name}: unknown platform {topo.platform!r}")
    expected = topo.num_devices * num_slices
    if len(devices) != expected:
        raise RuntimeError(f"{topo.name}: the compiler made {len(devices)} devices, expected {expected}")
    return devices


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a missing parent package
        return False


def _pip_jax(extra: str) -> str:
    import jax

    return f'pip install "jax[{extra}]=={jax.__version__}"'


def _tpu_devices(topo: Topology, num_slices: int) -> list:
    import jax
    from jax.experimental import topologies

    if os.environ.get("TPU_LIBRARY_PATH") is None and not _has_module("libtpu"):
        raise RuntimeError(
            f"AOT compilation for {topo.name} needs libtpu, which is not installed. Install it "
            f"(no TPU needed; better in a separate virtualenv): {_pip_jax('tpu')}")
    # Compile-only devices use no chip: libtpu's one-process-per-host lock (/tmp/libtpu_lockfile) would
    # refuse a second plan running beside this one ("Internal error when accessing libtpu multi-process lockfile")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # libtpu's first use in a process prints its start-up complaints on a host without a TPU (no accelerator
    # type, no worker hostnames: irrelevant to compiling); they are shown only when the devices are not made
    try:
        with native_stderr.shown_only_on_error():
            desc = topologies.get_topology_desc(
                platform="tpu", topology_name=topo.topology, chip_config_name="megacore"
                if topo.device_kind in ("TPU v4", "TPU v5") else "default",
                chips_per_host_bounds=topo.chips_per_host_bounds, num_slices=num_slices, wrap=topo.wrap)
    except jax.errors.JaxRuntimeError as e:
        raise RuntimeError(f"libtpu could not make topology {topo.topology!r} ({topo.name}): {e}") from e
    return list(desc.devices)


def _gpu_devices(topo: Topology) -> list:
    import jax
    from jax._src import xla_bridge
    from jax.experimental import topologies

    spec = _GPU_TARGET_CONFIGS.get(topo.device_kind)
    if spec is None:
        raise RuntimeError(f"{topo.name}: no XLA GPU target config for {topo.device_kind!r}")
    if not (_has_module("jax_plugins.xla_cuda12") or _has_module("jax_plugins.xla_cuda13")):
        raise RuntimeError(
            f"AOT compilation for {topo.name} needs JAX's CUDA plugin, which is not installed. Install "
            f'it (no GPU needed; about 180 MB; better in a separate virtualenv): pip install '
            f'"jax-cuda12-plugin=={jax.__version__}" "jax-cuda12-pjrt=={jax.__version__}"')
    if not xla_bridge.backends_are_initialized():
        # Without a GPU the plugin's CUDA driver check fails and the plugin is skipped; the check
        # is irrelevant to compiling.
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    try:
        desc = topologies.get_topology_desc(platform="cuda", topology=topo.topology, target_config=spec)
    except NotImplementedError as e:
        raise RuntimeError(
            f"{topo.name}: the CUDA plugin is installed but not registered (on a machine without a GPU "
            "its driver check fails). Set JAX_PLATFORMS=cpu or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 "
            "before JAX initializes, or call abstract_devices before any other JAX call.") from e
    return list(desc.devices)


def _gpu_target_config(name: str, memory: int, bandwidth: int, model_str: str) -> str:
    """A stream_executor.GpuTargetConfigProto (text format) for an SXM Hopper GPU (sm_90a, 132 SMs).

    Fields from XLA's xla/backends/gpu/target_config/specs/{h100_sxm,h200}.txtpb, less the per-unit
    rate tables (cost model only) and collective_memory_granularity (unknown to jaxlib 0.10).
    """
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
    feature_extension: ACCELERATED_FEATURES
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  model_str: "{model_str}"
  device_address_bits: 64
  pcie_bandwidth: 34359738368
  ecc_enabled: true
  name: "{name}"
  device_interconnect_info {{
    active_links: 18
  }}
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
  patch: 0
}}
device_description_str: "{name}"
"""


_GPU_TARGET_CONFIGS = {
    "NVIDIA H100 80GB HBM3": _gpu_target_config(
        "NVIDIA H100 80GB HBM3", 84942979072, 3352320000000,
        "sm_9.0a with 84942979072B RAM, 132 cores, 1980000KHz clock, 2619000KHz mem clock, 52428800B L2$"),
    "NVIDIA H200 141GB HBM3e": _gpu_target_config(
        "NVIDIA H200 141GB HBM3e", 151397597184, 4800000000000,
        "sm_9.0a with 151397597184B RAM, 132 cores, 1980000KHz clock, 3750000KHz mem clock, 52428800B L2$"),
}
