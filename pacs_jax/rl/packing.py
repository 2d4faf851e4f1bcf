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
    stream_index  [M S K, Q] int32, Q = min(N Lp, r R), the same order: the response stream, the
                  flat indices n Lp + c into the shard's packed rows [N, Lp] of the positions that
                  predict a response token (the token before it; t = 0 .. min(length, R - 1) of
                  each sequence, the last one the value's slot after the response), first, then 0s
    stream_length [M K, 1] int32: per micro-batch, the longest of its shards' streams
    unpack_index  [B, R] int32, in the rows' own order: for response token t of row b (t <= its
                  length), its place in the shard's stream; 0 elsewhere (masked)

The LM head (the fused log-probs, a loop of ceil(stream_length / chunk) trips) runs on the stream
only: on the response tokens, not on the prompts nor the padding. Split by ``rl.micro_batches``
with blocks of N rows (pack_index), of one row (stream_index, stream_length) and of ``unit`` rows
(the [B, ...] arrays), micro-batch k of mini-batch m finds its own packed rows, shard by shard, where its
padded rows are. On the device, a packed token's segment id is its padded row's local index + 1 (0:
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


PACKING_KEYS = ("pack_index", "stream_index", "stream_length", "unpack_index")  # a plan's arrays, by name


@dataclasses.dataclass(frozen=True)
class PackedPlan:
    """One pass's plan (see the module docstring): its arrays (``PACKING_KEYS``, host arrays, the same
    on every process), rows = N, and the tokens the pass computes: real (prompt + response tokens of
    every sequence) and computed (M K S N Lp)."""

    pack_index: np.ndarray
    stream_index: np.ndarray
    stream_length: np.ndarray
    unpack_index: np.ndarray
    rows: int
    tokens_real: int
    tokens_computed: int

    def arrays(self) -> dict[str, np.ndarray]:
        """The plan's arrays by ``PACKING_KEYS``."""
        return {k: getattr(self, k) for k in PACKING_KEYS}


def shards_for(rows: int, mesh_shards: int | None = None) -> int:
    """Batch shards of a micro-batch of ``rows`` rows on the mesh in context, or of a mesh whose
    batch axes make ``mesh_shards`` (1 when they do not divide: the rows are then replicated, as
    ``sharding.batch_sharding`` places them)."""
    shards = batch_shards() if mesh_shards is None else mesh_shards
    return shards if rows % shards == 0 else 1


def packed_units(plan: dict, num_rows: int, num_micro_batches: int) -> dict[str, int]:
    """The block sizes of a plan's own arrays for ``rl.micro_batches`` over K = ``num_micro_batches``
    micro-batches of ``num_rows`` rows in all: N (the packed rows of a micro-batch on a shard, from
    pack_index [K S N, Lp]) for pack_index, 1 for stream_index [K S, Q] and stream_length [K, 1];
    unpack_index [B, R] is split as the rows are."""
    N = plan["pack_index"].shape[0] // (num_micro_batches * shards_for(num_rows // num_micro_batches))
    return {"pack_index": N, "stream_index": 1, "stream_length": 1}


def row_buckets(rows: int, count: int) -> tuple[int, ...]:
    """The packed-row counts N a pass may use for micro-batches of ``rows`` rows a shard: at most
    ``count`` of them, ceil(rows x j / count) for j = 1 .. count (every count 1 .. rows when rows <=
    count; ``rows`` always among them: one sequence a row always fits)."""
    return tuple(sorted({math.ceil(rows * j / count) for j in range(1, count + 1)}))


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
                 shards: int, buckets: int) -> PackedPlan:
    """The plan of one pass over B sequences: prompt_lengths, response_lengths [B] (real tokens;
    prompts left-padded to ``prompt_width``, responses right-padded to ``response_width`` in the
    padded rows), rows in ``micro_batch_layout`` (``mini_batches`` x ``micro_batches`` micro-batches
    of ``unit``-row blocks over ``shards`` shards), packed into rows of ``packed_length`` tokens, N the
    smallest of ``row_buckets(r, buckets)`` that holds every micro-batch's packing on every shard.
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
    N = next(n for n in row_buckets(r, buckets) if n >= needed)
    pack_index = np.full((M, S, K, N, Lp), -1, np.int32)
    stream_index = np.zeros((M, S, K, min(N * Lp, r * R)), np.int32)
    stream_length = np.zeros((M, K), np.int32)
    unpack_index = np.zeros((B, R), np.int32)
    for (m, k, s), bins in placed.items():
        used = 0
        for j, (row, (b, offset)) in enumerate(zip(layout[m, k, s], bins)):
            length, prompt = int(seq_lengths[row]), int(prompt_lengths[row])
            start = j * W + prompt_width - prompt  # the row's first real token, flat in [r, W]
            pack_index[m, s, k, b, offset:offset + length] = start + np.arange(length)
            # response token t sits at offset + prompt + t; the token before it predicts it
            t = np.arange(min(int(response_lengths[row]), R - 1) + 1)
            stream_index[m, s, k, used:used + len(t)] = b * Lp + offset + prompt - 1 + t
            unpack_index[row, :len(t)] = used + t
            used += len(t)
        stream_length[m, k] = max(stream_length[m, k], used)
    return PackedPlan(pack_index.reshape(M * S * K * N, Lp), stream_index.reshape(M * S * K, -1),
                      stream_length.reshape(M * K, 1), unpack_index, N, int(seq_lengths.sum()), M * K * S * N * Lp)


# ------------------------------------------------------------------------------------------------
# on the device


def _local_gather(x: jax.Array, index: jax.Array, shards: int, features: int = 0) -> jax.Array:
    """x [S a, ..., F...] and index [S c, ...] int32 (flat indices into a shard's block of x, >= 0),
    both split over the batch shards, with ``features`` trailing feature dims F of x carried along ->
    x's shard-local entries [S c, ..., F...] (a gather batched over S: no shard reads another's rows)."""
    feature_shape = x.shape[x.ndim - features:] if features else ()
    flat = x.reshape(shards, -1, *feature_shape)
    where = index.reshape(shards, -1, *(1,) * features)
    out = jnp.take_along_axis(flat, where, axis=1).reshape(*index.shape, *feature_shape)
    return constrain(out, ("batch",) + (None,) * (out.ndim - 1))


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


def response_stream(x: jax.Array, stream_index: jax.Array, shards: int) -> jax.Array:
    """Per-position values of one micro-batch's packed rows, x [S N, Lp, ...], -> its response stream
    [S, Q, ...] (``stream_index`` [S, Q]; a gather within each of the S = ``shards`` shards)."""
    return _local_gather(x, stream_index, shards, features=x.ndim - 2)


def unpack(stream: jax.Array, unpack_index: jax.Array) -> jax.Array:
    """Per-position values of a micro-batch's response stream [S, Q] -> [S r, R] at
    ``unpack_index`` [S r, R]."""
    return _local_gather(stream, unpack_index, shards_for(unpack_index.shape[0]))
