"""FLOP rate of our forward pass against this machine's fp32 matmul rate, and against transformers.

    python tools/bench_forward.py                          # Qwen2.5-0.5B shape, B=4, T=256, fp32
    python tools/bench_forward.py --preset Qwen3-0.6B --no_torch

Random weights (the FLOP count does not depend on them). Prints one table:
  - the measured fp32 matmul rate of one [N, N] @ [N, N] product (the machine's practical peak),
  - our jitted forward (tokens [B, T] -> logits [B, T, V]): time, FLOPs (analytic, and XLA's own
    count), FLOP/s and its fraction of the matmul rate,
  - transformers (PyTorch CPU) on the same weights and tokens: time, and our speed-up over it.
Times are the best of --repeats runs after one warm-up (compilation) run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from pacs_jax import models


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="Qwen2.5-0.5B", choices=sorted(models.PRESETS), help="model shape")
    parser.add_argument("--batch", type=int, default=4, help="B (default: 4)")
    parser.add_argument("--seq", type=int, default=256, help="T (default: 256)")
    parser.add_argument("--matmul_size", type=int, default=2048, help="N of the reference matmul (default: 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (default: 3)")
    parser.add_argument("--no_torch", action="store_true", help="skip the transformers comparison")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def best_time(run: Callable[[], object], repeats: int, desc: str) -> tuple[float, object]:
    """(best wall time over ``repeats`` runs after one warm-up, the last result)."""
    result = run()  # warm-up: compilation, allocation
    times = []
    for _ in tqdm(range(repeats), desc=desc, leave=False):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return min(times), result


def matmul_rate(n: int, repeats: int) -> float:
    """Measured fp32 FLOP/s of one jitted [n, n] @ [n, n] matmul."""
    a, b = (jax.random.normal(k, (n, n), jnp.float32) for k in jax.random.split(jax.random.key(0)))
    matmul = jax.jit(jnp.matmul)
    seconds, _ = best_time(lambda: matmul(a, b).block_until_ready(), repeats, f"matmul {n}")
    return 2 * n**3 / seconds


def forward_flops(cfg: models.QwenConfig, batch: int, seq: int) -> int:
    """Matmul FLOPs of one forward pass over [batch, seq] tokens, LM head included.

    Attention counts the full [T, T] score and value products: the masked kernel computes them all.
    """
    D, H, K, Dh, F, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size, cfg.vocab_size)
    projections = D * H * Dh + 2 * D * K * Dh + H * Dh * D + 3 * D * F  # q, k, v, o, gate, up, down
    attention = 2 * seq * H * Dh  # q k^T and p v, per query token
    per_token = 2 * (cfg.num_hidden_layers * (projections + attention) + D * V)
    return batch * seq * per_token


def xla_flops(compiled) -> float | None:
    """XLA's FLOP count of a compiled program (None when the backend does not report it)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    return (analysis or {}).get("flops")


def torch_forward(model: models.Qwen, tokens: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
    """(best time, logits) of transformers' forward on the same weights (exported through export_hf)."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        directory = models.export_hf(model, f"{tmp}/hf", progress=True)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    input_ids = torch.from_numpy(tokens.astype(np.int64))

    def run():
        with torch.no_grad():
            return hf_model(input_ids=input_ids).logits

    seconds, logits = best_time(run, repeats, "transformers forward")
    return seconds, logits.numpy()


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    cfg = models.preset(args.preset, dtype="float32", param_dtype="float32")
    peak = matmul_rate(args.matmul_size, args.repeats)

    model = models.init_random(cfg, seed=args.seed)
    graphdef, state = nnx.split(model)
    tokens = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    compiled = forward.lower(state, jnp.asarray(tokens)).compile()
    device_tokens = jnp.asarray(tokens)
    ours_s, logits = best_time(lambda: compiled(state, device_tokens).block_until_ready(), args.repeats, "our forward")
    flops = forward_flops(cfg, args.batch, args.seq)
    counted = xla_flops(compiled)

    rows = [("fp32 matmul rate", f"{peak / 1e9:.1f} GFLOP/s", f"[{args.matmul_size}]x[{args.matmul_size}] on "
             f"{jax.devices()[0].device_kind} ({jax.device_count()} device(s))"),
            ("forward", f"{ours_s * 1e3:.0f} ms", f"{args.preset} shape, B={args.batch}, T={args.seq}, fp32"),
            ("forward FLOPs", f"{flops / 1e12:.3f} TFLOP",
             "analytic" + (f"; XLA counts {counted / 1e12:.3f} TFLOP" if counted else "")),
            ("forward FLOP rate", f"{flops / ours_s / 1e9:.1f} GFLOP/s", ""),
            ("fraction of matmul rate", f"{flops / ours_s / peak:.1%}", "")]
    result = {"matmul_flops_per_s": peak, "forward_s": ours_s, "forward_flops": flops,
              "fraction_of_matmul_rate": flops / ours_s / peak}
    if not args.no_torch:
        torch_s, torch_logits = torch_forward(model, tokens, args.repeats)
        ours = np.asarray(logits)
        rel = float(np.abs(ours - torch_logits).max() / np.abs(torch_logits).max())
        rows += [("transformers forward", f"{torch_s * 1e3:.0f} ms",
                  f"same weights and tokens; max rel logit diff {rel:.1e}"),
                 ("transformers FLOP rate", f"{flops / torch_s / 1e9:.1f} GFLOP/s", ""),
                 ("ours / transformers speed", f"{torch_s / ours_s:.2f}x", "> 1: ours is faster")]
        result.update(torch_s=torch_s, speedup_vs_torch=torch_s / ours_s)
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>16}  {note}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
