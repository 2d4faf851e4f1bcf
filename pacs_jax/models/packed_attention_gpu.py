"""Our Pallas GPU (Triton) flash-attention kernel for packed rows: it visits only the blocks it does not mask.

Shapes: B rows, T tokens a row (a multiple of the block b), H query heads, K key/value heads,
G = H // K, Dh head size (a power of 2, 16..128), n = T / b blocks a row.

A packed row holds several sequences, each one contiguous run of one segment id (> 0), padding id 0
(as ``rl.packing`` lays them out). Query t sees key s iff s <= t and ids[s] == ids[t] > 0.

The schedule (``schedule``, from the ids, per row): with runs contiguous, the keys a query block
needs are one range of key blocks, from the block where its first real query's sequence starts to
the block of its last real query; the queries that need a key block, from the block of its first
real key to the block where its last real key's sequence ends. Every block in those ranges holds a
visible (query, key) pair (the run of that first query, or last key, crosses each of them), so the
kernels visit exactly the blocks that are not wholly masked, as splash attention's block-sparse
masks do on TPU; a block of padding only is visited by none. JAX's ``pallas.ops.gpu.attention.mha``
(used before) visits every block up to the diagonal and masks the rows' other sequences: for rows
of four sequences, about four times the blocks these visit.

Three kernels, each one program per (block, row, query head):
* forward, query block i over its key blocks: an online softmax in float32 (scores accumulated in
  float32 and scaled by Dh**-0.5 in float32, p rounded to V's dtype for p v), out and the
  log-sum-exp (0 for a query that sees no key: padding);
* dq, query block i over the same key blocks: p = exp(s - lse), ds = p (do v^T - delta) with
  delta = rowsum(do out), dq += ds k (ds rounded to the operands' dtype);
* dk / dv, key block j over its query blocks: dv += p^T do, dk += ds^T q.
K/V heads are read in place for each query head (h // G, no repeated copy); dk / dv come per query
head in float32 and are summed over each group. The arithmetic is the "xla" path's
(``attention._flash``): dots at JAX's default precision, padding queries output 0 with zero
gradients.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BLOCK = 64  # queries and keys a block (forward and backward)
# 4 warps and 3 pipeline stages a program: measured with JAX's mha kernel on an H200 (docs/design.md 4.4)
LAUNCH = dict(num_warps=4, num_stages=3)
_NEG = -1e30  # score of a masked entry (the "xla" path's)
_F32 = jnp.float32


class Schedule(NamedTuple):
    """The blocks each program visits, int32 [B, n] each: query block i reads key blocks
    ``key_first[:, i]`` .. ``key_last[:, i]``, key block j is read by query blocks ``query_first[:, j]``
    .. ``query_last[:, j]`` (first > last: none)."""

    key_first: jax.Array
    key_last: jax.Array
    query_first: jax.Array
    query_last: jax.Array


def schedule(ids: jax.Array, block: int = BLOCK) -> Schedule:
    """ids int32 [B, T] (T a multiple of ``block``; each segment one contiguous run, 0 padding) -> the
    block ranges of the kernels' loops."""
    B, T = ids.shape
    n = T // block
    t = jnp.arange(T, dtype=jnp.int32)
    change = ids[:, 1:] != ids[:, :-1]
    starts = jnp.concatenate([jnp.ones((B, 1), bool), change], axis=1)
    ends = jnp.concatenate([change, jnp.ones((B, 1), bool)], axis=1)
    run_first = lax.cummax(jnp.where(starts, t, 0), axis=1)  # [B, T]: where t's run starts
    run_last = lax.cummin(jnp.where(ends, t, T - 1), axis=1, reverse=True)  # where it ends
    real = ids > 0
    blocks = lambda x: x.reshape(B, n, block)  # noqa: E731
    key_first = jnp.min(blocks(jnp.where(real, run_first, T)), axis=2) // block  # n when no real query
    key_last = jnp.max(blocks(jnp.where(real, t, -1)), axis=2) // block  # -1 when none
    query_first = jnp.min(blocks(jnp.where(real, t, T)), axis=2) // block
    query_last = jnp.max(blocks(jnp.where(real, run_last, -1)), axis=2) // block
    return Schedule(*(x.astype(jnp.int32) for x in (key_first, key_last, query_first, query_last)))


def blocks_visited(ids: np.ndarray, block: int = BLOCK) -> tuple[int, int]:
    """(forward, dk/dv) blocks a (row, query head) visits over all rows of ids [B, T] (T a multiple of
    ``block``); the dq kernel visits the forward's."""
    s = jax.device_get(schedule(jnp.asarray(ids, jnp.int32), block))
    count = lambda first, last: int(np.maximum(last - first + 1, 0).sum())  # noqa: E731
    return count(s.key_first, s.key_last), count(s.query_first, s.query_last)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array, *, scale: float | None = None,
                     block: int = BLOCK, interpret: bool = False) -> jax.Array:
    """q [B, T, H, Dh], k/v [B, T, K, Dh] (T a multiple of ``block``, Dh a power of 2 in 16..128), ids
    int32 [B, T] -> [B, T, H, Dh] in q.dtype: query t sees key s iff s <= t and ids[s] == ids[t] > 0
    (zeros for padding queries). scale: of the scores, default Dh**-0.5 (a head size padded with
    zeros passes its own). interpret: the Pallas interpreter (tests on CPU)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _attention(q, k, v, ids.astype(jnp.int32), scale, block, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, ids, scale, block, interpret):
    return _forward(q, k, v, ids, schedule(ids, block), scale, block, interpret)[0]


def _attention_fwd(q, k, v, ids, scale, block, interpret):
    plan = schedule(ids, block)
    out, lse = _forward(q, k, v, ids, plan, scale, block, interpret)
    return out, (q, k, v, ids, plan, out, lse)


def _attention_bwd(scale, block, interpret, residuals, dout):
    q, k, v, ids, plan, out, lse = residuals
    B, T, H, Dh = q.shape
    K = k.shape[2]
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1).transpose(0, 2, 1)  # [B, H, T]
    dq = _backward_dq(q, k, v, ids, plan, dout, lse, delta, scale, block, interpret)
    dk, dv = _backward_dkv(q, k, v, ids, plan, dout, lse, delta, scale, block, interpret)  # [B, T, H, Dh] float32
    dk, dv = (x.reshape(B, T, K, H // K, Dh).sum(axis=3) for x in (dk, dv))
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _call(kernel, name, grid, in_specs, out_specs, out_shape, interpret, *args):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          compiler_params=plgpu.CompilerParams(**LAUNCH), interpret=interpret, name=name)(*args)


def _specs(B, T, H, K, Dh, block):
    """BlockSpecs over the grid (i, b, h) (a row and head's blocks launched one after another, so they
    find its K/V, or q, rows in the L2 cache): a block of rows of q-like [B, T, H, Dh] arrays, a whole row
    of head h // G of k-like [B, T, K, Dh] arrays or of q-like ones, a row of [B, H, T] (lse, delta), a
    row of ids, block i's entry of a [B, n] schedule array."""
    from jax.experimental import pallas as pl

    G = H // K
    return dict(
        q_block=pl.BlockSpec((None, block, None, Dh), lambda i, b, h: (b, i, h, 0)),
        q_row=pl.BlockSpec((None, T, None, Dh), lambda i, b, h: (b, 0, h, 0)),
        kv_row=pl.BlockSpec((None, T, None, Dh), lambda i, b, h: (b, 0, h // G, 0)),
        kv_block=pl.BlockSpec((None, block, None, Dh), lambda i, b, h: (b, i, h // G, 0)),
        stat_block=pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i)),
        stat_row=pl.BlockSpec((None, None, T), lambda i, b, h: (b, h, 0)),
        ids=pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
        bound=pl.BlockSpec((None, 1), lambda i, b, h: (b, i)),
    )


def _forward(q, k, v, ids, plan, scale, block, interpret):
    """-> out [B, T, H, Dh] in q.dtype, lse float32 [B, H, T]."""
    B, T, H, Dh = q.shape
    s = _specs(B, T, H, k.shape[2], Dh, block)
    kernel = functools.partial(_forward_kernel, block=block, scale=scale)
    return _call(kernel, "pacs_packed_attention_fwd", (T // block, B, H),
                 [s["q_block"], s["kv_row"], s["kv_row"], s["ids"], s["bound"], s["bound"]],
                 [s["q_block"], s["stat_block"]],
                 [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), _F32)], interpret,
                 q, k, v, ids, plan.key_first, plan.key_last)


def _backward_dq(q, k, v, ids, plan, dout, lse, delta, scale, block, interpret):
    """-> dq [B, T, H, Dh] in q.dtype."""
    B, T, H, Dh = q.shape
    s = _specs(B, T, H, k.shape[2], Dh, block)
    kernel = functools.partial(_dq_kernel, block=block, scale=scale)
    return _call(kernel, "pacs_packed_attention_dq", (T // block, B, H),
                 [s["q_block"], s["kv_row"], s["kv_row"], s["ids"], s["q_block"], s["stat_block"], s["stat_block"],
                  s["bound"], s["bound"]],
                 s["q_block"], jax.ShapeDtypeStruct(q.shape, q.dtype), interpret,
                 q, k, v, ids, dout, lse, delta, plan.key_first, plan.key_last)


def _backward_dkv(q, k, v, ids, plan, dout, lse, delta, scale, block, interpret):
    """-> dk, dv [B, T, H, Dh] float32, per query head (key block j of head h // G against head h)."""
    B, T, H, Dh = q.shape
    s = _specs(B, T, H, k.shape[2], Dh, block)
    kernel = functools.partial(_dkv_kernel, block=block, scale=scale)
    shape = jax.ShapeDtypeStruct((B, T, H, Dh), _F32)
    return _call(kernel, "pacs_packed_attention_dkv", (T // block, B, H),
                 [s["q_row"], s["kv_block"], s["kv_block"], s["ids"], s["q_row"], s["stat_row"], s["stat_row"],
                  s["bound"], s["bound"]],
                 [s["q_block"], s["q_block"]], [shape, shape], interpret,
                 q, k, v, ids, dout, lse, delta, plan.query_first, plan.query_last)


def block_scores(q, k, q_ids, k_ids, q_start, k_start, scale):
    """q [bq, Dh], k [bk, Dh], their ids [bq] / [bk] and first positions -> (scores float32 [bq, bk],
    visible bool [bq, bk]): one block's q k^T * scale and its mask. Every kernel scores its blocks here."""
    from jax.experimental.pallas import triton as plgpu

    q_pos = q_start + jnp.arange(q.shape[0])
    k_pos = k_start + jnp.arange(k.shape[0])
    visible = (k_pos[None, :] <= q_pos[:, None]) & (q_ids[:, None] == k_ids[None, :]) & (q_ids[:, None] > 0)
    return plgpu.dot(q, k, trans_b=True) * scale, visible


def _forward_kernel(q_ref, k_ref, v_ref, ids_ref, first_ref, last_ref, o_ref, lse_ref, *, block, scale):
    """One (row, head, query block i): q_ref [b, Dh], k_ref / v_ref [T, Dh] (the row, its KV head),
    ids_ref [T], first_ref / last_ref [1] -> o_ref [b, Dh], lse_ref [b]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    i = pl.program_id(0)
    q = q_ref[...]
    q_ids = ids_ref[pl.ds(i * block, block)]

    def step(j, carry):
        m, l, acc = carry
        keys = pl.ds(j * block, block)
        scores, visible = block_scores(q, k_ref[keys, :], q_ids, ids_ref[keys], i * block, j * block, scale)
        m_new = jnp.maximum(m, jnp.max(jnp.where(visible, scores, _NEG), axis=1))
        p = jnp.where(visible, jnp.exp(scores - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        v = v_ref[keys, :]
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((block,), _NEG, _F32), jnp.zeros((block,), _F32), jnp.zeros(q.shape, _F32))
    m, l, acc = lax.fori_loop(first_ref[0], last_ref[0] + 1, step, init)
    seen = l > 0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, ids_ref, do_ref, lse_ref, delta_ref, first_ref, last_ref, dq_ref, *, block, scale):
    """One (row, head, query block i): q_ref / do_ref [b, Dh], k_ref / v_ref [T, Dh], ids_ref [T],
    lse_ref / delta_ref [b], first_ref / last_ref [1] -> dq_ref [b, Dh]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    q_ids = ids_ref[pl.ds(i * block, block)]
    lse, delta = lse_ref[...], delta_ref[...]

    def step(j, dq):
        keys = pl.ds(j * block, block)
        k = k_ref[keys, :]
        scores, visible = block_scores(q, k, q_ids, ids_ref[keys], i * block, j * block, scale)
        p = jnp.where(visible, jnp.exp(scores - lse[:, None]), 0.0)
        ds = p * (plgpu.dot(do, v_ref[keys, :], trans_b=True) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(first_ref[0], last_ref[0] + 1, step, jnp.zeros(q.shape, _F32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, ids_ref, do_ref, lse_ref, delta_ref, first_ref, last_ref, dk_ref, dv_ref, *,
                block, scale):
    """One (row, query head, key block j): q_ref / do_ref [T, Dh] (the row, that head), k_ref / v_ref
    [b, Dh] (its KV head), ids_ref [T], lse_ref / delta_ref [T], first_ref / last_ref [1] -> dk_ref /
    dv_ref [b, Dh] float32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_ids = ids_ref[pl.ds(j * block, block)]

    def step(i, carry):
        dk, dv = carry
        queries = pl.ds(i * block, block)
        q, do = q_ref[queries, :], do_ref[queries, :]
        scores, visible = block_scores(q, k, ids_ref[queries], k_ids, i * block, j * block, scale)
        p = jnp.where(visible, jnp.exp(scores - lse_ref[queries][:, None]), 0.0)  # [bq, bk]
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta_ref[queries][:, None])
        return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = lax.fori_loop(first_ref[0], last_ref[0] + 1, step, (zeros, zeros))
    dk_ref[...] = dk * scale
    dv_ref[...] = dv
