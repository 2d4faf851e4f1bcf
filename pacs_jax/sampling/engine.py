"""The sampler program: one prefill per prompt, then its n samples decoded by a fixed number of slots
in one jitted loop (continuous batching, as vLLM and JetStream keep their decode batch full).

Shapes: P prompts (padded), T prompt length (left-padded), n samples per prompt, Q = P * n rows (row
i*n + j is sample j of prompt i), C decode slots (``settings.slots``; C = Q is static batching),
N = max_new_tokens, S = T + N cache slots per decode slot, V vocabulary, L layers, D hidden.

    layout   the parameters cast to the compute dtype and laid out for decode once per call:
             replicated over the batch axes ("data", "fsdp"), split over "tensor" only, so no decode
             step gathers a weight over the network (docs/design.md section 3.2)
    prefill  [P, T] prompts -> K/V [L, P, T] and the last prompt position's logits [P, V]; token 0 of
             every row is selected from them (the prompt is processed once, not n times)
    decode   a ``lax.while_loop`` over decode steps. Each of the C slots holds one row at a time: a
             step feeds every busy slot its last token at its own cache slot T + t - 1 and selects its
             token t. A row that stops (stop id, or its own budget) frees its slot in that step, and
             the slot takes the next waiting row at once: that row's prompt K/V is copied into the
             slot's first T cache slots. The loop ends when no row is left waiting or running.
    tail     with ``settings.tail_slots``, once no row is waiting the decode batch narrows as rows
             end (``narrowing_widths``): the running rows move to the first w slots of the cache
             and a loop of width w goes on, so the long tail does not decode C mostly idle slots
             (vLLM's batch shrinks the same way as its requests finish).
    paged    with ``settings.page_size``, the same queue and tail over a K/V page pool instead of the
             [C, S] cache: each prompt's K/V stored once for its n rows, a row's pages taken as it
             grows and returned when it ends, narrowing moving page tables, not K/V (sampling/paged.py).

Queues per batch shard: on a mesh whose batch axes split P and C, the decode loop runs under
``shard_map``, manual over the batch axes, so a shard's slots take only its own prompts' rows and a
refill never crosses devices; the "tensor" axis stays automatic (tensor-parallel layers inside).
Before the prefill, the real prompts' rows are spread evenly over the P batch positions
(``spread_rows``): batch-padding prompts (an all-zero mask row) hold no work, so without this the
shards holding them would idle while the others ran all the rows. A position p takes a copy of one
real prompt and a contiguous range of its samples (a real prompt gets about P / (real prompts)
positions and its n samples are split over them), so every position, and every shard, holds n x
(real prompts) / P rows up to rounding. The outputs are scattered back to rows i*n + j. Without
batch padding every prompt keeps its own position and all its samples (the identity).

Results do not depend on scheduling: token t of row (i, j) is selected with the key
``fold_in(fold_in(fold_in(key, i), j), t)`` and from that row's logits alone, so the same row gets the
same tokens whatever slot, position or shard it ran in, when, and beside which other rows (up to the
float round-off of a matmul over a different batch).

The whole sampler call is one ``jax.jit`` of a pure function of (parameter state, arrays); the model
is ``nnx.split`` by the caller and its graphdef is a static argument, so calls with the same shapes
reuse one compilation. Static: shapes, n, max_new_tokens, top_k, slots, tail_slots. Traced: temperature
(0 = greedy), top_p, the key, the per-row budgets and the stop ids, so greedy evaluation and sampled
training share a program. The KV cache is allocated inside the program and freed when it returns.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from pacs_jax.models.qwen import KVCache, positions_from_mask
from pacs_jax.sampling.buckets import round_up
from pacs_jax.sampling.paged import default_pages, paged_decode_loop
from pacs_jax.sampling.settings import SamplingSettings, row_pages
from pacs_jax.sampling.narrowing import run_widths
from pacs_jax.sampling.selection import is_stop, select_tokens
from pacs_jax.sharding import constrain, current_rules, replicated

PAD_ID = 0  # token id written after a sample's end (its response_mask is 0 there)
STOP_ID_SLOTS = 8  # stop ids are padded to a multiple of this, so changing them rarely recompiles

_TRACE_COUNT = 0


def compile_count() -> int:
    """How many times the sampler program has been traced (= compiled) in this process."""
    return _TRACE_COUNT


class SampleArrays(NamedTuple):
    """Device arrays of one sampler call; rows i*n .. i*n+n-1 are the samples of prompt i.

    tokens:        [Q, N] int32, generated ids (stop id included), PAD_ID after the end
    logprobs:      [Q, N] float32, log_softmax(logits / T) of each generated token (T = 1 if greedy), 0 after the end
    response_mask: [Q, N] int32, 1 on generated tokens
    lengths:       [Q] int32, generated tokens per row (stop id included)
    stopped:       [Q] bool, True if the row ended at a stop id ("stop"), False at its budget ("length")
    prefill_tokens: [] int32, real prompt tokens of the call, its prompts' lengths summed (a prompt is
                   prefilled once; one spread to several batch positions, once at each, where
                   batch-padding prompts would have been)
    decode_steps:  [] int32, decode steps of the call (of its slowest queue when the batch is sharded)
    slot_steps:    [] int32, decode slots x decode steps, summed over the decode batch widths (a queue
                   narrowing in its tail runs fewer slots a step); the slowest queue's times the queues
                   when the batch is sharded (the others wait for it)
    free_pages:    [] int32, the paged sampler: response pages free at the end of the call, summed over
                   the queues (all of them when every page came back); 0 for the contiguous samplers
    """

    tokens: jax.Array
    logprobs: jax.Array
    response_mask: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    prefill_tokens: jax.Array
    decode_steps: jax.Array
    slot_steps: jax.Array
    free_pages: jax.Array


def slot_utilisation(lengths: np.ndarray, slot_steps: int) -> float:
    """Tokens made by decode steps / slot steps (``SampleArrays.slot_steps``: slots x decode steps at
    each decode batch width): how full the decoded slots were (1 = never idle).

    lengths: [Q] generated tokens per row; token 0 of each row comes from the prefill, not a decode step.
    """
    decoded = int(np.sum(np.maximum(np.asarray(lengths, np.int64) - 1, 0)))
    return decoded / slot_steps if slot_steps else 1.0


def _decode_layout(state: nnx.State, dtype) -> nnx.State:
    """The parameters as decode reads them: floats in the compute dtype, replicated over the batch
    axes of the mesh in context and split over "tensor" only (one gather per call, none per decode
    step)."""
    rules = current_rules()
    decode_rules = rules.without(*rules.batch_axes())

    def place(var: nnx.Variable) -> nnx.Variable:
        x = var.get_value()
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        if getattr(var, "logical_axes", None) is not None:
            x = jax.lax.with_sharding_constraint(x, decode_rules.sharding(var.logical_axes, x.shape))
        return var.replace(value=x)

    return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def queues(prompts: int, slots: int, batch_shards: int) -> int:
    """The sampler's queues (decode loops) for a call: one per batch shard when the shards divide
    both the prompts and the slots, else one for the whole call."""
    return batch_shards if prompts % batch_shards == 0 and slots % batch_shards == 0 else 1


def _queue_groups(prompts: int, slots: int) -> tuple[str, ...]:
    """The mesh axes the decode loop is split over (one queue per shard, ``queues``), or none."""
    rules = current_rules()
    axes = rules.batch_axes()
    shards = math.prod(rules.mesh.shape[a] for a in axes)
    return axes if axes and queues(prompts, slots, shards) == shards else ()


def spread_rows(real: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each real prompt's samples run: the rows of the R real prompts spread evenly over all P
    batch positions, so contiguous blocks of positions (batch shards) hold equal work whatever the
    number and places of the batch-padding prompts.

    real: [P] bool, False for batch-padding prompts. Real prompt k (in order, k < R) takes positions
    floor(k P / R) .. floor((k + 1) P / R) - 1 (one or more, adjacent); its m-th of c positions takes
    samples floor(m n / c) .. floor((m + 1) n / c) - 1. Without padding (R = P) this is the identity.
    Returns (prompt [P] int32: the prompt whose copy position p holds; first [P] int32: its first
    sample there; count [P] int32: how many, 0 .. n, summing to R x n; all 0 when R = 0).
    """
    P = real.shape[0]
    R = jnp.sum(real, dtype=jnp.int32)
    ranked = jnp.argsort(~real, stable=True).astype(jnp.int32)  # the real prompts first, in order
    p = jnp.arange(P, dtype=jnp.int32)
    divisor = jnp.maximum(R, 1)
    k = ((p + 1) * R + P - 1) // P - 1  # the real prompt of position p: floor(k P / R) <= p
    start = k * P // divisor
    copies = jnp.maximum((k + 1) * P // divisor - start, 1)
    m = p - start
    first = m * n // copies
    count = jnp.where(R > 0, (m + 1) * n // copies - first, 0)
    return ranked[jnp.clip(k, 0, P - 1)], first, count


def narrowing_widths(slots: int, tail_slots: int | None) -> tuple[int, ...]:
    """The decode batch widths of one queue, widest first: ``slots`` while rows wait, then, once the
    queue is empty, each width of the ladder 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and 3 x 2^(k-1):
    each about 2/3 or 3/4 of the one above) below ``slots`` and at least ``tail_slots``. A width
    takes over when the rows still running fit it. ``tail_slots`` None (or >= slots): no narrowing.
    """
    if tail_slots is None or tail_slots >= slots:
        return (slots,)
    ladder = {w for k in range(slots.bit_length()) for w in (2 ** k, 3 * 2 ** k // 2)}
    return (slots, *sorted((w for w in ladder if max(tail_slots, 1) <= w < slots), reverse=True))


class _Rows(NamedTuple):
    """Rows ``index`` [count] of K/V buffers [L, B, K, S, Dh], or of the cache being written (k, v None)."""

    k: jax.Array | None
    v: jax.Array | None
    index: jax.Array


def _decode_loop(model, prompt_cache: KVCache, prompt_real, real, first_tokens, first_logp, budgets, row_keys,
                 temperature, top_p, stop_ids, *, n: int, slots: int, tail_slots: int | None, max_new_tokens: int,
                 top_k: int):
    """The decode loop of one queue: all rows of a call, or one batch shard's rows under shard_map.

    prompt_cache: K/V [L, P, T, K, Dh] of the prefill; prompt_real [P, T] bool; real [Q] bool, False
    for rows that hold no sample (those of batch-padding prompts); first_tokens, first_logp, budgets
    [Q]; row_keys [Q] PRNG keys.

    One ``while_loop`` a width of ``narrowing_widths(slots, tail_slots)``: the first runs all C slots
    and refills them from the queue; once the queue is empty and the rows still running fit the next
    width w, they move to the first w slots (their K/V rows copied inside the one [L, C, K, S, Dh]
    cache, in place) and the next loop decodes only those w slots, so the long tail of a call costs
    w, not C, slots a step. A row's tokens do not depend on the width it ran at.
    Returns (tokens [Q, N], logprobs [Q, N], lengths [Q], stopped [Q], decode steps [], slot steps []:
    the widths' slots x decode steps, summed).
    """
    P, T = prompt_real.shape
    Q, C, N = P * n, slots, max_new_tokens
    widths = narrowing_widths(C, tail_slots)
    select = functools.partial(select_tokens, temperature=temperature, top_p=top_p, top_k=top_k)

    first_stop = real & is_stop(first_tokens, stop_ids)
    waiting = real & ~first_stop & (budgets > 1)  # rows that need decode steps
    order = jnp.argsort(~waiting, stable=True).astype(jnp.int32)  # the queue: those rows, in row order
    queued = jnp.sum(waiting, dtype=jnp.int32)
    prompt_lengths = jnp.sum(prompt_real, axis=-1, dtype=jnp.int32)  # [P]

    tokens = jnp.zeros((Q, N), jnp.int32).at[:, 0].set(jnp.where(real, first_tokens, PAD_ID))
    logprobs = jnp.zeros((Q, N), jnp.float32).at[:, 0].set(jnp.where(real, first_logp, 0.0))
    lengths, stopped = real.astype(jnp.int32), first_stop

    def copy_rows(cache, rows: _Rows, targets, count):
        """Rows rows.index[k] of rows.k / rows.v (None: of the cache itself) -> cache rows targets[k]
        (one [L, 1, K, S', Dh] slice each, S' <= S), for k < count. Within the cache the copies read
        the loop's own buffer, so no second cache is kept for them; each source row must still hold
        its value when its turn comes."""
        def copy(k, cache):
            at = (0, targets[k], 0, 0, 0)
            return KVCache(*(jax.lax.dynamic_update_slice(
                c, jax.lax.dynamic_slice_in_dim(c if src is None else src, rows.index[k], 1, axis=1), at)
                for c, src in ((cache.k, rows.k), (cache.v, rows.v))))
        return jax.lax.fori_loop(0, count, copy, cache)

    def refill(free, row, t, last, cache, kv_valid, taken):
        """Free slots take the next waiting rows (in queue order); slots left without one go idle
        (row Q). A taken slot gets its row's token 0 as its last token and its prompt's K/V."""
        rank = jnp.cumsum(free, dtype=jnp.int32) - 1
        take = free & (taken + rank < queued)
        row = jnp.where(take, order[jnp.minimum(taken + rank, Q - 1)], jnp.where(free, Q, row))
        t = jnp.where(take, 1, t)
        last = jnp.where(take, first_tokens[jnp.minimum(row, Q - 1)], last)
        fill = jnp.argsort(~take, stable=True).astype(jnp.int32)  # the taken slots first
        count = jnp.sum(take, dtype=jnp.int32)
        prompt = jnp.minimum(row, Q - 1) // n  # [C]
        cache = copy_rows(cache, _Rows(prompt_cache.k, prompt_cache.v, prompt[fill]), fill, count)
        kv_valid = kv_valid.at[:, :T].set(jnp.where(take[:, None], prompt_real[prompt], kv_valid[:, :T]))
        return row, t, last, cache, kv_valid, taken + count

    def decode_step(carry, refills: bool):
        steps, row, t, last, cache, kv_valid, taken, tokens, logprobs, lengths, stopped = carry
        busy = row < Q
        r = jnp.minimum(row, Q - 1)
        positions = prompt_lengths[r // n] + t - 1  # [w]: the position of each slot's last token
        hidden, cache = model.forward(last[:, None], positions[:, None], kv_valid, cache, T + t - 1)
        keys = jax.vmap(jax.random.fold_in)(row_keys[r], t)
        token, logp = select(model.logits(hidden)[:, 0], keys)
        out = jnp.where(busy, row, Q)  # idle slots write nowhere (out of bounds: dropped)
        tokens = tokens.at[out, t].set(token, mode="drop")
        logprobs = logprobs.at[out, t].set(logp, mode="drop")
        hit = busy & is_stop(token, stop_ids)
        t = jnp.where(busy, t + 1, t)
        lengths = lengths.at[out].set(t, mode="drop")
        stopped = stopped.at[out].set(hit, mode="drop")
        done = hit | (t >= budgets[r])
        if refills:
            row, t, last, cache, kv_valid, taken = refill(~busy | done, row, t, token, cache, kv_valid, taken)
        else:
            row, last = jnp.where(done, Q, row), token
        return steps + 1, row, t, last, cache, kv_valid, taken, tokens, logprobs, lengths, stopped

    def narrow(carry, width: int):
        """The running rows to slots 0 .. width - 1 (in slot order), their K/V rows with them."""
        steps, row, t, last, cache, kv_valid, *rest = carry
        busy = row < Q
        moved = jnp.argsort(~busy, stable=True).astype(jnp.int32)  # the busy slots first
        # in place: a row moves to a slot before its own, and the slots are filled in order
        cache = copy_rows(cache, _Rows(None, None, moved), jnp.arange(width, dtype=jnp.int32),
                          jnp.sum(busy, dtype=jnp.int32))
        keep = moved[:width]
        return (steps, row[keep], t[keep], last[keep], cache, kv_valid[keep], *rest)

    cache = model.init_cache(C, T + N)
    kv_valid = jnp.concatenate([jnp.zeros((C, T), bool), jnp.ones((C, N), bool)], axis=1)  # [C, S]
    idle = jnp.full((C,), Q, jnp.int32)
    zeros = jnp.zeros((C,), jnp.int32)
    row, t, last, cache, kv_valid, taken = refill(jnp.ones((C,), bool), idle, zeros, zeros, cache, kv_valid,
                                                  jnp.int32(0))
    carry = (jnp.int32(0), row, t, last, cache, kv_valid, taken, tokens, logprobs, lengths, stopped)
    carry, slot_steps = run_widths(carry, widths, decode_step, narrow,
                                   running=lambda c: jnp.sum(c[1] < Q, dtype=jnp.int32),
                                   waiting=lambda c: c[6] < queued)
    steps, tokens, logprobs, lengths, stopped = carry[0], *carry[7:]
    return tokens, logprobs, lengths, stopped, steps, slot_steps


def _queue_loop(model, *args, n: int, slots: int, tail_slots: int | None, max_new_tokens: int, top_k: int,
                page_size: int | None, pages: int | None):
    """The decode loop of one queue (``_decode_loop``'s arguments): over a cache row per slot, or with
    ``page_size`` over a page pool of ``pages`` response pages (sampling/paged.py). Returns
    ``_decode_loop``'s results and the free pages at the end (0 without pages)."""
    if page_size is None:
        return *_decode_loop(model, *args, n=n, slots=slots, tail_slots=tail_slots, max_new_tokens=max_new_tokens,
                             top_k=top_k), jnp.int32(0)
    return paged_decode_loop(model, *args, n=n, slots=slots, max_new_tokens=max_new_tokens, top_k=top_k,
                             page_size=page_size, pages=pages or default_pages(slots, page_size, max_new_tokens),
                             widths=narrowing_widths(slots, tail_slots), pad_id=PAD_ID)


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("n", "max_new_tokens", "top_k", "slots", "tail_slots", "page_size", "pages"))
def _sample_program(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array,
                     prompt_mask: jax.Array, budgets: jax.Array, key: jax.Array, temperature: jax.Array,
                     top_p: jax.Array, stop_ids: jax.Array, *, n: int, max_new_tokens: int, top_k: int,
                     slots: int, tail_slots: int | None, page_size: int | None = None,
                     pages: int | None = None) -> SampleArrays:
    global _TRACE_COUNT
    _TRACE_COUNT += 1
    cfg = nnx.merge(graphdef, state).cfg
    model = nnx.merge(graphdef, _decode_layout(state, jnp.dtype(cfg.dtype)))
    select = functools.partial(select_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    P, T = prompt_tokens.shape
    Q = P * n
    prefill_tokens = jnp.sum(prompt_mask != 0, dtype=jnp.int32)
    real = jnp.any(prompt_mask != 0, axis=-1)  # [P]: False for batch-padding prompts

    # Position p holds samples first[p] .. first[p] + count[p] - 1 of prompt source[p]: spread evenly
    # over the positions when each batch shard runs its own queue (one queue needs no spreading).
    axes = _queue_groups(P, slots)
    if axes:
        source, first, count = spread_rows(real, n)
        prompt_tokens, prompt_mask = prompt_tokens[source], prompt_mask[source]
    else:
        source, first, count = jnp.arange(P), jnp.zeros(P, jnp.int32), jnp.where(real, n, 0)
    samples = first[:, None] + jnp.arange(n)  # [P, n]: sample j of each position's rows
    held = (jnp.arange(n) < count[:, None]).reshape(Q)  # [Q]: False for rows without a sample
    origin = jnp.where(held, (source[:, None] * n + samples).reshape(Q), Q)  # [Q]: row i*n + j, Q if none
    budgets = budgets.astype(jnp.int32)
    if axes:
        budgets = budgets[jnp.minimum(origin, Q - 1)]

    # Prefill. All-padding prompts (batch padding) get one visible slot so their attention is
    # defined; their rows come back empty.
    prompt_tokens = constrain(prompt_tokens.astype(jnp.int32), ("batch", "length"))
    prompt_real = constrain(prompt_mask.astype(bool), ("batch", "length"))
    padding_row = ~jnp.any(prompt_real, axis=-1)  # [P]
    visible = prompt_real.at[:, -1].set(prompt_real[:, -1] | padding_row)
    hidden, prompt_cache = model.forward(prompt_tokens, positions_from_mask(visible), visible,
                                         model.init_cache(P, T), 0)
    last = jnp.max(jnp.where(visible, jnp.arange(T), 0), axis=-1)  # [P]: T - 1 when left-padded
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [P, 1, D]
    first_logits = model.logits(last_hidden)[:, 0]  # [P, V]: only the last real position is needed

    # Token 0 of every row, sample by sample (one [P, V] selection at a time, not [Q, V]); the key of
    # a row is that of its prompt and sample, wherever it runs.
    row_keys = jax.vmap(lambda i, js: jax.vmap(lambda j: jax.random.fold_in(jax.random.fold_in(key, i), j))(js))(
        source, samples)  # [P, n]
    first_tokens, first_logp = jax.lax.map(
        lambda keys: select(first_logits, jax.vmap(jax.random.fold_in)(keys, jnp.zeros(P, jnp.int32))),
        row_keys.T)  # [n, P] each
    rows = lambda x: x.T.reshape(Q)  # [n, P] -> [Q], row p*n + j
    loop_args = (prompt_cache, prompt_real, held, rows(first_tokens), rows(first_logp), budgets,
                 row_keys.reshape(Q), temperature, top_p, stop_ids)
    static = dict(n=n, slots=slots, tail_slots=tail_slots, max_new_tokens=max_new_tokens, top_k=top_k,
                  page_size=page_size, pages=pages)

    if axes:
        mesh = current_rules().mesh
        shards = math.prod(mesh.shape[a] for a in axes)
        split, whole = PartitionSpec(axes), PartitionSpec()
        cache_split = KVCache(PartitionSpec(None, axes), PartitionSpec(None, axes))

        per_queue = dict(slots=slots // shards, tail_slots=None if tail_slots is None else max(tail_slots // shards, 1))

        def per_shard(state, *args):
            *out, steps, slot_steps, free_pages = _queue_loop(nnx.merge(graphdef, state), *args,
                                                              **{**static, **per_queue})
            return *out, steps[None], slot_steps[None], free_pages[None]

        decode = jax.shard_map(per_shard, mesh=mesh,
                               in_specs=(whole, cache_split, split, split, split, split, split, split, whole,
                                         whole, whole),
                               out_specs=(split,) * 7, axis_names=set(axes), check_vma=False)
        *outs, steps, slot_steps, free_pages = decode(nnx.state(model), *loop_args)
        steps, slot_steps, free_pages = jnp.max(steps), jnp.max(slot_steps) * shards, jnp.sum(free_pages)
        # each position's rows back to rows i*n + j (the rows of batch-padding prompts stay empty)
        tokens, logprobs, lengths, stopped = (
            constrain(jnp.full_like(x, empty).at[origin].set(x, mode="drop"), ("batch",) + (None,) * (x.ndim - 1))
            for x, empty in zip(outs, (PAD_ID, 0.0, 0, False)))
    else:
        tokens, logprobs, lengths, stopped, steps, slot_steps, free_pages = _queue_loop(model, *loop_args, **static)
    response_mask = (jnp.arange(max_new_tokens)[None, :] < lengths[:, None]).astype(jnp.int32)
    return SampleArrays(tokens, logprobs, response_mask, lengths, stopped, prefill_tokens, steps, slot_steps,
                        free_pages)


def stop_id_array(stop_token_ids) -> np.ndarray:
    """Stop ids padded with -1 (never matches) to a multiple of STOP_ID_SLOTS: [S] int32."""
    stop_ids = np.full(round_up(max(len(stop_token_ids), 1), STOP_ID_SLOTS), -1, np.int32)
    stop_ids[:len(stop_token_ids)] = stop_token_ids
    return stop_ids


def _program_args(prompt_tokens, prompt_mask, settings: SamplingSettings, key, budgets=None, *,
                  abstract: bool = False):
    """The sampler program's positional arguments and static keywords.

    budgets: None (every row may use max_new_tokens) or [Q] ints in [1, max_new_tokens], each row's
    own budget (vLLM's per-request max_tokens).
    The key is placed replicated on the mesh in context (a real call's key may come committed or not).
    abstract: the key (replicated), the budgets, the scalars and the stop ids come as
    ``jax.ShapeDtypeStruct``s, the others without a sharding (as the uncommitted arrays of a real call,
    so the lowering is the same program),
    and nothing is placed on any device: the program can be lowered for devices this process cannot
    use (compile-only TPU devices on a CPU host). ``key`` is then None (a typed key) or anything
    with the key's shape and dtype.
    """
    if prompt_tokens.ndim != 2 or prompt_tokens.shape != prompt_mask.shape:
        raise ValueError(f"prompt_tokens {prompt_tokens.shape} and prompt_mask {prompt_mask.shape} "
                         "must both be [P, T]")
    if prompt_tokens.shape[0] < 1 or prompt_tokens.shape[1] < 1:
        raise ValueError(f"prompt_tokens: empty shape {prompt_tokens.shape}")
    rows = prompt_tokens.shape[0] * settings.n
    slots = rows if settings.slots is None else settings.slots
    if slots > rows:
        raise ValueError(f"slots={slots}: more decode slots than rows ({prompt_tokens.shape[0]} prompts x "
                         f"n={settings.n}); use at most {rows}")
    stop_ids = stop_id_array(settings.stop_token_ids)
    tail_slots = None if settings.tail_slots is None or settings.tail_slots >= slots else settings.tail_slots
    if settings.pages is not None and settings.pages < row_pages(settings.page_size, settings.max_new_tokens):
        raise ValueError(f"pages={settings.pages}: a queue's pool must hold one row's response pages, "
                         f"{row_pages(settings.page_size, settings.max_new_tokens)} of {settings.page_size} tokens "
                         f"(max_new_tokens={settings.max_new_tokens})")
    static = dict(n=settings.n, max_new_tokens=settings.max_new_tokens, top_k=settings.top_k, slots=slots,
                  tail_slots=tail_slots, page_size=settings.page_size, pages=settings.pages)
    if abstract:
        key = jax.eval_shape(jax.random.key, 0) if key is None else key
        spec = jax.ShapeDtypeStruct
        args = (prompt_tokens, prompt_mask, spec((rows,), jnp.int32), spec(key.shape, key.dtype, sharding=replicated()),
                spec((), jnp.float32), spec((), jnp.float32), spec(stop_ids.shape, jnp.int32))
        return args, static
    if budgets is None:
        budgets = np.full(rows, settings.max_new_tokens, np.int32)
    budgets = np.asarray(budgets)
    if budgets.shape != (rows,) or not np.issubdtype(budgets.dtype, np.integer):
        raise ValueError(f"budgets: expected {rows} integers (one per row), got {budgets.dtype} {budgets.shape}")
    if budgets.min() < 1 or budgets.max() > settings.max_new_tokens:
        raise ValueError(f"budgets: every row's budget must be in [1, max_new_tokens={settings.max_new_tokens}], "
                         f"got {int(budgets.min())} .. {int(budgets.max())}")
    # numpy, not jnp: made on the host without compiling anything (no eager op per call shape)
    args = (prompt_tokens, prompt_mask, budgets.astype(np.int32), jax.device_put(key, replicated()),
            np.float32(settings.temperature),
            np.float32(settings.top_p), stop_ids)
    return args, static


def sample(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array, prompt_mask: jax.Array,
           settings: SamplingSettings, key: jax.Array, budgets=None) -> SampleArrays:
    """The jitted sampler program on padded arrays (what the trainer calls).

    graphdef, state: ``nnx.split(model)`` (split once, reuse across calls).
    prompt_tokens, prompt_mask: [P, T] prompts, mask 1 on real tokens (left padding, as buckets.left_pad
    makes, wastes no attention; right padding works too); an all-zero mask row is batch padding
    (its samples come back empty). Bucket P and T (see buckets.py) to bound
    the number of compilations. key: a JAX PRNG key for this call. budgets: None, or [Q] per-row
    budgets in [1, settings.max_new_tokens].
    Returns SampleArrays with Q = P * n rows grouped by prompt.
    """
    args, static = _program_args(prompt_tokens, prompt_mask, settings, key, budgets)
    return _sample_program(graphdef, state, *args, **static)


def lower_sample(graphdef: nnx.GraphDef, state, prompt_tokens, prompt_mask, settings: SamplingSettings,
                  key=None) -> jax.stages.Lowered:
    """The sampler program lowered for abstract arguments (``jax.ShapeDtypeStruct`` with shardings):
    ``.compile()`` it ahead of time (warm-up, memory planning).

    Nothing concrete is made: the key (default: an abstract typed key; a given key only lends its
    shape and dtype), the budgets, the temperature, top_p and stop ids are abstract and unsharded,
    like the uncommitted arrays of a real call, so the program can be lowered for devices this
    process cannot use (compile-only TPU devices on a CPU host) and is the one a real call runs.
    """
    args, static = _program_args(prompt_tokens, prompt_mask, settings, key, abstract=True)
    return _sample_program.lower(graphdef, state, *args, **static)
