"""The decode loop of one queue, over a K/V store (docs/design.md section 3.2): the queue, the refill
ranking, the decode step and the narrowing, written once for every sampler; where the K/V lives is
the store's (``KVStore``: contiguous cache rows in sampling/contiguous.py, a page pool in
sampling/paged.py).

Shapes: P prompts (padded), T prompt length, n samples per prompt, Q = P n rows (row i n + j is
sample j of prompt i), C decode slots, w the slots of the current decode width (C, then narrower),
N = max_new_tokens, V vocabulary, D hidden.

A slot holds one row at a time (row Q: idle). A decode step feeds every busy slot its last token at
its position (its prompt's length + t - 1) and selects its token t from its own logits with the key
``fold_in(row key, t)``; a row that hits a stop id or its budget frees its slot in that step, and the
free slots take the next waiting rows in queue (row) order, as far as the store admits them.
``decode_step`` is that step alone, a pure function of named arguments: it can be jitted and lowered
on its own (``engine.lower_decode_step``). ``decode_chunk`` runs up to a given number of steps of the
loop (the sampler calls it until ``progress`` says the queue is done: engine.py).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from pacs_jax.sampling.narrowing import WidthLoop, fit, run_widths
from pacs_jax.sampling.selection import Selection, is_stop


class Queue(NamedTuple):
    """What one queue decodes, fixed for the call.

    order:          [Q] int32, the rows that need decode steps first, in row order
    queued:         [] int32, how many of them
    first_tokens:   [Q] int32, token 0 of each row (from the prefill)
    budgets:        [Q] int32, each row's budget (tokens, token 0 included)
    row_keys:       [Q] PRNG keys, one per row
    prompt_lengths: [P] int32, real tokens of each prompt
    stop_ids:       [S] int32, padded with -1
    """

    order: jax.Array
    queued: jax.Array
    first_tokens: jax.Array
    budgets: jax.Array
    row_keys: jax.Array
    prompt_lengths: jax.Array
    stop_ids: jax.Array

    @property
    def rows(self) -> int:
        return self.row_keys.shape[0]

    @property
    def samples(self) -> int:
        """n, the rows of a prompt."""
        return self.rows // self.prompt_lengths.shape[0]


class Slots(NamedTuple):
    """The decode slots, [w] int32 each."""

    row: jax.Array   # the row a slot holds, Q when idle
    t: jax.Array     # the index of the row's next token
    last: jax.Array  # the last selected token, fed at the next step


class Outputs(NamedTuple):
    """The rows' results, written as they are made: tokens, logprobs [Q, N]; lengths [Q] int32, stopped [Q] bool;
    routing None, or (a model with experts, recording its routing) [Q, N, L, k]: the experts of response token t
    in every layer, where decode step t + 1 fed it (a row's last token is never fed: its entry stays 0)."""

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    routing: jax.Array | None = None


class DecodeState(NamedTuple):
    """The decode loop's carry: steps [] int32 (decode steps so far), the slots, the store's state
    (``KVStore``), taken [] int32 (rows of the queue taken so far), the outputs."""

    steps: jax.Array
    slots: Slots
    kv: Any
    taken: jax.Array
    outputs: Outputs


class QueueResult(NamedTuple):
    """One queue's results: ``Outputs``' fields but its routing, decode steps [], slot steps [] (each width's
    slots x its decode steps, summed), free pages at the end [] (0 without pages) and the routing record."""

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    steps: jax.Array
    slot_steps: jax.Array
    free_pages: jax.Array
    routing: jax.Array | None = None


class KVStore(Protocol):
    """Where the decode slots' K/V lives; a pytree (its per-call arrays as leaves, its sizes static)
    whose methods are pure functions of its state (the ``DecodeState.kv`` it makes and returns)."""

    def init(self, model, slots: int) -> Any:
        """The state of ``slots`` empty slots (the model gives the cache's shape)."""

    def admissible(self, kv, offered: jax.Array, candidate: jax.Array) -> jax.Array:
        """offered [w] bool (free slots offered the next waiting rows), candidate [w] their rows ->
        [w] bool, the slots that take them (the offers are in queue order: a refused one refuses
        the rest)."""

    def admit(self, kv, take: jax.Array, row: jax.Array, prompt: jax.Array) -> Any:
        """The slots where take [w] start rows row [w] of prompts prompt [w]: their prompt's K/V."""

    def attend(self, model, kv, last: jax.Array, positions: jax.Array, t: jax.Array, busy: jax.Array,
               with_routing: bool = False):
        """One decode step of the model: last [w] tokens at positions [w] (token t [w] of each row;
        busy [w] bool) -> (hidden [w, 1, D], state with their K/V written, and with ``with_routing`` the
        experts each token used [w, 1, L, k], else None)."""

    def release(self, kv, done: jax.Array) -> Any:
        """The slots where done [w] end their rows."""

    def narrow(self, kv, moved: jax.Array, running: jax.Array, width: int) -> Any:
        """The slots moved [w] (the running ones first, in slot order; ``running`` [] of them) to
        slots 0 .. width - 1 (``running`` 0: no K/V moves)."""

    def free_pages(self, kv) -> jax.Array:
        """[] int32, pages free (0 for a store without pages)."""

    def resize(self, kv, width: int) -> Any:
        """The state with its per-slot arrays cut to their first ``width`` slots, or padded to
        ``width`` (the padding is never read)."""

    def carried(self) -> KVStore:
        """The store as the decode steps read it: what only ``init`` reads dropped (it lives on in
        the state), so a sampler split into programs does not hold it twice between them."""


def make_queue(real, first_tokens, budgets, row_keys, prompt_lengths, stop_ids) -> Queue:
    """The queue of rows real [Q] (False: no sample) that need decode steps: not stopped at token 0
    (first_tokens [Q]) and a budget (budgets [Q]) over 1."""
    waiting = real & ~is_stop(first_tokens, stop_ids) & (budgets > 1)
    return Queue(jnp.argsort(~waiting, stable=True).astype(jnp.int32), jnp.sum(waiting, dtype=jnp.int32),
                 first_tokens, budgets, row_keys, prompt_lengths, stop_ids)


def first_outputs(real, first_tokens, first_logp, stop_ids, max_new_tokens: int, pad_id: int,
                  routing: tuple | None = None) -> Outputs:
    """The outputs of rows real [Q] bool (False: no sample) with only token 0 written: first_tokens
    [Q] int32, first_logp [Q] float32, stop_ids [S] -> ``Outputs`` of [Q, max_new_tokens]; ``routing``
    (L, k, dtype): with a zeroed routing record [Q, max_new_tokens, L, k]."""
    Q, N = real.shape[0], max_new_tokens
    record = None if routing is None else jnp.zeros((Q, N, *routing[:2]), routing[2])
    return Outputs(jnp.zeros((Q, N), jnp.int32).at[:, 0].set(jnp.where(real, first_tokens, pad_id)),
                   jnp.zeros((Q, N), jnp.float32).at[:, 0].set(jnp.where(real, first_logp, 0.0)),
                   real.astype(jnp.int32), real & is_stop(first_tokens, stop_ids), record)


def start(model, queue: Queue, store: KVStore, real: jax.Array, first_logp: jax.Array, max_new_tokens: int,
          slots: int, pad_id: int, routing: tuple | None = None) -> DecodeState:
    """The state before the first decode step: token 0 of every row written (real [Q] bool, False
    for rows without a sample; first_logp [Q]) and the C slots filled from the queue; ``routing`` (L, k,
    dtype): the decode steps record the experts of the tokens they feed (``Outputs.routing``)."""
    Q = queue.rows
    outputs = first_outputs(real, queue.first_tokens, first_logp, queue.stop_ids, max_new_tokens, pad_id, routing)
    zeros = jnp.zeros((slots,), jnp.int32)
    idle = DecodeState(jnp.int32(0), Slots(jnp.full((slots,), Q, jnp.int32), zeros, zeros), store.init(model, slots),
                       jnp.int32(0), outputs)
    return refill(queue, store, idle, jnp.ones((slots,), bool))


def refill(queue: Queue, store: KVStore, state: DecodeState, free: jax.Array) -> DecodeState:
    """Free slots (free [w] bool) take the next waiting rows in queue order, as far as the store
    admits them; slots left without one go idle. A taken slot's last token is its row's token 0."""
    Q, slots = queue.rows, state.slots
    rank = jnp.cumsum(free, dtype=jnp.int32) - 1
    candidate = queue.order[jnp.minimum(state.taken + rank, Q - 1)]
    take = store.admissible(state.kv, free & (state.taken + rank < queue.queued), candidate)
    row = jnp.where(take, candidate, jnp.where(free, Q, slots.row))
    r = jnp.minimum(row, Q - 1)
    kv = store.admit(state.kv, take, row, r // queue.samples)
    slots = Slots(row, jnp.where(take, 1, slots.t), jnp.where(take, queue.first_tokens[r], slots.last))
    return state._replace(slots=slots, kv=kv, taken=state.taken + jnp.sum(take, dtype=jnp.int32))


def decode_step(model, queue: Queue, store: KVStore, selection: Selection, state: DecodeState, *,
                refills: bool) -> DecodeState:
    """One decode step of every slot of the current width; with ``refills`` the slots whose rows end
    take the next waiting rows (the first width), else they go idle (the narrower widths)."""
    Q, slots, outputs = queue.rows, state.slots, state.outputs
    busy = slots.row < Q
    r = jnp.minimum(slots.row, Q - 1)
    positions = queue.prompt_lengths[r // queue.samples] + slots.t - 1  # [w]: the position of each slot's last token
    record = outputs.routing
    hidden, kv, experts = store.attend(model, state.kv, slots.last, positions, slots.t, busy,
                                       with_routing=record is not None)
    keys = jax.vmap(jax.random.fold_in)(queue.row_keys[r], slots.t)
    token, logp = selection.select_from_hidden(model, hidden[:, 0], keys)
    out = jnp.where(busy, slots.row, Q)  # idle slots write nowhere (out of bounds: dropped)
    hit = busy & is_stop(token, queue.stop_ids)
    t = jnp.where(busy, slots.t + 1, slots.t)
    if record is not None:  # the fed token is the row's token t - 1
        record = record.at[out, slots.t - 1].set(experts[:, 0].astype(record.dtype), mode="drop")
    outputs = Outputs(outputs.tokens.at[out, slots.t].set(token, mode="drop"),
                      outputs.logprobs.at[out, slots.t].set(logp, mode="drop"),
                      outputs.lengths.at[out].set(t, mode="drop"), outputs.stopped.at[out].set(hit, mode="drop"),
                      record)
    done = hit | (busy & (t >= queue.budgets[r]))
    state = DecodeState(state.steps + 1, Slots(slots.row, t, token), store.release(kv, done), state.taken, outputs)
    if refills:
        return refill(queue, store, state, ~busy | done)
    return state._replace(slots=state.slots._replace(row=jnp.where(done, Q, slots.row)))


def narrow(queue: Queue, store: KVStore, state: DecodeState, width: int, active: jax.Array | bool = True
           ) -> DecodeState:
    """The running rows to slots 0 .. width - 1, in slot order (the store moves their K/V or tables).
    ``active`` False: no K/V moves (the per-slot arrays come back moved all the same, to be dropped)."""
    busy = state.slots.row < queue.rows
    moved = jnp.argsort(~busy, stable=True).astype(jnp.int32)  # the busy slots first
    keep = moved[:width]
    running = jnp.where(active, jnp.sum(busy, dtype=jnp.int32), 0)
    return state._replace(slots=jax.tree.map(lambda x: x[keep], state.slots),
                          kv=store.narrow(state.kv, moved, running, width))


def resize(queue: Queue, store: KVStore, state: DecodeState, width: int) -> DecodeState:
    """The state's slots cut or padded to ``width`` (padding slots idle)."""
    slots = Slots(fit(state.slots.row, width, queue.rows), fit(state.slots.t, width), fit(state.slots.last, width))
    return state._replace(slots=slots, kv=store.resize(state.kv, width))


def decode_chunk(model, queue: Queue, store: KVStore, selection: Selection, loop: WidthLoop,
                 widths: tuple[int, ...], steps: int) -> WidthLoop:
    """Up to ``steps`` more decode steps of one queue's loop: one ``while_loop`` a width of ``widths``
    (engine.narrowing_widths), until no row waits or runs; the steps, and the tokens, do not depend
    on ``steps``."""
    running = lambda s: jnp.sum(s.slots.row < queue.rows, dtype=jnp.int32)
    waiting = lambda s: s.taken < queue.queued
    return run_widths(loop, widths, steps, functools.partial(decode_step, model, queue, store, selection),
                      functools.partial(narrow, queue, store), functools.partial(resize, queue, store),
                      running, waiting)


def progress(queue: Queue, loop: WidthLoop, widths: tuple[int, ...]) -> jax.Array:
    """[4] int32: rows done, rows (with a sample), tokens made so far, and 1 once the queue is done
    (0 before)."""
    outputs, slots = loop.carry.outputs, loop.carry.slots
    rows = jnp.sum(outputs.lengths > 0, dtype=jnp.int32)
    running = jnp.sum(slots.row < queue.rows, dtype=jnp.int32)
    done = rows - (queue.queued - loop.carry.taken) - running
    return jnp.stack([done, rows, jnp.sum(outputs.lengths, dtype=jnp.int32),
                      (loop.phase == len(widths)).astype(jnp.int32)])


def result(store: KVStore, loop: WidthLoop) -> QueueResult:
    """One queue's results once its loops are done."""
    state = loop.carry
    out = state.outputs
    return QueueResult(out.tokens, out.logprobs, out.lengths, out.stopped, state.steps, loop.slot_steps,
                       store.free_pages(state.kv), out.routing)
