"""``generate``: token-id lists in, n samples per prompt out (grouped by prompt).

Multi-process: every process calls it with the same prompts and gets every sample back.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from pacs_jax.distributed import put_rows, to_host
from pacs_jax.models.qwen import Qwen
from pacs_jax.sampling.buckets import bucket_batch, bucket_length, left_pad
from pacs_jax.sampling.engine import sample
from pacs_jax.sampling.settings import SamplingSettings, call_slots
from pacs_jax.sharding import batch_shards, placement


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Samples grouped by prompt: entries i*n .. i*n+n-1 belong to prompt i.

    tokens: generated ids per sample, the stop id included when one was hit.
    logprobs: matching log_softmax(logits / T) per token (T = 1 for greedy), float.
    finish_reason: "stop" (hit a stop id) or "length" (used max_new_tokens).
    prefill_tokens: prompt tokens run through the prefill (sum of prompt lengths: once per prompt).
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reason: list[str]
    prefill_tokens: int


def _check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts: expected a non-empty list of token-id lists")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, np.ndarray)):
            raise ValueError(f"prompts[{i}]: expected a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty")
        for j, token in enumerate(prompt):
            if not isinstance(token, numbers.Integral) or isinstance(token, bool) or not 0 <= token < vocab_size:
                raise ValueError(f"prompts[{i}][{j}]={token!r}: not a token id in [0, {vocab_size})")
        out.append([int(t) for t in prompt])
    return out


def generate(model: Qwen, prompts: Sequence[Sequence[int]], max_new_tokens: int, n: int = 1,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             stop_token_ids: Sequence[int] | int | None = None, seed: int = 0, *,
             slots: int | None = None, tail_slots: int | None = None, budgets: Sequence[int] | None = None,
             page_size: int | None = None, pages: int | None = None,
             length_multiple: int = 64, max_cache_length: int | None = None) -> GenerateOutput:
    """Sample ``n`` continuations of each prompt (token-id lists) with a KV cache.

    temperature 0 is greedy; stop_token_ids None means the model's eos_token_id(s), () means none.
    slots: decode slots (continuous batching; capped at the call's rows); None: one per row (static).
    tail_slots: with slots, the narrowest the decode batch gets once no row waits (SamplingSettings).
    budgets: per prompt, its samples' new-token budget (<= max_new_tokens, vLLM's per-request
    max_tokens); None: max_new_tokens for all. page_size, pages: the paged sampler (SamplingSettings).
    The samples do not depend on ``slots`` nor on the pages.
    Prompts are left-padded to a multiple of ``length_multiple`` and their count to a power of two
    (bounded compilations; see buckets.py). ``max_cache_length`` (default: the model's
    max_position_embeddings) bounds prompt length + max_new_tokens.
    """
    cfg = model.cfg
    if stop_token_ids is None:
        eos = cfg.eos_token_id
        stop_token_ids = () if eos is None else eos
    settings = SamplingSettings(max_new_tokens=max_new_tokens, n=n, temperature=temperature, top_p=top_p,
                                top_k=top_k, stop_token_ids=stop_token_ids, page_size=page_size, pages=pages)
    settings.check_vocab(cfg.vocab_size)
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"seed={seed!r}: must be an integer")
    if not isinstance(length_multiple, numbers.Integral) or length_multiple < 1:
        raise ValueError(f"length_multiple={length_multiple!r}: must be an integer >= 1")
    cache_limit = cfg.max_position_embeddings if max_cache_length is None else max_cache_length
    prompts = _check_prompts(prompts, cfg.vocab_size)
    for i, prompt in enumerate(prompts):
        if len(prompt) + max_new_tokens > cache_limit:
            raise ValueError(f"prompts[{i}] has {len(prompt)} tokens: with max_new_tokens={max_new_tokens} "
                             f"it exceeds the cache length {cache_limit} (max_cache_length)")

    longest = max(len(p) for p in prompts)
    length = bucket_length(longest, length_multiple, cache_limit - max_new_tokens)
    batch = bucket_batch(len(prompts), batch_shards())
    tokens, mask = left_pad(prompts, batch, length)
    sharding = placement(("batch", "length"), tokens.shape)
    tokens, mask = put_rows(tokens, sharding), put_rows(mask, sharding)
    if budgets is not None:
        if len(budgets) != len(prompts):
            raise ValueError(f"budgets: {len(budgets)} given for {len(prompts)} prompts")
        budgets = np.repeat(np.pad(np.asarray(budgets), (0, batch - len(prompts)), constant_values=1), n)
    if slots is not None:
        slots = call_slots(slots, batch * n)
        settings = dataclasses.replace(settings, slots=slots, tail_slots=None if tail_slots is None else min(tail_slots, slots))
    graphdef, state = nnx.split(model)
    out = sample(graphdef, state, tokens, mask, settings, jax.random.key(seed), budgets)

    rows = len(prompts) * n
    # every process gets every sample (a collective when the rows span processes)
    out_tokens, out_logprobs, lengths, stopped, prefill_tokens = to_host(
        (out.tokens, out.logprobs, out.lengths, out.stopped, out.prefill_tokens))
    return GenerateOutput(
        tokens=[out_tokens[r, :lengths[r]].tolist() for r in range(rows)],
        logprobs=[out_logprobs[r, :lengths[r]].tolist() for r in range(rows)],
        finish_reason=["stop" if stopped[r] else "length" for r in range(rows)],
        prefill_tokens=int(prefill_tokens))
