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
of the token after it), and is not recomputed but on a resume. With ``SamplingSettings.record_routing``
(routing replay R3) the experts go as the K/V does: each prompt's as its last prefill routed them, each
response token's as the decode step that fed it did, and a resume's reseat records the tokens it feeds
again (an export holds no record, so a resume refuses rows that ended before it, ``_check_recordable``):

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
(``seam.queues``), every program runs once per shard under ``shard_map`` (``seam.on_queues``),
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

Files: this module is the host side (``CarryOverSampler``: a call, an export, a resume);
carry_over_state.py the spec, the ``CarryState`` and the queues; carry_over_records.py what a call, an
export and a resume give back; carry_over_programs.py a call's four programs (init, insert, chunk,
harvest); carry_over_resume.py a resume's two (restore, reseat); carry_over_lowering.py the six
lowered and compiled ahead of time. They build on the engine's public seam (sampling/seam.py), as the
one-call sampler (sampling/engine.py) does.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pacs_jax import distributed
from pacs_jax.sampling.carry_over_lowering import CarryOverLowered
from pacs_jax.sampling.carry_over_programs import (chunk_program, compile_count, harvest_program, init_program,
                                                   insert_program)
from pacs_jax.sampling.carry_over_records import (CarryOverProgress, CarryOverRows, InFlightRows, ReseatProgress,
                                                  SavedRows)
from pacs_jax.sampling.carry_over_resume import reseat_program, restore_program
from pacs_jax.sampling.carry_over_state import CarryOverSpec, CarryState, carry_over_spec, queue_axes, queue_count
from pacs_jax.sampling.seam import PAD_ID, queue_shards, run_chunks, stop_id_array
from pacs_jax.sampling.selection import Selection
from pacs_jax.sampling.settings import CARRY_OVER_ORDERS, SamplingSettings
from pacs_jax.sharding import batch_shards, replicated

# the carry-over's public names (its callers import them from here, wherever they are defined)
__all__ = ["CarryOverLowered", "CarryOverProgress", "CarryOverRows", "CarryOverSampler", "InFlightRows",
           "ReseatProgress", "SavedRows", "carry_over_spec", "compile_count", "queue_count"]


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


def _check_recordable(rows: InFlightRows, spec: CarryOverSpec) -> None:
    """A ValueError when a resume that records routing (``SamplingSettings.record_routing``) would leave a row of
    ``rows`` without its experts: an export holds no record, and the reseat records those of the rows it seats
    again only, so a row that fed a token (2 or more) and held no decode slot (it ended before the export, its
    group not yet returned) would come back with an empty record. The trainer queues such prompts again instead
    (training/engine/carry_over.py)."""
    seated = set(np.asarray(rows.slots)[np.asarray(rows.slots) >= 0].tolist())
    rows_a_generation = spec.prompts * spec.engine.n
    for version, saved in zip(rows.generations, rows.rows):
        first = version % spec.generations * rows_a_generation
        fed = [k for k in np.flatnonzero(np.asarray(saved.lengths) > 1) if first + k not in seated]
        if fed:
            raise ValueError(f"in-flight rows: row {fed[0]} of generation {version} ended before the export and holds "
                             "no routing record to resume with (record_routing): sample its prompt again")


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
        if queue_shards(axes) != self.queues:
            raise ValueError(f"carry-over: made for {self.queues} queues (the mesh then), the mesh in context "
                             f"gives {queue_shards(axes)}: make the sampler on the mesh it runs on")
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
            self.spec, queue_shards(self._axes))
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
        them, the K/V of their tokens recomputed with ``params`` (``reseat_program``, a chunk of decode
        steps' worth of positions a program); recording routing, the experts of the tokens it feeds too (a
        row that ended before the export has none: refused, ``_check_recordable``). The next call is version ``rows.version`` + 1; its rows
        continue as the engine that exported them would (the same tokens where the recomputed K/V gives
        the same logits). wait(progress, last): called after each generation's program (last None) and
        each chunk (``ReseatProgress``), as ``step``'s; a resume it abandons (by raising) leaves an
        empty engine. The programs are compiled by ``lower(...).compile()`` (the warm-up) with the shapes
        of a call."""
        if len(prompts) != len(rows.generations):
            raise ValueError(f"{len(prompts)} prompt batches for {len(rows.generations)} generations in flight")
        if self.settings.record_routing:
            _check_recordable(rows, self.spec)
        self.reset()
        spec, settings = self.spec, self.settings
        key = jax.device_put(jax.random.key(0), replicated())  # the init program's: only the keys' shape is read
        self._axes = self._made_axes()
        _check_seats(rows.slots, spec, queue_shards(self._axes))
        state = init_program(self.graphdef, params, key, spec=spec, axes=self._axes)
        self._shardings = tuple(leaf.sharding for leaf in jax.tree.leaves(state))
        pinned = dict(spec=spec, axes=self._axes, shardings=self._shardings)
        selection = Selection(np.float32(settings.temperature), np.float32(settings.top_p), settings.top_k)
        stop_ids = stop_id_array(settings.stop_token_ids)
        layout = None
        for version, saved, (tokens, mask) in zip(rows.generations, rows.rows, prompts):
            layout, state = restore_program(self.graphdef, params, state, tokens, mask, selection, stop_ids,
                                            np.int32(version), saved, **pinned)
            if wait is not None:
                wait(state.decode.outputs.lengths, None)
        if layout is not None:
            idle = np.full(spec.engine.slots, spec.rows, np.int32)
            seats = iter((np.where(rows.slots >= 0, rows.slots, spec.rows).astype(np.int32),))  # the first chunk's
            state = run_chunks(lambda state: reseat_program(self.graphdef, layout, state, next(seats, idle), **pinned),
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
            init_program.lower(self.graphdef, params, key, spec=spec, axes=axes), self.graphdef, params, prompt_tokens,
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
            self._state = init_program(self.graphdef, params, key, spec=spec, axes=self._axes)
            self._shardings = tuple(leaf.sharding for leaf in jax.tree.leaves(self._state))
        pinned = dict(spec=spec, axes=self._axes, shardings=self._shardings)
        version_array = np.int32(version)
        inserted = insert_program(self.graphdef, params, self._state, prompt_tokens, prompt_mask,
                                  budgets.astype(np.int32), key, selection, stop_ids, version_array,
                                  self._carried_prompts(version, prompt_tokens, prompt_mask), **pinned)
        self._prompts = {v: batch for v, batch in self._prompts.items() if v > version - spec.generations}
        self._prompts[version] = (prompt_tokens, prompt_mask)
        self._state = None  # donated: a failed call leaves no state to reuse
        state = run_chunks(lambda state: chunk_program(self.graphdef, inserted.layout, state, selection, stop_ids,
                                                       **pinned), inserted.state, CarryOverProgress.read, wait)
        self._state, result = harvest_program(state, version_array, inserted.dropped, inserted.dropped_version,
                                              inserted.carried, **pinned)
        self._version = version
        return result
