"""How close the paged sampler's decode step is to the memory-bandwidth limit.

    python tools/bench_decode.py [--preset Qwen2.5-0.5B] [--dtype float32] [--slots 16] [--fill 64]
                                 [--steps 32] [--page-size 16] [--rounds 3]

``slots`` random prompts of ``fill`` tokens, one greedy sample each (no stop id), in ``slots`` decode
slots of the paged sampler (random weights). A decode step's time is (t(1 + steps tokens) - t(1
token)) / steps, best of ``rounds`` each (prefill and first token cancel): one program, the 1-token
call the same call with every row's budget 1 (no decode step), compiled and run once first. What a
step must read: the weights in the compute dtype (the decode layout) and the live K/V pages, slots x
(fill + steps / 2 on average) tokens x layers x 2 (K and V) x kv heads x head dim, each token's page
read whole (rounded up to pages). The copy bandwidth is measured in the same
process: a jitted negation of a ``--copy-mb`` array (bytes read + written / its best time). Prints
``decode step X ms, Y GB live, Z of the measured copy bandwidth`` (Z: Y / X over the copy rate). X is
"n/a (too short to time)" when the difference is not positive (the steps took no longer than noise
on a busy CPU: raise --steps and --rounds), Z too then, and when it falls outside [0, 1] (a step
faster than the copy rate allows: too short to time, or the weights held in a CPU's cache).
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from device_rates import best_seconds, copy_rate, device_line, matmul_rate
from pacs_jax import models, sampling, sharding
from pacs_jax.sampling.buckets import round_up


def step_bytes(cfg: models.QwenConfig, params: int, slots: int, fill: int, steps: int, page_size: int) -> float:
    """Bytes one decode step reads: the weights in the compute dtype and the live K/V pages (each
    row's tokens at mid-run, rounded up to whole pages)."""
    itemsize = jnp.dtype(cfg.dtype).itemsize
    tokens = round_up(fill + steps // 2, page_size)
    kv = slots * tokens * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    return params * itemsize + kv


NOT_MEASURABLE = "n/a (too short to time)"


def result_line(step_seconds: float, live_bytes: float, copy_bytes_per_second: float) -> str:
    """"decode step X ms, Y GB live, Z of the measured copy bandwidth", Z the share of the copy rate
    the step reaches (``live_bytes / step_seconds`` over ``copy_bytes_per_second``). X is
    ``NOT_MEASURABLE`` when ``step_seconds`` is not positive (a difference of two timings), Z when X is
    or when Z falls outside [0, 1]: never a negative time, never a share above 1 or below 0."""
    timed = step_seconds > 0 and math.isfinite(step_seconds)
    share = live_bytes / step_seconds / copy_bytes_per_second if timed and copy_bytes_per_second > 0 else math.nan
    step_text = f"{step_seconds * 1e3:.2f} ms" if timed else NOT_MEASURABLE
    share_text = f"{share:.2f}" if 0 <= share <= 1 else NOT_MEASURABLE
    return f"decode step {step_text}, {live_bytes / 1e9:.3f} GB live, {share_text} of the measured copy bandwidth"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="Qwen2.5-0.5B")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (default 0: the preset's)")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary entries (default 0: the preset's)")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--fill", type=int, default=64, help="prompt tokens of every row")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copy-mb", type=int, default=1024, help="the copy bandwidth's array")
    args = parser.parse_args()
    if (min(args.slots, args.fill, args.steps, args.page_size, args.rounds, args.copy_mb) < 1
            or min(args.layers, args.vocab) < 0):
        parser.error("every size must be >= 1")

    cfg = models.preset(args.preset, eos_token_id=None, dtype=args.dtype, param_dtype=args.dtype)
    cfg = cfg.replace(num_hidden_layers=args.layers or cfg.num_hidden_layers, vocab_size=args.vocab or cfg.vocab_size)
    model = models.init_random(cfg, seed=0)
    graphdef, state = nnx.split(model)
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(args.slots, args.fill))
    placed = sharding.placement(("batch", "length"), prompts.shape)
    tokens = jax.device_put(prompts.astype(np.int32), placed)
    mask = jax.device_put(np.ones(prompts.shape, np.int32), placed)
    print(f"{args.preset} ({args.dtype}): {args.slots} slots, {args.fill}-token prompts, {args.steps} decode steps, "
          f"pages of {args.page_size}, {cfg.num_hidden_layers} layers; {device_line()}")

    settings = sampling.SamplingSettings(max_new_tokens=1 + args.steps, slots=args.slots, page_size=args.page_size)

    def run(new_tokens: int):
        budgets = np.full(args.slots, new_tokens, np.int32)
        return lambda: jax.block_until_ready(sampling.sample(graphdef, state, tokens, mask, settings,
                                                             jax.random.key(0), budgets).tokens)

    long, short = run(1 + args.steps), run(1)
    long(), short()  # compile, and the first call of each
    step = (best_seconds(long, args.rounds) - best_seconds(short, args.rounds)) / args.steps
    rate = copy_rate(args.copy_mb, args.rounds)
    live = step_bytes(cfg, params, args.slots, args.fill, args.steps, args.page_size)
    size = 1024 if jax.devices()[0].platform == "cpu" else 4096  # a CPU's rate at 4096: seconds of a check
    print(f"copy bandwidth {rate / 1e9:.1f} GB/s (read + write of a {args.copy_mb} MiB array); {args.dtype} matmul "
          f"{matmul_rate(args.dtype, size, args.rounds) / 1e12:.2f} TFLOP/s ({size}^3)")
    print(result_line(step, live, rate))


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    main()
