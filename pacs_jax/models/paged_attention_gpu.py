"""Our Pallas GPU (Triton) kernel for paged decode attention, with the XLA path's arithmetic.

Shapes: B rows, K key/value heads, G = H // K query heads a KV head, Dh head size, N' pages of the
pool as the kernel sees it (all layers side by side), s page size, M the page table's width.

One program per (row, KV head): its G query heads [G, Dh], read from q [B, H, Dh] as a tile of
``rows`` >= 16 (the smallest Triton's dot takes; the rows past G masked, zeros in registers, never
read or written in memory: no padded copy of q or of the output) against the row's live pages only,
``block`` pages at a time (a loop of ceil(length / (block s)) trips inside the kernel: no host round
trip, no page past the row's length read twice or at all beyond the last block), an online softmax
in float32. Its numerics are the
"xla" path's (``paged_attention._xla_paged``), written for a GPU:

* scores ``q k^T`` accumulate in float32 and are scaled by Dh**-0.5 in float32 (q is not pre-scaled
  in its own dtype); the dots take JAX's default precision, as the XLA path's einsums do (float32
  operands: TF32 on an H200 for both, measured: a float32 matmul's relative error 2.8e-4 at the
  default, 4.6e-7 at "highest"; ``jax_default_matmul_precision`` moves both alike);
* probabilities are cast to V's dtype for ``p v`` (as the XLA path does), accumulated in float32;
* the output is divided by the softmax sum in float32 and rounded to q's dtype once, at the end.

The library kernel (``jax.experimental.pallas.ops.gpu.paged_attention``) rounds its output and its
softmax sum to the input dtype before the division, takes q scaled in its own dtype, and needs M
divisible by a power-of-2 compute block (a Triton lowering error otherwise); this one takes any M
(the table is padded to a multiple of ``block`` with page 0, masked by the length). Its limits are
``paged_attention_gpu.unsupported`` (models/kernels.py asks it before choosing this kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_NEG = -1e30  # score of a masked entry (the XLA path's)
_MIN_TILE = 16  # Triton's dot takes no operand dimension below 16
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def unsupported(head_dim: int, page_size: int, dtype) -> str | None:
    """None when the kernel takes these shapes, else the reason it does not (Triton tiles are powers
    of 2: the head size and the page size must be, the head size at least 16)."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _DTYPES]:
        return f"dtype {jnp.dtype(dtype).name} (takes float32, bfloat16, float16)"
    if not _pow2(head_dim) or head_dim < _MIN_TILE:
        return f"head size {head_dim} (takes a power of 2 >= {_MIN_TILE})"
    if not _pow2(page_size):
        return f"page size {page_size} (takes a power of 2)"
    return None


def compute_block(table_width: int, page_size: int, block_pages: int = 8) -> int:
    """Pages a block of the kernel's loop: a power of 2 <= block_pages (and <= the table's width
    rounded up to a power of 2), raised until a block holds >= 16 tokens (Triton's smallest tile)."""
    block = 1
    while block * 2 <= min(block_pages, table_width):
        block *= 2
    while block * page_size < _MIN_TILE:
        block *= 2
    return block


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array, table: jax.Array,
                    *, block_pages: int = 8, interpret: bool = False) -> jax.Array:
    """q [B, H, Dh] (unscaled) against k/v pages [K, N', s, Dh] through table [B, M] (entries index
    N'), row b's first lengths[b] tokens visible -> [B, H, Dh] in q.dtype (zeros where lengths[b] is 0).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B, H, Dh = q.shape
    K, _, s, _ = k_pages.shape
    G, M = H // K, table.shape[1]
    reason = unsupported(Dh, s, q.dtype)
    if reason is not None:
        raise ValueError(f"paged_attention_gpu: {reason}")
    block = compute_block(M, s, block_pages)
    rows = max(_MIN_TILE, 1 << (G - 1).bit_length())
    table = jnp.pad(table.astype(jnp.int32), ((0, 0), (0, -M % block)))  # page 0: past every length
    kernel = functools.partial(_decode_kernel, group=G, rows=rows, block=block, scale=Dh ** -0.5)
    return pl.pallas_call(
        kernel,
        grid=(B, K),
        in_specs=[
            pl.BlockSpec((None, H, Dh), lambda b, h: (b, 0, 0)),  # row b's q (the kernel reads head h's G)
            pl.BlockSpec((None,) + k_pages.shape[1:], lambda b, h: (h, 0, 0, 0)),  # k pages of head h
            pl.BlockSpec((None,) + v_pages.shape[1:], lambda b, h: (h, 0, 0, 0)),  # v pages of head h
            pl.BlockSpec((None, table.shape[1]), lambda b, h: (b, 0)),  # row b's table
            pl.BlockSpec((1,), lambda b, h: (b,)),  # row b's length
        ],
        out_specs=pl.BlockSpec((None, H, Dh), lambda b, h: (b, 0, 0)),  # row b's output (head h writes its G)
        out_shape=jax.ShapeDtypeStruct((B, H, Dh), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"pacs_paged_decode_block{block}",
    )(q, k_pages, v_pages, table, lengths.astype(jnp.int32))


def _decode_kernel(q_ref, k_ref, v_ref, table_ref, length_ref, o_ref, *, group: int, rows: int, block: int,
                   scale: float):
    """One (row, KV head h): q_ref [H, Dh] (the row's heads; h's are h G .. h G + G - 1), k_ref / v_ref
    [N', s, Dh], table_ref [M'], length_ref [1] -> o_ref [H, Dh] (h's G heads written, no other).
    Head h's q rows load as a [rows, Dh] tile, rows past G masked to zero (they never leave registers:
    their scores, probabilities and outputs are computed and dropped at the masked store)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    Dh = q_ref.shape[1]
    s = k_ref.shape[1]
    width = block * s
    length = length_ref[0]
    heads = pl.ds(pl.program_id(1) * group, rows)
    mine = (jnp.arange(rows) < group)[:, None]  # [rows, 1]: head h's rows of the tile
    q = plgpu.load(q_ref.at[heads, :], mask=mine, other=0)  # [rows, Dh]
    offsets = jnp.arange(width)

    def step(j, carry):
        m, l, acc = carry
        pages = table_ref[pl.ds(j * block, block)]  # [block]
        k = k_ref[pages].reshape(width, Dh)
        v = v_ref[pages].reshape(width, Dh)
        visible = (j * width + offsets) < length  # [width]
        scores = plgpu.dot(q, k, trans_b=True) * scale  # [rows, width] float32
        scores = jnp.where(visible[None, :], scores, _NEG)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        p = jnp.where(visible[None, :], jnp.exp(scores - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        v = jnp.where(visible[:, None], v, jnp.zeros_like(v))  # pages past the length: anything
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, Dh), jnp.float32))
    _, l, acc = lax.fori_loop(0, (length + width - 1) // width, step, init)
    plgpu.store(o_ref.at[heads, :], (acc / jnp.where(l == 0, 1.0, l)[:, None]).astype(o_ref.dtype), mask=mine)
