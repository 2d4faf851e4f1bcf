"""FLOP rate of the trainer's update phase (one PACS optimizer step) against the fp32 matmul rate.

    python tools/bench_update.py                       # Qwen2.5-0.5B widths, 2 layers, 8 x (64 + 64) tokens
    python tools/bench_update.py --layers 24 --prompts 2
    python tools/bench_update.py --packing             # padded vs packed rows (tools/bench_update_packing.py)

Runs training/update_step.make_update_step (fused log-probs, PACS loss, gradient, AdamW, in place)
on a random model and a synthetic mini-batch of whole groups. The FLOP rate counts useful work,
3 x the forward's matmul FLOPs, LM head on the response tokens only (the MFU convention: recomputation in the fused log-probs' backward
is not credited); XLA's own count of the compiled step is printed beside it, but it counts a
while-loop body once, so it undercounts the chunked log-prob loop. Prints the step time, FLOP/s and its fraction of a jitted fp32 matmul measured in the
same process; the runs take turns (tools/bench_forward.py) so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from device_rates import device_line
from bench_forward import forward_flops, interleaved_best_times, jax_matmul, xla_flops
from pacs_jax import models
from pacs_jax.rl.update_batch import UpdateBatch
from pacs_jax.training.learner.optim import make_optimizer
from pacs_jax.training.learner.update_step import make_update_step


def synthetic_batch(cfg: models.QwenConfig, prompts: int, n: int, prompt_len: int, response_len: int,
                    seed: int = 0) -> UpdateBatch:
    """A mini-batch of ``prompts`` groups of ``n``: random tokens, ragged responses, both labels per group."""
    rng = np.random.default_rng(seed)
    B, L = prompts * n, prompt_len + response_len
    ids = rng.integers(0, cfg.vocab_size, (B, L), dtype=np.int32)
    lengths = rng.integers(response_len // 2, response_len + 1, B)
    response_mask = (np.arange(response_len)[None] < lengths[:, None]).astype(np.float32)
    attention = np.concatenate([np.ones((B, prompt_len), np.int32), response_mask.astype(np.int32)], axis=1)
    rewards = np.tile(np.arange(n) % 2, prompts).astype(np.float32)
    old_logp = -rng.random((B, response_len), dtype=np.float32) * 5 * response_mask
    return jax.tree.map(jnp.asarray, UpdateBatch(input_ids=ids, attention_mask=attention, response_mask=response_mask,
                                                 old_logp=old_logp, rewards=rewards))


def main(argv=None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--packing" in argv:  # the padded-vs-packed comparison has options of its own
        from bench_update_packing import main as packing_main
        return {"packing comparison": 1.0} if packing_main(argv) == 0 else {}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="Qwen2.5-0.5B", choices=sorted(models.PRESETS))
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2: keeps a CPU run short)")
    parser.add_argument("--prompts", type=int, default=1, help="groups in the mini-batch")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--response_len", type=int, default=64)
    parser.add_argument("--matmul_size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    cfg = models.preset(args.preset, num_hidden_layers=args.layers)
    model = models.init_random(cfg)
    graphdef, params = nnx.split(model)
    optimizer, _ = make_optimizer(1e-6)
    opt_state = jax.jit(optimizer.init)(params)
    step = make_update_step(graphdef, optimizer, "pacs", group_size=args.n)
    batch = synthetic_batch(cfg, args.prompts, args.n, args.prompt_len, args.response_len)
    flops = xla_flops(step.lower(params, opt_state, batch).compile())
    state = {"params": params, "opt": opt_state}

    def run_step():
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], batch)
        jax.block_until_ready(metrics[-1]["loss"])

    times = interleaved_best_times({"matmul": jax_matmul(args.matmul_size), "update": run_step}, args.repeats)
    matmul_rate = 2 * args.matmul_size ** 3 / times["matmul"]
    B = args.prompts * args.n
    prompt_head = 2 * B * args.prompt_len * cfg.hidden_size * cfg.vocab_size  # the LM head runs on responses only
    analytic = 3 * (forward_flops(cfg, B, args.prompt_len + args.response_len) - prompt_head)
    rate = analytic / times["update"]
    rows = {
        "fp32 matmul rate (GFLOP/s)": matmul_rate / 1e9,
        "update step time (s)": times["update"],
        "update FLOPs, 3 x forward (GFLOP)": analytic / 1e9,
        "update FLOPs, XLA count (GFLOP, loops once)": (flops or float("nan")) / 1e9,
        "update FLOP rate (GFLOP/s)": rate / 1e9,
        "fraction of matmul rate": rate / matmul_rate,
    }
    print(f"PACS update step: {args.preset} widths, {args.layers} layers, {args.prompts}x{args.n} responses of "
          f"{args.prompt_len}+{args.response_len} tokens, fp32; {device_line()}")
    for name, value in rows.items():
        print(f"  {name:<45} {value:12.3f}")
    return rows


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    sys.exit(0 if main() else 1)
