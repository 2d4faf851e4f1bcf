"""Sampler throughput vs Hugging Face ``transformers`` generate, on the same random weights, one process;
or (``--compare``) our continuous-batching and paged samplers vs our static one on long-tailed response
lengths; or (``--carry-over``) carry-over rollouts vs today's paged call, step by step.

    python tools/bench_sampling.py [--preset Qwen2.5-0.5B] [--batch 32] [--prompt 64] [--new 64]
                                   [--dtypes float32,bfloat16] [--rounds 3]
    python tools/bench_sampling.py --compare [--preset Qwen2.5-0.5B] [--batch 16] [--n 4] [--slots 32]
                                   [--tail-slots 1] [--page-size 16] [--new 512] [--dtypes float32]
    python tools/bench_sampling.py --carry-over [--preset Qwen2.5-0.5B] [--layers 2] [--batch 16] [--n 4]
                                   [--slots 32] [--page-size 16] [--new 512] [--steps 5] [--max-staleness 1]

``--compare``: ``batch`` random prompts x ``n`` samples, greedy, no stop id; each row's budget is drawn
from a log-normal with median new / 8 and sigma 1, rounded and clipped to [1, new] (RL response
lengths are right-skewed: most answers end far below the budget, a few run into it; with 64 rows about
one in three calls has a row at the budget). Both samplers run the same rows with the same budgets
in the same KV-cache memory, ``slots`` decode slots: static batching
runs the rows in calls of ``slots`` rows, each call until its longest row ends (the trainer's static
sampler with ``rollout.micro_batches``); the continuous sampler runs them all in one call, a slot
taking the next row when its row ends, and once no row waits narrows its decode batch down to
``tail-slots`` as rows end (0: never); the paged sampler does the same over a page pool of
``page-size``-token pages (each prompt stored once for its n rows).
Prints each one's decode steps, slot utilisation (tokens made by decode steps / slot steps, the
slots decoded at each step summed) and tokens/s (generated tokens / wall time, prefill included; best
of ``rounds``, the program compiled ahead of time first); then how the continuous and the paged
sampler's tokens differ from the static one's (the fraction of differing tokens and where the
differing rows first diverge: 0 on a CPU; on a GPU or TPU matmuls over different batch widths round
differently, and a row that once selects another token goes its own way from there); and ends with
``continuous vs static: utilisation U_c vs U_s, tokens/s ratio R_c`` and
``paged vs static: utilisation U_p vs U_s, tokens/s ratio R_p, differing tokens F %``.

``--carry-over``: ``steps`` training steps of ``batch`` prompt groups of ``n`` samples each, greedy, no
stop id, each row's budget log-normal as ``--compare``'s (the budget ``new`` is 8x the median). Today's
paged call (``sampling.sample``, ``slots`` decode slots, no narrowing) samples each step's ``batch``
prompts and waits for their longest row; the carry-over engine (sampling/carry_over.py, as the
trainer runs it: room for 2 ``batch`` prompts a call, ``batch`` groups returned, ``max-staleness``)
inserts 2 ``batch`` prompts at the first call and then as many as the call before returned (and
those it dropped), and ends each call once ``batch`` groups are complete, the rows still running
going on in the next call. Both take their prompts and budgets from one stream, in order; both are
compiled ahead of time. Prints each step's slot utilisation (tokens sampled by decode steps / (decode
steps x slots): an accelerator's decode step reads all the weights however few of its slots run, so
this is the fraction of its decode time that samples tokens) and, over the steps after the first (the
first starts from empty slots), decode steps, utilisation and this CPU's decoded tokens/s (tokens
sampled by decode steps / wall time of the calls, prefill included) of each, and ends with
``carry-over vs paged: utilisation U_c vs U_p (ratio X), tokens/s T_c vs T_p (ratio Y)``.

Greedy decoding of ``batch`` random prompts of ``prompt`` tokens, exactly ``new`` new tokens each (no
stop id), both sides on the same weights (random, exported with models.export_hf).

Every (side, dtype) is warmed up (our first calls compile and are not timed), then ``rounds``
rounds each time every (side, dtype) at ``new`` tokens (ours also at 1 token), interleaved so that
load from other processes hits all alike; the best time of each is kept, and each side is judged
at its best dtype.

Prints tokens/s (new tokens / wall time, prefill included) per side, their ratio, and our decode
step's achieved FLOP rate as a fraction of the machine's measured matmul rate (a 4096^3 jnp matmul
per dtype, float32 accumulation, measured in each round; the best is kept). Our decode step time
is (t(new tokens) - t(1 token)) / (new - 1): prefill and first token cancel. Decode-step
FLOPs: 2 * batch * (matmul parameters, lm_head included) + attention (4 * batch * cache slots *
heads * head_dim per layer).
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from device_rates import device_line, matmul_rate, rates_line
from pacs_jax import checkpoints, models, sampling, sharding
from pacs_jax.sampling.buckets import round_up
from pacs_jax.sampling.carry_over import CarryOverSampler
from pacs_jax.sampling.engine import lower_sample


def _timed(fn: Callable[[], object]) -> float:
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


def ours(hf_dir: pathlib.Path, dtype: str, prompts: list[list[int]]) -> Callable[[int], None]:
    """A function generating ``tokens`` new tokens per prompt with sampling.generate."""
    model = checkpoints.from_pretrained(hf_dir, dtype=dtype, param_dtype=dtype)

    def run(tokens: int) -> None:
        out = sampling.generate(model, prompts, max_new_tokens=tokens, stop_token_ids=())
        assert all(len(t) == tokens for t in out.tokens), "a row stopped early"

    return run


def theirs(hf_dir: pathlib.Path, dtype: str, prompts: list[list[int]]) -> Callable[[int], None]:
    """A function generating ``tokens`` new tokens per prompt with transformers generate (PyTorch's: imported
    here, as --compare and --carry-over run without it)."""
    import torch
    from transformers import AutoModelForCausalLM

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


def long_tailed_budgets(rows: int, new: int, seed: int = 0) -> np.ndarray:
    """[rows] budgets: log-normal with median new / 8 and sigma 1, rounded, clipped to [1, new]."""
    draws = np.random.default_rng(seed).lognormal(np.log(new / 8), 1.0, size=rows)
    return np.clip(np.rint(draws), 1, new).astype(np.int32)


def compare(args) -> None:
    """The continuous sampler against static batching on the same rows, long-tailed budgets and
    decode slots (the same KV-cache memory)."""
    dtype = args.dtypes.split(",")[0]
    cfg = models.preset(args.preset, eos_token_id=None, dtype=dtype, param_dtype=dtype)
    cfg = cfg.replace(num_hidden_layers=args.layers or cfg.num_hidden_layers, vocab_size=args.vocab or cfg.vocab_size)
    rows = args.batch * args.n
    if not 1 <= args.slots <= rows or args.slots % args.n or rows % args.slots:
        raise SystemExit(f"--slots {args.slots}: must divide the {rows} rows (--batch x --n) and be a multiple of "
                         f"--n {args.n} (static batching runs --slots / --n prompts a call)")
    if not 0 <= args.tail_slots <= args.slots:
        raise SystemExit(f"--tail-slots {args.tail_slots}: must be in [0, --slots {args.slots}]")
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, size=(args.batch, args.prompt)).tolist()
    budgets = long_tailed_budgets(rows, args.new)
    print(f"{args.preset} ({dtype}): {args.batch} prompts x n {args.n} = {rows} rows, prompt {args.prompt}, budgets "
          f"log-normal (median {args.new / 8:g}, sigma 1) clipped to {args.new}: mean {budgets.mean():.1f}, max "
          f"{budgets.max()}; {cfg.num_hidden_layers} layers; {device_line()}")
    print(rates_line((dtype,)), flush=True)
    model = models.init_random(cfg, seed=0)
    graphdef, state = nnx.split(model)

    def calls(prompts_a_call: int) -> list[tuple[jax.Array, jax.Array, np.ndarray]]:
        """(tokens, mask, budgets) of each sampler call of ``prompts_a_call`` prompts."""
        out = []
        for first in range(0, args.batch, prompts_a_call):
            host_tokens, host_mask = sampling.left_pad(prompts[first:first + prompts_a_call], prompts_a_call,
                                                       round_up(args.prompt, 64))
            placed = sharding.placement(("batch", "length"), host_tokens.shape)
            out.append((jax.device_put(host_tokens, placed), jax.device_put(host_mask, placed),
                        budgets[first * args.n:(first + prompts_a_call) * args.n]))
        return out

    sides = {"static": (calls(args.slots // args.n), None, None, None),
             "continuous": (calls(args.batch), args.slots, args.tail_slots or None, None),
             "paged": (calls(args.batch), args.slots, args.tail_slots or None, args.page_size)}
    results = {}
    for name, (side_calls, slots, tail_slots, page_size) in sides.items():
        settings = sampling.SamplingSettings(max_new_tokens=args.new, n=args.n, slots=slots, tail_slots=tail_slots,
                                             page_size=page_size)

        def run():
            return [jax.device_get(sampling.sample(graphdef, state, tokens, mask, settings, jax.random.key(0), b))
                    for tokens, mask, b in side_calls]

        # compiled ahead of time (the program a call runs), so no untimed sampling run is needed
        tokens, mask, _ = side_calls[0]
        compile_s = _timed(lambda: lower_sample(graphdef, sharding.abstract(state), sharding.abstract(tokens),
                                                sharding.abstract(mask), settings).compile())
        seconds, outs = float("inf"), None
        for _ in range(args.rounds):
            start = time.perf_counter()
            outs = run()
            seconds = min(seconds, time.perf_counter() - start)
        lengths = np.concatenate([o.lengths for o in outs])
        steps = sum(int(o.decode_steps) for o in outs)
        utilisation = sampling.slot_utilisation(lengths, sum(int(o.slot_steps) for o in outs))
        results[name] = (np.concatenate([o.tokens for o in outs]), lengths, utilisation, int(lengths.sum()) / seconds)
        print(f"{name:<11} {len(outs)} call(s) of {rows // len(outs)} rows in {args.slots} slots (narrowing to "
              f"{tail_slots or '-'})  decode steps {steps:>5}  utilisation {utilisation:.3f}  {seconds:7.1f} s  "
              f"{results[name][3]:7.1f} tokens/s  (compiled in {compile_s:.1f} s)", flush=True)
    for name, (_, side_lengths, _, _) in results.items():
        if not np.array_equal(side_lengths, budgets):  # no stop id: every row runs to its budget
            raise SystemExit(f"{name}: {int(np.sum(side_lengths != budgets))} of {rows} rows did not end at their budget")
    static_tokens, _, u_s, r_s = results["static"]
    differing = {}
    for name in ("continuous", "paged"):
        differing[name], line = divergence(results[name][0], static_tokens, budgets)
        print(f"{name} vs static: {line}")
    (_, _, u_c, r_c), (_, _, u_p, r_p) = results["continuous"], results["paged"]
    print(f"continuous vs static: utilisation {u_c:.3f} vs {u_s:.3f}, tokens/s ratio {r_c / r_s:.2f}")
    print(f"paged vs static: utilisation {u_p:.3f} vs {u_s:.3f}, tokens/s ratio {r_p / r_s:.2f}, differing tokens "
          f"{100 * differing['paged']:.2f} %")


def carry_over_steps(cfg: models.QwenConfig, *, batch: int, n: int, slots: int, page_size: int, prompt: int,
                     new: int, steps: int, max_staleness: int = 1, seed: int = 0) -> dict[str, tuple[float, float]]:
    """``--carry-over``'s comparison on a model of ``cfg`` (random weights); prints its lines and returns
    {"carry-over" | "paged": (slot utilisation, decoded tokens/s)} over the steps after the first."""
    if steps < 2:
        raise SystemExit(f"--steps {steps}: need 2 or more (the first starts from empty slots and is not counted)")
    if not 1 <= slots <= batch * n:
        raise SystemExit(f"--slots {slots}: must be in [1, {batch * n}] (--batch x --n rows a step)")
    graphdef, state = nnx.split(models.init_random(cfg, seed=seed))
    settings = sampling.SamplingSettings(max_new_tokens=new, n=n, slots=slots, page_size=page_size)
    engine = CarryOverSampler(graphdef, settings, prompts=2 * batch, prompt_length=prompt, groups=batch,
                              max_staleness=max_staleness)
    rng = np.random.default_rng(seed)

    def draw(count: int) -> list[tuple[list[int], np.ndarray]]:
        """The stream's next ``count`` prompts and their [n] budgets."""
        budgets = long_tailed_budgets(count * n, new, seed=int(rng.integers(1 << 31))).reshape(count, n)
        return [(rng.integers(0, cfg.vocab_size, size=prompt).tolist(), b) for b in budgets]

    def placed(items: list[tuple[list[int], np.ndarray]], width: int) -> tuple[jax.Array, jax.Array, np.ndarray]:
        """[width, prompt] tokens and mask (rows past ``items``: batch padding) and [width n] budgets."""
        tokens, mask = sampling.left_pad([p for p, _ in items], width, prompt)
        budgets = np.full((width, n), 1, np.int32)
        budgets[:len(items)] = [b for _, b in items]
        where = sharding.placement(("batch", "length"), tokens.shape)
        return jax.device_put(tokens, where), jax.device_put(mask, where), budgets.reshape(-1)

    abstract = lambda width: jax.ShapeDtypeStruct((width, prompt), jnp.int32,
                                                 sharding=sharding.placement(("batch", "length"), (width, prompt)))
    compile_s = {"paged": _timed(lambda: lower_sample(graphdef, sharding.abstract(state), abstract(batch),
                                                      abstract(batch), settings).compile()),
                 "carry-over": _timed(lambda: engine.lower(sharding.abstract(state), abstract(2 * batch),
                                                           abstract(2 * batch)).compile())}
    print(f"{batch} groups of n {n} a step in {slots} slots, pages of {page_size} tokens, prompt {prompt}, budgets "
          f"log-normal (median {new / 8:g}, sigma 1) clipped to {new}; carry-over: room for {2 * batch} prompts a "
          f"call, max_staleness {max_staleness}; compiled in {compile_s['paged']:.1f} s (paged), "
          f"{compile_s['carry-over']:.1f} s (carry-over)", flush=True)
    stream = []  # the prompts and their budgets in order, drawn as the sides need them

    def take(start: int, count: int) -> list[tuple[list[int], np.ndarray]]:
        while len(stream) < start + count:
            stream.extend(draw(batch))
        return stream[start:start + count]

    cursor, queued, dropped = 0, [], []  # carry-over's next prompt of the stream, its waiting ones, the last dropped
    inserted = {}  # version -> carry-over's prompts of that call
    totals = {side: [0, 0, 0.0] for side in ("paged", "carry-over")}  # decoded tokens, decode steps, seconds
    for step in range(steps):
        # today's: this step's prompts of the stream, until its longest row ends
        tokens, mask, budgets = placed(take(step * batch, batch), batch)
        start = time.perf_counter()
        out = jax.device_get(sampling.sample(graphdef, state, tokens, mask, settings, jax.random.key(step), budgets))
        paged = (int(np.maximum(out.lengths - 1, 0).sum()), int(out.decode_steps), time.perf_counter() - start)
        # carry-over's call (as training/engine/carry_over.py feeds it): those dropped first, then as many new prompts as
        # the call before returned, until ``batch`` groups are complete
        queued = dropped + queued
        count = 2 * batch if step == 0 else min(batch + len(dropped), 2 * batch)
        fresh = max(count - len(queued), 0)
        queued, cursor = queued + take(cursor, fresh), cursor + fresh
        inserted[step], queued = queued[:count], queued[count:]
        tokens, mask, budgets = placed(inserted[step], 2 * batch)
        start = time.perf_counter()
        rows = jax.device_get(engine.step(state, step, tokens, mask, jax.random.key(step), budgets))
        carried = (int(rows.decoded_tokens), int(rows.decode_steps), time.perf_counter() - start)
        dropped = ([inserted[int(rows.dropped_version)][p] for p in np.flatnonzero(rows.dropped)]
                   if int(rows.dropped_version) >= 0 else [])
        line = []
        for side, (decoded, decode_steps, seconds) in (("paged", paged), ("carry-over", carried)):
            if step:
                totals[side] = [t + x for t, x in zip(totals[side], (decoded, decode_steps, seconds))]
            utilisation = decoded / max(decode_steps * slots, 1)
            line.append(f"{side} {decode_steps:>5} decode steps, utilisation {utilisation:.3f}, {seconds:6.2f} s")
        print(f"step {step + 1}: " + "; ".join(line) + f"; carry-over: {int(rows.carried_rows)} rows carried in, "
              f"staleness mean {float(rows.staleness_mean):.2f} max {int(rows.staleness_max)}, {len(dropped)} prompts "
              "dropped", flush=True)
    results = {}
    for side, (decoded, decode_steps, seconds) in totals.items():
        results[side] = (decoded / (decode_steps * slots), decoded / seconds)
        print(f"steps 2-{steps} {side:<10} decode steps {decode_steps:>6}  utilisation {results[side][0]:.3f}  "
              f"{seconds:7.1f} s  {results[side][1]:8.1f} decoded tokens/s", flush=True)
    (u_c, r_c), (u_p, r_p) = results["carry-over"], results["paged"]
    print(f"carry-over vs paged: utilisation {u_c:.3f} vs {u_p:.3f} (ratio {u_c / u_p:.2f}), tokens/s {r_c:.1f} vs "
          f"{r_p:.1f} (ratio {r_c / r_p:.2f})")
    return results


def carry_over(args) -> None:
    """``--carry-over``: carry-over rollouts against today's paged call on the preset (random weights)."""
    dtype = args.dtypes.split(",")[0]
    cfg = models.preset(args.preset, eos_token_id=None, dtype=dtype, param_dtype=dtype)
    cfg = cfg.replace(num_hidden_layers=args.layers or cfg.num_hidden_layers, vocab_size=args.vocab or cfg.vocab_size)
    print(f"{args.preset} ({dtype}), {cfg.num_hidden_layers} layers; {device_line()}", flush=True)
    carry_over_steps(cfg, batch=args.batch, n=args.n, slots=args.slots, page_size=args.page_size, prompt=args.prompt,
                     new=args.new, steps=args.steps, max_staleness=args.max_staleness)


def divergence(tokens: np.ndarray, reference: np.ndarray, lengths: np.ndarray) -> tuple[float, str]:
    """How two samplers' tokens of the same rows differ: (the fraction of differing tokens, a line
    saying it and where the rows that differ first diverge (on an accelerator, matmuls over different batch widths
    round differently, and a greedy row that once picks another token goes its own way from there).

    tokens, reference: [Q, N] ids; lengths: [Q] tokens of each row (the same on both sides).
    )"""
    live = np.arange(tokens.shape[1])[None, :] < lengths[:, None]  # [Q, N]
    differ = (tokens != reference) & live
    fraction = differ.sum() / max(live.sum(), 1)
    rows = np.flatnonzero(differ.any(axis=1))
    line = f"differing tokens {100 * fraction:.2f} % of {int(live.sum())}, rows {len(rows)} of {len(tokens)}"
    if len(rows):
        first = differ[rows].argmax(axis=1)  # [rows]: the first differing token of each such row
        share = first / lengths[rows]
        line += (f"; they first diverge at token {int(first.min())} .. {int(np.median(first))} .. {int(first.max())} "
                 f"(min .. median .. max), {np.median(share):.0%} of the way into a row (median)")
    return float(fraction), line


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", action="store_true", help="continuous vs static on long-tailed budgets")
    parser.add_argument("--carry-over", action="store_true", help="carry-over rollouts vs today's paged call")
    parser.add_argument("--preset", default="Qwen2.5-0.5B")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (default 0: the preset's)")
    parser.add_argument("--vocab", type=int, default=0, help="--compare, --carry-over: vocabulary entries (default 0: "
                                                             "the preset's)")
    parser.add_argument("--batch", type=int, default=None, help="prompts (default 32; --compare: 16; --carry-over: "
                                                                "groups a step, 16)")
    parser.add_argument("--n", type=int, default=4, help="--compare, --carry-over: samples per prompt")
    parser.add_argument("--slots", type=int, default=32, help="--compare, --carry-over: the decode slots")
    parser.add_argument("--tail-slots", type=int, default=1,
                        help="--compare: the narrowest decode batch once no row waits (0: no narrowing)")
    parser.add_argument("--page-size", type=int, default=16,
                        help="--compare, --carry-over: the paged sampler's page size")
    parser.add_argument("--steps", type=int, default=5, help="--carry-over: training steps (sampler calls)")
    parser.add_argument("--max-staleness", type=int, default=1, help="--carry-over: rollout.max_staleness")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=None, help="new tokens (default 64; --compare: 512)")
    parser.add_argument("--dtypes", default=None, help="default float32,bfloat16; --compare: float32")
    parser.add_argument("--rounds", type=int, default=None, help="default 3; --compare: 1")
    args = parser.parse_args()
    defaults = dict(batch=16, new=512, dtypes="float32", rounds=1) if args.compare or args.carry_over else \
        dict(batch=32, new=64, dtypes="float32,bfloat16", rounds=3)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.compare:
        return compare(args)
    if args.carry_over:
        return carry_over(args)
    if args.new < 2 or args.rounds < 1:
        parser.error("need --new >= 2 and --rounds >= 1")
    dtypes = args.dtypes.split(",")
    import torch  # transformers' side (``theirs``)

    cfg = models.preset(args.preset, eos_token_id=None)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, size=(args.batch, args.prompt)).tolist()
    print(f"{args.preset}: batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, greedy; "
          f"{device_line()}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)")

    configs = [(side, dtype) for side in SIDES for dtype in dtypes]
    times: dict[tuple[str, str, int], list[float]] = {}
    peak = {dtype: 0.0 for dtype in ["float32", *dtypes]}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = pathlib.Path(tmp) / "model"
        models.export_hf(models.init_random(cfg, seed=0), hf_dir)
        runners = {(side, dtype): SIDES[side](hf_dir, dtype, prompts) for side, dtype in configs}
        for (side, _), run in runners.items():  # compile / warm up
            for tokens in ((args.new, 1) if side == "ours" else (2,)):
                run(tokens)
        for _ in range(args.rounds):
            for dtype in peak:  # measured between the runs, best kept: the same load as the runs
                peak[dtype] = max(peak[dtype], matmul_rate(dtype))
            for (side, dtype), run in runners.items():
                for tokens in ((args.new, 1) if side == "ours" else (args.new,)):
                    times.setdefault((side, dtype, tokens), []).append(_timed(lambda: run(tokens)))

    best = {key: min(v) for key, v in times.items()}
    print(f"\nbest of {args.rounds} interleaved rounds, {args.new} new tokens")
    print(f"{'side':<13}{'dtype':<10}{'seconds':>9}{'tokens/s':>10}")
    rates: dict[str, tuple[float, str]] = {}
    for side, dtype in configs:
        rate = args.batch * args.new / best[side, dtype, args.new]
        print(f"{side:<13}{dtype:<10}{best[side, dtype, args.new]:>9.2f}{rate:>10.1f}")
        rates[side] = max(rates.get(side, (0.0, "")), (rate, dtype))
    print(f"\nratio ours ({rates['ours'][1]}) / transformers ({rates['transformers'][1]}), each at its best dtype: "
          f"{rates['ours'][0] / rates['transformers'][0]:.2f}")
    flops = decode_step_flops(cfg, args.batch, round_up(args.prompt, 64) + args.new)
    print(f"\nour decode step ({flops / 1e9:.1f} GFLOP), vs the measured 4096^3 matmul rates "
          + ", ".join(f"{d} {r / 1e9:.1f} GFLOP/s" for d, r in peak.items()) + " (float32 accumulation):")
    for dtype in dtypes:
        step = (best["ours", dtype, args.new] - best["ours", dtype, 1]) / (args.new - 1)
        fractions = ", ".join(f"{flops / step / rate:.0%} of {d}" for d, rate in peak.items())
        print(f"  {dtype:<10}{step * 1e3:7.1f} ms {flops / step / 1e9:7.1f} GFLOP/s = {fractions}")


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    main()
