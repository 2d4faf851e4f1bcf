"""Packed rows' attention against the padded pass at equal tokens: one attention call, forward + backward.

    python tools/bench_attention.py                                 # on a GPU: padded, packed, packed-xla
    python tools/bench_attention.py --preset Qwen2.5-1.5B --rows 8 --length 4608 --sequences 4
    python tools/bench_attention.py --runs packed-xla --rows 2 --length 1024     # a CPU: the XLA path only

The gradient of sum(out * g) with respect to q, k and v (random, the preset's H, K, Dh, ``--dtype``) of
``models.attention.attention`` on ``--rows`` rows of ``--length`` tokens, as the trainer's layers call it:
    padded      impl "cudnn", each row one sequence of ``length`` real tokens (on a GPU: cuDNN)
    packed      impl "cudnn" with segment ids, each row ``--sequences`` sequences of equal length
                (on a GPU: our block-sparse Pallas kernel, models/packed_attention_gpu.py)
    packed-xla  impl "xla" with the same segment ids (the blockwise XLA path)
Every run computes the same tokens; the causal masks differ (one long sequence against several short
ones). Prints the device and its measured peak rates (tools/device_rates.py), then each run's best
time of ``--rounds`` after compiling it and its ratio to the first run's.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench_decode import best_seconds
from device_rates import device_line, rates_line
from pacs_jax import models
from pacs_jax.models.attention import attention

RUNS = ("padded", "packed", "packed-xla")


def gradient_runner(run: str, q, k, v, g, sequences: int):
    """A runner of one jitted forward + backward of ``run`` (see the module docstring); waits for it."""
    B, T = q.shape[:2]
    segment_ids = None
    if run != "padded":
        ids = 1 + np.arange(T) * sequences // T  # [T]: sequence i of equal length has id i + 1
        segment_ids = jnp.asarray(np.broadcast_to(ids, (B, T)), jnp.int32)
    impl = "xla" if run == "packed-xla" else "cudnn"
    valid = jnp.ones((B, T), bool)

    def loss(q, k, v):
        out = attention(q, k, v, valid, segment_ids=segment_ids, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * g)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return lambda: jax.block_until_ready(grad(q, k, v))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="Qwen2.5-1.5B", choices=sorted(models.PRESETS), help="the heads' shape")
    parser.add_argument("--rows", type=int, default=8, help="rows (default: 8)")
    parser.add_argument("--length", type=int, default=4608, help="tokens a row (default: 4608, the paper's 512 + 4096)")
    parser.add_argument("--sequences", type=int, default=4, help="sequences a packed row (default: 4)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    runs = args.runs.split(",")
    if not set(runs) <= set(RUNS) or min(args.rows, args.length, args.sequences, args.rounds) < 1:
        parser.error(f"--runs takes {', '.join(RUNS)}; every size must be >= 1")

    cfg = models.PRESETS[args.preset]
    H, K, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (args.rows, args.length, heads, Dh), args.dtype)
               for key, heads in zip(keys, (H, K, K)))
    g = jax.random.normal(keys[3], q.shape, jnp.float32)
    print(f"{device_line()}; {rates_line((args.dtype,))}", flush=True)
    print(f"attention forward + backward: {args.rows} rows x {args.length} tokens, H {H}, K {K}, Dh {Dh} "
          f"({args.preset}), {args.dtype}; packed rows of {args.sequences} sequences", flush=True)
    first = None
    for run in runs:
        runner = gradient_runner(run, q, k, v, g, args.sequences)
        runner()  # compile
        seconds = best_seconds(runner, args.rounds)
        first = first or seconds
        print(f"  {run:<11} {seconds * 1e3:9.2f} ms  {seconds / first:5.2f} x {runs[0]}", flush=True)
    return 0


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    sys.exit(main())
