"""The device a benchmark runs on and its measured peak rates, printed beside the benchmark's figures.

    python tools/bench_device.py [--dtype bfloat16]

``peak_rates`` measures, in the calling process, the best rate of a jitted [n, n] @ [n, n] matmul in
the given dtype (n 8192 on an accelerator, 1024 on a CPU: the practical FLOP peak) and of a jitted
negation of a float32 array (bytes read + written: the practical memory-bandwidth peak), after one
warm-up (compilation) run each; ``device_line`` puts them on one line with the device kind, count
and the JAX version, e.g.
    device NVIDIA H200 x 1 (jax 0.11.2, gpu): bfloat16 matmul 780 TFLOP/s, copy 4.3e+03 GB/s (measured)
"""

from __future__ import annotations

import argparse
import sys

import jax

from bench_decode import best_seconds, copy_bandwidth
from bench_forward import jax_matmul


def peak_rates(dtype: str = "float32", *, matmul_size: int = 0, copy_mb: int = 0, rounds: int = 3) -> dict[str, float]:
    """{"matmul_flops": FLOP/s of a ``dtype`` matmul, "copy_bytes": bytes/s of a copy}, measured now
    (sizes 0: 8192 / 1024 MiB on an accelerator, 1024 / 256 MiB on a CPU)."""
    cpu = jax.devices()[0].platform == "cpu"
    n = matmul_size or (1024 if cpu else 8192)
    matmul = jax_matmul(n, dtype)
    matmul()
    return {"matmul_flops": 2 * n ** 3 / best_seconds(matmul, rounds),
            "copy_bytes": copy_bandwidth(copy_mb or (256 if cpu else 1024), rounds)}


def device_line(dtype: str = "float32", **kwargs) -> str:
    """One line: the device kind and count, JAX's version and platform, and ``peak_rates(dtype)``."""
    rates = peak_rates(dtype, **kwargs)
    device = jax.devices()[0]
    return (f"device {device.device_kind} x {jax.device_count()} (jax {jax.__version__}, {device.platform}): "
            f"{dtype} matmul {rates['matmul_flops'] / 1e12:.3g} TFLOP/s, copy {rates['copy_bytes'] / 1e9:.3g} GB/s "
            "(measured)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", help="the matmul's dtype (default: float32)")
    args = parser.parse_args(argv)
    print(device_line(args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
