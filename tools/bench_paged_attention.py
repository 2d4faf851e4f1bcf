"""One paged decode-attention call: our GPU kernel against the XLA paged path, in time
and in value, and the device's float32 matmul precision.

    python tools/bench_paged_attention.py                     # a GPU: 256 rows, Qwen2.5-1.5B heads, fills 64 and 2000
    python tools/bench_paged_attention.py --rows 2 --fills 60 --pool 64   # a CPU: the kernels in the Pallas interpreter

Rows of random queries against a random page pool [K, 2 layers, ``--pool`` pages, 16, Dh] through random
page tables, every row ``fill`` tokens long (table width ceil(fill / 16) rounded up to 8 pages). For each
implementation of models/paged_attention.py (``xla``, and ``ours``: impl "gpu", our Pallas kernel; JAX's
``jax.experimental.pallas.ops.gpu.paged_attention``, which it replaced in issue 40, is deprecated since JAX
0.11 and no longer compared) it prints the best of ``--rounds`` call times (dispatch included) and the largest
|difference| from the XLA path's output. First the device and its measured rates (tools/device_rates.py),
and how far a float32 matmul at JAX's default precision and at "highest" is from float64 (TF32 or not).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from device_rates import device_line, rates_line
from pacs_jax.models.paged_attention import PageView, paged_decode_attention

PAGE = 16


def matmul_errors(n: int = 1024) -> str:
    a = np.random.default_rng(0).normal(size=(n, n)).astype(np.float32)
    exact = a.astype(np.float64) @ a.astype(np.float64)
    parts = []
    for precision in (None, "highest"):
        out = np.asarray(jnp.dot(jnp.asarray(a), jnp.asarray(a), precision=precision))
        parts.append(f"{precision or 'default'} {np.abs(out - exact).max() / np.abs(exact).max():.1e}")
    return "float32 matmul, largest error relative to float64: " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--heads", type=int, default=12, help="query heads (default: Qwen2.5-1.5B's 12)")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--pool", type=int, default=8192, help="pages a layer of the pool")
    parser.add_argument("--fills", default="64,2000", help="comma-separated tokens a row")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    gpu = jax.devices()[0].platform == "gpu"
    print(f"{device_line()}; {rates_line(('bfloat16', 'float32'))}")
    print(matmul_errors())
    B, H, K, Dh = args.rows, args.heads, args.kv_heads, args.head_dim
    for dtype in args.dtypes.split(","):
        for fill in (int(f) for f in args.fills.split(",")):
            rng = np.random.default_rng(0)
            width = -(-(-(-fill // PAGE)) // 8) * 8
            q = jnp.asarray(rng.normal(size=(B, 1, H, Dh)), dtype)
            k_pool, v_pool = (jnp.asarray(rng.normal(size=(K, 2, args.pool, PAGE, Dh)), dtype) for _ in range(2))
            lengths = jnp.full((B,), fill, jnp.int32)
            view = PageView(jnp.asarray(rng.integers(0, args.pool, size=(B, width)), jnp.int32), lengths, lengths,
                            lengths)
            runs = {"xla": lambda q, k, v, view: paged_decode_attention(q, k, v, 1, view, impl="xla"),
                    "ours": lambda q, k, v, view: paged_decode_attention(q, k, v, 1, view, impl="gpu",
                                                                         interpret=not gpu)}
            outs, times = {}, {}
            for name, run in runs.items():
                call = jax.jit(run)
                try:
                    outs[name] = np.asarray(call(q, k_pool, v_pool, view), np.float32)
                except Exception as e:  # a kernel that does not lower for these shapes: say so, go on
                    print(f"  {name}: failed: {str(e).splitlines()[0][:200]}")
                    continue
                best = float("inf")
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    call(q, k_pool, v_pool, view).block_until_ready()
                    best = min(best, time.perf_counter() - start)
                times[name] = best
            print(f"{dtype}, {B} rows of {fill} tokens ({width} pages a table): " + ", ".join(
                f"{name} {times[name] * 1e6:.0f} us, max |diff| from xla {np.abs(out - outs['xla']).max():.2e}"
                for name, out in outs.items()))


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    main()
