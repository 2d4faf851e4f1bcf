"""The K/V store of the static and continuous samplers (a ``decode.KVStore``; docs/design.md section
3.2): one cache row of T + N slots per decode slot, the prompt's K/V copied into a slot's first T
cache slots when it takes a row, the row's tokens written at T + t - 1.

Shapes: P prompts of T (padded) tokens, C decode slots (w of the current width), N =
max_new_tokens, S = T + N, L layers, K key/value heads, Dh head size.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from pacs_jax.models.qwen import KVCache
from pacs_jax.sampling.narrowing import fit


class RowState(NamedTuple):
    """cache: K/V [L, C, K, S, Dh] (the decode reads and writes its first w rows); kv_valid [w, S] bool."""

    cache: KVCache
    kv_valid: jax.Array


def _copy_rows(cache: KVCache, source: KVCache | None, index, targets, count) -> KVCache:
    """Rows index[k] of source (None: of the cache itself) -> cache rows targets[k] (one
    [L, 1, K, S', Dh] slice each, S' <= S), for k < count. Within the cache the copies read the loop's
    own buffer, so no second cache is kept for them; each source row must still hold its value when
    its turn comes."""
    def copy(k, cache):
        at = (0, targets[k], 0, 0, 0)
        return KVCache(*(jax.lax.dynamic_update_slice(
            c, jax.lax.dynamic_slice_in_dim(c if src is None else src, index[k], 1, axis=1), at)
            for c, src in zip(cache, (None, None) if source is None else source)))
    return jax.lax.fori_loop(0, count, copy, cache)


@struct.dataclass
class RowStore:
    """prompt_cache: the prefill's K/V [L, P, K, T, Dh]; prompt_real [P, T] bool."""

    prompt_cache: KVCache
    prompt_real: jax.Array
    max_new_tokens: int = struct.field(pytree_node=False)

    def init(self, model, slots: int) -> RowState:
        T = self.prompt_real.shape[1]
        kv_valid = jnp.concatenate([jnp.zeros((slots, T), bool), jnp.ones((slots, self.max_new_tokens), bool)], axis=1)
        return RowState(model.init_cache(slots, T + self.max_new_tokens), kv_valid)

    def admissible(self, kv: RowState, offered, candidate):
        return offered

    def admit(self, kv: RowState, take, row, prompt) -> RowState:
        T = self.prompt_real.shape[1]
        fill = jnp.argsort(~take, stable=True).astype(jnp.int32)  # the taken slots first
        cache = _copy_rows(kv.cache, self.prompt_cache, prompt[fill], fill, jnp.sum(take, dtype=jnp.int32))
        kv_valid = kv.kv_valid.at[:, :T].set(jnp.where(take[:, None], self.prompt_real[prompt], kv.kv_valid[:, :T]))
        return RowState(cache, kv_valid)

    def attend(self, model, kv: RowState, last, positions, t, busy, with_routing: bool = False):
        T = self.prompt_real.shape[1]
        out = model.forward(last[:, None], positions[:, None], kv.kv_valid, kv.cache, T + t - 1,
                            with_routing=with_routing)
        return out[0], kv._replace(cache=out[1]), out[2] if with_routing else None

    def release(self, kv: RowState, done) -> RowState:
        return kv

    def narrow(self, kv: RowState, moved, running, width: int) -> RowState:
        # in place: a row moves to a slot before its own, and the slots are filled in order
        cache = _copy_rows(kv.cache, None, moved, jnp.arange(width, dtype=jnp.int32), running)
        return RowState(cache, kv.kv_valid[moved[:width]])

    def free_pages(self, kv: RowState) -> jax.Array:
        return jnp.int32(0)

    def resize(self, kv: RowState, width: int) -> RowState:
        return kv._replace(kv_valid=fit(kv.kv_valid, width))  # the cache keeps its C rows at every width

    def carried(self) -> RowStore:
        return self
