"""Decode attention over a paged KV cache: one query per row against the live pages of its sequence.

Shapes: B rows, H query heads, K key/value heads, G = H // K, Dh head size, L layers, N pages in the
pool, s page size (tokens a page), M pages a sequence may span (the page table's width).

The pool holds every layer's pages, [K, L, N, s, Dh] each for keys and values (``PagedKVCache``):
seen as [K, L N, s, Dh] (a reshape, no copy), it is the library kernels' ``k_pages`` with layer l's
page p at l N + p, so a layer's attention reads the pool in place (no per-layer slice is copied).
A sequence is compact: its
token i sits at slot i % s of page ``table[b, i // s]``, and its first ``lengths[b]`` tokens are
visible (no padding inside a sequence: the sampler stores a prompt's real tokens from position 0,
sampling/paged.py). Table entries past a row's live pages may be any page of the pool (they are
never read, or read and masked).

``paged_decode_attention(q, k_pool, v_pool, layer, view, impl)``:

* "xla" (any backend; the reference the kernels are tested against): an online softmax over blocks
  of ``block_pages`` pages, each block's pages gathered by the table from the pool (only the live
  pages: a loop over ceil(max(lengths) / (block_pages s)) blocks, a dynamic trip count).
* "tpu": ``jax.experimental.pallas.ops.tpu.paged_attention`` (the Mosaic kernel; its DMAs read only
  each row's live pages).
* "gpu": our Pallas (Triton) kernel, ``models/paged_attention_gpu.py``, with the "xla" path's
  arithmetic (float32 scores scaled in float32, float32 accumulation, one rounding of the output),
  any table width M. The library's ``pallas.ops.gpu.paged_attention`` is not used: its output and
  softmax sum rounded to the input dtype before the division, and a compute block that must divide
  M in a power of 2 (a Triton lowering error for M = 132; docs/design.md 4.4).
The kernels take the whole pool and the table offset by the layer; the TPU kernel does not scale q,
so q comes scaled by Dh**-0.5 there. Under a mesh, a kernel runs in ``shard_map`` over
the axes not already manual (GSPMD cannot split a kernel call): the heads over the "act_kv_heads"
axes ("tensor") when they divide K (each device its own heads' pages, as the pool is split:
``POOL_AXES``), the rows over the batch axes when they divide B, replicated over the others. ``interpret=True`` runs a kernel in the Pallas
interpreter (tests on CPU; the TPU kernel under ``pltpu.force_tpu_interpret_mode``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pacs_jax.models import paged_attention_gpu
from pacs_jax.models.attention import _mesh_axes
from pacs_jax.numerics import batched_dot_operand
from pacs_jax.sharding import LOGICAL_RULES, constrain

PAGED_IMPLS = ("xla", "tpu", "gpu")
POOL_AXES = ("act_kv_heads", "layers", None, None, None)  # a pool's heads split as the attention's
_NEG = -1e30  # score of a masked entry: finite, so (masked - masked) is 0, never NaN
_F32 = jnp.float32


class PagedKVCache(NamedTuple):
    """The page pool of all layers: keys and values [K, L, N, s, Dh] each, in the compute dtype."""

    k: jax.Array
    v: jax.Array


class PageView(NamedTuple):
    """What one decode step of B rows reads and writes in the pool.

    table:  [B, M] int32, page i of each row's sequence
    lengths: [B] int32, visible tokens of each row (the token this step writes included)
    write_page, write_slot: [B] int32, where this step's key and value go (page, slot in it)
    """

    table: jax.Array
    lengths: jax.Array
    write_page: jax.Array
    write_slot: jax.Array


def write(pool: jax.Array, x: jax.Array, layer: jax.Array, view: PageView) -> jax.Array:
    """pool [K, L, N, s, Dh] <- x [B, 1, K, Dh] at layer ``layer``, row b at (write_page[b],
    write_slot[b]): one scatter, in place in the decode loop. Busy rows write distinct (page, slot)
    pairs; the sampler's idle rows all write into one scratch page that no row reads.

    Each (row, head) writes a [Dh] vector at an index (head, layer, page, slot), so the scatter's
    window is the pool's minor dimension: a [K, Dh] window would make XLA:TPU lay the pool out
    with the heads next to Dh and copy all of it back to the kernels' layout at every layer of
    every step. Under a mesh the scatter runs in ``shard_map`` over the heads' axes (each device
    writes its own heads' pages, as the pool is split: ``POOL_AXES``), so GSPMD never sees a head
    index it cannot split.
    """
    put = _write_heads
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.auto_axes:
        heads = _mesh_axes(mesh, tuple(a for a in LOGICAL_RULES["act_kv_heads"] if a in mesh.auto_axes),
                           pool.shape[0])
        put = jax.shard_map(put, mesh=mesh, in_specs=(P(heads), P(None, None, heads), P(), P(), P()),
                            out_specs=P(heads), axis_names=set(mesh.auto_axes), check_vma=False)
    return constrain(put(pool, x, jnp.asarray(layer, jnp.int32), view.write_page, view.write_slot), POOL_AXES)


def _write_heads(pool, x, layer, page, slot) -> jax.Array:
    """pool [K, L, N, s, Dh] <- x [B, 1, K, Dh]: row b's head k at (k, layer, page[b], slot[b])."""
    B, K = x.shape[0], pool.shape[0]
    heads = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))
    return pool.at[heads, layer, page[:, None], slot[:, None]].set(x[:, 0], mode="promise_in_bounds")


def paged_decode_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array | int,
                           view: PageView, *, impl: str = "xla", block_pages: int = 8,
                           interpret: bool = False) -> jax.Array:
    """q [B, 1, H, Dh] against layer ``layer`` of the pools [K, L, N, s, Dh], each row's first
    view.lengths[b] tokens through its page table view.table [B, M]; softmax in float32.
    Returns [B, 1, H, Dh] in q.dtype (zeros for a row with no visible token).
    block_pages: pages per block of the "xla" path and per compute block of the kernels (capped at M;
    made to divide it for "xla" and "tpu", a power of 2 for "gpu": ``paged_attention_gpu.compute_block``).
    """
    B, _, H, Dh = q.shape
    K, L, N, s, _ = k_pool.shape
    M = view.table.shape[1]
    if k_pool.shape != v_pool.shape or H % K or k_pool.shape[-1] != Dh or view.table.shape[0] != B:
        raise ValueError(f"paged_decode_attention: q {q.shape}, pools {k_pool.shape} / {v_pool.shape}, table "
                         f"{view.table.shape} do not fit q [B, 1, H, Dh], pools [K, L, N, s, Dh], table [B, M]")
    if impl not in PAGED_IMPLS:
        raise ValueError(f"paged attention impl {impl!r}: expected one of {PAGED_IMPLS}")
    block = max(d for d in range(1, min(block_pages, M) + 1) if M % d == 0)
    lengths = jnp.minimum(view.lengths.astype(jnp.int32), M * s)
    if impl == "xla":
        return _xla_paged(q, k_pool, v_pool, layer, view.table, lengths, block)
    if impl == "tpu":
        q_in = (q[:, 0].astype(_F32) * Dh ** -0.5).astype(q.dtype)  # [B, H, Dh]
        kernel = functools.partial(_tpu_kernel, block=block)
    else:
        q_in = q[:, 0]  # the GPU kernel scales its float32 scores
        kernel = functools.partial(paged_attention_gpu.paged_attention, block_pages=block_pages, interpret=interpret)
    pages = (p.reshape(K, L * N, s, Dh) for p in (k_pool, v_pool))  # layer l's page i at l N + i
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.auto_axes:  # a kernel call must be manual over every axis of the mesh
        heads = _mesh_axes(mesh, tuple(a for a in LOGICAL_RULES["act_kv_heads"] if a in mesh.auto_axes), K)
        rows = _mesh_axes(mesh, tuple(a for a in LOGICAL_RULES["batch"] if a in mesh.auto_axes), B)
        kernel = jax.shard_map(kernel, mesh=mesh, in_specs=(P(rows, heads), P(heads), P(heads), P(rows), P(rows)),
                               out_specs=P(rows, heads), axis_names=set(mesh.auto_axes), check_vma=False)
    out = kernel(q_in, *pages, lengths, view.table + layer * N)
    if impl == "tpu":  # ours writes zeros for a row with no visible token; the library's does not
        out = jnp.where((lengths > 0)[:, None, None], out, 0)
    return out[:, None].astype(q.dtype)


def _tpu_kernel(q, k_pages, v_pages, lengths, table, *, block: int) -> jax.Array:
    """The library's TPU kernel: q [B, H, Dh] (scaled), k/v pages [K, N, s, Dh], lengths [B], table
    [B, M] -> [B, H, Dh]; ``block`` divides M."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    return paged_attention(q, k_pages, v_pages, lengths, table, pages_per_compute_block=block)


def _xla_paged(q, k_pool, v_pool, layer, table, lengths, block: int) -> jax.Array:
    """The "xla" path: q [B, 1, H, Dh], pools [K, L, N, s, Dh], table [B, M], lengths [B] int32 ->
    [B, 1, H, Dh]; blocks of ``block`` pages (dividing M), only those up to the longest row's."""
    B, _, H, Dh = q.shape
    K, s = k_pool.shape[0], k_pool.shape[3]
    G, width = H // K, block * s
    q4 = batched_dot_operand(q.reshape(B, K, G, Dh))
    scale = Dh ** -0.5
    offsets = jnp.arange(width)

    def gather(pool, j):  # the rows' pages j*block .. j*block + block - 1 -> [B, K, width, Dh]
        pages = lax.dynamic_slice_in_dim(table, j * block, block, axis=1)  # [B, block]
        x = jnp.asarray(pool)[:, layer, pages]  # [K, B, block, s, Dh]
        return jnp.moveaxis(x, 0, 1).reshape(B, K, width, Dh)

    def step(j, carry):
        m, l, acc = carry
        mask = (j * width + offsets)[None, :] < lengths[:, None]  # [B, width]
        v_j = batched_dot_operand(jnp.where(mask[:, None, :, None], gather(v_pool, j), 0))  # unwritten: anything
        s_j = jnp.einsum("bkgd,bksd->bkgs", q4, batched_dot_operand(gather(k_pool, j)),
                         preferred_element_type=_F32) * scale
        mask = mask[:, None, None, :]
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s_j, _NEG), axis=-1))
        p = jnp.where(mask, jnp.exp(s_j - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[..., None] + jnp.einsum("bkgs,bksd->bkgd", p.astype(v_j.dtype), v_j,
                                                  preferred_element_type=_F32)
        return m_new, l * alpha + p.sum(-1), acc

    init = (jnp.full((B, K, G), _NEG, _F32), jnp.zeros((B, K, G), _F32), jnp.zeros((B, K, G, Dh), _F32))
    _, l, acc = lax.fori_loop(0, (jnp.max(lengths) + width - 1) // width, step, init)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    return out.reshape(B, 1, H, Dh).astype(q.dtype)
