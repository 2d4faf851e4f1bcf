"""A carry-over call's four programs (sampling/carry_over.py tells the mechanism): ``init_program``
(each queue's empty ``CarryState``), ``insert_program`` (retire a region, prefill the new prompts into
it, refresh the carried ones, rebuild the queue and fill the free slots), ``chunk_program`` (decode
steps until B groups are complete) and ``harvest_program`` (the B oldest complete groups); each runs
once per queue through the engine's seam (``seam.on_queues``). ``compile_count`` counts their traces
and those of a resume's programs (sampling/carry_over_resume.py).

Shapes (as sampling/carry_over.py's): P prompts a call (padded), T prompt length, n samples a prompt,
G = max_staleness + 1 generations, R = G P n rows, C decode slots, B groups a call returns, N =
max_new_tokens, s page size, TP = ceil(T / s), F response pages, S queues (batch shards, or 1).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.models.moe import routing_dtype, routing_shape
from pacs_jax.models.paged_attention import POOL_AXES, PagedKVCache
from pacs_jax.sampling import decode
from pacs_jax.sampling.carry_over_records import CarryOverRows
from pacs_jax.sampling.carry_over_state import CarryOverSpec, CarryState
from pacs_jax.sampling.paged import prompt_pages, row_promise
from pacs_jax.sampling.seam import (PAD_ID, decode_model, input_shares, on_queues, prefill, queue_shards,
                                    queue_shares, sampling_model)
from pacs_jax.sampling.selection import Selection
from pacs_jax.sharding import constrain

_TRACE_COUNT = 0


def compile_count() -> int:
    """How many times the carry-over programs (init, insert, chunk, harvest; a resume's restore and
    reseat) have been traced (= compiled) in this process."""
    return _TRACE_COUNT


def count_trace() -> None:
    """Count one trace of a carry-over program (``compile_count``)."""
    global _TRACE_COUNT
    _TRACE_COUNT += 1


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes"))
def init_program(graphdef: nnx.GraphDef, params: nnx.State, key: jax.Array, *, spec: CarryOverSpec,
                 axes: tuple[str, ...]) -> CarryState:
    """The empty state of each queue (stacked with ``axes``, ``queue_axes``): a zero pool, every slot
    idle, no generation inserted (key only lends the shape of the rows' key data)."""
    count_trace()
    cfg = nnx.merge(graphdef, params).cfg
    queue = spec.per_queue(queue_shards(axes))
    return on_queues(lambda key: _empty_state(cfg, key, queue), axes, (key,), ())


def _empty_state(cfg, key: jax.Array, spec: CarryOverSpec) -> CarryState:
    """One queue's empty state (``init_program``)."""
    G, P, n, C, N, R = (spec.generations, spec.prompts, spec.engine.n, spec.engine.slots, spec.engine.max_new_tokens,
                        spec.rows)
    shape = (cfg.num_key_value_heads, cfg.num_hidden_layers, G * P * spec.prompt_pages + spec.engine.pages + 1,
             spec.engine.page_size, cfg.head_dim)
    zeros = lambda: constrain(jnp.zeros(shape, jnp.dtype(cfg.dtype)), POOL_AXES)
    store = spec.store(jnp.zeros((R,), jnp.int32), jnp.zeros((G * P,), jnp.int32), PagedKVCache(zeros(), zeros()))
    routing = (*routing_shape(cfg), routing_dtype(cfg.num_experts)) if spec.engine.routing else None
    record = lambda rows, length: None if routing is None else jnp.zeros((rows, length, *routing[:2]), routing[2])
    outputs = decode.Outputs(jnp.zeros((R, N), jnp.int32), jnp.zeros((R, N), jnp.float32), jnp.zeros((R,), jnp.int32),
                             jnp.zeros((R,), bool), record(R, N))
    prompt_routing = record(G * P, spec.prompt_length)
    idle = jnp.zeros((C,), jnp.int32)
    state = decode.DecodeState(jnp.int32(0), decode.Slots(jnp.full((C,), R, jnp.int32), idle, idle),
                               store.init(None, C), jnp.int32(0), outputs)
    return CarryState(state, jnp.zeros((R, N), jnp.int32), jnp.zeros((R,), jnp.int32), jnp.zeros((R,), jnp.int32),
                      jnp.ones((R,), jnp.int32), jax.random.key_data(jax.random.split(key, R)), store.promise,
                      store.prompt_lengths, jnp.arange(R, dtype=jnp.int32), jnp.int32(0), jnp.full((G,), -1, jnp.int32),
                      jnp.zeros((G * P,), bool), prompt_routing)


def _put_prompt_pages(kv, prompt_cache, prompt_real: jax.Array, spec: CarryOverSpec, g: jax.Array):
    """The pool's state kv with region g's P prompts' pages written from a prefill's K/V (prompt_cache
    [L, P, K, T, Dh], prompt_real [P, T])."""
    pages = prompt_pages(prompt_cache, prompt_real, spec.engine.page_size)
    at = g * spec.prompts * spec.prompt_pages
    return kv._replace(k=jax.lax.dynamic_update_slice_in_dim(kv.k, pages.k.astype(kv.k.dtype), at, axis=2),
                       v=jax.lax.dynamic_update_slice_in_dim(kv.v, pages.v.astype(kv.v.dtype), at, axis=2))


def _put_prompt_routing(whole: jax.Array | None, part: jax.Array | None, spec: CarryOverSpec, g: jax.Array):
    """The state's prompt routing record (``CarryState.prompt_routing`` [G P, T, L, k], or None: no record)
    with region g's P prompts' from a prefill (part [P, T, L, k])."""
    if whole is None:
        return None
    return jax.lax.dynamic_update_slice_in_dim(whole, part.astype(whole.dtype), g * spec.prompts, axis=0)


def _refreshed(model: nnx.Module, carried_prompts: tuple, key: jax.Array, selection: Selection,
               stop_ids: jax.Array, spec: CarryOverSpec) -> tuple:
    """The prompts of the G - 1 generations before this call prefilled again with ``model`` (the decode
    layout's; ``carried_prompts``: (tokens [P, T], mask [P, T]) a generation, the last call's first;
    all-padding where no generation was inserted) -> (K/V [L, P, K, T, Dh], prompt_real [P, T], and
    recording routing their experts [P, T, L, k], else None) a generation, so that the rows still to
    decode in this call attend to the current weights' K/V of their prompt, not to an earlier call's
    (``_refresh_prompts`` writes them)."""
    budgets = jnp.ones((spec.prompts * spec.engine.n,), jnp.int32)  # token 0 of this prefill is not kept
    done = (prefill(model, tokens, mask, budgets, key, selection, stop_ids, n=spec.engine.n, spread=False,
                    record_routing=spec.engine.routing) for tokens, mask in carried_prompts)
    return tuple((x.inputs.prompt_cache, x.inputs.prompt_real, x.prompt_routing) for x in done)


def _refresh_prompts(kv, prompt_routing: jax.Array | None, refreshed: tuple, version: jax.Array,
                     spec: CarryOverSpec) -> tuple:
    """The pool's state kv and the prompt routing record with ``_refreshed``'s K/V and experts of the
    generations before ``version`` in their regions -> (kv, prompt_routing)."""
    for age, (prompt_cache, prompt_real, routing) in enumerate(refreshed, start=1):
        g = jnp.mod(version - age, spec.generations)
        kv = _put_prompt_pages(kv, prompt_cache, prompt_real, spec, g)
        prompt_routing = _put_prompt_routing(prompt_routing, routing, spec, g)
    return kv, prompt_routing


def put_generation(state: CarryState, kv, outputs: decode.Outputs, spec: CarryOverSpec, g: jax.Array,
                   version: jax.Array, inputs, rows: decode.Outputs, versions: jax.Array, first_tokens: jax.Array,
                   row_keys: jax.Array, live: jax.Array, prompt_routing: jax.Array | None = None
                   ) -> tuple[CarryState, object, decode.Outputs]:
    """Region g takes the generation inserted at ``version``: its prompts' pages from the prefill
    (``inputs``, ``seam.QueueInputs``: its K/V [L, P, K, T, Dh], budgets [P n]; recording routing, its
    experts ``prompt_routing`` [P, T, L, k]), its rows' outputs (``rows``: [P n, N] / [P n], their routing
    [P n, N, L, k] with the state's), versions [P n, N], token 0 [P n], key data [P n, k], live prompts
    [P] -> (state, the pool's state kv, the outputs of all R rows)."""
    P, n = spec.prompts, spec.engine.n
    put = lambda whole, part: jax.lax.dynamic_update_slice_in_dim(whole, part.astype(whole.dtype),
                                                                  g * part.shape[0], axis=0)
    kv = _put_prompt_pages(kv, inputs.prompt_cache, inputs.prompt_real, spec, g)
    lengths = jnp.sum(inputs.prompt_real, axis=-1, dtype=jnp.int32)
    outputs = jax.tree.map(put, outputs, rows)  # without a routing record its None stays None
    state = state._replace(
        versions=put(state.versions, versions), call_start=outputs.lengths,
        first_tokens=put(state.first_tokens, first_tokens), budgets=put(state.budgets, inputs.budgets),
        row_keys=put(state.row_keys, row_keys),
        promise=put(state.promise, row_promise(lengths, inputs.budgets, n, spec.engine.page_size)),
        prompt_lengths=put(state.prompt_lengths, lengths), inserted=state.inserted.at[g].set(version),
        live=put(state.live, live), prompt_routing=_put_prompt_routing(state.prompt_routing, prompt_routing, spec, g))
    return state, kv, outputs


class Inserted(NamedTuple):
    """What a call's insert program (``insert_program``) gives its chunk and harvest programs."""

    layout: nnx.State  # the model's state in the decode layout
    state: CarryState  # the decode state with the new prompts in (donated to the chunks)
    dropped: jax.Array  # [P] bool: the retired generation's prompts never returned
    dropped_version: jax.Array  # [] int32: the retired generation's version when any was dropped, else -1
    carried: jax.Array  # [] int32: rows of earlier calls still running as the call began


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes", "shardings"), donate_argnames=("state",))
def insert_program(graphdef: nnx.GraphDef, params: nnx.State, state: CarryState, prompt_tokens: jax.Array,
                   prompt_mask: jax.Array, budgets: jax.Array, key: jax.Array, selection: Selection,
                   stop_ids: jax.Array, version: jax.Array, carried_prompts: tuple, *, spec: CarryOverSpec,
                   axes: tuple[str, ...], shardings: tuple | None) -> Inserted:
    """A call's first program, in each queue (``_insert_queue``; with ``axes`` queue q takes prompts q P / S
    .. (q + 1) P / S - 1 of the call's and of each carried generation's [P, T], and their budgets):
    retire region ``version mod G``, prefill the new prompts with ``params`` into it, token 0 of their
    rows, the G - 1 earlier generations' prompts prefilled again (``carried_prompts``,
    ``_refresh_prompts``), the queue rebuilt and the free slots filled. dropped [P] in batch order."""
    count_trace()
    model = decode_model(graphdef, params)
    queue = spec.per_queue(queue_shards(axes))
    # the prefills of the whole call, GSPMD-split as engine.sample's (a kernel's own shard_map inside
    # a queue's would not lower): the rows' keys those of the call's prompts
    prefilled = prefill(model, prompt_tokens, prompt_mask, budgets, key, selection, stop_ids, n=spec.engine.n,
                        spread=False, record_routing=spec.engine.routing)
    refreshed = _refreshed(model, carried_prompts, key, selection, stop_ids, spec)

    def per_queue(stop_ids, version, state, inputs, prompt_routing, refreshed):
        return _insert_queue(state, inputs, prompt_routing, stop_ids, version, refreshed, queue)

    state, dropped, dropped_version, carried = on_queues(
        per_queue, axes, (stop_ids, version),
        (state, input_shares(prefilled.inputs, axes), queue_shares(prefilled.prompt_routing, axes),
         tuple((queue_shares(cache, axes, axis=1), queue_shares(real, axes), queue_shares(routing, axes))
               for cache, real, routing in refreshed)))
    if axes:  # [S, P / S] -> [P]; the retired generation's version (the same in every queue that dropped one)
        dropped, dropped_version, carried = dropped.reshape(-1), jnp.max(dropped_version), jnp.sum(carried)
    return Inserted(nnx.state(model), state.pinned(shardings), dropped, dropped_version, carried)


def _insert_queue(state: CarryState, inputs, prompt_routing: jax.Array | None, stop_ids: jax.Array,
                  version: jax.Array, refreshed: tuple, spec: CarryOverSpec) -> tuple:
    """``insert_program`` in one queue (``spec`` its own) of its share of the prefills (``inputs``, the new
    prompts' ``seam.QueueInputs`` of its P prompts, ``prompt_routing`` their experts or None; ``refreshed``,
    ``_refreshed``'s) -> (state, dropped [P], dropped_version [], carried [])."""
    G, P, n, N, R = spec.generations, spec.prompts, spec.engine.n, spec.engine.max_new_tokens, spec.rows
    g = jnp.mod(version, G)
    region = lambda index, size: index // size == g  # index in a [G size] array -> in region g
    rows = jnp.arange(R, dtype=jnp.int32)
    old = state.decode

    # Retire the generation in region g: its slots and pages freed, its unreturned prompts dropped.
    retired = (old.slots.row < R) & region(old.slots.row, P * n)
    kv = state.page_store(spec).release(old.kv, retired)
    slots = old.slots._replace(row=jnp.where(retired, R, old.slots.row))
    dropped = jax.lax.dynamic_slice_in_dim(state.live, g * P, P)
    dropped_version = jnp.where(jnp.any(dropped), state.inserted[g], -1)
    carried = jnp.sum(jnp.repeat(state.live, n) & ~region(rows, P * n) & ~state.finished(old.outputs),
                      dtype=jnp.int32)

    record = old.outputs.routing
    first = decode.first_outputs(inputs.real, inputs.first_tokens, inputs.first_logp, stop_ids, N, PAD_ID,
                                 None if record is None else (*record.shape[2:], record.dtype))
    state, kv, outputs = put_generation(
        state, kv, old.outputs, spec, g, version, inputs, first, jnp.zeros((P * n, N), jnp.int32).at[:, 0].set(version),
        inputs.first_tokens, jax.random.key_data(inputs.row_keys), jnp.any(inputs.prompt_real, axis=-1),
        prompt_routing)
    kv, refreshed_routing = _refresh_prompts(kv, state.prompt_routing, refreshed, version, spec)
    state = state._replace(prompt_routing=refreshed_routing)
    busy = slots.row < R  # every row in a slot is a carried generation's: its copy of the partial page is redone
    kv = state.page_store(spec).recopy(kv, busy, jnp.minimum(slots.row, R - 1) // n)

    # The queue: rows waiting (live, not ended, in no slot), oldest generation first, in row order.
    in_slot = jnp.zeros((R,), bool).at[slots.row].set(True, mode="drop")
    waiting = jnp.repeat(state.live, n) & ~state.finished(outputs) & ~in_slot
    rank = spec.age_rank(version)[rows // (P * n)] * (P * n) + rows % (P * n)
    state = state._replace(order=jnp.argsort(jnp.where(waiting, rank, R), stable=True).astype(jnp.int32),
                           queued=jnp.sum(waiting, dtype=jnp.int32))
    decode_state = decode.DecodeState(jnp.int32(0), slots, kv, jnp.int32(0), outputs)
    decode_state = decode.refill(state.queue(stop_ids), state.page_store(spec), decode_state, slots.row == R)
    return state._replace(decode=decode_state), dropped, dropped_version, carried


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes", "shardings"), donate_argnames=("state",))
def chunk_program(graphdef: nnx.GraphDef, layout: nnx.State, state: CarryState, selection: Selection,
                  stop_ids: jax.Array, *, spec: CarryOverSpec, axes: tuple[str, ...], shardings: tuple | None):
    """Up to ``spec.engine.chunk_steps`` decode steps in each queue, while fewer than its B (B / S with
    ``axes``) groups a call may return (``CarryState.awaited``) are complete and some row runs -> (state, progress
    [3] int32, replicated: those groups complete and rows running, summed over the queues, 1 once every
    queue is done)."""
    count_trace()
    queue = spec.per_queue(queue_shards(axes))

    def per_queue(layout, selection, stop_ids, state):
        return _chunk_queue(sampling_model(graphdef, layout), state, selection, stop_ids, queue)

    state, progress = on_queues(per_queue, axes, (layout, selection, stop_ids), (state,))
    if axes:  # [S, 3] -> the call's
        progress = jnp.concatenate([jnp.sum(progress[:, :2], axis=0), jnp.min(progress[:, 2:], axis=0)])
    return state.pinned(shardings), constrain(progress, (None,))


def _chunk_queue(model: nnx.Module, state: CarryState, selection: Selection, stop_ids: jax.Array,
                 spec: CarryOverSpec) -> tuple[CarryState, jax.Array]:
    """``chunk_program`` in one queue -> (state, progress [3] int32)."""
    n, R = spec.engine.n, spec.rows
    queue, store = state.queue(stop_ids), state.page_store(spec)
    limit = state.decode.steps + spec.engine.chunk_steps
    awaited = state.awaited(spec, jnp.max(state.inserted))  # this call's insert holds the newest version
    running = lambda d: jnp.sum(d.slots.row < R, dtype=jnp.int32)
    groups = lambda d: jnp.sum(state.complete(d.outputs, n) & awaited, dtype=jnp.int32)
    more = lambda d: (running(d) > 0) & (groups(d) < spec.groups)
    step = functools.partial(decode.decode_step, model, queue, store, selection, refills=True)
    decode_state = jax.lax.while_loop(lambda d: more(d) & (d.steps < limit), step, state.decode)
    progress = jnp.stack([groups(decode_state), running(decode_state), (~more(decode_state)).astype(jnp.int32)])
    return state._replace(decode=decode_state), progress


@functools.partial(jax.jit, static_argnames=("spec", "axes", "shardings"), donate_argnames=("state",))
def harvest_program(state: CarryState, version: jax.Array, dropped: jax.Array, dropped_version: jax.Array,
                    carried: jax.Array, *, spec: CarryOverSpec, axes: tuple[str, ...], shardings: tuple | None
                     ) -> tuple[CarryState, CarryOverRows]:
    """A call's last program: in each queue (``_harvest_queue``) this call's tokens stamped with
    ``version``, its B (B / S with ``axes``) oldest complete groups that the call may return
    (``CarryState.awaited``) gathered and marked returned; the queues' joined (``_joined_rows``), with the
    insert's dropped [P], dropped_version [] and carried_rows [] passed through."""
    count_trace()
    queue = spec.per_queue(queue_shards(axes))
    state, rows, staleness, returned = on_queues(lambda version, state: _harvest_queue(state, version, queue), axes,
                                                 (version,), (state,))
    if axes:
        rows = _joined_rows(rows, staleness, returned, queue)
    rows = rows._replace(dropped=dropped, dropped_version=dropped_version, carried_rows=carried)
    return state.pinned(shardings), rows


def _harvest_queue(state: CarryState, version: jax.Array, spec: CarryOverSpec) -> tuple:
    """``harvest_program`` in one queue -> (state, its ``CarryOverRows`` but dropped, dropped_version and
    carried_rows (None), the staleness summed over its returned tokens [] float32, those tokens [] int32)."""
    G, P, n, B, N = spec.generations, spec.prompts, spec.engine.n, spec.groups, spec.engine.max_new_tokens
    outputs = state.decode.outputs
    t = jnp.arange(N, dtype=jnp.int32)[None, :]
    made = (t >= state.call_start[:, None]) & (t < outputs.lengths[:, None])  # [R, N]: sampled in this call
    versions = jnp.where(made, version, state.versions)

    complete = state.complete(outputs, n) & state.awaited(spec, version)
    pick = jnp.argsort(jnp.where(complete, spec.prompt_rank(version), G * P), stable=True)[:B].astype(jnp.int32)
    valid = complete[pick]
    rows = (pick[:, None] * n + jnp.arange(n, dtype=jnp.int32)).reshape(B * n)
    valid_rows = jnp.repeat(valid, n)
    lengths = jnp.where(valid_rows, outputs.lengths[rows], 0)
    mask = t < lengths[:, None]  # [B n, N]
    picked = lambda x, empty: jnp.where(mask, x[rows], empty)
    token_versions = picked(versions, 0)
    staleness = jnp.where(mask, version - token_versions, 0)
    staleness_sum, tokens_returned = jnp.sum(staleness, dtype=jnp.float32), jnp.sum(mask, dtype=jnp.int32)
    steps = state.decode.steps
    result = CarryOverRows(
        picked(outputs.tokens, PAD_ID), picked(outputs.logprobs, 0.0), token_versions, mask.astype(jnp.int32),
        lengths, valid_rows & outputs.stopped[rows], jnp.where(valid, state.inserted[pick // P], -1),
        jnp.where(valid, pick % P, -1), valid, None, None, None, steps,
        jnp.sum(outputs.lengths - state.call_start, dtype=jnp.int32), steps * spec.engine.slots,
        staleness_sum / jnp.maximum(tokens_returned, 1).astype(jnp.float32), jnp.max(staleness),
        *_picked_routing(state, outputs, pick, valid, rows, mask))
    live = state.live.at[pick].set(state.live[pick] & ~valid)
    state = state._replace(versions=versions, call_start=outputs.lengths, live=live)
    return state, result, staleness_sum, tokens_returned


def _picked_routing(state: CarryState, outputs: decode.Outputs, pick: jax.Array, valid: jax.Array, rows: jax.Array,
                    mask: jax.Array) -> tuple:
    """The routing records of the groups a harvest returns (``_harvest_queue``: their prompts pick [B], valid
    [B], their rows [B n], the rows' generated tokens mask [B n, N]) -> (prompt_routing [B, T, L, k], routing
    [B n, N, L, k]), 0 where nothing was returned; (None, None) without a record."""
    if outputs.routing is None:
        return None, None
    prompts = jnp.where(valid[:, None, None, None], state.prompt_routing[pick], 0)
    return prompts, jnp.where(mask[:, :, None, None], outputs.routing[rows], 0)


def _joined_rows(rows: CarryOverRows, staleness: jax.Array, returned: jax.Array, spec: CarryOverSpec
                 ) -> CarryOverRows:
    """The queues' ``_harvest_queue`` results stacked [S, ...] (``spec`` a queue's) as the call's: the
    groups queue by queue (queue q's B / S, then q + 1's), group_prompt the index in the call's batch
    (queue q's prompt p is q P / S + p), decode_steps the most of any queue, decoded_tokens and
    slot_steps summed, the staleness mean over every returned token (staleness [S] its sums, returned
    [S] the tokens) and its max the max."""
    first = jnp.arange(rows.group_prompt.shape[0], dtype=jnp.int32)[:, None] * spec.prompts  # [S, 1]
    rows = rows._replace(group_prompt=jnp.where(rows.group_valid, rows.group_prompt + first, -1))
    flat = {name: jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), getattr(rows, name))
            for name in (*CarryOverRows._fields[:9], "prompt_routing", "routing")}  # None: no routing record
    return rows._replace(
        **flat, decode_steps=jnp.max(rows.decode_steps), decoded_tokens=jnp.sum(rows.decoded_tokens),
        slot_steps=jnp.sum(rows.slot_steps),
        staleness_mean=jnp.sum(staleness) / jnp.maximum(jnp.sum(returned), 1).astype(jnp.float32),
        staleness_max=jnp.max(rows.staleness_max))
