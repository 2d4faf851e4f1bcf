"""Causal grouped-query attention that never builds a [T, T] score matrix, on every backend.

Shapes: B batch, T tokens, H query heads, K key/value heads, G = H // K query heads per KV head,
Dh head size, S cache slots, b a block of ``block_size`` tokens, n = T / b blocks.

Masking: query t of row r sees key s iff ``kv_valid[r, s]`` and s <= t. ``kv_valid`` holds one
contiguous run of True per row (left-padded prompt + right-padded response, or a left-padded
prompt), or none (batch padding). A query that sees no key returns zeros, with zero gradient.
Packed rows (several sequences in one row, training only): with ``segment_ids`` [B, T] int32 (0 on
padding, each sequence its own id, ``kv_valid = segment_ids > 0``) query t also needs
``segment_ids[r, s] == segment_ids[r, t]``: attention stays within a sequence.

Implementations (``attention(impl=...)``; "auto" picks by backend, see ``resolve_impl``):

* "xla" (any backend; the reference): flash attention in plain JAX with a custom VJP.
  Forward, for each query block i (``lax.map``), an online softmax over key blocks j = 0..i only
  (blocks above the diagonal are skipped), all in float32:
      s = q_i k_j^T * Dh**-0.5                   [B, K, G, b, b]
      m' = max(m, rowmax(s)),  p = exp(s - m')   (masked entries: p = 0)
      l = l * exp(m - m') + rowsum(p),  acc = acc * exp(m - m') + p v_j
      out_i = acc / l (0 where l == 0),  lse_i = m + log(l)
  Residuals: q, k, v, kv_valid, out and lse [B, K, G, T] only.
  Backward (flash-attention 2), for each key block j (``lax.scan``), over query blocks i = j..n-1:
      p = exp(s - lse_i),  dv_j += p^T do_i,  dp = do_i v_j^T,  ds = p * (dp - D_i)
      dk_j += ds^T q_i * scale,  dq_i += ds k_j * scale        with D = rowsum(dout * out)
  The largest intermediates are [B, K, G, b, b] score blocks and [B, T, K, G, Dh] accumulators.
  T is padded up to a multiple of the block internally. All dots keep the batch and head dims as
  batch dims, so batch and head shardings (GSPMD) propagate through unchanged. With segment ids,
  the key blocks before the first segment that a query block holds (in any row) are skipped too,
  and in the backward pass the query blocks after the last segment a key block holds.
* "cudnn" (NVIDIA GPU): ``jax.nn.dot_product_attention(implementation="cudnn")``, whose masks are
  causal plus per-row *lengths* (right padding only). Each row is rolled left by its number of
  leading pads so that its real tokens start at slot 0; queries get length T - start (a query in
  the right padding still sees every real token) and keys the number of real tokens; the output is
  rolled back and the queries that see no key are zeroed. Packed rows (segment ids), whose masks
  cuDNN through ``jax.nn`` cannot express, run our block-sparse Pallas (Triton) flash-attention
  kernel instead (``models/packed_attention_gpu.py``: causal + segment ids, forward and backward
  kernels that visit only the blocks holding a visible (query, key) pair; GQA by reading each K/V
  head in place), or the "xla" path where it does not take the shapes (``models/kernels.py``: each
  kernel's limits and the choice).
* "splash" (TPU): the Pallas splash-attention kernel (heads-major, causal mask block-sparse) with
  segment ids for the padding (and for the sequences of packed rows), one kernel call per batch row (``jax.vmap``), under ``shard_map``
  when a mesh is set with ``jax.set_mesh``.

``decode_attention`` is the one-query step against a KV cache: an online softmax over the first
ceil(filled / block_size) blocks of the cache only (a loop with a dynamic trip count), so the
unwritten slots >= filled beyond the last block are never read. On GPU it is one masked pass over
the whole cache instead (a dynamic-trip-count loop syncs with the host there; see the code).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pacs_jax.models import kernels, packed_attention_gpu
from pacs_jax.numerics import batched_dot_operand
from pacs_jax import sharding
from pacs_jax.sharding import LOGICAL_RULES

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")

_NEG = -1e30  # score of a masked entry: finite, so (masked - masked) is 0, never NaN
_F32 = jnp.float32


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """'auto' -> 'splash' on TPU, 'cudnn' on GPU, 'xla' elsewhere; other names pass through.

    platform: a JAX platform name ('cpu', 'gpu', 'cuda', 'tpu', ...); default the mesh in context's
    (sharding.platform()).
    Raises ValueError naming the allowed values for an unknown impl.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r}: expected one of {ATTENTION_IMPLS}")
    if impl != "auto":
        return impl
    platform = platform or sharding.platform()
    return {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}.get(platform, "xla")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_valid: jax.Array, *, segment_ids: jax.Array | None = None,
              impl: str = "auto", block_size: int = 512) -> jax.Array:
    """Causal self-attention over one sequence layout (training forward, log-prob pass, prefill).

    q [B, T, H, Dh], k and v [B, T, K, Dh] (H a multiple of K), kv_valid [B, T] bool.
    Query t sees key s iff kv_valid[b, s] and s <= t (and, with segment_ids [B, T] int32 for packed
    rows, segment_ids[b, s] == segment_ids[b, t]; then kv_valid must be segment_ids > 0, which the
    packed GPU kernel reads from the ids alone); scale Dh**-0.5; softmax in float32.
    block_size: the query/key block of the "xla" implementation.
    Returns [B, T, H, Dh] in q.dtype; zeros (and zero gradients) for queries that see no key.
    """
    B, T, H, Dh = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != Dh or H % k.shape[2]:
        raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                         "q [B, T, H, Dh], k = v [B, T, K, Dh] with H a multiple of K")
    if kv_valid.shape != (B, T):
        raise ValueError(f"attention: kv_valid {kv_valid.shape}, expected {(B, T)}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"attention: segment_ids {segment_ids.shape}, expected {(B, T)}")
    kv_valid = kv_valid.astype(bool)
    impl = kernels.attention(resolve_impl(impl), head_dim=Dh, dtype=q.dtype, packed=segment_ids is not None).impl
    if impl == "packed_gpu":
        return _packed_gpu_attention(q, k, v, segment_ids)
    if impl == "xla":
        return _xla_attention(q, k, v, kv_valid, block_size, segment_ids)
    if impl == "cudnn":
        return _rolled_attention(q, k, v, kv_valid, _cudnn_core)
    return _splash_attention(q, k, v, kv_valid, segment_ids=segment_ids)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_valid: jax.Array,
                     filled: jax.Array | int, *, block_size: int = 512) -> jax.Array:
    """One decode step: q [B, 1, H, Dh] against caches [B, K, S, Dh] (H a multiple of K).

    kv_valid [B, S] bool; filled: int32, [] or [B] (may be traced), the number of written slots of
    each row (rows of a continuous-batching sampler sit at different slots). Row b sees slot s iff
    kv_valid[b, s] and s < filled[b]. Only the first ceil(max(filled) / block) blocks of the cache
    are read (a dynamic-trip-count loop, online softmax in float32); values in the unwritten slots
    are ignored, whatever they hold (NaN included).
    Returns [B, 1, H, Dh] in q.dtype (zeros for a row with no visible slot).
    """
    B, _, H, Dh = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    G = H // K
    block = min(block_size, S)
    scale = Dh ** -0.5
    q4 = batched_dot_operand(q.reshape(B, K, G, Dh))
    filled = jnp.broadcast_to(jnp.minimum(jnp.asarray(filled, jnp.int32), S), (B,))
    offsets = jnp.arange(block)

    def step(j, carry):
        m, l, acc = carry
        start = jnp.minimum(j * block, S - block)  # a last block past S is shifted back to end at S
        k_j = batched_dot_operand(_read_cache_block(k_cache, start, block))  # [B, K, b, Dh]
        v_j = _read_cache_block(v_cache, start, block)
        pos = start + offsets
        seen = (pos >= j * block)[None, :] & (pos[None, :] < filled[:, None])  # not seen earlier, written
        mask = lax.dynamic_slice_in_dim(kv_valid, start, block, axis=1).astype(bool) & seen  # [B, b]
        v_j = batched_dot_operand(jnp.where(mask[:, None, :, None], v_j, 0))  # unwritten slots: anything
        s = _dot("bkgd,bksd->bkgs", q4, k_j) * scale  # [B, K, G, b]
        mask = mask[:, None, None, :]
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _NEG), axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[..., None] + _dot("bkgs,bksd->bkgd", p.astype(v_j.dtype), v_j)
        return m_new, l * alpha + p.sum(-1), acc

    if sharding.platform() == "gpu":
        # One masked pass over all S slots: on GPU a loop with a dynamic trip count syncs with the host
        # every iteration (measured on an H100, B 8, S 4096: 67-294 us per decode step blockwise, 18 us
        # in one pass), which costs more than reading the unwritten slots.
        mask = kv_valid.astype(bool) & (jnp.arange(S)[None, :] < filled[:, None])  # [B, S]
        s = _dot("bkgd,bksd->bkgs", q4, k_cache) * scale
        s = jnp.where(mask[:, None, None, :], s, _NEG)
        p = jnp.where(mask[:, None, None, :], jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
        v = jnp.where(mask[:, None, :, None], v_cache, 0)
        acc, l = _dot("bkgs,bksd->bkgd", p.astype(v.dtype), v), p.sum(-1)
    else:
        init = (jnp.full((B, K, G), _NEG, _F32), jnp.zeros((B, K, G), _F32), jnp.zeros((B, K, G, Dh), _F32))
        _, l, acc = lax.fori_loop(0, (jnp.max(filled) + block - 1) // block, step, init)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    return out.reshape(B, 1, H, Dh).astype(q.dtype)


def _read_cache_block(cache: jax.Array, start: jax.Array, block: int) -> jax.Array:
    """cache [B, K, S, Dh] -> slots start .. start + block - 1, [B, K, block, Dh]."""
    return lax.dynamic_slice_in_dim(cache, start, block, axis=2)


# ---------------------------------------------------------------------------------------------
# "xla": blockwise flash attention in plain JAX with a custom VJP


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=_F32)


def _xla_attention(q, k, v, kv_valid, block_size, segment_ids=None):
    """q [B, T, H, Dh], k/v [B, T, K, Dh], kv_valid [B, T], segment_ids None or [B, T] int32
    -> [B, T, H, Dh] (pads T to the block)."""
    B, T, H, Dh = q.shape
    K = k.shape[2]
    block = min(block_size, T)
    pad = -T % block
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        kv_valid = jnp.pad(kv_valid, ((0, 0), (0, pad)))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    segments = None if segment_ids is None else _Segments.of(segment_ids.astype(jnp.int32), block)
    out = _flash(q.reshape(B, T + pad, K, H // K, Dh), k, v, kv_valid, segments, block)
    return out.reshape(B, T + pad, H, Dh)[:, :T]


class _Segments(NamedTuple):
    """Packed rows' segments for the "xla" path: ids [B, T] int32, and per block of ``block`` tokens
    the first key block any of its queries sees (``first_key``, [n]) and the last query block that
    sees any of its keys (``last_query``, [n]), over all rows."""

    ids: jax.Array
    first_key: jax.Array
    last_query: jax.Array

    @staticmethod
    def of(ids: jax.Array, block: int) -> "_Segments":
        B, T = ids.shape
        t = jnp.arange(T)
        starts = jnp.concatenate([jnp.ones((B, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
        ends = jnp.concatenate([ids[:, 1:] != ids[:, :-1], jnp.ones((B, 1), bool)], axis=1)
        first = lax.cummax(jnp.where(starts, t, 0), axis=1)  # [B, T]: where t's segment starts
        last = lax.cummin(jnp.where(ends, t, T - 1), axis=1, reverse=True)  # where it ends
        first_key = jnp.min(first[:, ::block], axis=0) // block  # [n], of each block's first query
        last_query = jnp.max(last[:, block - 1::block], axis=0) // block  # [n], of each block's last key
        return _Segments(ids, first_key.astype(jnp.int32), last_query.astype(jnp.int32))


def _block_mask(kv_valid, i, j, block, segments=None):
    """[B, 1, 1, b(query), b(key)] bool: key visible to query, for query block i and key block j."""
    offsets = jnp.arange(block)
    causal = (j * block + offsets)[None, :] <= (i * block + offsets)[:, None]
    valid = lax.dynamic_slice_in_dim(kv_valid, j * block, block, axis=1)
    mask = valid[:, None, None, None, :] & causal
    if segments is None:
        return mask
    same = _take(segments.ids, i, block)[:, :, None] == _take(segments.ids, j, block)[:, None, :]  # [B, b, b]
    return mask & same[:, None, None]


def _take(x, i, block, axis=1):
    return lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


def _flash_forward(q, k, v, kv_valid, segments, block):
    """q [B, T, K, G, Dh], k/v [B, T, K, Dh], kv_valid [B, T] (T a multiple of block), segments None
    or ``_Segments`` -> out [B, T, K, G, Dh] float32, lse [B, K, G, T] float32 (0 for a query that
    sees no key)."""
    B, T, K, G, Dh = q.shape
    n = T // block
    scale = Dh ** -0.5
    q, k, v = (batched_dot_operand(x) for x in (q, k, v))

    def query_block(i):
        q_i = _take(q, i, block)  # [B, b, K, G, Dh]

        def key_block(j, carry):
            m, l, acc = carry
            v_j = _take(v, j, block)
            mask = _block_mask(kv_valid, i, j, block, segments)
            s = _dot("bqkgd,bskd->bkgqs", q_i, _take(k, j, block)) * scale
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _NEG), axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # [B, K, G, b, b]
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha[..., None] + _dot("bkgqs,bskd->bkgqd", p.astype(v_j.dtype), v_j)
            return m_new, l * alpha + p.sum(-1), acc

        init = (jnp.full((B, K, G, block), _NEG, _F32), jnp.zeros((B, K, G, block), _F32),
                jnp.zeros((B, K, G, block, Dh), _F32))
        first = 0 if segments is None else segments.first_key[i]
        m, l, acc = lax.fori_loop(first, i + 1, key_block, init)  # key blocks up to the diagonal
        out = acc / jnp.where(l == 0, 1.0, l)[..., None]
        lse = jnp.where(l == 0, 0.0, m + jnp.log(jnp.where(l == 0, 1.0, l)))
        return out, lse

    out, lse = lax.map(query_block, jnp.arange(n))  # [n, B, K, G, b, Dh], [n, B, K, G, b]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(B, T, K, G, Dh)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(B, K, G, T)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, kv_valid, segments, block):
    """q [B, T, K, G, Dh], k/v [B, T, K, Dh], kv_valid [B, T] bool, segments None or ``_Segments``
    -> out [B, T, K, G, Dh] in q.dtype."""
    return _flash_forward(q, k, v, kv_valid, segments, block)[0].astype(q.dtype)


def _flash_fwd(q, k, v, kv_valid, segments, block):
    out, lse = _flash_forward(q, k, v, kv_valid, segments, block)
    out = out.astype(q.dtype)
    return out, (q, k, v, kv_valid, segments, out, lse)


def _flash_bwd(block, residuals, dout):
    q, k, v, kv_valid, segments, out, lse = residuals
    B, T, K, G, Dh = q.shape
    n = T // block
    scale = Dh ** -0.5
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1).transpose(0, 2, 3, 1)  # [B, K, G, T]
    qd, kd, vd, dod = (batched_dot_operand(x) for x in (q, k, v, dout))

    def key_block(dq, j):
        k_j, v_j = _take(kd, j, block), _take(vd, j, block)  # [B, b, K, Dh]

        def query_block(i, carry):
            dq, dk_j, dv_j = carry
            q_i, do_i = _take(qd, i, block), _take(dod, i, block)  # [B, b, K, G, Dh]
            lse_i, delta_i = _take(lse, i, block, axis=3), _take(delta, i, block, axis=3)
            mask = _block_mask(kv_valid, i, j, block, segments)
            s = _dot("bqkgd,bskd->bkgqs", q_i, k_j) * scale
            p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)  # [B, K, G, b, b]
            dv_j = dv_j + _dot("bkgqs,bqkgd->bskd", p.astype(dod.dtype), do_i)
            ds = p * (_dot("bqkgd,bskd->bkgqs", do_i, v_j) - delta_i[..., None])
            ds = ds.astype(qd.dtype)
            dk_j = dk_j + _dot("bkgqs,bqkgd->bskd", ds, q_i)
            dq_i = _take(dq, i, block) + _dot("bkgqs,bskd->bqkgd", ds, k_j)
            return lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, axis=1), dk_j, dv_j

        zeros = jnp.zeros((B, block, K, Dh), _F32)
        last = n if segments is None else segments.last_query[j] + 1
        dq, dk_j, dv_j = lax.fori_loop(j, last, query_block, (dq, zeros, zeros))  # diagonal and below
        return dq, (dk_j, dv_j)

    dq, (dk, dv) = lax.scan(key_block, jnp.zeros(q.shape, _F32), jnp.arange(n))
    dk, dv = (x.transpose(1, 0, 2, 3, 4).reshape(B, T, K, Dh) for x in (dk, dv))  # from [n, B, b, K, Dh]
    return (dq * scale).astype(q.dtype), (dk * scale).astype(k.dtype), dv.astype(v.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------
# "cudnn": rows rolled so that the padding is on the right, then cuDNN's causal + lengths mask


def _rolled_attention(q, k, v, kv_valid, core):
    """Causal attention with arbitrary (contiguous) padding through a right-padding-only core.

    q [B, T, H, Dh], k/v [B, T, K, Dh], kv_valid [B, T] bool. Row b is rolled left by start[b],
    the index of its first real token, so its tokens sit at slots 0 .. count[b] - 1, then come the
    right pads and, wrapped around at the end, the left pads. ``core(q, k, v, q_len, kv_len)``
    (q_len, kv_len int32 [B]) must return [B, T, H, Dh] where rolled query t < q_len[b] attends to
    the keys s <= t with s < kv_len[b] (rows t >= q_len[b] may hold anything). q_len = T - start
    covers the real tokens and the right pads, whose queries see every real token as in the
    "xla" path; kv_len = count (at least 1). The output is rolled back and the queries that see
    no key (left pads, all-padding rows) are set to 0.
    """
    T = kv_valid.shape[1]
    count = jnp.sum(kv_valid, axis=1, dtype=jnp.int32)
    start = jnp.argmax(kv_valid, axis=1).astype(jnp.int32)  # 0 for an all-padding row
    out = core(*(_roll_rows(x, start) for x in (q, k, v)), T - start, jnp.maximum(count, 1))
    out = _roll_rows(out, -start)
    sees = jnp.cumsum(kv_valid, axis=1) > 0  # [B, T]: some real key at or before t
    return jnp.where(sees[:, :, None, None], out, 0).astype(q.dtype)


@jax.custom_vjp
def _roll_rows(x: jax.Array, shift: jax.Array) -> jax.Array:
    """x [B, T, ...], shift int32 [B] -> y with y[b, t] = x[b, (t + shift[b]) % T] (a gather)."""
    T = x.shape[1]
    index = (jnp.arange(T)[None, :] + shift[:, None]) % T
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


# The transpose of a permutation is the inverse permutation: a gather again, not a scatter-add.
_roll_rows.defvjp(lambda x, shift: (_roll_rows(x, shift), shift),
                  lambda shift, g: (_roll_rows(g, -shift), None))


_CUDNN_SEQ_MULTIPLE = 64  # T is padded to this (cuDNN rejects some lengths, e.g. odd ones)


def _cudnn_core(q, k, v, q_len, kv_len):
    """cuDNN flash attention, causal with per-row lengths (bfloat16 unless the input is float16).

    q [B, T, H, Dh], k/v [B, T, K, Dh], q_len/kv_len int32 [B] -> [B, T, H, Dh].
    cuDNN needs Dh a multiple of 8 (at most 256 on Hopper, 128 before).
    """
    T = q.shape[1]
    dtype = jnp.float16 if q.dtype == jnp.float16 else jnp.bfloat16
    pad = -T % _CUDNN_SEQ_MULTIPLE  # the padded slots are past both lengths
    q, k, v = (jnp.pad(x.astype(dtype), ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=q_len,
                                       key_value_seq_lengths=kv_len, implementation="cudnn")
    return out[:, :T]


# ---------------------------------------------------------------------------------------------
# "cudnn" with segment ids: packed rows through our block-sparse Pallas (Triton) kernel


def _packed_gpu_attention(q, k, v, segment_ids, *, interpret: bool = False):
    """q [B, T, H, Dh], k/v [B, T, K, Dh], segment_ids [B, T] int32 (0: padding; each sequence one
    contiguous run) -> [B, T, H, Dh] in q.dtype: query t sees key s iff s <= t and
    segment_ids[b, s] == segment_ids[b, t] > 0 (``models/packed_attention_gpu.py``: only the blocks
    not wholly masked are visited, forward and backward; padding queries output zeros, zero gradients).

    T is padded with id 0 to a multiple of the kernel's block, the head size with zeros to a power of
    2. Under a mesh set with ``jax.set_mesh`` the kernel runs in ``shard_map`` over the batch and head
    axes (``_on_mesh``), as splash does; K/V heads are repeated to H only when their count does not
    divide over the head axes. interpret: run the kernel in the Pallas interpreter (testing on CPU).
    """
    B, T, H, Dh = q.shape
    pad = -T % packed_attention_gpu.BLOCK
    head_pad = (1 << max(0, Dh - 1).bit_length()) - Dh
    ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)))
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, head_pad))) for x in (q, k, v))
    kernel = functools.partial(packed_attention_gpu.packed_attention, scale=Dh ** -0.5, interpret=interpret)
    kernel, repeat = _on_mesh(kernel, B, H, k.shape[2], head_axis=2, id_arrays=1)
    if repeat:
        k, v = (jnp.repeat(x, H // k.shape[2], axis=2) for x in (k, v))
    return kernel(q, k, v, ids)[:, :T, :, :Dh]


# ---------------------------------------------------------------------------------------------
# "splash": the Pallas TPU splash-attention kernel

_SPLASH_LANES = 128  # the kernel's sequence blocks are multiples of this


def _splash_attention(q, k, v, kv_valid, *, segment_ids=None, interpret: bool = False):
    """q [B, T, H, Dh], k/v [B, T, K, Dh], kv_valid [B, T] bool, segment_ids None or [B, T] int32
    (packed rows, 0 on padding) -> [B, T, H, Dh] in q.dtype.

    T is padded to a multiple of 128. Segment ids encode the padding: a query is in segment 1 iff
    some real key is at or before it (else 0; the padded tail continues its row's last query), a
    key iff it is real (else 0); with the causal mask, query t then sees exactly the real keys
    s <= t, and a query of segment 0 sees itself (a key of segment 0), so no softmax row is empty;
    those queries are zeroed afterwards. Packed rows pass their own ids for queries and keys alike
    (a padding query, segment 0, sees the padding before it and is zeroed).
    Under a mesh set with ``jax.set_mesh``, the kernel runs in ``shard_map``: batch over the mesh
    axes of the logical "batch" rule, heads over those of "act_heads" (each only if it divides);
    K/V heads are repeated to H heads when their count does not divide over the head axes.
    interpret: run the kernel in the Pallas interpreter (testing on CPU).
    """
    B, T, H, Dh = q.shape
    K, dtype = k.shape[2], q.dtype
    pad = -T % _SPLASH_LANES
    if segment_ids is None:
        sees = jnp.cumsum(kv_valid, axis=1) > 0
        q_segment = jnp.pad(sees, ((0, 0), (0, pad)), mode="edge").astype(jnp.int32)
        kv_segment = jnp.pad(kv_valid, ((0, 0), (0, pad))).astype(jnp.int32)
    else:
        sees = segment_ids > 0
        q_segment = kv_segment = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)))
    q = (q.astype(_F32) * Dh ** -0.5).astype(dtype)  # the kernel does not scale
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3) for x in (q, k, v))
    kernel, repeat = _on_mesh(functools.partial(_splash_rows, interpret=interpret), B, H, K, head_axis=1,
                              id_arrays=2)
    if repeat:
        k, v = (jnp.repeat(x, H // K, axis=1) for x in (k, v))
    out = kernel(q, k, v, q_segment, kv_segment).transpose(0, 2, 1, 3)[:, :T]  # [B, T, H, Dh]
    return jnp.where(sees[:, :, None, None], out, 0).astype(dtype)


def _on_mesh(kernel, B: int, H: int, K: int, *, head_axis: int, id_arrays: int):
    """A kernel ``kernel(q, k, v, *ids)`` (q, k, v with the batch on axis 0 and H / K heads on
    ``head_axis``, ``id_arrays`` int32 [B, T] arrays) under ``shard_map`` when a mesh of more than
    one device is set with ``jax.set_mesh``: batch over the mesh axes of the logical "batch" rule,
    heads over those of "act_heads" (each only if it divides). Returns (kernel, repeat): repeat is
    True when the K/V heads must be repeated to H first (their count does not divide as H's does).
    Without such a mesh, (kernel, False)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel, False
    batch = _mesh_axes(mesh, LOGICAL_RULES["batch"], B)
    heads = _mesh_axes(mesh, LOGICAL_RULES["act_heads"], H)
    kv_heads = _mesh_axes(mesh, LOGICAL_RULES["act_kv_heads"], K) if heads else None
    spec = P(batch, *(None,) * (head_axis - 1), heads)
    kernel = jax.shard_map(kernel, mesh=mesh, in_specs=(spec,) * 3 + (P(batch),) * id_arrays, out_specs=spec,
                           check_vma=False)
    return kernel, bool(heads) and kv_heads != heads


def _mesh_axes(mesh, axes, size):
    """The mesh axes among ``axes`` (size > 1) as a PartitionSpec entry, or None when their product
    does not divide ``size``."""
    present = tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)
    ways = 1
    for a in present:
        ways *= mesh.shape[a]
    if not present or size % ways:
        return None
    return present[0] if len(present) == 1 else present


def _splash_rows(q, k, v, q_segment, kv_segment, *, interpret: bool):
    """Heads-major q [B, H, T, Dh], k/v [B, K, T, Dh], segment ids int32 [B, T] -> [B, H, T, Dh]
    (T a multiple of 128): the splash kernel per batch row (``jax.vmap``)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    H, T = q.shape[1], q.shape[2]
    block = next(b for b in (512, 256, 128) if T % b == 0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    mask = splash.MultiHeadMask([splash.CausalMask((T, T))] * H)
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=interpret)
    return jax.vmap(kernel)(q, k, v, segment_ids=splash.SegmentIds(q_segment, kv_segment))
