"""The paged decode loop of one queue (``SamplingSettings.page_size``; docs/design.md 3.2): the K/V of a
call lives in one page pool instead of a [C, T + N] cache row per slot.

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

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pacs_jax.models.paged_attention import POOL_AXES, PagedKVCache, PageView
from pacs_jax.models.qwen import KVCache
from pacs_jax.sampling.narrowing import run_widths
from pacs_jax.sampling.selection import is_stop, select_tokens
from pacs_jax.sampling.settings import row_pages
from pacs_jax.sharding import constrain


def default_pages(slots: int, page_size: int, max_new_tokens: int) -> int:
    """Response pages of a queue of ``slots`` slots when none are given: every slot's longest row at
    once, so no row ever waits for pages."""
    return slots * max(row_pages(page_size, max_new_tokens), 1)


class _Slots(NamedTuple):
    """The decode slots' state (each [C], table [C, M]); row Q: an idle slot."""

    row: jax.Array
    t: jax.Array        # the next token's index in its row
    last: jax.Array     # the last selected token (fed at the next step)
    table: jax.Array    # [C, M] page of each position // s
    own: jax.Array      # the first table entry that is the slot's own page
    held: jax.Array     # own pages taken
    promised: jax.Array  # own pages the row may need in all


def table_width(prompt_tokens: int, max_new_tokens: int, page_size: int) -> int:
    """M, the pages a slot's table holds: its prompt bucket's and its response's (the last token is
    selected, never written)."""
    return -(-(prompt_tokens + max_new_tokens - 1) // page_size)


class _Pool(NamedTuple):
    k: jax.Array
    v: jax.Array
    free: jax.Array     # [F] stack of free response pages; its first ``count`` entries
    count: jax.Array    # []


def _compact_pool(prompt_cache: KVCache, prompt_real: jax.Array, page_size: int, pages: int) -> PagedKVCache:
    """The prefill's K/V [L, P, K, T, Dh] (prompt_real [P, T]: one contiguous run of real tokens per
    prompt) -> the pool [K, L, P TP + pages + 1, s, Dh]: each prompt's real tokens first, in its TP
    pages, then ``pages`` + 1 zero pages."""
    L, P, K, T, Dh = prompt_cache.k.shape
    TP = -(-T // page_size)
    start = jnp.argmax(prompt_real, axis=1).astype(jnp.int32)  # [P]: the first real token (0 if none)
    source = (jnp.arange(T)[None, :] + start[:, None]) % T  # [P, T]: compact position -> padded one

    def paged(x):
        x = jnp.take_along_axis(x, source[None, :, None, :, None], axis=3)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, TP * page_size - T), (0, 0)))
        x = x.reshape(L, P, K, TP, page_size, Dh).transpose(2, 0, 1, 3, 4, 5).reshape(K, L, P * TP, page_size, Dh)
        return constrain(jnp.concatenate([x, jnp.zeros((K, L, pages + 1, page_size, Dh), x.dtype)], axis=2), POOL_AXES)

    return PagedKVCache(paged(prompt_cache.k), paged(prompt_cache.v))


def paged_decode_loop(model, prompt_cache: KVCache, prompt_real, real, first_tokens, first_logp, budgets, row_keys,
                      temperature, top_p, stop_ids, *, n: int, slots: int, max_new_tokens: int, top_k: int,
                      page_size: int, pages: int, widths: tuple[int, ...], pad_id: int):
    """The decode loop of one queue over a page pool; arguments and results as engine._decode_loop's
    (prompt_cache [L, P, K, T, Dh], prompt_real [P, T], real, first_tokens, first_logp, budgets [Q],
    row_keys [Q]), plus ``pages`` (F response pages), ``widths`` (engine.narrowing_widths) and the
    id written after a row's end. Returns (tokens [Q, N], logprobs [Q, N], lengths [Q], stopped [Q],
    decode steps [], slot steps [], free pages at the end []: F when every page came back).
    """
    P, T = prompt_real.shape
    Q, C, N, s = P * n, slots, max_new_tokens, page_size
    TP, M = -(-T // s), table_width(T, N, s)
    scratch = P * TP + pages  # the page idle slots write into
    select = functools.partial(select_tokens, temperature=temperature, top_p=top_p, top_k=top_k)

    prompt_lengths = jnp.sum(prompt_real, axis=-1, dtype=jnp.int32)  # [P]
    first_stop = real & is_stop(first_tokens, stop_ids)
    waiting = real & ~first_stop & (budgets > 1)
    order = jnp.argsort(~waiting, stable=True).astype(jnp.int32)
    queued = jnp.sum(waiting, dtype=jnp.int32)
    rows_prompt = jnp.arange(Q, dtype=jnp.int32) // n
    promise = -(-(prompt_lengths[rows_prompt] % s + budgets - 1) // s)  # [Q] own pages a row may need

    tokens = jnp.zeros((Q, N), jnp.int32).at[:, 0].set(jnp.where(real, first_tokens, pad_id))
    logprobs = jnp.zeros((Q, N), jnp.float32).at[:, 0].set(jnp.where(real, first_logp, 0.0))
    lengths, stopped = real.astype(jnp.int32), first_stop

    def pop(pool: _Pool, take):
        """A page off the stack for each slot where ``take`` [w] (in slot order) -> (pages [w], pool)."""
        rank = jnp.cumsum(take, dtype=jnp.int32) - 1
        page = pool.free[jnp.clip(pool.count - 1 - rank, 0, pages - 1)]
        return jnp.where(take, page, scratch), pool._replace(count=pool.count - jnp.sum(take, dtype=jnp.int32))

    def release(pool: _Pool, slot: _Slots, done):
        """The pages of the slots where ``done`` back onto the stack; those slots hold none after."""
        j = jnp.arange(M)[None, :]
        owned = done[:, None] & (j >= slot.own[:, None]) & (j < (slot.own + slot.held)[:, None])  # [w, M]
        offset = jnp.cumsum(owned.reshape(-1), dtype=jnp.int32).reshape(owned.shape) - 1
        at = jnp.where(owned, pool.count + offset, pages)  # out of bounds: dropped
        free = pool.free.at[at].set(slot.table, mode="drop")
        return (pool._replace(free=free, count=pool.count + jnp.sum(owned, dtype=jnp.int32)),
                slot._replace(held=jnp.where(done, 0, slot.held), promised=jnp.where(done, 0, slot.promised)))

    def refill(slot: _Slots, pool: _Pool, taken, free_slots):
        """Free slots take the next waiting rows in queue order, as long as the pages not promised to
        running rows cover theirs; each taken row gets its first page (its prompt's partial page
        copied in) and its table."""
        rank = jnp.cumsum(free_slots, dtype=jnp.int32) - 1
        candidate = order[jnp.minimum(taken + rank, Q - 1)]
        offered = free_slots & (taken + rank < queued)
        need = jnp.where(offered, promise[candidate], 0)
        available = pool.count - jnp.sum(slot.promised - slot.held)
        take = offered & (jnp.cumsum(need) <= available)
        row = jnp.where(take, candidate, jnp.where(free_slots, Q, slot.row))
        p = jnp.minimum(row, Q - 1) // n
        own = prompt_lengths[p] // s  # [w]: the first position past the prompt's full pages
        page, pool = pop(pool, take)
        j = jnp.arange(M)[None, :]
        table = jnp.where(take[:, None], jnp.where(j < own[:, None], p[:, None] * TP + j, page[:, None]), slot.table)

        fill = jnp.argsort(~take, stable=True).astype(jnp.int32)
        partial = p * TP + jnp.minimum(own, TP - 1)  # the prompt's partly filled page (garbage past it: masked)

        def copy(k, pool):
            src, dst = partial[fill[k]], page[fill[k]]
            move = lambda x: jax.lax.dynamic_update_slice_in_dim(
                x, jax.lax.dynamic_slice_in_dim(x, src, 1, axis=2), dst, axis=2)
            return pool._replace(k=move(pool.k), v=move(pool.v))

        pool = jax.lax.fori_loop(0, jnp.sum(take, dtype=jnp.int32), copy, pool)
        slot = _Slots(row, jnp.where(take, 1, slot.t), jnp.where(take, first_tokens[jnp.minimum(row, Q - 1)], slot.last),
                      table, jnp.where(take, own, slot.own), jnp.where(take, 1, slot.held),
                      jnp.where(take, promise[jnp.minimum(row, Q - 1)], slot.promised))
        return slot, pool, taken + jnp.sum(take, dtype=jnp.int32)

    def decode_step(carry, refills: bool):
        steps, slot, pool, taken, tokens, logprobs, lengths, stopped = carry
        busy = slot.row < Q
        r = jnp.minimum(slot.row, Q - 1)
        position = prompt_lengths[r // n] + slot.t - 1  # [w]: compact position of the token fed
        grows = busy & (position % s == 0) & (position // s > slot.own)  # the token starts a new page
        page, pool = pop(pool, grows)
        w = slot.row.shape[0]
        table = slot.table.at[jnp.arange(w), jnp.where(grows, position // s, M)].set(page, mode="drop")
        slot = slot._replace(table=table, held=slot.held + grows)
        view = PageView(table, jnp.where(busy, position + 1, 0),
                        jnp.where(busy, table[jnp.arange(w), jnp.minimum(position // s, M - 1)], scratch),
                        jnp.where(busy, position % s, 0))
        hidden, cache = model.forward(slot.last[:, None], position[:, None], None, PagedKVCache(pool.k, pool.v), view)
        pool = pool._replace(k=cache.k, v=cache.v)
        keys = jax.vmap(jax.random.fold_in)(row_keys[r], slot.t)
        token, logp = select(model.logits(hidden)[:, 0], keys)
        out = jnp.where(busy, slot.row, Q)
        tokens = tokens.at[out, slot.t].set(token, mode="drop")
        logprobs = logprobs.at[out, slot.t].set(logp, mode="drop")
        hit = busy & is_stop(token, stop_ids)
        t = jnp.where(busy, slot.t + 1, slot.t)
        lengths = lengths.at[out].set(t, mode="drop")
        stopped = stopped.at[out].set(hit, mode="drop")
        done = hit | (busy & (t >= budgets[r]))
        pool, slot = release(pool, slot._replace(t=t, last=token), done)
        if refills:
            slot, pool, taken = refill(slot, pool, taken, ~busy | done)
        else:
            slot = slot._replace(row=jnp.where(done, Q, slot.row))
        return steps + 1, slot, pool, taken, tokens, logprobs, lengths, stopped

    def narrow(carry, width: int):
        """The running slots to the first ``width`` (in slot order): their tables move, no K/V."""
        steps, slot, *rest = carry
        keep = jnp.argsort(~(slot.row < Q), stable=True).astype(jnp.int32)[:width]
        return (steps, jax.tree.map(lambda x: x[keep], slot), *rest)

    cache = _compact_pool(prompt_cache, prompt_real, s, pages)
    pool = _Pool(cache.k, cache.v, P * TP + jnp.arange(pages, dtype=jnp.int32), jnp.int32(pages))
    zeros = jnp.zeros((C,), jnp.int32)
    idle = _Slots(jnp.full((C,), Q, jnp.int32), zeros, zeros, jnp.zeros((C, M), jnp.int32), zeros, zeros, zeros)
    slot, pool, taken = refill(idle, pool, jnp.int32(0), jnp.ones((C,), bool))
    carry = (jnp.int32(0), slot, pool, taken, tokens, logprobs, lengths, stopped)
    carry, slot_steps = run_widths(carry, widths, decode_step, narrow,
                                   running=lambda c: jnp.sum(c[1].row < Q, dtype=jnp.int32),
                                   waiting=lambda c: c[3] < queued)
    steps, _, pool, _, tokens, logprobs, lengths, stopped = carry
    return tokens, logprobs, lengths, stopped, steps, slot_steps, pool.count
