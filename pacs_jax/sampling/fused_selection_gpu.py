"""Our Pallas GPU (Triton) kernel for the decode step's LM head and token selection in one pass: the
logits are never written to memory.

Shapes: B rows, D hidden size, V vocabulary (a device's shard of it), bv the vocabulary block, bm the
row block, nv = V / bv.

The XLA path (``selection.select_tokens`` on ``Qwen.logits``) writes the float32 logits [B, V] (at 256
slots and Qwen's 151,936 entries, 156 MB) and reads them back three times (the log-normaliser's max
and sum, the selection), more when it samples. Here one program per (row block, vocabulary block)
computes its logits tile [bm, bv] in float32 (bv-wide slices of the head, D in chunks of ``depth``),
divides by the temperature, and reduces the tile to five numbers a row: the tile's max and sum of
exp(x - max) (for the log-normaliser), the best of x + noise (x alone when greedy), its first
index and its x. A few [nv, B] partials leave the kernel; ``combine`` reduces them over nv.

The numerics are ``select_tokens``' with top_p 1 and no top_k: the noise is its Gumbel noise bit for
bit (sampling/gumbel.py: element i of row b from the row's key and counter i, whatever the tile), the
token the first index of the row's maximum of scaled logits + noise (of scaled logits when greedy),
the log-prob x[token] - logsumexp(x) of the full-vocabulary distribution; the logsumexp is summed per
tile and the tiles' sums rescaled to the row's max (an online logsumexp), equal to XLA's
max-then-sum up to float32 rounding. The tile's dot accumulates in float32 at JAX's default precision,
as the XLA path's einsum does.

Limits (``unsupported``; models/kernels.py asks before choosing it): V and D multiples of 16
(Triton's smallest dot tile; Qwen's are multiples of 128), bfloat16, float16 or float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pacs_jax.sampling import gumbel

_MIN_TILE = 16  # Triton's dot takes no operand dimension below 16
_DTYPES = ("float32", "bfloat16", "float16")


class Partials(NamedTuple):
    """Per vocabulary block and row, [nv, B] each: the scaled logits' max and sum of exp(x - max)
    (float32), the best of x + noise, its first vocabulary index (int32) and its x (float32)."""

    max: jax.Array
    sum: jax.Array
    best: jax.Array
    index: jax.Array
    value: jax.Array


def _block(n: int, cap: int) -> int:
    """The largest power of 2 <= cap dividing n (at least 1)."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def unsupported(vocab: int, hidden: int, dtype) -> str | None:
    """None when the kernel takes a head [V, D] (or [D, V]) of this vocabulary, hidden size and dtype,
    else why not."""
    if jnp.dtype(dtype).name not in _DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (takes {', '.join(_DTYPES)})"
    if vocab % _MIN_TILE or hidden % _MIN_TILE:
        return f"vocabulary {vocab}, hidden size {hidden} (takes multiples of {_MIN_TILE})"
    return None


def partials(hidden: jax.Array, head: jax.Array, k0: jax.Array, k1: jax.Array, temperature: jax.Array,
             offset: jax.Array | int = 0, *, vocab_major: bool, rows: int = 32, vocab_block: int = 128,
             depth: int = 128, interpret: bool = False) -> Partials:
    """hidden [B, D] (the final-normed last hidden states), head [V, D] (``vocab_major``: a tied
    embedding) or [D, V] in hidden's dtype, key words k0, k1 [B] uint32 (``gumbel.key_words``),
    temperature [] float32 (0: greedy), offset: the global index of this head's first entry (a device's
    vocabulary shard) -> ``Partials`` [V / bv, B]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B, D = hidden.shape
    V = head.shape[0] if vocab_major else head.shape[1]
    reason = unsupported(V, D, hidden.dtype)
    if reason is not None:
        raise ValueError(f"fused_selection_gpu: {reason}")
    bm = max(_MIN_TILE, min(rows, 1 << (B - 1).bit_length()))
    bv, bd = _block(V, vocab_block), _block(D, depth)
    Bp = -(-B // bm) * bm
    pad = lambda x: jnp.pad(x, ((0, Bp - B),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
    nv = V // bv
    head_spec = (pl.BlockSpec((bv, D), lambda b, v: (v, 0)) if vocab_major
                 else pl.BlockSpec((D, bv), lambda b, v: (0, v)))
    row = pl.BlockSpec((bm,), lambda b, v: (b,))
    out = pl.BlockSpec((None, bm), lambda b, v: (v, b))
    kernel = functools.partial(_kernel, depth=bd, vocab_major=vocab_major)
    f32, i32 = jax.ShapeDtypeStruct((nv, Bp), jnp.float32), jax.ShapeDtypeStruct((nv, Bp), jnp.int32)
    result = pl.pallas_call(
        kernel,
        grid=(Bp // bm, nv),  # the row blocks of one head block side by side: the head is read once
        in_specs=[pl.BlockSpec((1,), lambda b, v: (0,))] * 2 + [pl.BlockSpec((bm, D), lambda b, v: (b, 0)),
                                                                 head_spec, row, row],
        out_specs=[out] * 5,
        out_shape=[f32, f32, f32, i32, f32],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"pacs_fused_selection_v{bv}",
    )(jnp.reshape(temperature, (1,)).astype(jnp.float32), jnp.reshape(offset, (1,)).astype(jnp.int32), pad(hidden),
      head, pad(k0.astype(jnp.uint32)), pad(k1.astype(jnp.uint32)))
    return Partials(*(x[:, :B] for x in result))


def _kernel(temperature_ref, offset_ref, h_ref, w_ref, k0_ref, k1_ref, max_ref, sum_ref, best_ref, index_ref,
            value_ref, *, depth: int, vocab_major: bool):
    """One (row block, vocabulary block): temperature_ref [1], offset_ref [1] (the shard's first entry),
    h_ref [bm, D], w_ref [bv, D] or [D, bv], k0_ref / k1_ref [bm] -> five [bm] outputs."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    bm, D = h_ref.shape
    bv = w_ref.shape[0] if vocab_major else w_ref.shape[1]

    def step(k, acc):
        h = h_ref[:, pl.ds(k * depth, depth)]
        if vocab_major:
            return acc + plgpu.dot(h, w_ref[:, pl.ds(k * depth, depth)], trans_b=True)
        return acc + plgpu.dot(h, w_ref[pl.ds(k * depth, depth), :])

    logits = lax.fori_loop(0, D // depth, step, jnp.zeros((bm, bv), jnp.float32))
    temperature = temperature_ref[0]
    sampled = temperature > 0.0
    x = logits / jnp.where(sampled, temperature, 1.0)
    column = offset_ref[0] + pl.program_id(1) * bv + jnp.arange(bv, dtype=jnp.int32)  # [bv]: vocabulary indices
    top = jnp.max(x, axis=1)
    max_ref[...] = top
    sum_ref[...] = jnp.sum(jnp.exp(x - top[:, None]), axis=1)
    noise = gumbel.noise(k0_ref[...][:, None], k1_ref[...][:, None], column.astype(jnp.uint32)[None, :])
    y = jnp.where(sampled, x + noise, x)
    best = jnp.max(y, axis=1)
    first = jnp.min(jnp.where(y == best[:, None], column[None, :], np.int32(2 ** 30)), axis=1)
    best_ref[...] = best
    index_ref[...] = first
    value_ref[...] = jnp.max(jnp.where(column[None, :] == first[:, None], x, -jnp.inf), axis=1)


def combine(p: Partials) -> tuple[jax.Array, jax.Array]:
    """Partials [nv, B] (blocks in vocabulary order, of every shard) -> (tokens [B] int32, log-probs [B]
    float32): the token of the first block holding the row's best (a tie goes to the lower index, as
    the XLA path's first argmax), x[token] - logsumexp(x)."""
    top = jnp.max(p.max, axis=0)
    log_norm = top + jnp.log(jnp.sum(p.sum * jnp.exp(p.max - top[None, :]), axis=0))
    block = jnp.argmax(p.best, axis=0)  # the first block at the maximum
    pick = lambda x: jnp.take_along_axis(x, block[None, :], axis=0)[0]  # noqa: E731
    return pick(p.index), pick(p.value) - log_norm


def select(hidden: jax.Array, head: jax.Array, keys: jax.Array, temperature: jax.Array, *, vocab_major: bool,
           interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """hidden [B, D], head [V, D] (``vocab_major``) or [D, V], keys [B] (typed PRNG keys),
    temperature [] -> (tokens [B] int32, log-probs [B] float32), as ``selection.select_tokens`` on the
    head's logits with top_p 1 and no top_k. On a mesh, each device runs the kernel on its shard of
    the vocabulary (the "vocab" rule's axes) and its rows (the "batch" rule's), its indices and noise
    counters offset to its shard's first entry; the partials meet in ``combine``."""
    from jax.sharding import PartitionSpec as P

    from pacs_jax.models.attention import _mesh_axes
    from pacs_jax.sharding import LOGICAL_RULES

    k0, k1 = gumbel.key_words(keys)
    B, V = hidden.shape[0], head.shape[0] if vocab_major else head.shape[1]
    call = functools.partial(_shard, vocab_axes=None, vocab_major=vocab_major, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.auto_axes:  # a kernel call must be manual over every axis of the mesh
        vocab = _mesh_axes(mesh, tuple(a for a in LOGICAL_RULES["vocab"] if a in mesh.auto_axes), V)
        rows = _mesh_axes(mesh, tuple(a for a in LOGICAL_RULES["batch"] if a in mesh.auto_axes), B)
        call = jax.shard_map(functools.partial(call, vocab_axes=vocab), mesh=mesh,
                             in_specs=(P(rows), P(vocab) if vocab_major else P(None, vocab), P(rows), P(rows), P()),
                             out_specs=Partials(*[P(vocab, rows)] * 5), axis_names=set(mesh.auto_axes),
                             check_vma=False)
    return combine(call(hidden, head, k0, k1, jnp.asarray(temperature, jnp.float32)))


def _shard(hidden, head, k0, k1, temperature, *, vocab_axes, vocab_major: bool, interpret: bool) -> Partials:
    """``partials`` on one device's shard of the head: its first entry's index is the shard's number
    along ``vocab_axes`` (None: the whole head) times the shard's size."""
    V = head.shape[0] if vocab_major else head.shape[1]
    offset = lax.axis_index(vocab_axes) * V if vocab_axes else 0
    return partials(hidden, head, k0, k1, temperature, offset, vocab_major=vocab_major, interpret=interpret)
