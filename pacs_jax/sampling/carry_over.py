"""Carry-over rollouts (issue 50): a paged sampler whose decode state outlives one call. A call ends
as soon as B complete groups (all n rows of a prompt ended) are available; the rows still running
keep their slots and pages and go on in the next call, with the weights of that call, beside the
next batch of prompts. Every token records the policy version that sampled it.

Shapes: P prompts a call (padded), T prompt length, n samples a prompt, G = max_staleness + 1
generations (the prompt batches of the last G calls), R = G P n rows, C decode slots, B groups a
call returns, N = max_new_tokens, s page size, TP = ceil(T / s), F response pages.

    regions  the prompt batch inserted at version v is generation v; it lives in region g = v mod G:
             prompts g P .. g P + P - 1 (their K/V in pool pages (g P + p) TP ..), rows g P n .. g P n
             + P n - 1 (row (g P + p) n + j is sample j of prompt p), so every array has a fixed shape
             and the decode step (sampling/decode.py) and the page store (sampling/paged.py) run on
             the G P prompts and R rows as on one call's.
    insert   (a call's first program) retire the generation in region g (inserted G versions ago):
             its rows in slots free their slots and pages, and its prompts not yet returned are
             dropped (reported: the caller queues them again); then prefill the new prompts with the
             current weights into region g, token 0 of their rows; prefill the G - 1 earlier
             generations' prompts again with the same weights into their regions (``refresh``); and
             rebuild the queue: the rows waiting, the oldest generation's first, then the new ones,
             each in row order; free slots take rows at once.
    refresh  a carried row decodes with the current weights, and with them the K/V of its prompt:
             left as an earlier call wrote them, the new weights would attend to the old weights'
             K/V, a model neither policy is (on the demo: ten times the sampler's KL to the learner's
             pi_old and 9 to 15 points of held-out accuracy lost, docs/measurements.md section 9).
             ``CarryOverSampler`` keeps the earlier generations' prompts and hands them back; each row
             in a slot takes its prompt's partly filled page again (``PageStore.recopy``). It costs
             one more prefill of P prompts a carried generation, a call.
    decode   chunks of decode steps (decode.decode_step, refilling slots as rows end) with the
             current weights, until B groups are complete or no row runs.
    harvest  (the last program) the tokens made in this call stamped with its version; the B oldest
             complete groups (oldest generation first, then prompt order) gathered and marked
             returned.
    order    which groups a call waits for (``CarryOverSpec.order``): "completion", any B complete
             groups (the call ends as soon as B are; the groups that complete first are the shorter
             responses'); "admission", the B oldest live groups (the call ends when they are all
             complete: no group is returned before an older one, so the returned groups' lengths are
             not biased short; the newer rows still decode in the slots that free meanwhile).

A prompt's K/V is that of the current call's weights (inserted or refreshed); a response token's K/V
stays where it was written, computed by the weights of the call whose decode step fed it (the version
of the token after it), and is not recomputed but on a resume:

    export   (host) the rows in flight after a call: each generation with a live prompt, its rows'
             tokens, log-probs, versions, lengths, stop flags, budgets and keys, and the row each slot
             holds (``InFlightRows``; no K/V)
    restore  (a resume's program a generation) its prompts prefilled with the current weights into its
             region, its rows' outputs as exported
    reseat   (a resume's last program, in chunks of ``chunk_steps`` positions, so a stop signal is
             answered between two as between a call's decode chunks) the rows that held slots back in
             them, each admitted as a refill admits it, then its tokens 0 .. length - 2 fed through the
             store's ``attend`` one position a step (the decode step's K/V write): their K/V recomputed
             with the current weights, the slots as a decode step leaves them (next token ``length``,
             last token fed next), so the next call goes on as the engine that exported them would.

Token t of row (i, j) of the prompts inserted with key k is selected with ``fold_in(fold_in(fold_in(k, i), j), t)`` from its own logits,
as ``engine.sample`` selects it: the tokens do not depend on the schedule, and with unchanged weights
the rows equal ``engine.sample``'s of the same prompts and key.

Queues per batch shard (``queue_axes``): when the batch axes ("data", "fsdp") divide P, C and B
(``engine.queues``), every program runs once per shard under ``shard_map`` (``engine._on_queues``),
as ``engine.sample``'s decode loops do: queue q holds prompts q P / S .. (q + 1) P / S - 1 of each
generation (S shards), C / S slots, F / S response pages and a pool of its own (G P / S prompts' pages
and those), and returns B / S groups a call; a call ends when every queue has its groups or runs no
row. The ``CarryState`` is each queue's, stacked on a leading queue axis split over the batch axes, so
a device holds 1 / S of the pool where one queue would hold all of it (split over the K/V heads
only). Results keep the call's numbering: ``CarryOverRows``' group_prompt and dropped index the
call's batch, and an export (``InFlightRows``) is that of one queue of the whole call, which a resume
on a mesh with the same split takes back. Otherwise one queue: the decode step runs GSPMD-partitioned
over the call's arrays as ``engine.sample``'s one-queue path does.

``CarryOverSampler.lower`` lowers the four programs and a resume's two on abstract arguments, as
``engine.lower_sample`` the ordinary sampler's: the trainer's warm-up compiles them before step 1 (a
real call, or a resume, then finds them compiled) and reads XLA's memory of them;
tools/plan_memory.py compiles them for a slice.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pacs_jax import distributed
from pacs_jax.models.paged_attention import POOL_AXES, PagedKVCache
from pacs_jax.sampling import decode
from pacs_jax.sampling.engine import (EngineSpec, PAD_ID, run_chunks, stop_id_array, _decode_model, _device_bytes,
                                      _on_queues, _prefill, _results, _shards, queues)
from pacs_jax.sampling.paged import PageStore, default_pages, prompt_pages, row_promise, table_width
from pacs_jax.sampling.selection import Selection
from pacs_jax.sampling.settings import CARRY_OVER_ORDERS, SamplingSettings, row_pages
from pacs_jax.sharding import batch_shards, constrain, current_rules, replicated

_TRACE_COUNT = 0


def compile_count() -> int:
    """How many times the carry-over programs (init, insert, chunk, harvest) have been traced (=
    compiled) in this process."""
    return _TRACE_COUNT


def _traced() -> None:
    global _TRACE_COUNT
    _TRACE_COUNT += 1


@dataclasses.dataclass(frozen=True)
class CarryOverSpec:
    """The static part of the carry-over programs: the paged ``EngineSpec`` of the whole call (n,
    max_new_tokens, C slots, page size, F response pages, chunk steps), P prompts a call of T tokens,
    G generations, B groups a call returns, and the order it returns them in ("completion" or
    "admission", ``CARRY_OVER_ORDERS``); a queue's share of them: ``per_queue``."""

    engine: EngineSpec
    prompts: int
    prompt_length: int
    generations: int
    groups: int
    order: str = CARRY_OVER_ORDERS[0]

    @property
    def rows(self) -> int:
        """R = G P n."""
        return self.generations * self.prompts * self.engine.n

    @property
    def prompt_pages(self) -> int:
        """TP."""
        return -(-self.prompt_length // self.engine.page_size)

    def per_queue(self, shards: int) -> CarryOverSpec:
        """The spec of one of ``shards`` queues (one a batch shard, ``queue_axes``): P / shards prompts a
        generation, C / shards slots, F / shards response pages, B / shards groups a call (itself for one)."""
        if shards == 1:
            return self
        engine = dataclasses.replace(self.engine.per_queue(shards), pages=self.engine.pages // shards)
        return dataclasses.replace(self, engine=engine, prompts=self.prompts // shards, groups=self.groups // shards)

    def store(self, promise: jax.Array, prompt_lengths: jax.Array, pool: PagedKVCache | None = None) -> PageStore:
        """The page store of the G P prompts: promise [R], prompt_lengths [G P]."""
        s, N = self.engine.page_size, self.engine.max_new_tokens
        return PageStore(pool, promise, prompt_lengths, s, self.engine.pages, self.prompt_pages,
                         table_width(self.prompt_length, N, s))


class CarryState(NamedTuple):
    """The decode state that outlives a call (a pytree of fixed shapes).

    decode:         decode.DecodeState: steps [] (this call's decode steps), slots [C] (row R: idle),
                    kv (paged.PageState: the pool [K, L, G P TP + F + 1, s, Dh], free pages, the
                    slots' tables), taken [] (rows of ``order`` taken this call), outputs (tokens,
                    logprobs [R, N], lengths [R], stopped [R])
    versions:       [R, N] int32, the policy version that sampled each token (0 past a row's end)
    call_start:     [R] int32, each row's length when this call's decode began
    first_tokens:   [R] int32, token 0 of each row
    budgets:        [R] int32, each row's budget
    row_keys:       [R, k] uint32, each row's PRNG key as its key data (``jax.random.key_data``: a key
                    array's sharding is not the same on every path, a plain array's is)
    promise:        [R] int32, the response pages each row may need (paged.row_promise)
    prompt_lengths: [G P] int32
    order:          [R] int32, the queue: waiting rows first, oldest generation first, in row order
    queued:         [] int32, waiting rows in ``order``
    inserted:       [G] int32, the version that inserted each region's generation (-1: none yet)
    live:           [G P] bool, real prompts inserted and neither returned nor dropped

    With queues per batch shard (``queue_axes``) each is a queue's (of its P / S prompts a generation and
    C / S slots), stacked on a leading queue axis [S, ...].
    """

    decode: decode.DecodeState
    versions: jax.Array
    call_start: jax.Array
    first_tokens: jax.Array
    budgets: jax.Array
    row_keys: jax.Array
    promise: jax.Array
    prompt_lengths: jax.Array
    order: jax.Array
    queued: jax.Array
    inserted: jax.Array
    live: jax.Array


class CarryOverRows(NamedTuple):
    """One call's results (device arrays): B groups' rows, row k n + j sample j of group k (with queues
    per batch shard, queue q's B / S groups are groups q B / S ..; the indices are the call's).

    tokens:          [B n, N] int32, PAD_ID after the end
    logprobs:        [B n, N] float32, 0 after the end
    versions:        [B n, N] int32, the policy version that sampled each token, 0 after the end
    response_mask:   [B n, N] int32, 1 on generated tokens
    lengths:         [B n] int32
    stopped:         [B n] bool, True at a stop id, False at the budget
    group_version:   [B] int32, the version (call) whose prompt batch the group came from (-1: none)
    group_prompt:    [B] int32, its index in that batch (-1: none)
    group_valid:     [B] bool, False where fewer than B groups completed (no row left to run)
    dropped:         [P] bool, prompts of the batch of ``dropped_version`` dropped by this call
                     (unreturned when their generation retired: queue them again)
    dropped_version: [] int32, the version whose batch ``dropped`` indexes (-1: none retired)
    carried_rows:    [] int32, rows of earlier calls still running or waiting when this call began
    decode_steps:    [] int32, this call's decode steps (the most of any queue's)
    decoded_tokens:  [] int32, tokens its decode steps sampled (every row's, returned or not)
    slot_steps:      [] int32, C x decode steps (a queue's slots x its steps, summed over the queues)
    staleness_mean:  [] float32, mean of (this version - token version) over the returned tokens
    staleness_max:   [] int32, its max
    """

    tokens: jax.Array
    logprobs: jax.Array
    versions: jax.Array
    response_mask: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    group_version: jax.Array
    group_prompt: jax.Array
    group_valid: jax.Array
    dropped: jax.Array
    dropped_version: jax.Array
    carried_rows: jax.Array
    decode_steps: jax.Array
    decoded_tokens: jax.Array
    slot_steps: jax.Array
    staleness_mean: jax.Array
    staleness_max: jax.Array

    @property
    def slot_utilisation(self) -> float:
        """Tokens sampled by this call's decode steps / slot steps (1: no slot ever idle)."""
        return int(self.decoded_tokens) / int(self.slot_steps) if int(self.slot_steps) else 1.0


class CarryOverProgress(NamedTuple):
    """A call's progress after a chunk: groups complete (not yet returned), rows running, and
    whether the call's decode is done (B groups complete, or no row runs)."""

    groups: int
    running: int
    done: bool

    @classmethod
    def read(cls, progress: jax.Array) -> CarryOverProgress:
        """From the chunk program's replicated [3] array."""
        groups, running, done = np.asarray(progress.addressable_data(0)).tolist()
        return cls(groups, running, bool(done))


def _queue(state: CarryState, stop_ids: jax.Array) -> decode.Queue:
    return decode.Queue(state.order, state.queued, state.first_tokens, state.budgets,
                        jax.random.wrap_key_data(state.row_keys),
                        state.prompt_lengths, stop_ids)


def _store(state: CarryState, spec: CarryOverSpec) -> PageStore:
    """The page store as the decode steps read it (the pool lives in ``state.decode.kv``)."""
    return spec.store(state.promise, state.prompt_lengths)


def _finished(state: CarryState, outputs: decode.Outputs) -> jax.Array:
    """[R] bool: rows ended (a stop id, or their budget); rows never inserted are not."""
    return outputs.stopped | (outputs.lengths >= state.budgets)


def _complete(state: CarryState, outputs: decode.Outputs, n: int) -> jax.Array:
    """[G P] bool: live prompts whose n rows all ended."""
    return state.live & jnp.all(_finished(state, outputs).reshape(-1, n), axis=1)


def _age_rank(generations: int, version: jax.Array) -> jax.Array:
    """[G] int32: each region's generation by age at ``version`` (0 the oldest, G - 1 this version's)."""
    return jnp.mod(jnp.arange(generations, dtype=jnp.int32) - version - 1, generations)


def _prompt_rank(spec: CarryOverSpec, version: jax.Array) -> jax.Array:
    """[G P] int32: each prompt's place in admission order at ``version`` (oldest generation first, then
    prompt order)."""
    prompts = jnp.arange(spec.generations * spec.prompts, dtype=jnp.int32)
    return _age_rank(spec.generations, version)[prompts // spec.prompts] * spec.prompts + prompts % spec.prompts


def _awaited(state: CarryState, spec: CarryOverSpec, version: jax.Array) -> jax.Array:
    """[G P] bool: the groups a call may return, by ``spec.order``: every live prompt ("completion"), or
    the B oldest live prompts ("admission")."""
    if spec.order == "completion":
        return state.live
    rank = jnp.where(state.live, _prompt_rank(spec, version), spec.generations * spec.prompts)
    oldest = jnp.argsort(rank, stable=True)[:spec.groups]
    return jnp.zeros_like(state.live).at[oldest].set(state.live[oldest])


def _pinned(state: CarryState, shardings: tuple | None) -> CarryState:
    """The state in the shardings the init program gave it (None: as XLA places it), so every call's
    programs see the same signature."""
    if shardings is None:
        return state
    return jax.lax.with_sharding_constraint(state, jax.tree.unflatten(jax.tree.structure(state), shardings))


def queue_count(prompts: int, slots: int, groups: int, batch_shards: int) -> int:
    """The carry-over's queues for P ``prompts`` a call, C ``slots`` and B ``groups`` a call on a mesh of
    ``batch_shards``: one a shard when the shards divide P, C (``engine.queues``) and B, else one."""
    return batch_shards if queues(prompts, slots, batch_shards) == batch_shards and groups % batch_shards == 0 else 1


def queue_axes(spec: CarryOverSpec) -> tuple[str, ...]:
    """The mesh axes (of the mesh in context) that the carry-over's queues are split over: the batch axes
    when their shards divide P, C (``engine.queues``) and B, a queue a shard, each with its share of
    the pool; none otherwise (one queue for the whole call). Raises ValueError when the response
    pages (``rollout.pages``) split over the queues leave a queue less than one row's."""
    axes = current_rules().batch_axes()
    if queue_count(spec.prompts, spec.engine.slots, spec.groups, _shards(axes)) == 1:
        return ()
    shards, need = _shards(axes), row_pages(spec.engine.page_size, spec.engine.max_new_tokens)
    if spec.engine.pages // shards < need:
        raise ValueError(f"pages={spec.engine.pages}: split over {shards} queues (one a batch shard), a queue's "
                         f"{spec.engine.pages // shards} must hold one row's response pages, {need}")
    return axes


def _split(tree, axes: tuple[str, ...], axis: int = 0):
    """With ``axes``, each array [..., S k, ...] of ``tree`` (S k its dim ``axis``) as each queue's share
    stacked, [S, ..., k, ...] (queue q takes q k .. q k + k - 1, as ``engine.sample``'s shards split the
    prompts); as it is without."""
    if not axes:
        return tree
    shards = _shards(axes)
    return jax.tree.map(lambda x: jnp.moveaxis(
        x.reshape(*x.shape[:axis], shards, x.shape[axis] // shards, *x.shape[axis + 1:]), axis, 0), tree)


def _split_inputs(inputs, axes: tuple[str, ...]):
    """A prefill's ``engine.QueueInputs`` of the whole call as each queue's share (``_split``: the K/V
    [L, P, K, T, Dh] split over P, the others over their first axis), its stop ids left out (None)."""
    return _split(inputs._replace(prompt_cache=None, stop_ids=None), axes)._replace(
        prompt_cache=_split(inputs.prompt_cache, axes, axis=1))


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes"))
def _init_program(graphdef: nnx.GraphDef, params: nnx.State, key: jax.Array, *, spec: CarryOverSpec,
                  axes: tuple[str, ...]) -> CarryState:
    """The empty state of each queue (stacked with ``axes``, ``queue_axes``): a zero pool, every slot
    idle, no generation inserted (key only lends the shape of the rows' key data)."""
    _traced()
    cfg = nnx.merge(graphdef, params).cfg
    queue = spec.per_queue(_shards(axes))
    return _on_queues(lambda key: _empty_state(cfg, key, queue), axes, (key,), ())


def _empty_state(cfg, key: jax.Array, spec: CarryOverSpec) -> CarryState:
    """One queue's empty state (``_init_program``)."""
    G, P, n, C, N, R = (spec.generations, spec.prompts, spec.engine.n, spec.engine.slots, spec.engine.max_new_tokens,
                        spec.rows)
    shape = (cfg.num_key_value_heads, cfg.num_hidden_layers, G * P * spec.prompt_pages + spec.engine.pages + 1,
             spec.engine.page_size, cfg.head_dim)
    zeros = lambda: constrain(jnp.zeros(shape, jnp.dtype(cfg.dtype)), POOL_AXES)
    store = spec.store(jnp.zeros((R,), jnp.int32), jnp.zeros((G * P,), jnp.int32), PagedKVCache(zeros(), zeros()))
    outputs = decode.Outputs(jnp.zeros((R, N), jnp.int32), jnp.zeros((R, N), jnp.float32), jnp.zeros((R,), jnp.int32),
                             jnp.zeros((R,), bool))
    idle = jnp.zeros((C,), jnp.int32)
    state = decode.DecodeState(jnp.int32(0), decode.Slots(jnp.full((C,), R, jnp.int32), idle, idle),
                               store.init(None, C), jnp.int32(0), outputs)
    return CarryState(state, jnp.zeros((R, N), jnp.int32), jnp.zeros((R,), jnp.int32), jnp.zeros((R,), jnp.int32),
                      jnp.ones((R,), jnp.int32), jax.random.key_data(jax.random.split(key, R)), store.promise,
                      store.prompt_lengths, jnp.arange(R, dtype=jnp.int32), jnp.int32(0), jnp.full((G,), -1, jnp.int32),
                      jnp.zeros((G * P,), bool))


def _put_prompt_pages(kv, prompt_cache, prompt_real: jax.Array, spec: CarryOverSpec, g: jax.Array):
    """The pool's state kv with region g's P prompts' pages written from a prefill's K/V (prompt_cache
    [L, P, K, T, Dh], prompt_real [P, T])."""
    pages = prompt_pages(prompt_cache, prompt_real, spec.engine.page_size)
    at = g * spec.prompts * spec.prompt_pages
    return kv._replace(k=jax.lax.dynamic_update_slice_in_dim(kv.k, pages.k.astype(kv.k.dtype), at, axis=2),
                       v=jax.lax.dynamic_update_slice_in_dim(kv.v, pages.v.astype(kv.v.dtype), at, axis=2))


def _refreshed(model: nnx.Module, carried_prompts: tuple, key: jax.Array, selection: Selection,
               stop_ids: jax.Array, spec: CarryOverSpec) -> tuple:
    """The prompts of the G - 1 generations before this call prefilled again with ``model`` (the decode
    layout's; ``carried_prompts``: (tokens [P, T], mask [P, T]) a generation, the last call's first;
    all-padding where no generation was inserted) -> (K/V [L, P, K, T, Dh], prompt_real [P, T]) a
    generation, so that the rows still to decode in this call attend to the current weights' K/V of
    their prompt, not to an earlier call's (``_refresh_prompts`` writes them)."""
    budgets = jnp.ones((spec.prompts * spec.engine.n,), jnp.int32)  # token 0 of this prefill is not kept
    inputs = (_prefill(model, tokens, mask, budgets, key, selection, stop_ids, spec.engine, ()).inputs
              for tokens, mask in carried_prompts)
    return tuple((x.prompt_cache, x.prompt_real) for x in inputs)


def _refresh_prompts(kv, refreshed: tuple, version: jax.Array, spec: CarryOverSpec):
    """The pool's state kv with ``_refreshed``'s K/V of the generations before ``version`` in their regions."""
    for age, (prompt_cache, prompt_real) in enumerate(refreshed, start=1):
        kv = _put_prompt_pages(kv, prompt_cache, prompt_real, spec, jnp.mod(version - age, spec.generations))
    return kv


def _put_generation(state: CarryState, kv, outputs: decode.Outputs, spec: CarryOverSpec, g: jax.Array,
                    version: jax.Array, inputs, rows: decode.Outputs, versions: jax.Array, first_tokens: jax.Array,
                    row_keys: jax.Array, live: jax.Array) -> tuple[CarryState, object, decode.Outputs]:
    """Region g takes the generation inserted at ``version``: its prompts' pages from the prefill
    (``inputs``, ``engine.QueueInputs``: its K/V [L, P, K, T, Dh], budgets [P n]), its rows' outputs
    (``rows``: [P n, N] / [P n]), versions [P n, N], token 0 [P n], key data [P n, k], live prompts
    [P] -> (state, the pool's state kv, the outputs of all R rows)."""
    P, n = spec.prompts, spec.engine.n
    put = lambda whole, part: jax.lax.dynamic_update_slice_in_dim(whole, part.astype(whole.dtype),
                                                                  g * part.shape[0], axis=0)
    kv = _put_prompt_pages(kv, inputs.prompt_cache, inputs.prompt_real, spec, g)
    lengths = jnp.sum(inputs.prompt_real, axis=-1, dtype=jnp.int32)
    outputs = decode.Outputs(*(put(whole, part) for whole, part in zip(outputs, rows)))
    state = state._replace(
        versions=put(state.versions, versions), call_start=outputs.lengths,
        first_tokens=put(state.first_tokens, first_tokens), budgets=put(state.budgets, inputs.budgets),
        row_keys=put(state.row_keys, row_keys),
        promise=put(state.promise, row_promise(lengths, inputs.budgets, n, spec.engine.page_size)),
        prompt_lengths=put(state.prompt_lengths, lengths), inserted=state.inserted.at[g].set(version),
        live=put(state.live, live))
    return state, kv, outputs


class Inserted(NamedTuple):
    """What a call's insert program (``_insert_program``) gives its chunk and harvest programs."""

    layout: nnx.State  # the model's state in the decode layout
    state: CarryState  # the decode state with the new prompts in (donated to the chunks)
    dropped: jax.Array  # [P] bool: the retired generation's prompts never returned
    dropped_version: jax.Array  # [] int32: the retired generation's version when any was dropped, else -1
    carried: jax.Array  # [] int32: rows of earlier calls still running as the call began


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes", "shardings"), donate_argnames=("state",))
def _insert_program(graphdef: nnx.GraphDef, params: nnx.State, state: CarryState, prompt_tokens: jax.Array,
                    prompt_mask: jax.Array, budgets: jax.Array, key: jax.Array, selection: Selection,
                    stop_ids: jax.Array, version: jax.Array, carried_prompts: tuple, *, spec: CarryOverSpec,
                    axes: tuple[str, ...], shardings: tuple | None) -> Inserted:
    """A call's first program, in each queue (``_insert_queue``; with ``axes`` queue q takes prompts q P / S
    .. (q + 1) P / S - 1 of the call's and of each carried generation's [P, T], and their budgets):
    retire region ``version mod G``, prefill the new prompts with ``params`` into it, token 0 of their
    rows, the G - 1 earlier generations' prompts prefilled again (``carried_prompts``,
    ``_refresh_prompts``), the queue rebuilt and the free slots filled. dropped [P] in batch order."""
    _traced()
    model = _decode_model(graphdef, params)
    queue = spec.per_queue(_shards(axes))
    # the prefills of the whole call, GSPMD-split as engine.sample's (a kernel's own shard_map inside
    # a queue's would not lower): the rows' keys those of the call's prompts
    inputs = _prefill(model, prompt_tokens, prompt_mask, budgets, key, selection, stop_ids, spec.engine, ()).inputs
    refreshed = _refreshed(model, carried_prompts, key, selection, stop_ids, spec)

    def per_queue(stop_ids, version, state, inputs, refreshed):
        return _insert_queue(state, inputs, stop_ids, version, refreshed, queue)

    state, dropped, dropped_version, carried = _on_queues(
        per_queue, axes, (stop_ids, version),
        (state, _split_inputs(inputs, axes), tuple((_split(cache, axes, axis=1), _split(real, axes))
                                                   for cache, real in refreshed)))
    if axes:  # [S, P / S] -> [P]; the retired generation's version (the same in every queue that dropped one)
        dropped, dropped_version, carried = dropped.reshape(-1), jnp.max(dropped_version), jnp.sum(carried)
    return Inserted(nnx.state(model), _pinned(state, shardings), dropped, dropped_version, carried)


def _insert_queue(state: CarryState, inputs, stop_ids: jax.Array, version: jax.Array, refreshed: tuple,
                  spec: CarryOverSpec) -> tuple:
    """``_insert_program`` in one queue (``spec`` its own) of its share of the prefills (``inputs``, the new
    prompts' ``engine.QueueInputs`` of its P prompts; ``refreshed``, ``_refreshed``'s) -> (state, dropped
    [P], dropped_version [], carried [])."""
    G, P, n, N, R = spec.generations, spec.prompts, spec.engine.n, spec.engine.max_new_tokens, spec.rows
    g = jnp.mod(version, G)
    region = lambda index, size: index // size == g  # index in a [G size] array -> in region g
    rows = jnp.arange(R, dtype=jnp.int32)
    old = state.decode

    # Retire the generation in region g: its slots and pages freed, its unreturned prompts dropped.
    retired = (old.slots.row < R) & region(old.slots.row, P * n)
    kv = _store(state, spec).release(old.kv, retired)
    slots = old.slots._replace(row=jnp.where(retired, R, old.slots.row))
    dropped = jax.lax.dynamic_slice_in_dim(state.live, g * P, P)
    dropped_version = jnp.where(jnp.any(dropped), state.inserted[g], -1)
    carried = jnp.sum(jnp.repeat(state.live, n) & ~region(rows, P * n) & ~_finished(state, old.outputs),
                      dtype=jnp.int32)

    first = decode.first_outputs(inputs.real, inputs.first_tokens, inputs.first_logp, stop_ids, N, PAD_ID)
    state, kv, outputs = _put_generation(
        state, kv, old.outputs, spec, g, version, inputs, first, jnp.zeros((P * n, N), jnp.int32).at[:, 0].set(version),
        inputs.first_tokens, jax.random.key_data(inputs.row_keys), jnp.any(inputs.prompt_real, axis=-1))
    kv = _refresh_prompts(kv, refreshed, version, spec)
    busy = slots.row < R  # every row in a slot is a carried generation's: its copy of the partial page is redone
    kv = _store(state, spec).recopy(kv, busy, jnp.minimum(slots.row, R - 1) // n)

    # The queue: rows waiting (live, not ended, in no slot), oldest generation first, in row order.
    in_slot = jnp.zeros((R,), bool).at[slots.row].set(True, mode="drop")
    waiting = jnp.repeat(state.live, n) & ~_finished(state, outputs) & ~in_slot
    rank = _age_rank(G, version)[rows // (P * n)] * (P * n) + rows % (P * n)
    state = state._replace(order=jnp.argsort(jnp.where(waiting, rank, R), stable=True).astype(jnp.int32),
                           queued=jnp.sum(waiting, dtype=jnp.int32))
    decode_state = decode.DecodeState(jnp.int32(0), slots, kv, jnp.int32(0), outputs)
    decode_state = decode.refill(_queue(state, stop_ids), _store(state, spec), decode_state, slots.row == R)
    return state._replace(decode=decode_state), dropped, dropped_version, carried


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes", "shardings"), donate_argnames=("state",))
def _chunk_program(graphdef: nnx.GraphDef, layout: nnx.State, state: CarryState, selection: Selection,
                   stop_ids: jax.Array, *, spec: CarryOverSpec, axes: tuple[str, ...], shardings: tuple | None):
    """Up to ``spec.engine.chunk_steps`` decode steps in each queue, while fewer than its B (B / S with
    ``axes``) groups a call may return (``_awaited``) are complete and some row runs -> (state, progress
    [3] int32, replicated: those groups complete and rows running, summed over the queues, 1 once every
    queue is done)."""
    _traced()
    queue = spec.per_queue(_shards(axes))

    def per_queue(layout, selection, stop_ids, state):
        return _chunk_queue(nnx.merge(graphdef, layout), state, selection, stop_ids, queue)

    state, progress = _on_queues(per_queue, axes, (layout, selection, stop_ids), (state,))
    if axes:  # [S, 3] -> the call's
        progress = jnp.concatenate([jnp.sum(progress[:, :2], axis=0), jnp.min(progress[:, 2:], axis=0)])
    return _pinned(state, shardings), constrain(progress, (None,))


def _chunk_queue(model: nnx.Module, state: CarryState, selection: Selection, stop_ids: jax.Array,
                 spec: CarryOverSpec) -> tuple[CarryState, jax.Array]:
    """``_chunk_program`` in one queue -> (state, progress [3] int32)."""
    n, R = spec.engine.n, spec.rows
    queue, store = _queue(state, stop_ids), _store(state, spec)
    limit = state.decode.steps + spec.engine.chunk_steps
    awaited = _awaited(state, spec, jnp.max(state.inserted))  # this call's insert holds the newest version
    running = lambda d: jnp.sum(d.slots.row < R, dtype=jnp.int32)
    groups = lambda d: jnp.sum(_complete(state, d.outputs, n) & awaited, dtype=jnp.int32)
    more = lambda d: (running(d) > 0) & (groups(d) < spec.groups)
    step = functools.partial(decode.decode_step, model, queue, store, selection, refills=True)
    decode_state = jax.lax.while_loop(lambda d: more(d) & (d.steps < limit), step, state.decode)
    progress = jnp.stack([groups(decode_state), running(decode_state), (~more(decode_state)).astype(jnp.int32)])
    return state._replace(decode=decode_state), progress


@functools.partial(jax.jit, static_argnames=("spec", "axes", "shardings"), donate_argnames=("state",))
def _harvest_program(state: CarryState, version: jax.Array, dropped: jax.Array, dropped_version: jax.Array,
                     carried: jax.Array, *, spec: CarryOverSpec, axes: tuple[str, ...], shardings: tuple | None
                     ) -> tuple[CarryState, CarryOverRows]:
    """A call's last program: in each queue (``_harvest_queue``) this call's tokens stamped with
    ``version``, its B (B / S with ``axes``) oldest complete groups that the call may return
    (``_awaited``) gathered and marked returned; the queues' joined (``_joined_rows``), with the
    insert's dropped [P], dropped_version [] and carried_rows [] passed through."""
    _traced()
    queue = spec.per_queue(_shards(axes))
    state, rows, staleness, returned = _on_queues(lambda version, state: _harvest_queue(state, version, queue), axes,
                                                  (version,), (state,))
    if axes:
        rows = _joined_rows(rows, staleness, returned, queue)
    rows = rows._replace(dropped=dropped, dropped_version=dropped_version, carried_rows=carried)
    return _pinned(state, shardings), rows


def _harvest_queue(state: CarryState, version: jax.Array, spec: CarryOverSpec) -> tuple:
    """``_harvest_program`` in one queue -> (state, its ``CarryOverRows`` but dropped, dropped_version and
    carried_rows (None), the staleness summed over its returned tokens [] float32, those tokens [] int32)."""
    G, P, n, B, N = spec.generations, spec.prompts, spec.engine.n, spec.groups, spec.engine.max_new_tokens
    outputs = state.decode.outputs
    t = jnp.arange(N, dtype=jnp.int32)[None, :]
    made = (t >= state.call_start[:, None]) & (t < outputs.lengths[:, None])  # [R, N]: sampled in this call
    versions = jnp.where(made, version, state.versions)

    complete = _complete(state, outputs, n) & _awaited(state, spec, version)
    pick = jnp.argsort(jnp.where(complete, _prompt_rank(spec, version), G * P), stable=True)[:B].astype(jnp.int32)
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
        staleness_sum / jnp.maximum(tokens_returned, 1).astype(jnp.float32), jnp.max(staleness))
    live = state.live.at[pick].set(state.live[pick] & ~valid)
    state = state._replace(versions=versions, call_start=outputs.lengths, live=live)
    return state, result, staleness_sum, tokens_returned


def _joined_rows(rows: CarryOverRows, staleness: jax.Array, returned: jax.Array, spec: CarryOverSpec
                 ) -> CarryOverRows:
    """The queues' ``_harvest_queue`` results stacked [S, ...] (``spec`` a queue's) as the call's: the
    groups queue by queue (queue q's B / S, then q + 1's), group_prompt the index in the call's batch
    (queue q's prompt p is q P / S + p), decode_steps the most of any queue, decoded_tokens and
    slot_steps summed, the staleness mean over every returned token (staleness [S] its sums, returned
    [S] the tokens) and its max the max."""
    first = jnp.arange(rows.group_prompt.shape[0], dtype=jnp.int32)[:, None] * spec.prompts  # [S, 1]
    rows = rows._replace(group_prompt=jnp.where(rows.group_valid, rows.group_prompt + first, -1))
    flat = {name: getattr(rows, name).reshape(-1, *getattr(rows, name).shape[2:]) for name in CarryOverRows._fields[:9]}
    return rows._replace(
        **flat, decode_steps=jnp.max(rows.decode_steps), decoded_tokens=jnp.sum(rows.decoded_tokens),
        slot_steps=jnp.sum(rows.slot_steps),
        staleness_mean=jnp.sum(staleness) / jnp.maximum(jnp.sum(returned), 1).astype(jnp.float32),
        staleness_max=jnp.max(rows.staleness_max))


class SavedRows(NamedTuple):
    """One generation's rows as exported (``InFlightRows``), the arguments of the restore program.

    tokens, logprobs, versions: [P n, N] (int32, float32, int32; PAD_ID / 0 / 0 past a row's length)
    lengths:  [P n] int32, tokens made so far
    stopped:  [P n] bool
    budgets:  [P n] int32
    row_keys: [P n, k] uint32, each row's key data
    live:     [P] bool, the prompts neither returned nor dropped
    """

    tokens: jax.Array
    logprobs: jax.Array
    versions: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    budgets: jax.Array
    row_keys: jax.Array
    live: jax.Array


class InFlightRows(NamedTuple):
    """What a resume needs of the rows in flight after a call, on the host (numpy; every process the
    same): ``CarryOverSampler.export`` -> ``CarryOverSampler.resume``. Their K/V is not in it: a
    resume recomputes it with the weights it is given.

    version:     the version of the call after which they were exported
    generations: the versions whose prompt batches still hold live prompts, oldest first
    rows:        one ``SavedRows`` of numpy arrays a generation (the rows of its prompts not live
                 emptied: length 0)
    slots:       [C] int32, the row each decode slot held (-1: idle)
    """

    version: int
    generations: tuple[int, ...]
    rows: tuple[SavedRows, ...]
    slots: np.ndarray

    @property
    def running(self) -> int:
        """Rows in decode slots (their K/V is what a resume recomputes)."""
        return int(np.sum(self.slots >= 0))

    @property
    def tokens(self) -> int:
        """Tokens sampled so far by the rows in flight."""
        return int(sum(rows.lengths.sum() for rows in self.rows))

    @property
    def row_count(self) -> int:
        """Rows in flight: rows of live prompts with a token."""
        return int(sum(np.sum(rows.lengths > 0) for rows in self.rows))


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes", "shardings"), donate_argnames=("state",))
def _restore_program(graphdef: nnx.GraphDef, params: nnx.State, state: CarryState, prompt_tokens: jax.Array,
                     prompt_mask: jax.Array, selection: Selection, stop_ids: jax.Array, version: jax.Array,
                     saved: SavedRows, *, spec: CarryOverSpec, axes: tuple[str, ...], shardings: tuple | None
                     ) -> tuple[nnx.State, CarryState]:
    """A resume's program for each generation in flight (oldest first), in each queue (``_restore_queue``;
    with ``axes`` queue q takes prompts q P / S .. (q + 1) P / S - 1 and their rows of ``saved``): its
    prompts [P, T] prefilled with ``params`` into region ``version mod G`` (their K/V recomputed), its
    rows' outputs, versions, budgets and keys as ``saved`` holds them (token 0 as sampled then, not the
    prefill's). No slot takes a row. Returns (the decode layout, the state)."""
    _traced()
    model = _decode_model(graphdef, params)
    queue = spec.per_queue(_shards(axes))
    key = jax.random.wrap_key_data(saved.row_keys[0])  # the prefill's token 0 is not kept: any key
    inputs = _prefill(model, prompt_tokens, prompt_mask, saved.budgets, key, selection, stop_ids, spec.engine,
                      ()).inputs  # the whole call's, GSPMD-split (as the insert's)
    state = _on_queues(lambda version, state, inputs, saved: _restore_queue(state, inputs, version, saved, queue), axes,
                       (version,), (state, _split_inputs(inputs, axes), _split(saved, axes)))
    return nnx.state(model), _pinned(state, shardings)


def _restore_queue(state: CarryState, inputs, version: jax.Array, saved: SavedRows, spec: CarryOverSpec
                   ) -> CarryState:
    """``_restore_program`` in one queue (``spec`` its own) of its share of the prefill (``inputs``) and
    of the rows (``saved``)."""
    g = jnp.mod(version, spec.generations)
    rows = decode.Outputs(saved.tokens, saved.logprobs, saved.lengths, saved.stopped)
    state, kv, outputs = _put_generation(state, state.decode.kv, state.decode.outputs, spec, g, version, inputs, rows,
                                         saved.versions, saved.tokens[:, 0], saved.row_keys, saved.live)
    return state._replace(decode=state.decode._replace(kv=kv, outputs=outputs))


class ReseatProgress(NamedTuple):
    """A resume's replay after a chunk (``_reseat_program``): the positions left to feed (the most of any
    slot) and whether every slot's are fed."""

    left: int
    done: bool

    @classmethod
    def read(cls, progress: jax.Array) -> ReseatProgress:
        """From the reseat program's replicated [2] array."""
        left, done = np.asarray(progress.addressable_data(0)).tolist()
        return cls(left, bool(done))


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes", "shardings"), donate_argnames=("state",))
def _reseat_program(graphdef: nnx.GraphDef, layout: nnx.State, state: CarryState, slot_rows: jax.Array, *,
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
    _traced()
    shards = _shards(axes)
    queue = spec.per_queue(shards)

    def per_queue(layout, state, slot_rows):
        return _reseat_queue(nnx.merge(graphdef, layout), state, slot_rows, queue)

    if axes:
        slot_rows = _queue_rows(slot_rows, spec, shards)
    state, progress = _on_queues(per_queue, axes, (layout,), (state, slot_rows))
    if axes:  # [S, 2] -> the call's
        progress = jnp.stack([jnp.max(progress[:, 0]), jnp.min(progress[:, 1])])
    return _pinned(state, shardings), constrain(progress, (None,))


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
    """``_reseat_program`` in one queue (slot_rows [C] in its own numbering) -> (state, progress [2])."""
    R, n = spec.rows, spec.engine.n
    store, outputs = _store(state, spec), state.decode.outputs
    take = slot_rows < R
    kv = store.admit(state.decode.kv, take, slot_rows, jnp.minimum(slot_rows, R - 1) // n)
    row = jnp.where(take, slot_rows, state.decode.slots.row)
    seated = row < R
    r = jnp.minimum(row, R - 1)
    target = jnp.where(seated, outputs.lengths[r], 1)  # [C]: a slot's t once its tokens are fed
    positions = lambda t: state.prompt_lengths[r // n] + t - 1
    token = lambda t: jnp.take_along_axis(outputs.tokens[r], (t - 1)[:, None], axis=1)[:, 0]

    def feed(carry):
        kv, t, steps = carry
        busy = t < target
        _, kv = store.attend(model, kv, token(t), positions(t), t, busy)
        return kv, jnp.where(busy, t + 1, t), steps + 1

    t = jnp.where(take, 1, jnp.where(seated, state.decode.slots.t, 1))  # a seated slot's next position to feed
    kv, t, _ = jax.lax.while_loop(lambda carry: jnp.any(carry[1] < target) & (carry[2] < spec.engine.chunk_steps),
                                  feed, (kv, t, jnp.int32(0)))
    slots = decode.Slots(row, jnp.where(seated, t, 0), jnp.where(seated, token(t), 0))
    left = jnp.max(target - t)
    progress = jnp.stack([left, (left == 0).astype(jnp.int32)])
    return state._replace(decode=state.decode._replace(slots=slots, kv=kv)), progress


@dataclasses.dataclass(frozen=True)
class CarryOverCompiled:
    """The six compiled programs (init, insert, chunk, harvest; a resume's restore and reseat), read as
    one: ``as_text()`` their HLO, ``memory_analysis()`` that of the fullest. The ``CarryState`` is an
    argument (init: the result) of each, so it is counted in all; the parameters are counted among the
    arguments of the chunk, harvest and reseat programs too (``parameter_bytes`` per device), which run
    while they stay on the device without taking them."""

    programs: tuple[jax.stages.Compiled, ...]
    parameter_bytes: int

    def as_text(self) -> str:
        return "\n".join(program.as_text() for program in self.programs)

    def memory_analysis(self):
        def counted(mem, extra: int):
            peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0) or (
                mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                + mem.temp_size_in_bytes)
            return types.SimpleNamespace(argument_size_in_bytes=mem.argument_size_in_bytes + extra,
                                         output_size_in_bytes=mem.output_size_in_bytes,
                                         alias_size_in_bytes=mem.alias_size_in_bytes,
                                         temp_size_in_bytes=mem.temp_size_in_bytes, peak_memory_in_bytes=peak + extra)
        # init, insert and restore take the parameters; chunk, harvest and reseat run beside them
        outside = (0, 0, self.parameter_bytes, self.parameter_bytes, 0, self.parameter_bytes)
        return max((counted(p.memory_analysis(), extra) for p, extra in zip(self.programs, outside)),
                   key=lambda mem: mem.peak_memory_in_bytes)


@dataclasses.dataclass(frozen=True)
class CarryOverLowered:
    """The init program lowered on abstract arguments (``CarryOverSampler.lower``) and the abstract
    arguments of the others: ``compile()`` compiles it, then insert, chunk, harvest, restore and
    reseat on the abstract results of the one before (their shapes and the shardings the compiled
    programs give them, as a real call's arrays come), the state pinned to the init program's
    shardings as ``CarryOverSampler.step`` pins it, so a real call (or a resume) with these shapes
    finds all six compiled. saved: a generation's ``SavedRows``, slot_rows [C] (a resume's); axes: the
    queues' (``queue_axes``)."""

    init: jax.stages.Lowered
    graphdef: nnx.GraphDef
    params: nnx.State
    prompt_tokens: jax.ShapeDtypeStruct
    prompt_mask: jax.ShapeDtypeStruct
    budgets: jax.ShapeDtypeStruct
    key: jax.ShapeDtypeStruct
    selection: Selection
    stop_ids: jax.ShapeDtypeStruct
    version: jax.ShapeDtypeStruct
    saved: SavedRows
    slot_rows: jax.ShapeDtypeStruct
    spec: CarryOverSpec
    axes: tuple[str, ...]

    def compile(self) -> CarryOverCompiled:
        init = self.init.compile()
        state = _results(self.init, init)
        pinned = dict(spec=self.spec, axes=self.axes, shardings=tuple(leaf.sharding for leaf in jax.tree.leaves(state)))
        insert_lowered = _insert_program.lower(self.graphdef, self.params, state, self.prompt_tokens, self.prompt_mask,
                                               self.budgets, self.key, self.selection, self.stop_ids, self.version,
                                               ((self.prompt_tokens, self.prompt_mask),) * (self.spec.generations - 1),
                                               **pinned)
        insert = insert_lowered.compile()
        inserted = _results(insert_lowered, insert)
        chunk_lowered = _chunk_program.lower(self.graphdef, inserted.layout, inserted.state, self.selection,
                                             self.stop_ids, **pinned)
        chunk = chunk_lowered.compile()
        state = _results(chunk_lowered, chunk)[0]
        harvest = _harvest_program.lower(state, self.version, inserted.dropped, inserted.dropped_version,
                                         inserted.carried, **pinned).compile()
        restore_lowered = _restore_program.lower(self.graphdef, self.params, state, self.prompt_tokens,
                                                 self.prompt_mask, self.selection, self.stop_ids, self.version,
                                                 self.saved, **pinned)
        restore = restore_lowered.compile()
        layout, state = _results(restore_lowered, restore)
        reseat = _reseat_program.lower(self.graphdef, layout, state, self.slot_rows, **pinned).compile()
        return CarryOverCompiled((init, insert, chunk, harvest, restore, reseat), _device_bytes(self.params))


def carry_over_spec(settings: SamplingSettings, *, prompts: int, prompt_length: int, groups: int,
                    max_staleness: int, order: str = CARRY_OVER_ORDERS[0]) -> CarryOverSpec:
    """The programs' static part, checked: the paged sampler with ``settings.slots`` slots, at most
    ``prompts`` groups a call, max_staleness >= 0, an order of ``CARRY_OVER_ORDERS``."""
    if order not in CARRY_OVER_ORDERS:
        raise ValueError(f"order={order!r}: must be one of {', '.join(CARRY_OVER_ORDERS)}")
    if settings.sampler != "paged" or settings.slots is None:
        raise ValueError("carry-over runs the paged sampler: settings need page_size and slots")
    if settings.tail_slots is not None:
        raise ValueError(f"tail_slots={settings.tail_slots}: carry-over never narrows (its calls end before a tail)")
    if not 1 <= groups <= prompts:
        raise ValueError(f"groups={groups}: must be in [1, prompts={prompts}] (a call returns at most its prompts' "
                         "worth of groups)")
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
    need = row_pages(settings.page_size, settings.max_new_tokens)
    pages = settings.pages or default_pages(settings.slots, settings.page_size, settings.max_new_tokens)
    if pages < need:
        raise ValueError(f"pages={pages}: the pool must hold one row's response pages, {need} of "
                         f"{settings.page_size} tokens (max_new_tokens={settings.max_new_tokens})")
    engine = EngineSpec("paged", settings.n, settings.max_new_tokens, settings.slots, None, settings.page_size, pages,
                        settings.chunk_steps)
    return CarryOverSpec(engine, prompts, prompt_length, max_staleness + 1, groups, order)


def _whole_state(arrays: tuple, spec: CarryOverSpec, shards: int) -> tuple:
    """The host's copies of a state's (tokens, logprobs, lengths, stopped, versions, budgets, row_keys,
    inserted, live, slot rows) in one queue's numbering (``CarryOverSampler.export``): as they are with
    one queue (shards 1); each queue's stacked [S, ...] (of ``shards``) joined as one queue of the whole
    call holds them: row (g P + q P / S + p') n + j for queue q's row (g P / S + p') n + j, slot q C / S
    + c for its slot c."""
    if shards == 1:
        return arrays
    *per_row, inserted, live, slots = arrays
    G, R = spec.generations, spec.rows
    queue = spec.per_queue(shards)

    def whole(x):  # [S, G k, ...] -> [G S k, ...]: each generation's rows (or prompts) in the call's order
        x = x.reshape(shards, G, -1, *x.shape[2:])
        return np.swapaxes(x, 0, 1).reshape(-1, *x.shape[3:])

    rows = queue.prompts * spec.engine.n  # a queue's rows of one generation
    q = np.arange(shards)[:, None]
    held = slots // rows * spec.prompts * spec.engine.n + q * rows + slots % rows
    return (*map(whole, per_row), inserted[0], whole(live), np.where(slots < queue.rows, held, R).reshape(-1))


def _check_seats(slots: np.ndarray, spec: CarryOverSpec, shards: int) -> None:
    """A ValueError unless each decode slot of an export (``InFlightRows.slots`` [C], -1: idle) holds a
    row of its own queue's prompts (slot c's queue c // (C / S); prompt p's p // (P / S)): an export
    resumes on a mesh whose batch axes split the call as the one that wrote it."""
    slots = np.asarray(slots)
    if shards == 1:
        return
    held = slots >= 0
    prompt = slots % (spec.prompts * spec.engine.n) // spec.engine.n
    mine = prompt // (spec.prompts // shards) == np.arange(spec.engine.slots) // (spec.engine.slots // shards)
    if not (mine | ~held).all():
        raise ValueError(f"in-flight rows: slot {int(np.flatnonzero(held & ~mine)[0])} holds a row of another "
                         f"queue's prompts: the export was written with another split of the batch than this "
                         f"mesh's {shards} queues")


class CarryOverSampler:
    """The host side of carry-over rollouts: holds the ``CarryState`` between calls.

    sampler = CarryOverSampler(graphdef, settings, prompts=P, prompt_length=T, groups=B, max_staleness=1)
    rows = sampler.step(params, version, prompt_tokens, prompt_mask, key)  # B groups, ``CarryOverRows``
    saved = sampler.export()                  # the rows in flight, host arrays (a checkpoint's)
    fresh.resume(params, saved, prompts)      # another sampler goes on with them, K/V recomputed

    One call a version: ``version`` goes up by 1 from call to call (a generation lives G calls).
    Every call has the same shapes (P, T, the settings), so only the first compiles.
    """

    def __init__(self, graphdef: nnx.GraphDef, settings: SamplingSettings, *, prompts: int, prompt_length: int,
                 groups: int, max_staleness: int = 1, order: str = CARRY_OVER_ORDERS[0]):
        self.graphdef = graphdef
        self.settings = settings
        self.spec = carry_over_spec(settings, prompts=prompts, prompt_length=prompt_length, groups=groups,
                                    max_staleness=max_staleness, order=order)
        self._state: CarryState | None = None
        self._prompts: dict[int, tuple] = {}  # version -> (tokens, mask) [P, T] of the generations in the state
        self._shardings: tuple | None = None
        self._axes: tuple[str, ...] = ()  # the queues' (``queue_axes``), as the state was made
        self.queues = queue_count(self.spec.prompts, self.spec.engine.slots, self.spec.groups,
                                  batch_shards())  # on the mesh in context (every call's)
        self._version: int | None = None

    def _made_axes(self) -> tuple[str, ...]:
        """The queues' axes (``queue_axes``) on the mesh in context, as many queues as at construction."""
        axes = queue_axes(self.spec)
        if _shards(axes) != self.queues:
            raise ValueError(f"carry-over: made for {self.queues} queues (the mesh then), the mesh in context "
                             f"gives {_shards(axes)}: make the sampler on the mesh it runs on")
        return axes

    def reset(self) -> None:
        """Forget the rows in flight: the next call starts from an empty state, at any version."""
        self._state, self._version, self._prompts = None, None, {}

    def export(self) -> InFlightRows | None:
        """The rows in flight after the last call, on the host (None before any call): every generation
        with a live prompt, oldest first, its rows' tokens, log-probs, versions, lengths, stop flags,
        budgets and keys (the rows of prompts not live emptied), and the row each slot holds. A
        transfer of the state's [R, N] outputs from the device (``distributed.to_host``)."""
        if self._state is None:
            return None
        state = self._state
        G, P, n, R = self.spec.generations, self.spec.prompts, self.settings.n, self.spec.rows
        outputs = state.decode.outputs
        (tokens, logprobs, lengths, stopped, versions, budgets, row_keys, inserted, live, slots) = _whole_state(
            distributed.to_host((outputs.tokens, outputs.logprobs, outputs.lengths, outputs.stopped, state.versions,
                                 state.budgets, state.row_keys, state.inserted, state.live, state.decode.slots.row)),
            self.spec, _shards(self._axes))
        live = live.reshape(G, P)
        regions = sorted((int(inserted[g]), g) for g in range(G) if inserted[g] >= 0 and live[g].any())
        saved = []
        for _, g in regions:
            rows = slice(g * P * n, (g + 1) * P * n)
            kept = np.repeat(live[g], n)  # [P n]
            inside = np.arange(self.settings.max_new_tokens)[None, :] < np.where(kept, lengths[rows], 0)[:, None]
            saved.append(SavedRows(np.where(inside, tokens[rows], PAD_ID).astype(np.int32),
                                   np.where(inside, logprobs[rows], 0.0).astype(np.float32),
                                   np.where(inside, versions[rows], 0).astype(np.int32),
                                   np.where(kept, lengths[rows], 0).astype(np.int32), kept & stopped[rows],
                                   budgets[rows].astype(np.int32), row_keys[rows].astype(np.uint32), live[g].copy()))
        in_flight = np.isin(slots // (P * n), [g for _, g in regions]) & (slots < R)
        return InFlightRows(self._version, tuple(v for v, _ in regions), tuple(saved),
                            np.where(in_flight, slots, -1).astype(np.int32))

    def resume(self, params: nnx.State, rows: InFlightRows, prompts, *,
               wait: Callable[[jax.Array, ReseatProgress | None], None] | None = None) -> None:
        """Continue the rows in flight that ``export`` gave (a checkpoint's), with ``params``: for each of
        its generations (prompts: (tokens [P, T], mask [P, T]) a generation, as its call had them) the
        prompts prefilled again and the rows' outputs put back, then the rows that held slots back in
        them, the K/V of their tokens recomputed with ``params`` (``_reseat_program``, a chunk of decode
        steps' worth of positions a program). The next call is version ``rows.version`` + 1; its rows
        continue as the engine that exported them would (the same tokens where the recomputed K/V gives
        the same logits). wait(progress, last): called after each generation's program (last None) and
        each chunk (``ReseatProgress``), as ``step``'s; a resume it abandons (by raising) leaves an
        empty engine. The programs are compiled by ``lower(...).compile()`` (the warm-up) with the shapes
        of a call."""
        if len(prompts) != len(rows.generations):
            raise ValueError(f"{len(prompts)} prompt batches for {len(rows.generations)} generations in flight")
        self.reset()
        spec, settings = self.spec, self.settings
        key = jax.device_put(jax.random.key(0), replicated())  # the init program's: only the keys' shape is read
        self._axes = self._made_axes()
        _check_seats(rows.slots, spec, _shards(self._axes))
        state = _init_program(self.graphdef, params, key, spec=spec, axes=self._axes)
        self._shardings = tuple(leaf.sharding for leaf in jax.tree.leaves(state))
        pinned = dict(spec=spec, axes=self._axes, shardings=self._shardings)
        selection = Selection(np.float32(settings.temperature), np.float32(settings.top_p), settings.top_k)
        stop_ids = stop_id_array(settings.stop_token_ids)
        layout = None
        for version, saved, (tokens, mask) in zip(rows.generations, rows.rows, prompts):
            layout, state = _restore_program(self.graphdef, params, state, tokens, mask, selection, stop_ids,
                                             np.int32(version), saved, **pinned)
            if wait is not None:
                wait(state.decode.outputs.lengths, None)
        if layout is not None:
            idle = np.full(spec.engine.slots, spec.rows, np.int32)
            seats = iter((np.where(rows.slots >= 0, rows.slots, spec.rows).astype(np.int32),))  # the first chunk's
            state = run_chunks(lambda state: _reseat_program(self.graphdef, layout, state, next(seats, idle), **pinned),
                               state, ReseatProgress.read, wait)
        self._state, self._version = state, rows.version
        self._prompts = dict(zip(rows.generations, prompts))

    def _carried_prompts(self, version: int, prompt_tokens, prompt_mask) -> tuple:
        """The prompts (tokens, mask) [P, T] of generations version - 1 .. version - G + 1, as their calls
        had them; where none was inserted, all-padding arrays placed as this call's prompts are."""
        def padding(like):  # each process makes its own shards (no transfer, no program)
            if isinstance(like, jax.Array):
                zeros = np.zeros(like.shape, like.dtype)
                return jax.make_array_from_callback(like.shape, like.sharding, lambda index: zeros[index])
            return np.zeros_like(np.asarray(like))
        return tuple(self._prompts.get(version - age) or (padding(prompt_tokens), padding(prompt_mask))
                     for age in range(1, self.spec.generations))

    def lower(self, params, prompt_tokens: jax.ShapeDtypeStruct, prompt_mask: jax.ShapeDtypeStruct
              ) -> CarryOverLowered:
        """The six programs (a call's four, a resume's two) lowered for abstract arguments: params
        (``nnx.split``'s state, arrays or ``jax.ShapeDtypeStruct``s with shardings) and prompts [P, T]
        (with the shardings a call's come with); ``.compile()`` them ahead of time (warm-up, memory planning). Nothing concrete is
        made: the key (replicated), the budgets, the version, temperature, top_p, stop ids and a
        resume's saved rows are abstract, the unsharded ones like the host arrays ``step`` and
        ``resume`` pass, so the programs can be compiled for devices this process cannot use and are
        the ones a call runs."""
        spec, settings = self.spec, self.settings
        if prompt_tokens.shape != (spec.prompts, spec.prompt_length) or prompt_mask.shape != prompt_tokens.shape:
            raise ValueError(f"prompt_tokens {prompt_tokens.shape} and prompt_mask {prompt_mask.shape} must both be "
                             f"[{spec.prompts}, {spec.prompt_length}]")
        typed_key = jax.eval_shape(jax.random.key, 0)
        key = jax.ShapeDtypeStruct(typed_key.shape, typed_key.dtype, sharding=replicated())
        scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
        Q, N = spec.prompts * settings.n, settings.max_new_tokens
        k = jax.eval_shape(jax.random.key_data, typed_key).shape
        saved = SavedRows(jax.ShapeDtypeStruct((Q, N), jnp.int32), jax.ShapeDtypeStruct((Q, N), jnp.float32),
                          jax.ShapeDtypeStruct((Q, N), jnp.int32), jax.ShapeDtypeStruct((Q,), jnp.int32),
                          jax.ShapeDtypeStruct((Q,), bool), jax.ShapeDtypeStruct((Q,), jnp.int32),
                          jax.ShapeDtypeStruct((Q, *k), jnp.uint32), jax.ShapeDtypeStruct((spec.prompts,), bool))
        axes = self._made_axes()
        return CarryOverLowered(
            _init_program.lower(self.graphdef, params, key, spec=spec, axes=axes), self.graphdef, params, prompt_tokens,
            prompt_mask, jax.ShapeDtypeStruct((Q,), jnp.int32), key,
            Selection(scalar(jnp.float32), scalar(jnp.float32), settings.top_k),
            jax.ShapeDtypeStruct(stop_id_array(settings.stop_token_ids).shape, jnp.int32), scalar(jnp.int32), saved,
            jax.ShapeDtypeStruct((settings.slots,), jnp.int32), spec, axes)

    def step(self, params: nnx.State, version: int, prompt_tokens, prompt_mask, key: jax.Array, budgets=None, *,
             wait: Callable[[jax.Array, CarryOverProgress | None], None] | None = None) -> CarryOverRows:
        """Insert P new prompts [P, T] (mask 1 on real tokens; an all-zero row is batch padding) sampled
        with ``params`` (``nnx.split``'s state, the same structure every call) at policy ``version``,
        decode until B groups are complete, return them. budgets: None or [P n] ints in [1,
        max_new_tokens]. wait(progress, last): as ``engine.sample``'s, with ``CarryOverProgress``; a call
        it abandons (by raising) loses the rows in flight: the next call starts from an empty state."""
        spec, settings = self.spec, self.settings
        P, T = spec.prompts, spec.prompt_length
        if np.shape(prompt_tokens) != (P, T) or np.shape(prompt_mask) != (P, T):
            raise ValueError(f"prompt_tokens {np.shape(prompt_tokens)} and prompt_mask {np.shape(prompt_mask)} "
                             f"must both be [{P}, {T}]")
        if self._version is not None and version != self._version + 1:
            raise ValueError(f"version={version}: one call a version, the last was {self._version}")
        rows = P * settings.n
        budgets = np.full(rows, settings.max_new_tokens, np.int32) if budgets is None else np.asarray(budgets)
        if budgets.shape != (rows,) or not np.issubdtype(budgets.dtype, np.integer) or budgets.min() < 1 \
                or budgets.max() > settings.max_new_tokens:
            raise ValueError(f"budgets: expected {rows} integers in [1, max_new_tokens={settings.max_new_tokens}]")
        typed = jax.eval_shape(jax.random.key, 0).dtype
        if key.dtype != typed:  # the state keeps the rows' keys as their data, wrapped again as this kind
            raise ValueError(f"key: a {key.dtype} key; expected a {typed} key (jax.random.key)")
        key = jax.device_put(key, replicated())
        selection = Selection(np.float32(settings.temperature), np.float32(settings.top_p), settings.top_k)
        stop_ids = stop_id_array(settings.stop_token_ids)
        if self._state is None:
            self._axes = self._made_axes()
            self._state = _init_program(self.graphdef, params, key, spec=spec, axes=self._axes)
            self._shardings = tuple(leaf.sharding for leaf in jax.tree.leaves(self._state))
        pinned = dict(spec=spec, axes=self._axes, shardings=self._shardings)
        version_array = np.int32(version)
        inserted = _insert_program(self.graphdef, params, self._state, prompt_tokens, prompt_mask,
                                   budgets.astype(np.int32), key, selection, stop_ids, version_array,
                                   self._carried_prompts(version, prompt_tokens, prompt_mask), **pinned)
        self._prompts = {v: batch for v, batch in self._prompts.items() if v > version - spec.generations}
        self._prompts[version] = (prompt_tokens, prompt_mask)
        self._state = None  # donated: a failed call leaves no state to reuse
        state = run_chunks(lambda state: _chunk_program(self.graphdef, inserted.layout, state, selection, stop_ids,
                                                        **pinned), inserted.state, CarryOverProgress.read, wait)
        self._state, result = _harvest_program(state, version_array, inserted.dropped, inserted.dropped_version,
                                               inserted.carried, **pinned)
        self._version = version
        return result
