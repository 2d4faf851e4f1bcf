"""Compiled memory of the fused log-prob gradient vs the naive [B, T, V] log_softmax.

Compiles (never runs) jax.grad of sum(token log-probs) w.r.t. hidden [B, T, D] and lm_head [D, V]
for both versions and prints XLA's temporary-buffer size, the ratio, and the largest buffer in the
optimized HLO. Defaults: one 16k-token sequence of Qwen2.5-0.5B (D=896, V=151936).

    python tools/bench_loss.py [--batch 1 --length 16384 --hidden 896 --vocab 151936 --chunks 256,512,1024]
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np

from device_rates import device_line
from pacs_jax import rl


def naive_logprobs(hidden, lm_head, targets):
    """[B, T, V] logits -> log_softmax -> gather: what the fused version avoids."""
    logits = jnp.einsum("btd,dv->btv", hidden, lm_head, preferred_element_type=jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


def compile_grad(logprobs_fn, specs):
    loss = lambda h, w, y: jnp.sum(logprobs_fn(h, w, y))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*specs).compile()


def largest_buffer(hlo_text: str) -> int:
    """Element count of the largest array shape written in an optimized HLO module."""
    dims = re.findall(r"\[(\d+(?:,\d+)*)\]", hlo_text)
    return max(int(np.prod([int(d) for d in s.split(",")])) for s in dims)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunks", default=f"256,{rl.logprobs.DEFAULT_CHUNK_SIZE},1024,2048")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    B, T, D, V = args.batch, args.length, args.hidden, args.vocab
    print(device_line())  # compiled memory only: no rate is measured
    print(f"gradient of sum(log-probs) w.r.t. hidden [{B}, {T}, {D}] and lm_head [{D}, {V}]; "
          f"B*T*V = {B * T * V:,} elements")
    print(f"{'dtype':>9} {'version':>14} {'temp GiB':>9} {'vs naive':>9} {'largest buffer (elements)':>26}")
    for dtype in args.dtypes.split(","):
        specs = (jax.ShapeDtypeStruct((B, T, D), jnp.dtype(dtype)), jax.ShapeDtypeStruct((D, V), jnp.dtype(dtype)),
                 jax.ShapeDtypeStruct((B, T), jnp.int32))
        naive = compile_grad(naive_logprobs, specs)
        naive_temp = naive.memory_analysis().temp_size_in_bytes
        print(f"{dtype:>9} {'naive':>14} {naive_temp / 2**30:9.2f} {1.0:9.3f} {largest_buffer(naive.as_text()):26,}")
        for chunk in map(int, args.chunks.split(",")):
            fused = compile_grad(lambda h, w, y, c=chunk: rl.token_logprobs(h, w, y, chunk_size=c), specs)
            temp = fused.memory_analysis().temp_size_in_bytes
            print(f"{dtype:>9} {f'fused C={chunk}':>14} {temp / 2**30:9.2f} {temp / naive_temp:9.3f} "
                  f"{largest_buffer(fused.as_text()):26,}")


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    main()
