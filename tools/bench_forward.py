"""FLOP rate of our forward pass against this machine's fp32 matmul rate, and against transformers.

    python tools/bench_forward.py                          # Qwen2.5-0.5B shape, B=4, T=256, fp32
    python tools/bench_forward.py --preset Qwen3-0.6B --no_torch

Random weights (the FLOP count does not depend on them). Prints one table:
  - the measured fp32 matmul rate of one [N, N] @ [N, N] product (the machine's practical peak),
  - our jitted forward (tokens [B, T] -> logits [B, T, V]): time, FLOPs (analytic, and XLA's own
    count), FLOP/s and its fraction of the matmul rate,
  - transformers (PyTorch CPU) on the same weights and tokens: time, and our speed-up over it.
Times are the best of --repeats rounds after one warm-up (compilation) run; within a round the
runs take turns, so that load from other processes hits them alike.
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
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (default: 3)")
    parser.add_argument("--no_torch", action="store_true", help="skip the transformers comparison")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def interleaved_best_times(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each runner over ``repeats`` rounds, after one warm-up (compilation) run each.

    The runners take turns within each round, so that load from other processes on a shared machine
    hits all of them alike (the numbers are compared as ratios).
    """
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, float("inf"))
    for _ in tqdm(range(repeats), desc="timing rounds", leave=False):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def jax_matmul(n: int, dtype: str = "float32") -> Callable[[], object]:
    """A runner for one jitted [n, n] @ [n, n] matmul in ``dtype`` (default fp32; 2 n^3 FLOPs)."""
    a, b = (jax.random.normal(k, (n, n), dtype) for k in jax.random.split(jax.random.key(0)))
    matmul = jax.jit(jnp.matmul)
    return lambda: matmul(a, b).block_until_ready()


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


def torch_runners(model: models.Qwen, tokens: np.ndarray, n: int) -> dict:
    """transformers on the same weights: {"forward", "matmul" ([n, n] @ [n, n]): runners,
    "logits": getter of the last forward's logits, "threads": torch's thread count}.

    The weights go through models.export_hf into a temporary HF directory.
    """
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        directory = models.export_hf(model, f"{tmp}/hf", progress=True)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    input_ids = torch.from_numpy(tokens.astype(np.int64))
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = {}

    def forward():
        with torch.no_grad():
            out["logits"] = hf_model(input_ids=input_ids).logits

    return {"forward": forward, "matmul": lambda: a @ b, "logits": lambda: out["logits"].numpy(),
            "threads": torch.get_num_threads()}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    cfg = models.preset(args.preset, dtype="float32", param_dtype="float32")
    n = args.matmul_size
    model = models.init_random(cfg, seed=args.seed)
    graphdef, state = nnx.split(model)
    tokens = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
    device_tokens = jnp.asarray(tokens)
    compiled = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)).lower(state, device_tokens).compile()
    ours = {}

    def our_forward():
        ours["logits"] = compiled(state, device_tokens).block_until_ready()

    runs = {"jax matmul": jax_matmul(n), "ours": our_forward}
    if not args.no_torch:
        reference = torch_runners(model, tokens, n)
        runs.update({"torch matmul": reference["matmul"], "transformers": reference["forward"]})
    best = interleaved_best_times(runs, args.repeats)

    flops = forward_flops(cfg, args.batch, args.seq)
    counted = xla_flops(compiled)
    peak = 2 * n**3 / best["jax matmul"]
    rate = flops / best["ours"]
    rows = [("fp32 matmul rate (XLA)", f"{peak / 1e9:.1f} GFLOP/s",
             f"[{n}]x[{n}] on {jax.devices()[0].device_kind} ({jax.device_count()} device(s))"),
            ("forward", f"{best['ours'] * 1e3:.0f} ms", f"{args.preset} shape, B={args.batch}, T={args.seq}, fp32"),
            ("forward FLOPs", f"{flops / 1e12:.3f} TFLOP",
             "analytic" + (f"; XLA counts {counted / 1e12:.3f} TFLOP" if counted else "")),
            ("forward FLOP rate", f"{rate / 1e9:.1f} GFLOP/s", ""),
            ("fraction of matmul rate", f"{rate / peak:.1%}", "forward FLOP/s / XLA matmul FLOP/s")]
    result = {"matmul_flops_per_s": peak, "forward_s": best["ours"], "forward_flops": flops,
              "fraction_of_matmul_rate": rate / peak}
    if not args.no_torch:
        torch_peak = 2 * n**3 / best["torch matmul"]
        ref = reference["logits"]()
        rel = float(np.abs(np.asarray(ours["logits"]) - ref).max() / np.abs(ref).max())
        rows += [("fp32 matmul rate (torch)", f"{torch_peak / 1e9:.1f} GFLOP/s",
                  f"[{n}]x[{n}], {reference['threads']} threads"),
                 ("transformers forward", f"{best['transformers'] * 1e3:.0f} ms",
                  f"same weights and tokens; max rel logit diff {rel:.1e}"),
                 ("transformers FLOP rate", f"{flops / best['transformers'] / 1e9:.1f} GFLOP/s",
                  f"{flops / best['transformers'] / torch_peak:.1%} of torch's matmul rate"),
                 ("ours / transformers speed", f"{best['transformers'] / best['ours']:.2f}x", "> 1: ours is faster")]
        result.update(torch_s=best["transformers"], torch_matmul_flops_per_s=torch_peak,
                      speedup_vs_torch=best["transformers"] / best["ours"])
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>16}  {note}")
    return result


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    main(sys.argv[1:])
