"""Sampler throughput vs Hugging Face ``transformers`` generate, on the same random weights, one process.

    python tools/bench_sampling.py [--preset Qwen2.5-0.5B] [--batch 32] [--prompt 64] [--new 64]
                                   [--dtypes float32,bfloat16] [--probe 8] [--rounds 3]

Greedy decoding of ``batch`` random prompts of ``prompt`` tokens, exactly ``new`` new tokens each (no
stop id), both sides on the same weights (random, exported with models.export_hf).

1. Probe: each side generates ``probe`` tokens in each dtype (after a warm-up; our first call
   compiles and is not timed); the faster dtype is that side's best.
2. Main: ``rounds`` rounds, each timing our generate of ``new`` tokens, of 1 token, and transformers'
   generate of ``new`` tokens, interleaved so that load from other processes hits both sides alike;
   the best time of each is kept.

Prints tokens/s (new tokens / wall time, prefill included) per side, their ratio, and our decode
step's achieved FLOP rate as a fraction of the machine's measured matmul rate (a 4096^3 jnp matmul,
float32 and our dtype, measured in each round; the best is kept). Our decode
step time is (t(new tokens) - t(1 token)) / (new - 1): prefill and first token cancel. Decode-step
FLOPs: 2 * batch * (matmul parameters, lm_head included) + attention (4 * batch * cache slots *
heads * head_dim per layer).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from pacs_jax import models, sampling
from pacs_jax.sampling.buckets import round_up


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_rate(dtype: str, size: int = 4096, repeats: int = 3) -> float:
    """Measured FLOP/s of one big jnp matmul (``dtype`` inputs, float32 accumulation and output)."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32).astype(dtype)
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    mm(a, b).block_until_ready()
    return 2 * size**3 / min(_timed(lambda: mm(a, b).block_until_ready()) for _ in range(repeats))


def decode_step_flops(cfg: models.QwenConfig, batch: int, cache_slots: int) -> float:
    D, F, H, K, Dh, L = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers)
    per_layer = D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F
    matmul_params = L * per_layer + D * cfg.vocab_size
    attention = L * 4 * cache_slots * H * Dh
    return 2.0 * batch * matmul_params + batch * attention


def ours(hf_dir: pathlib.Path, dtype: str, prompts: list[list[int]]) -> Callable[[int], None]:
    """A function generating ``tokens`` new tokens per prompt with sampling.generate."""
    model = models.from_pretrained(hf_dir, dtype=dtype, param_dtype=dtype)

    def run(tokens: int) -> None:
        out = sampling.generate(model, prompts, max_new_tokens=tokens, stop_token_ids=())
        assert all(len(t) == tokens for t in out.tokens), "a row stopped early"

    return run


def theirs(hf_dir: pathlib.Path, dtype: str, prompts: list[list[int]]) -> Callable[[int], None]:
    """A function generating ``tokens`` new tokens per prompt with transformers generate."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(tokens: int) -> None:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out.shape[1] == ids.shape[1] + tokens

    return run


SIDES = {"ours": ours, "transformers": theirs}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="Qwen2.5-0.5B")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--probe", type=int, default=8, help="new tokens of the dtype probe")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.new < 2 or args.probe < 1 or args.rounds < 1:
        parser.error("need --new >= 2, --probe >= 1, --rounds >= 1")

    cfg = models.preset(args.preset, eos_token_id=None)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, size=(args.batch, args.prompt)).tolist()
    print(f"{args.preset}: batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, greedy; "
          f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus), "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)")

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = pathlib.Path(tmp) / "model"
        models.export_hf(models.init_random(cfg, seed=0), hf_dir)

        print(f"\nprobe: seconds for {args.probe} new tokens")
        best_dtype, runners = {}, {}
        for side, make in SIDES.items():
            probe = {}
            for dtype in args.dtypes.split(","):
                run = make(hf_dir, dtype, prompts)
                run(args.probe)  # compile / warm up
                probe[dtype] = _timed(lambda: run(args.probe))
                print(f"  {side:<13}{dtype:<10}{probe[dtype]:8.2f}")
                if probe[dtype] == min(probe.values()):
                    best_dtype[side], runners[side] = dtype, run
                del run
            runners[side](args.new)  # warm up (and compile) the main shapes
        runners["ours"](1)

        times = {"ours": [], "ours_1": [], "transformers": []}
        peak = {"float32": 0.0, best_dtype["ours"]: 0.0}
        for _ in range(args.rounds):
            for dtype in peak:  # measured between the runs, best kept: the same load as the runs
                peak[dtype] = max(peak[dtype], matmul_rate(dtype))
            times["ours"].append(_timed(lambda: runners["ours"](args.new)))
            times["ours_1"].append(_timed(lambda: runners["ours"](1)))
            times["transformers"].append(_timed(lambda: runners["transformers"](args.new)))

    best = {k: min(v) for k, v in times.items()}
    step = (best["ours"] - best["ours_1"]) / (args.new - 1)
    flops = decode_step_flops(cfg, args.batch, round_up(args.prompt, 64) + args.new)
    print(f"\nmain: best of {args.rounds} interleaved rounds, {args.new} new tokens")
    print(f"{'side':<13}{'dtype':<10}{'seconds':>9}{'tokens/s':>10}")
    rates = {}
    for side in SIDES:
        rates[side] = args.batch * args.new / best[side]
        print(f"{side:<13}{best_dtype[side]:<10}{best[side]:>9.2f}{rates[side]:>10.1f}")
    print(f"\nratio ours / transformers: {rates['ours'] / rates['transformers']:.2f}")
    print(f"our decode step: {step * 1e3:.1f} ms, {flops / 1e9:.1f} GFLOP -> {flops / step / 1e9:.1f} GFLOP/s")
    for dtype, rate in peak.items():
        print(f"  = {flops / step / rate:.1%} of the measured {dtype} matmul rate ({rate / 1e9:.1f} GFLOP/s, "
              f"4096^3, float32 accumulation)")


if __name__ == "__main__":
    main()
