"""Packed rows: the plan that puts a pass's sequences into rows of a fixed length (docs/design.md
section 3.4a), made on the host, and the gathers that apply it on the device.

Shapes: B rows of the step (sequences), W = P + R the width of a padded row (prompt left-padded to
P, response right-padded to R), Lp ``packed_length``, M mini-batches, K micro-batches per
mini-batch, S batch shards, r = B / (M K S) rows of one micro-batch on one shard, N packed rows of
one micro-batch on one shard (the same for all of them: a bucket).

A pass (pi_old, the update, PPO's values and critic update) runs its rows in micro-batches
(``rl.micro_batches``); a micro-batch's rows are split over the S batch shards, r each. The plan
packs each shard's r sequences of each micro-batch, first-fit decreasing, into N rows of Lp tokens:
a sequence is its prompt without the left padding followed by its response up to its own length.
The plan never moves a sequence to another micro-batch or shard, so the grouping of the loss and
every sum over a micro-batch are those of the padded rows, and the device applies it with gathers
local to each shard:

    pack_index    [M S K N, Lp] int32, rows in (mini-batch, shard, micro-batch, packed row) order:
                  for each packed token, its flat index j W + c into the shard's padded rows
                  [r, W] of that micro-batch (row j, column c), or -1 (padding)
    unpack_index  [B, R] int32, in the rows' own order: for response token t of row b (t <= its
                  length), the flat index n Lp + c into the shard's packed rows [N, Lp] of the
                  position that predicts it (the token before it); 0 elsewhere (masked)

Split by ``rl.micro_batches`` with blocks of N rows (pack_index) and of ``unit`` rows (the [B, ...]
arrays), micro-batch k of mini-batch m finds its own packed rows, shard by shard, where its padded
rows are. On the device, a packed token's segment id is its padded row's local index + 1 (0:
padding) and its position its position in the padded row (``models.positions_from_mask``), so RoPE
sees exactly the unpacked row's positions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pacs_jax.models.qwen import positions_from_mask
from pacs_jax.rl.micro_batches import split_micro_batches
from pacs_jax.sharding import batch_shards, constrain


@dataclasses.dataclass(frozen=True)
class PackedPlan:
    """One pass's plan (see the module docstring): pack_index [M S K N, Lp], unpack_index [B, R] (host
    arrays, the same on every process), rows = N, and the tokens the pass computes: real (prompt +
    response tokens of every sequence) and computed (M K S N Lp)."""

    pack_index: np.ndarray
    unpack_index: np.ndarray
    rows: int
    tokens_real: int
    tokens_computed: int


def shards_for(rows: int) -> int:
    """Batch shards of a micro-batch of ``rows`` rows on the mesh in context (1 when they do not
    divide: the rows are then replicated, as ``sharding.batch_sharding`` places them)."""
    shards = batch_shards()
    return shards if rows % shards == 0 else 1


def packed_unit(pack_index: jax.Array, num_rows: int, num_micro_batches: int) -> int:
    """N, the packed rows of one micro-batch on one shard, of a pack_index [K S N, Lp] for K =
    ``num_micro_batches`` micro-batches of ``num_rows`` rows in all (static: from shapes)."""
    return pack_index.shape[0] // (num_micro_batches * shards_for(num_rows // num_micro_batches))


def row_buckets(rows: int, fractions: Sequence[float]) -> tuple[int, ...]:
    """The packed-row counts N a pass may use for micro-batches of ``rows`` rows a shard:
    ceil(rows x f) for each fraction f (1.0 always among them: one sequence per row always fits)."""
    return tuple(sorted({max(1, math.ceil(rows * f - 1e-9)) for f in (*fractions, 1.0)}))


def micro_batch_layout(num_rows: int, *, mini_batches: int, micro_batches: int, unit: int, shards: int) -> np.ndarray:
    """Which rows each (mini-batch, micro-batch, shard) holds: [M, K, S, r] row indices, as
    ``training/update_step.scanned_update`` (contiguous mini-batches) and ``rl.micro_batches``
    (strided micro-batches of ``unit``-row blocks, rows split contiguously over the shards) place them."""
    minis = np.arange(num_rows).reshape(mini_batches, -1)
    micro = np.stack([np.asarray(split_micro_batches(m, unit, micro_batches)) for m in minis])  # [M, K, B/(MK)]
    return micro.reshape(mini_batches, micro_batches, shards, -1)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """Bins of ``capacity`` for items of ``lengths`` (each <= capacity), longest first, each into the
    first bin with room: [(bin, offset)] per item, in the items' order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free: list[int] = []
    placed = [(0, 0)] * len(lengths)
    for i in order:
        length = lengths[i]
        b = next((b for b, room in enumerate(free) if room >= length), len(free))
        if b == len(free):
            free.append(capacity)
        placed[i] = (b, capacity - free[b])
        free[b] -= length
    return placed


def plan_packing(prompt_lengths: np.ndarray, response_lengths: np.ndarray, *, prompt_width: int,
                 response_width: int, packed_length: int, mini_batches: int, micro_batches: int, unit: int,
                 shards: int, fractions: Sequence[float]) -> PackedPlan:
    """The plan of one pass over B sequences: prompt_lengths, response_lengths [B] (real tokens;
    prompts left-padded to ``prompt_width``, responses right-padded to ``response_width`` in the
    padded rows), rows in ``micro_batch_layout`` (``mini_batches`` x ``micro_batches`` micro-batches
    of ``unit``-row blocks over ``shards`` shards), packed into rows of ``packed_length`` tokens, N the
    smallest of ``row_buckets`` that holds every micro-batch's packing on every shard.
    """
    prompt_lengths, response_lengths = np.asarray(prompt_lengths, np.int64), np.asarray(response_lengths, np.int64)
    B, W, R, Lp = len(prompt_lengths), prompt_width + response_width, response_width, packed_length
    seq_lengths = prompt_lengths + response_lengths
    if seq_lengths.max() > Lp:
        raise ValueError(f"a sequence of {seq_lengths.max()} tokens does not fit packed rows of {Lp}")
    if prompt_lengths.min() < 1:
        raise ValueError("every sequence needs a prompt token (the position that predicts its first response token)")
    layout = micro_batch_layout(B, mini_batches=mini_batches, micro_batches=micro_batches, unit=unit, shards=shards)
    M, K, S, r = layout.shape
    placed = {(m, k, s): first_fit_decreasing(seq_lengths[layout[m, k, s]].tolist(), Lp)
              for m in range(M) for k in range(K) for s in range(S)}
    needed = max(b + 1 for bins in placed.values() for b, _ in bins)
    N = next(n for n in row_buckets(r, fractions) if n >= needed)
    pack_index = np.full((M, S, K, N, Lp), -1, np.int32)
    unpack_index = np.zeros((B, R), np.int32)
    t = np.arange(R)
    for (m, k, s), bins in placed.items():
        for j, (row, (b, offset)) in enumerate(zip(layout[m, k, s], bins)):
            length, prompt = int(seq_lengths[row]), int(prompt_lengths[row])
            start = j * W + prompt_width - prompt  # the row's first real token, flat in [r, W]
            pack_index[m, s, k, b, offset:offset + length] = start + np.arange(length)
            # response token t sits at offset + prompt + t; the token before it predicts it
            unpack_index[row] = np.where(t <= response_lengths[row], b * Lp + offset + prompt - 1 + t, 0)
    return PackedPlan(pack_index.reshape(M * S * K * N, Lp), unpack_index, N, int(seq_lengths.sum()),
                      M * K * S * N * Lp)


# ------------------------------------------------------------------------------------------------
# on the device


def _local_gather(x: jax.Array, index: jax.Array, shards: int) -> jax.Array:
    """x [S a, ...] and index [S c, ...] int32 (flat indices into a shard's block of x, >= 0), both
    split over the batch shards -> x's shard-local entries [S c, ...] (a gather batched over S, so
    no shard reads another's rows)."""
    out = jnp.take_along_axis(x.reshape(shards, -1), index.reshape(shards, -1), axis=1)
    return constrain(out.reshape(index.shape), ("batch",) + (None,) * (index.ndim - 1))


def packed_inputs(input_ids: jax.Array, attention_mask: jax.Array, pack_index: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One micro-batch's padded rows input_ids, attention_mask [S r, W] and its pack_index [S N, Lp]
    -> packed (tokens, segment_ids, positions, targets), each [S N, Lp] int32: targets[n, c] is the
    token at c + 1 (the one that position c predicts)."""
    S, W = shards_for(input_ids.shape[0]), input_ids.shape[1]
    if pack_index.shape[0] % S:
        raise ValueError(f"pack_index of {pack_index.shape[0]} rows does not split over {S} batch shards")
    index = jnp.maximum(pack_index, 0)
    real = pack_index >= 0
    tokens = jnp.where(real, _local_gather(input_ids.astype(jnp.int32), index, S), 0)
    positions = jnp.where(real, _local_gather(positions_from_mask(attention_mask), index, S), 0)
    segment_ids = jnp.where(real, index // W + 1, 0).astype(jnp.int32)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    return tokens, segment_ids, positions, targets


def unpack(packed: jax.Array, unpack_index: jax.Array) -> jax.Array:
    """Per-token values of the packed rows [S N, Lp] -> [S r, R] at ``unpack_index`` (one micro-batch)."""
    return _local_gather(packed, unpack_index, shards_for(unpack_index.shape[0]))
