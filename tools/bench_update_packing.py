"""One optimizer step of PACS on padded rows against the same step on packed rows (train.packing):
``python tools/bench_update.py --packing`` runs this.

    python tools/bench_update.py --packing                 # the defaults below: about 7 min, 12 GB on 2 CPU cores
    python tools/bench_update.py --packing --preset Qwen2.5-1.5B --prompts 8 --budget 1024 --micro-batches 8
                                          # one 80 GB GPU (59.4 GiB peak compiled for an H100; 107.7 without remat)
    python tools/bench_update.py --packing --preset Qwen2.5-1.5B ... --attention xla   # packed rows' XLA attention

The model runs as the trainer runs it: the paper configs' compute dtype and remat policy
(configs/paper.py: bfloat16, float32 parameters, ``dots_with_no_batch_dims_saveable``), the trainer's
fused log-prob chunk (rl/logprobs.py ``DEFAULT_CHUNK_SIZE``) and attention ``auto`` (on a GPU: cuDNN for
padded rows, the Pallas flash-attention kernel for packed rows, models/attention.py), each a flag.

Shaped like a paper step: prompts drawn from the DeepScaleR problems shipped in data/ in the model's
chat template (the Qwen tokenizer in data/tokenizers/qwen3), left-padded to the paper's 512-token
bucket; n = 8 responses each of random tokens whose lengths are log-normal (median budget / 8,
sigma 1) clipped to the budget; the response bucket is the budget (one response of a paper step
almost always reaches it). Both runs compute the same loss (PACS, beta 1, RLOO, class weights) and
AdamW step on the same rows; the packed run packs the step's sequences into passes of rows of prompt
bucket + budget tokens, as the trainer does (rl/packing.py; rows a pass: ``--rows``, 0 as
train.packed_rows: a quarter of a padded micro-batch's). First prints the device and its measured
peak rates (tools/device_rates.py), then each run's time (one step, after compiling it) and tokens,
then the line
    packed vs padded: tokens computed ratio X, time ratio Y, loss difference D
(X, Y: padded / packed; D: |loss packed - loss padded|, float32).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from device_rates import device_line, rates_line
from configs import base, paper
from pacs_jax import data, models
from pacs_jax.models.config import ATTENTION_IMPLS, REMAT_POLICIES
from pacs_jax.rl import packing
from pacs_jax.rl.logprobs import DEFAULT_CHUNK_SIZE
from pacs_jax.rl.update_batch import UpdateBatch
from pacs_jax.training.learner.update_step import make_update_step

REPO_DATA = data.__file__.rsplit("/pacs_jax/", 1)[0] + "/data"
PROMPT_BUCKET = 512


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    model = paper.get_config().model  # the paper configs' compute dtype and remat (the same for every model)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packing", action="store_true", required=True,
                        help="compare padded and packed rows (the one comparison this tool makes)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts (x n responses) in the step (default: 4)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (default: 8)")
    parser.add_argument("--budget", type=int, default=1024, help="max new tokens: the response bucket (default: 1024)")
    parser.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation micro-batches (default: 2)")
    parser.add_argument("--rows", type=int, default=base.get_config().train.packed_rows,
                        help="packed rows a pass (default: the config's train.packed_rows; 0: a quarter of a "
                             "padded micro-batch's rows, at least a prompt group's)")
    parser.add_argument("--preset", default="", choices=["", *sorted(models.PRESETS)],
                        help="model shape (default: a 2-layer, 64-wide Qwen3 with the real vocabulary)")
    parser.add_argument("--dtype", default=model.dtype, choices=["float32", "bfloat16"],
                        help=f"compute dtype, parameters in float32 (default: the paper configs', {model.dtype})")
    parser.add_argument("--remat", default=model.remat, choices=REMAT_POLICIES,
                        help=f"what the backward pass keeps of each layer (default: the paper configs', {model.remat})")
    parser.add_argument("--attention", default=model.attention, choices=ATTENTION_IMPLS,
                        help=f"model.attention (default: {model.attention})")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_SIZE,
                        help="tokens per row per step of the fused log-probs (bounds the [rows, chunk, vocab] logits; "
                             f"default: the trainer's, {DEFAULT_CHUNK_SIZE})")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> models.QwenConfig:
    """The preset's shape (or a tiny Qwen3 with the real vocabulary) with the flags' dtype, remat and attention."""
    run = dict(dtype=args.dtype, param_dtype="float32", remat=args.remat, attention=args.attention)
    if args.preset:
        return models.PRESETS[args.preset].replace(**run)
    return models.QwenConfig(vocab_size=151936, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, model_type="qwen3",
                             tie_word_embeddings=True, **run)


def step_rows(args: argparse.Namespace, vocab: int) -> dict[str, np.ndarray]:
    """The step's padded rows: prompts from the DeepScaleR subset in the chat template, log-normal responses."""
    rs = np.random.RandomState(args.seed)
    tokenizer = data.load_tokenizer(f"{REPO_DATA}/tokenizers/qwen3")
    problems, _ = data.load_problems(f"{REPO_DATA}/deepscaler_subset/math.json", on_error="skip")
    chosen = [problems[i] for i in rs.choice(len(problems), args.prompts * 4, replace=False)]
    examples, _ = data.build_prompts(chosen, tokenizer, PROMPT_BUCKET)
    prompts = [e.prompt_ids for e in examples[:args.prompts]]
    B, P, R = args.prompts * args.n, PROMPT_BUCKET, args.budget
    responses = np.minimum(np.round(rs.lognormal(np.log(args.budget / 8), 1.0, B)), R).astype(np.int64)
    ids, mask = np.zeros((B, P + R), np.int32), np.zeros((B, P + R), np.int32)
    prompt_lengths = np.repeat([len(p) for p in prompts], args.n)
    for b in range(B):
        ids[b, P - prompt_lengths[b]:P] = prompts[b // args.n]
        ids[b, P:P + responses[b]] = rs.randint(0, vocab, responses[b])
        mask[b, P - prompt_lengths[b]:P + responses[b]] = 1
    response_mask = (np.arange(R)[None] < responses[:, None]).astype(np.float32)
    old_logp = (rs.randn(B, R) * 0.2 - np.log(vocab)).astype(np.float32) * response_mask
    rewards = rs.randint(0, 2, B).astype(np.float32)
    return dict(input_ids=ids, attention_mask=mask, response_mask=response_mask, old_logp=old_logp, rewards=rewards,
                prompt_lengths=prompt_lengths, response_lengths=responses)


def timed_step(update, params, batch) -> tuple[float, float, str]:
    """(seconds of one step after compiling it, its loss, compile seconds)."""
    state = (jax.tree.map(jnp.array, params), optax.adamw(1e-6).init(params))
    t0 = time.perf_counter()
    compiled = update.lower(*state, batch).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, _, metrics = jax.block_until_ready(compiled(*state, batch, np.int32(0)))  # its one mini-batch
    return time.perf_counter() - t0, float(metrics["loss"]), f"{compile_s:.0f} s"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = model_config(args)
    print(f"{device_line()}; {rates_line((args.dtype,))}", flush=True)
    graphdef, params = nnx.split(models.Qwen(cfg, rngs=nnx.Rngs(args.seed)))
    rows = step_rows(args, cfg.vocab_size)
    P, R, B, K = PROMPT_BUCKET, args.budget, args.prompts * args.n, args.micro_batches
    update = make_update_step(graphdef, optax.adamw(1e-6), "pacs", group_size=args.n, num_micro_batches=K,
                              chunk_size=args.chunk)
    batch = UpdateBatch(**{k: jnp.asarray(rows[k]) for k in ("input_ids", "attention_mask", "response_mask", "old_logp",
                                                             "rewards")})
    S = packing.shards_for(B // K)
    N = args.rows or packing.pass_rows(B // (K * S), P + R, P + R, unit=args.n, shards=S)
    plan = packing.plan_packing(rows["prompt_lengths"], rows["response_lengths"], prompt_width=P, response_width=R,
                                packed_length=P + R, mini_batches=1, unit=args.n, shards=S, rows=N,
                                passes=packing.pass_slots(B, P + R, P + R, unit=args.n, shards=S, rows=N))
    packed = batch.replace(packing=jax.tree.map(jnp.asarray, plan.arrays()))
    real = plan.tokens_real
    print(f"step: {args.prompts} prompts x {args.n} responses, "
          f"prompts {rows['prompt_lengths'].min()}-{rows['prompt_lengths'].max()} tokens (bucket {P}), responses "
          f"median {np.median(rows['response_lengths']):.0f}, max {rows['response_lengths'].max()} (budget {R}), "
          f"{K} micro-batches; model {args.preset or 'tiny Qwen3, real vocabulary'}, {args.dtype}, remat {args.remat}, "
          f"attention {args.attention}, log-prob chunk {args.chunk}", flush=True)
    t_pad, loss_pad, c_pad = timed_step(update, params, batch)
    padded_tokens = B * (P + R)
    print(f"padded  {B} rows x {P + R} tokens: {padded_tokens} computed, {real} real "
          f"(efficiency {real / padded_tokens:.3f}); step {t_pad:.2f} s (compiled in {c_pad}), loss {loss_pad:.6f}",
          flush=True)
    t_pack, loss_pack, c_pack = timed_step(update, params, packed)
    print(f"packed  {plan.passes[0]} pass(es) of {S * N} rows x {P + R} tokens: "
          f"{plan.tokens_computed} computed, {real} real (efficiency {real / plan.tokens_computed:.3f}); "
          f"step {t_pack:.2f} s (compiled in {c_pack}), loss {loss_pack:.6f}")
    print(f"packed vs padded: tokens computed ratio {padded_tokens / plan.tokens_computed:.2f}, "
          f"time ratio {t_pad / t_pack:.2f}, loss difference {abs(loss_pack - loss_pad):.2e}")
    return 0


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    sys.exit(main())
