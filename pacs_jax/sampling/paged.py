"""The paged sampler's K/V store (``SamplingSettings.page_size``; a ``decode.KVStore``; docs/design.md
3.2): the K/V of a queue lives in one page pool instead of a [C, T + N] cache row per slot.

Shapes: P prompts of T (padded) tokens, n samples each, Q = P n rows, C decode slots, N =
max_new_tokens, s page size, TP = ceil(T / s) pages a prompt, F response pages, M = ceil((T + N - 1) /
s) pages a sequence may span, L layers, K key/value heads, Dh head size.

    pool     [K, L, P TP + F + 1, s, Dh] keys and values (models/paged_attention.py): prompt p's
             pages p TP .. p TP + TP - 1, the F response pages, and one scratch page that idle slots
             write into (a freed page may already be another row's)
    prompts  prefilled once (engine.py) and stored compact: prompt p's real tokens at positions 0 ..
             len_p - 1 (its rotary positions), so attention needs no mask, only each row's length.
             Its n samples read its full pages and never write them; the partly filled last page
             (len_p mod s tokens) is copied into each sample's first response page when the row
             takes a slot, and the row's tokens continue there.
    pages    a stack of free response pages. A row is admitted (takes a free slot, in queue order)
             only when the free pages, less those promised to running rows, cover all it may need
             (ceil((len_p mod s + budget - 1) / s) pages); otherwise it and the rows behind it wait
             for pages to return. A running row takes a page from the stack when its next token
             starts one (it grows), and returns all its pages when it ends, in the same step.
    table    [C, M] per slot: its prompt's full pages, then its own pages as it takes them.
    tail     narrowing (engine.narrowing_widths) permutes the slots' tables; no K/V moves.

Token t of row (i, j) is selected as in the contiguous samplers (its own key, its own logits), so
the tokens do not depend on the pool size or the schedule (up to round-off: on a CPU they equal the
continuous and static samplers').
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from pacs_jax.models.paged_attention import POOL_AXES, PagedKVCache, PageView
from pacs_jax.models.qwen import KVCache
from pacs_jax.sampling.settings import row_pages
from pacs_jax.sampling.narrowing import fit
from pacs_jax.sharding import constrain


def default_pages(slots: int, page_size: int, max_new_tokens: int) -> int:
    """Response pages of a queue of ``slots`` slots when none are given: every slot's longest row at
    once, so no row ever waits for pages."""
    return slots * max(row_pages(page_size, max_new_tokens), 1)


def table_width(prompt_tokens: int, max_new_tokens: int, page_size: int) -> int:
    """M, the pages a slot's table holds: its prompt bucket's and its response's (the last token is
    selected, never written)."""
    return -(-(prompt_tokens + max_new_tokens - 1) // page_size)


def prompt_pages(prompt_cache: KVCache, prompt_real: jax.Array, page_size: int) -> PagedKVCache:
    """The prefill's K/V [L, P, K, T, Dh] (prompt_real [P, T]: one contiguous run of real tokens per
    prompt) -> the prompts' pages [K, L, P TP, s, Dh]: each prompt's real tokens first, in its TP pages."""
    L, P, K, T, Dh = prompt_cache.k.shape
    TP = -(-T // page_size)
    start = jnp.argmax(prompt_real, axis=1).astype(jnp.int32)  # [P]: the first real token (0 if none)
    source = (jnp.arange(T)[None, :] + start[:, None]) % T  # [P, T]: compact position -> padded one

    def paged(x):
        x = jnp.take_along_axis(x, source[None, :, None, :, None], axis=3)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, TP * page_size - T), (0, 0)))
        return x.reshape(L, P, K, TP, page_size, Dh).transpose(2, 0, 1, 3, 4, 5).reshape(K, L, P * TP, page_size, Dh)

    return PagedKVCache(paged(prompt_cache.k), paged(prompt_cache.v))


def _compact_pool(prompt_cache: KVCache, prompt_real: jax.Array, page_size: int, pages: int) -> PagedKVCache:
    """The prompts' pages (``prompt_pages``), then ``pages`` + 1 zero pages: the pool [K, L, P TP +
    pages + 1, s, Dh]."""
    def pool(x):
        K, L, _, s, Dh = x.shape
        return constrain(jnp.concatenate([x, jnp.zeros((K, L, pages + 1, s, Dh), x.dtype)], axis=2), POOL_AXES)

    return PagedKVCache(*(pool(x) for x in prompt_pages(prompt_cache, prompt_real, page_size)))


def row_promise(prompt_lengths: jax.Array, budgets: jax.Array, n: int, page_size: int) -> jax.Array:
    """The own pages each row may need: prompt_lengths [P], budgets [P n] -> [P n] int32,
    ceil((len_p mod s + budget - 1) / s) (its prompt's partly filled page and its decoded tokens)."""
    prompt = jnp.arange(budgets.shape[0], dtype=jnp.int32) // n
    return -(-(prompt_lengths[prompt] % page_size + budgets - 1) // page_size)


class PageState(NamedTuple):
    """The pool and the slots' pages: k, v [K, L, P TP + F + 1, s, Dh]; free [F] int32, a stack of
    free response pages, its first ``count`` [] entries; per slot ([w], table [w, M]): table, page of
    each position // s; own, the first table entry that is the slot's own page; held, own pages
    taken; promised, own pages the row may need in all."""

    k: jax.Array
    v: jax.Array
    free: jax.Array
    count: jax.Array
    table: jax.Array
    own: jax.Array
    held: jax.Array
    promised: jax.Array


@struct.dataclass
class PageStore:
    """The paged sampler's ``decode.KVStore``. pool: the prompts' pages and F = ``pages`` response
    pages (``_compact_pool``); promise [Q] int32, the own pages each row may need
    (ceil((len_p mod s + budget - 1) / s)); prompt_lengths [P] int32."""

    pool: PagedKVCache
    promise: jax.Array
    prompt_lengths: jax.Array
    page_size: int = struct.field(pytree_node=False)
    pages: int = struct.field(pytree_node=False)
    prompt_pages: int = struct.field(pytree_node=False)  # TP
    table_width: int = struct.field(pytree_node=False)  # M

    @classmethod
    def build(cls, prompt_cache: KVCache, prompt_real: jax.Array, budgets: jax.Array, *, n: int, page_size: int,
              pages: int, max_new_tokens: int) -> "PageStore":
        """The store of one queue: prompt_cache [L, P, K, T, Dh], prompt_real [P, T], budgets [Q]."""
        T = prompt_real.shape[1]
        prompt_lengths = jnp.sum(prompt_real, axis=-1, dtype=jnp.int32)
        promise = row_promise(prompt_lengths, budgets, n, page_size)
        return cls(_compact_pool(prompt_cache, prompt_real, page_size, pages), promise, prompt_lengths, page_size,
                   pages, -(-T // page_size), table_width(T, max_new_tokens, page_size))

    @property
    def scratch(self) -> int:
        """The page idle slots write into."""
        return self.prompt_lengths.shape[0] * self.prompt_pages + self.pages

    def init(self, model, slots: int) -> PageState:
        P, zeros = self.prompt_lengths.shape[0], jnp.zeros((slots,), jnp.int32)
        return PageState(self.pool.k, self.pool.v, P * self.prompt_pages + jnp.arange(self.pages, dtype=jnp.int32),
                         jnp.int32(self.pages), jnp.zeros((slots, self.table_width), jnp.int32), zeros, zeros, zeros)

    def _pop(self, kv: PageState, take):
        """A page off the stack for each slot where ``take`` [w] (in slot order) -> (pages [w], state)."""
        rank = jnp.cumsum(take, dtype=jnp.int32) - 1
        page = kv.free[jnp.clip(kv.count - 1 - rank, 0, self.pages - 1)]
        return jnp.where(take, page, self.scratch), kv._replace(count=kv.count - jnp.sum(take, dtype=jnp.int32))

    def admissible(self, kv: PageState, offered, candidate):
        """The offered rows while the pages not promised to running rows cover theirs."""
        need = jnp.where(offered, self.promise[candidate], 0)
        return offered & (jnp.cumsum(need) <= kv.count - jnp.sum(kv.promised - kv.held))

    def admit(self, kv: PageState, take, row, prompt) -> PageState:
        """Each taken row gets its first page (its prompt's partial page copied in) and its table."""
        s, TP, M = self.page_size, self.prompt_pages, self.table_width
        own = self.prompt_lengths[prompt] // s  # [w]: the first position past the prompt's full pages
        page, kv = self._pop(kv, take)
        j = jnp.arange(M)[None, :]
        table = jnp.where(take[:, None], jnp.where(j < own[:, None], prompt[:, None] * TP + j, page[:, None]), kv.table)
        fill = jnp.argsort(~take, stable=True).astype(jnp.int32)
        partial = prompt * TP + jnp.minimum(own, TP - 1)  # the prompt's partly filled page (garbage past it: masked)

        def copy(k, kv):
            src, dst = partial[fill[k]], page[fill[k]]
            move = lambda x: jax.lax.dynamic_update_slice_in_dim(
                x, jax.lax.dynamic_slice_in_dim(x, src, 1, axis=2), dst, axis=2)
            return kv._replace(k=move(kv.k), v=move(kv.v))

        kv = jax.lax.fori_loop(0, jnp.sum(take, dtype=jnp.int32), copy, kv)
        return kv._replace(table=table, own=jnp.where(take, own, kv.own), held=jnp.where(take, 1, kv.held),
                           promised=jnp.where(take, self.promise[jnp.minimum(row, self.promise.shape[0] - 1)],
                                              kv.promised))

    def recopy(self, kv: PageState, busy, prompt) -> PageState:
        """Each busy slot's first own page takes its prompt's partly filled page again at the prompt's
        positions (its row's tokens after them kept): after the prompts' pages were written again
        (carry-over's refresh, sampling/carry_over.py). busy [w] bool, prompt [w] int32."""
        s, TP = self.page_size, self.prompt_pages
        w = busy.shape[0]
        first = kv.table[jnp.arange(w), jnp.minimum(kv.own, self.table_width - 1)]  # [w]: the slot's first own page
        partial = prompt * TP + jnp.minimum(kv.own, TP - 1)
        head = self.prompt_lengths[prompt] % s  # [w]: the prompt's tokens in that page
        fill = jnp.argsort(~busy, stable=True).astype(jnp.int32)

        def copy(k, kv):
            i = fill[k]
            keep = (jnp.arange(s) < head[i])[None, None, None, :, None]
            move = lambda x: jax.lax.dynamic_update_slice_in_dim(
                x, jnp.where(keep, jax.lax.dynamic_slice_in_dim(x, partial[i], 1, axis=2),
                             jax.lax.dynamic_slice_in_dim(x, first[i], 1, axis=2)), first[i], axis=2)
            return kv._replace(k=move(kv.k), v=move(kv.v))

        return jax.lax.fori_loop(0, jnp.sum(busy, dtype=jnp.int32), copy, kv)

    def attend(self, model, kv: PageState, last, positions, t, busy, with_routing: bool = False):
        """A slot whose token starts a new page takes one first; idle slots write into the scratch page."""
        s, M = self.page_size, self.table_width
        grows = busy & (positions % s == 0) & (positions // s > kv.own)
        page, kv = self._pop(kv, grows)
        w = last.shape[0]
        table = kv.table.at[jnp.arange(w), jnp.where(grows, positions // s, M)].set(page, mode="drop")
        view = PageView(table, jnp.where(busy, positions + 1, 0),
                        jnp.where(busy, table[jnp.arange(w), jnp.minimum(positions // s, M - 1)], self.scratch),
                        jnp.where(busy, positions % s, 0))
        out = model.forward(last[:, None], positions[:, None], None, PagedKVCache(kv.k, kv.v), view,
                            with_routing=with_routing)
        cache = out[1]
        return (out[0], kv._replace(k=cache.k, v=cache.v, table=table, held=kv.held + grows),
                out[2] if with_routing else None)

    def release(self, kv: PageState, done) -> PageState:
        """The pages of the slots where ``done`` back onto the stack; those slots hold none after."""
        j = jnp.arange(self.table_width)[None, :]
        owned = done[:, None] & (j >= kv.own[:, None]) & (j < (kv.own + kv.held)[:, None])  # [w, M]
        offset = jnp.cumsum(owned.reshape(-1), dtype=jnp.int32).reshape(owned.shape) - 1
        at = jnp.where(owned, kv.count + offset, self.pages)  # out of bounds: dropped
        return kv._replace(free=kv.free.at[at].set(kv.table, mode="drop"),
                           count=kv.count + jnp.sum(owned, dtype=jnp.int32),
                           held=jnp.where(done, 0, kv.held), promised=jnp.where(done, 0, kv.promised))

    def narrow(self, kv: PageState, moved, running, width: int) -> PageState:
        """The tables move, no K/V."""
        keep = moved[:width]
        return kv._replace(table=kv.table[keep], own=kv.own[keep], held=kv.held[keep], promised=kv.promised[keep])

    def free_pages(self, kv: PageState) -> jax.Array:
        return kv.count

    def resize(self, kv: PageState, width: int) -> PageState:
        return kv._replace(table=fit(kv.table, width), own=fit(kv.own, width), held=fit(kv.held, width),
                           promised=fit(kv.promised, width))

    def carried(self) -> PageStore:
        """Without the pool: ``init`` made it the state's K/V."""
        return self.replace(pool=None)
