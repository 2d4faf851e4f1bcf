"""What a benchmark runs on, and the rates it measures there, printed beside its figures.

``device_line()``: jax's version, the device kind and count, the host's CPUs.
``matmul_rate(dtype)``: FLOP/s of one big jitted matmul (``dtype`` inputs, float32 accumulation).
``copy_rate(megabytes)``: bytes read + written per second by a jitted negation of a float32 array.
``rates_line(dtypes)``: both, measured now, as one line.
Measured in the benchmark's own process, so a ratio against them holds under the same load.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp


def best_seconds(fn: Callable[[], object], rounds: int) -> float:
    """The best wall time of ``rounds`` calls of ``fn`` (which waits for its result)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def device_line() -> str:
    devices = jax.devices()
    return (f"jax {jax.__version__} on {len(devices)} x {devices[0].device_kind} ({devices[0].platform}), "
            f"{os.cpu_count()} cpus")


def matmul_rate(dtype: str, size: int = 4096, rounds: int = 3) -> float:
    """Measured FLOP/s of one [size, size] x [size, size] jnp matmul of ``dtype`` inputs (float32
    accumulation and output)."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32).astype(dtype)
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    mm(a, b).block_until_ready()
    return 2 * size**3 / best_seconds(lambda: mm(a, b).block_until_ready(), rounds)


def copy_rate(megabytes: int = 1024, rounds: int = 3) -> float:
    """Bytes read + written per second by a jitted negation of a float32 array of ``megabytes``."""
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    negate = jax.jit(jnp.negative)
    negate(x).block_until_ready()
    return 2 * x.nbytes / best_seconds(lambda: negate(x).block_until_ready(), rounds)


def rates_line(dtypes: Sequence[str] = ("bfloat16", "float32"), *, size: int = 0, megabytes: int = 0,
               rounds: int = 3) -> str:
    """'measured here: bfloat16 matmul X TFLOP/s, float32 matmul Y TFLOP/s, copy Z GB/s' (sizes 0: an
    8192 matmul and a 1024 MiB copy on an accelerator, 1024 and 256 MiB on a CPU)."""
    cpu = jax.devices()[0].platform == "cpu"
    size, megabytes = size or (1024 if cpu else 8192), megabytes or (256 if cpu else 1024)
    parts = [f"{d} matmul {matmul_rate(d, size, rounds) / 1e12:.2f} TFLOP/s" for d in dtypes]
    parts.append(f"copy {copy_rate(megabytes, rounds) / 1e9:.1f} GB/s (read + write of {megabytes} MiB)")
    return "measured here: " + ", ".join(parts)
