"""Sampler throughput vs Hugging Face ``transformers`` generate, on the same random weights, one process.

    python tools/bench_sampling.py [--preset Qwen2.5-0.5B] [--batch 32] [--prompt 64] [--new 64]
                                   [--dtypes float32,bfloat16] [--repeats 2]

Greedy decoding of ``batch`` random prompts of ``prompt`` tokens, exactly ``new`` new tokens each (no
stop id). For each dtype and each side the best of ``repeats`` warm runs is timed (our first call
compiles and is not timed). Prints new tokens/s per (side, dtype), the ratio of each side's best,
and our decode step's achieved FLOP rate as a fraction of the machine's measured float32 matmul rate.

Our decode-step time is (t(new tokens) - t(1 token)) / (new - 1): the prefill and first token cancel.
Decode-step FLOPs: 2 * batch * (matmul parameters, lm_head included) + attention
(4 * batch * cache slots * heads * head_dim per layer).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from pacs_jax import models, sampling
from pacs_jax.sampling.buckets import round_up


def matmul_rate(size: int = 4096, repeats: int = 5) -> float:
    """Measured float32 FLOP/s of one big jnp matmul on the default device."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    best = min(_timed(lambda: mm(a, b).block_until_ready()) for _ in range(repeats))
    return 2 * size**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_step_flops(cfg: models.QwenConfig, batch: int, cache_slots: int) -> float:
    D, F, H, K, Dh, L = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers)
    per_layer = D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F
    matmul_params = L * per_layer + D * cfg.vocab_size
    attention = L * 4 * cache_slots * H * Dh
    return 2.0 * batch * matmul_params + batch * attention


def ours(hf_dir: pathlib.Path, dtype: str, prompts: list[list[int]], new: int, repeats: int) -> tuple[float, float]:
    """(best seconds for ``new`` tokens, best seconds for 1 token) of sampling.generate."""
    model = models.from_pretrained(hf_dir, dtype=dtype, param_dtype=dtype)

    def run(tokens):
        return sampling.generate(model, prompts, max_new_tokens=tokens, stop_token_ids=())

    times = {}
    for tokens in (new, 1):
        out = run(tokens)  # compiles
        assert all(len(t) == tokens for t in out.tokens), "a row stopped early"
        times[tokens] = min(_timed(lambda: run(tokens)) for _ in range(repeats))
    return times[new], times[1]


def theirs(hf_dir: pathlib.Path, dtype: str, prompts: list[list[int]], new: int, repeats: int) -> tuple[float, None]:
    """(best seconds for ``new`` tokens, None) of transformers generate (its step time is not needed)."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(tokens):
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out.shape[1] == ids.shape[1] + tokens
        return out

    run(2)  # warm-up
    best = min(_timed(lambda: run(new)) for _ in range(repeats))
    del model
    return best, None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="Qwen2.5-0.5B")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sides", default="ours,transformers")
    args = parser.parse_args()
    if args.new < 2:
        parser.error("--new must be >= 2")

    cfg = models.preset(args.preset, eos_token_id=None)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, size=(args.batch, args.prompt)).tolist()
    print(f"{args.preset}: batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, greedy; "
          f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus), "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    peak = matmul_rate()
    print(f"measured float32 matmul rate: {peak / 1e9:.1f} GFLOP/s")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = pathlib.Path(tmp) / "model"
        models.export_hf(models.init_random(cfg, seed=0), hf_dir)
        for side in args.sides.split(","):
            for dtype in args.dtypes.split(","):
                fn = ours if side == "ours" else theirs
                full, first = fn(hf_dir, dtype, prompts, args.new, args.repeats)
                rows.append((side, dtype, full, first))

    cache_slots = round_up(args.prompt, 64) + args.new
    flops = decode_step_flops(cfg, args.batch, cache_slots)
    print(f"\n{'side':<13}{'dtype':<10}{'total s':>9}{'tokens/s':>10}{'step ms':>9}{'step GFLOP/s':>14}{'of peak':>9}")
    best: dict[str, float] = {}
    for side, dtype, full, first in rows:
        tokens_per_s = args.batch * args.new / full
        best[side] = max(best.get(side, 0.0), tokens_per_s)
        line = f"{side:<13}{dtype:<10}{full:>9.2f}{tokens_per_s:>10.1f}"
        if first is not None:
            step = (full - first) / (args.new - 1)
            line += f"{step * 1e3:>9.1f}{flops / step / 1e9:>14.1f}{flops / step / peak:>9.1%}"
        print(line)
    if len(best) == 2:
        print(f"\nratio ours / transformers (each at its best dtype): {best['ours'] / best['transformers']:.2f}")


if __name__ == "__main__":
    main()
