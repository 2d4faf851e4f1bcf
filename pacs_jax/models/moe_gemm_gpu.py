"""tokamax's grouped matmul for a mixture-of-experts layer on an NVIDIA Hopper GPU (models/moe.py).

``jax.lax.ragged_dot`` on XLA:GPU computes every expert's group densely (num_experts x the FLOPs and a
[G, M, N] temporary: 2.1 GB for one 4,096 x 2,048 x 768 matmul over 128 experts, against tokamax's 3.8 KB;
docs/measurements.md 8c); tokamax's Pallas Mosaic GPU kernel (``mosaic_gpu``: sm90 and sm100) reads each
group's rows only, forward and backward (its VJP is two more of its kernels).

What it takes (tokamax 0.0.17, ``pallas_mosaic_gpu_common.check_bf16xbf16_or_f16xf16``): both operands
bfloat16 or both float16, and its backward pass a cotangent of that dtype too, so the product comes back in
the operands' dtype (accumulated in float32 inside the kernel, rounded once), as transformers' bfloat16 experts
give it; a float32 model runs ``jax.lax.ragged_dot`` (kernels.moe_gemm says why).

tokamax reads the GPU's generation from JAX's default device at trace time, its backward pass's too: a program
compiled for GPUs from a host without one (tools/plan_memory.py --topology=h200x8) is traced with its mesh's
first device as the default (``sharding.tracing_device``, around training/program.py ``Program.compile``).
Its import loads libtpu's Pallas modules, whose start-up lines are held back unless the import fails.
"""

from __future__ import annotations

import functools
import logging

import jax

from pacs_jax import native_stderr


def _not_a_cache_miss(record: logging.LogRecord) -> bool:
    """tokamax warns, at every call it traces, that its autotuning cache lacks the shape, and then uses its
    heuristic configuration (a page of lines a program, each naming the whole op): dropped; the kernels line
    names the kernel."""
    return not str(record.msg).startswith("Autotuning cache miss")


@functools.cache
def _kernel():
    """tokamax's Mosaic GPU ragged_dot implementation, imported once (quietly)."""
    with native_stderr.shown_only_on_error():
        from tokamax._src.ops.ragged_dot.api import IMPLEMENTATIONS
    logging.getLogger("absl").addFilter(_not_a_cache_miss)  # tokamax logs through absl's logger
    return IMPLEMENTATIONS["mosaic_gpu"]


def installed() -> bool:
    """Whether tokamax can be imported."""
    try:
        _kernel()
    except ImportError:
        return False
    return True


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes [G] int32 (summing to M) -> [M, N] in lhs's
    dtype (bfloat16 or float16, as rhs): row m times rhs of its group, tokamax's Mosaic GPU kernel."""
    import tokamax

    return tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype, implementation=[_kernel()])
