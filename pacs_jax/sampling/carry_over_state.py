"""Carry-over's static spec and the decode state that outlives a call (sampling/carry_over.py tells
the mechanism): ``CarryOverSpec`` (``carry_over_spec`` checks one), ``CarryState`` and what reads it
(its queue, its page store, the rows and groups finished, the groups a call may return), and the queues
a call runs (``queue_count``, ``queue_axes``).

Shapes (as sampling/carry_over.py's): P prompts a call (padded), T prompt length, n samples a prompt,
G = max_staleness + 1 generations, R = G P n rows, C decode slots, B groups a call returns, N =
max_new_tokens, s page size, TP = ceil(T / s), F response pages, S queues (batch shards, or 1).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pacs_jax.models.paged_attention import PagedKVCache
from pacs_jax.sampling import decode
from pacs_jax.sampling.paged import PageStore, default_pages, table_width
from pacs_jax.sampling.seam import EngineSpec, queue_shards, queues
from pacs_jax.sampling.settings import CARRY_OVER_ORDERS, SamplingSettings, row_pages
from pacs_jax.sharding import current_rules


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

    def age_rank(self, version: jax.Array) -> jax.Array:
        """[G] int32: each region's generation by age at ``version`` (0 the oldest, G - 1 this version's)."""
        return jnp.mod(jnp.arange(self.generations, dtype=jnp.int32) - version - 1, self.generations)

    def prompt_rank(self, version: jax.Array) -> jax.Array:
        """[G P] int32: each prompt's place in admission order at ``version`` (oldest generation first, then
        prompt order)."""
        prompts = jnp.arange(self.generations * self.prompts, dtype=jnp.int32)
        return self.age_rank(version)[prompts // self.prompts] * self.prompts + prompts % self.prompts


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
                        settings.chunk_steps, settings.record_routing)
    return CarryOverSpec(engine, prompts, prompt_length, max_staleness + 1, groups, order)


def queue_count(prompts: int, slots: int, groups: int, batch_shards: int) -> int:
    """The carry-over's queues for P ``prompts`` a call, C ``slots`` and B ``groups`` a call on a mesh of
    ``batch_shards``: one a shard when the shards divide P, C (``seam.queues``) and B, else one."""
    return batch_shards if queues(prompts, slots, batch_shards) == batch_shards and groups % batch_shards == 0 else 1


def queue_axes(spec: CarryOverSpec) -> tuple[str, ...]:
    """The mesh axes (of the mesh in context) that the carry-over's queues are split over: the batch axes
    when their shards divide P, C (``seam.queues``) and B, a queue a shard, each with its share of
    the pool; none otherwise (one queue for the whole call). Raises ValueError when the response
    pages (``rollout.pages``) split over the queues leave a queue less than one row's."""
    axes = current_rules().batch_axes()
    if queue_count(spec.prompts, spec.engine.slots, spec.groups, queue_shards(axes)) == 1:
        return ()
    shards, need = queue_shards(axes), row_pages(spec.engine.page_size, spec.engine.max_new_tokens)
    if spec.engine.pages // shards < need:
        raise ValueError(f"pages={spec.engine.pages}: split over {shards} queues (one a batch shard), a queue's "
                         f"{spec.engine.pages // shards} must hold one row's response pages, {need}")
    return axes


class CarryState(NamedTuple):
    """The decode state that outlives a call (a pytree of fixed shapes).

    decode:         decode.DecodeState: steps [] (this call's decode steps), slots [C] (row R: idle),
                    kv (paged.PageState: the pool [K, L, G P TP + F + 1, s, Dh], free pages, the
                    slots' tables), taken [] (rows of ``order`` taken this call), outputs (tokens,
                    logprobs [R, N], lengths [R], stopped [R]; recording routing, ``EngineSpec.routing``: the
                    experts of each response token [R, N, L, k] as the decode step that fed it routed it)
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
    prompt_routing: None, or (recording routing) [G P, T, L, k]: each prompt's tokens' experts, as its last
                    prefill (the insert's, or this call's refresh) routed them

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
    prompt_routing: jax.Array | None = None

    def queue(self, stop_ids: jax.Array) -> decode.Queue:
        """The rows as the decode steps take them (``decode.Queue``: the waiting rows in ``order``, each
        row's key wrapped again); stop_ids [S] int32."""
        return decode.Queue(self.order, self.queued, self.first_tokens, self.budgets,
                            jax.random.wrap_key_data(self.row_keys), self.prompt_lengths, stop_ids)

    def page_store(self, spec: CarryOverSpec) -> PageStore:
        """The page store as the decode steps read it (the pool lives in ``self.decode.kv``)."""
        return spec.store(self.promise, self.prompt_lengths)

    def finished(self, outputs: decode.Outputs) -> jax.Array:
        """[R] bool: rows ended (a stop id, or their budget); rows never inserted are not."""
        return outputs.stopped | (outputs.lengths >= self.budgets)

    def complete(self, outputs: decode.Outputs, n: int) -> jax.Array:
        """[G P] bool: live prompts whose n rows all ended."""
        return self.live & jnp.all(self.finished(outputs).reshape(-1, n), axis=1)

    def awaited(self, spec: CarryOverSpec, version: jax.Array) -> jax.Array:
        """[G P] bool: the groups a call may return, by ``spec.order``: every live prompt ("completion"), or
        the B oldest live prompts ("admission")."""
        if spec.order == "completion":
            return self.live
        rank = jnp.where(self.live, spec.prompt_rank(version), spec.generations * spec.prompts)
        oldest = jnp.argsort(rank, stable=True)[:spec.groups]
        return jnp.zeros_like(self.live).at[oldest].set(self.live[oldest])

    def pinned(self, shardings: tuple | None) -> CarryState:
        """The state in the shardings the init program gave it (None: as XLA places it), so every call's
        programs see the same signature."""
        if shardings is None:
            return self
        return jax.lax.with_sharding_constraint(self, jax.tree.unflatten(jax.tree.structure(self), shardings))
