"""A carry-over resume's two programs (sampling/carry_over.py tells the mechanism):
``restore_program`` (a generation's prompts prefilled into its region, its rows' outputs put back as
exported) and ``reseat_program`` (the rows that held slots back in them, their K/V recomputed a chunk
of positions a program).

Shapes (as sampling/carry_over.py's): P prompts a call (padded), T prompt length, n samples a prompt,
G = max_staleness + 1 generations, R = G P n rows, C decode slots, B groups a call returns, N =
max_new_tokens, s page size, TP = ceil(T / s), F response pages, S queues (batch shards, or 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.sampling import decode
from pacs_jax.sampling.carry_over_programs import count_trace, put_generation
from pacs_jax.sampling.carry_over_records import SavedRows
from pacs_jax.sampling.carry_over_state import CarryOverSpec, CarryState
from pacs_jax.sampling.seam import (decode_model, input_shares, on_queues, prefill, queue_shards, queue_shares,
                                    sampling_model)
from pacs_jax.sampling.selection import Selection
from pacs_jax.sharding import constrain


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes", "shardings"), donate_argnames=("state",))
def restore_program(graphdef: nnx.GraphDef, params: nnx.State, state: CarryState, prompt_tokens: jax.Array,
                    prompt_mask: jax.Array, selection: Selection, stop_ids: jax.Array, version: jax.Array,
                    saved: SavedRows, *, spec: CarryOverSpec, axes: tuple[str, ...], shardings: tuple | None
                     ) -> tuple[nnx.State, CarryState]:
    """A resume's program for each generation in flight (oldest first), in each queue (``_restore_queue``;
    with ``axes`` queue q takes prompts q P / S .. (q + 1) P / S - 1 and their rows of ``saved``): its
    prompts [P, T] prefilled with ``params`` into region ``version mod G`` (their K/V recomputed), its
    rows' outputs, versions, budgets and keys as ``saved`` holds them (token 0 as sampled then, not the
    prefill's). No slot takes a row. Returns (the decode layout, the state)."""
    count_trace()
    model = decode_model(graphdef, params)
    queue = spec.per_queue(queue_shards(axes))
    key = jax.random.wrap_key_data(saved.row_keys[0])  # the prefill's token 0 is not kept: any key
    prefilled = prefill(model, prompt_tokens, prompt_mask, saved.budgets, key, selection, stop_ids, n=spec.engine.n,
                        spread=False, record_routing=spec.engine.routing)  # the whole call's, GSPMD-split
    state = on_queues(lambda version, state, inputs, routing, saved: _restore_queue(state, inputs, routing, version,
                                                                                     saved, queue), axes,
                      (version,), (state, input_shares(prefilled.inputs, axes),
                                   queue_shares(prefilled.prompt_routing, axes), queue_shares(saved, axes)))
    return nnx.state(model), state.pinned(shardings)


def _restore_queue(state: CarryState, inputs, prompt_routing: jax.Array | None, version: jax.Array, saved: SavedRows,
                   spec: CarryOverSpec) -> CarryState:
    """``restore_program`` in one queue (``spec`` its own) of its share of the prefill (``inputs``, and its
    experts ``prompt_routing`` or None) and of the rows (``saved``). An export holds no routing: the rows' record
    is zeroed here and the reseat records the experts of the tokens it feeds, with the resume's weights."""
    g = jnp.mod(version, spec.generations)
    record = state.decode.outputs.routing
    routing = None if record is None else jnp.zeros((saved.tokens.shape[0], *record.shape[1:]), record.dtype)
    rows = decode.Outputs(saved.tokens, saved.logprobs, saved.lengths, saved.stopped, routing)
    state, kv, outputs = put_generation(state, state.decode.kv, state.decode.outputs, spec, g, version, inputs, rows,
                                        saved.versions, saved.tokens[:, 0], saved.row_keys, saved.live, prompt_routing)
    return state._replace(decode=state.decode._replace(kv=kv, outputs=outputs))


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes", "shardings"), donate_argnames=("state",))
def reseat_program(graphdef: nnx.GraphDef, layout: nnx.State, state: CarryState, slot_rows: jax.Array, *,
                   spec: CarryOverSpec, axes: tuple[str, ...], shardings: tuple | None
                    ) -> tuple[CarryState, jax.Array]:
    """A resume's last program, run in chunks: the rows that held decode slots back in the same slots
    (slot_rows [C] int32, R: none; the first chunk's, every later chunk's all R), each admitted as a
    refill admits it (its first page, its prompt's partly filled page copied in, its promise) at token
    1, then, in this chunk and the next, the seated rows' tokens 0 .. length - 2 fed one position a
    step (up to ``spec.engine.chunk_steps`` steps a chunk) through the store's ``attend`` with the
    decode layout ``layout``, as the decode steps fed them: their K/V recomputed with these weights
    into pages of their own. Once all are fed each slot's next token is its row's token ``length``,
    its last the row's last token. With ``axes`` each queue (``_reseat_queue``) takes its slots, C / S
    a queue, their rows (the call's numbering, ``_queue_rows``) its own. Returns (the state, progress
    [2] int32, replicated: the positions left (the most of any queue's), 1 once none is)."""
    count_trace()
    shards = queue_shards(axes)
    queue = spec.per_queue(shards)

    def per_queue(layout, state, slot_rows):
        return _reseat_queue(sampling_model(graphdef, layout), state, slot_rows, queue)

    if axes:
        slot_rows = _queue_rows(slot_rows, spec, shards)
    state, progress = on_queues(per_queue, axes, (layout,), (state, slot_rows))
    if axes:  # [S, 2] -> the call's
        progress = jnp.stack([jnp.max(progress[:, 0]), jnp.min(progress[:, 1])])
    return state.pinned(shardings), constrain(progress, (None,))


def _queue_rows(slot_rows: jax.Array, spec: CarryOverSpec, shards: int) -> jax.Array:
    """The call's rows held by its slots [C] (row (g P + p) n + j, R: none) as each queue's [S, C / S]:
    queue q's slots hold rows of its own prompts p = q P / S + p', in its numbering (g P / S + p') n + j
    (R / S: none)."""
    per_queue = spec.prompts // shards * spec.engine.n  # a queue's rows of one generation
    rows = slot_rows.reshape(shards, -1)
    local = rows // (spec.prompts * spec.engine.n) * per_queue + rows % per_queue
    return jnp.where(rows < spec.rows, local, spec.rows // shards).astype(jnp.int32)


def _reseat_queue(model: nnx.Module, state: CarryState, slot_rows: jax.Array, spec: CarryOverSpec
                  ) -> tuple[CarryState, jax.Array]:
    """``reseat_program`` in one queue (slot_rows [C] in its own numbering) -> (state, progress [2])."""
    R, n = spec.rows, spec.engine.n
    store, outputs = state.page_store(spec), state.decode.outputs
    take = slot_rows < R
    kv = store.admit(state.decode.kv, take, slot_rows, jnp.minimum(slot_rows, R - 1) // n)
    row = jnp.where(take, slot_rows, state.decode.slots.row)
    seated = row < R
    r = jnp.minimum(row, R - 1)
    target = jnp.where(seated, outputs.lengths[r], 1)  # [C]: a slot's t once its tokens are fed
    positions = lambda t: state.prompt_lengths[r // n] + t - 1
    token = lambda t: jnp.take_along_axis(outputs.tokens[r], (t - 1)[:, None], axis=1)[:, 0]

    def feed(carry):
        kv, record, t, steps = carry
        busy = t < target
        _, kv, experts = store.attend(model, kv, token(t), positions(t), t, busy, with_routing=record is not None)
        if record is not None:  # the fed token is the row's token t - 1, as a decode step records it
            record = record.at[jnp.where(busy, r, R), t - 1].set(experts[:, 0].astype(record.dtype), mode="drop")
        return kv, record, jnp.where(busy, t + 1, t), steps + 1

    t = jnp.where(take, 1, jnp.where(seated, state.decode.slots.t, 1))  # a seated slot's next position to feed
    kv, record, t, _ = jax.lax.while_loop(
        lambda carry: jnp.any(carry[2] < target) & (carry[3] < spec.engine.chunk_steps), feed,
        (kv, outputs.routing, t, jnp.int32(0)))
    slots = decode.Slots(row, jnp.where(seated, t, 0), jnp.where(seated, token(t), 0))
    left = jnp.max(target - t)
    progress = jnp.stack([left, (left == 0).astype(jnp.int32)])
    outputs = outputs._replace(routing=record)
    return state._replace(decode=state.decode._replace(slots=slots, kv=kv, outputs=outputs)), progress
