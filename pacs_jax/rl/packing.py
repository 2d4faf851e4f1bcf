"""Packed rows: the plan that puts a pass's sequences into rows of a fixed length (docs/design.md
section 3.4a), made on the host, and the gathers that apply it on the device.

Shapes: B rows of the step (sequences), W = P + R the width of a padded row (prompt left-padded to
P, response right-padded to R), Lp ``packed_length``, M mini-batches of B_m = B / M rows, K the
pass slots of a mini-batch (``pass_slots``: at most K passes), S batch shards, N packed rows of one
pass on one shard, Q = N Lp the width of a shard's response stream.

A pass (pi_old, the update, PPO's values and critic update) runs a mini-batch as a few passes of S N
packed rows each, N on each shard (``pass_rows``: a quarter of a padded micro-batch's memory). The plan
places whole units (``unit`` rows: a prompt group for the actor's update, whose loss couples a
group's responses; one row for the others), the largest first, each into the first pass whose rows
can take all its sequences (first fit decreasing, the rows of a pass interleaved over the shards), so
a pass fills with sequences from anywhere in the mini-batch and a mini-batch takes as few passes as
its real tokens need (``PackedPlan.passes``; the rest of its K slots are empty and never run). A
sequence is its prompt without the left padding followed by its response up to its own length:

    pack_index    [M S K N, Lp] int32, rows in (mini-batch, shard, pass, packed row) order: for each
                  packed token, its flat index j W + c into the mini-batch's padded rows [B_m, W]
                  (row j, column c), or -1 (padding)
    stream_index  [M S K, Q] int32, the same order: the response stream, the flat indices n Lp + c
                  into the shard's packed rows [N, Lp] of the pass of the positions that predict a
                  response token (the token before it; t = 0 .. min(length, R - 1) of each sequence,
                  the last one the value's slot after the response), first, then 0s
    stream_length [M K, 1] int32: per pass, the longest of its shards' streams (0: an empty slot)
    unpack_index  [B, R] int32: for response token t of row b (t <= its length), its place s Q + q
                  in its pass's stream of all shards [S Q]; 0 elsewhere (masked)
    row_pass      [B] int32: the pass of row b within its mini-batch

The decoder runs on the packed rows (a segment id per sequence: its row's index in the mini-batch
+ 1, 0 for padding; its positions those of the padded row, so RoPE sees the unpacked row's
positions), the LM head (the fused log-probs, a loop of ceil(stream_length / chunk) trips) on the
stream only; the values come back to [B_m, R] through ``unpack_index`` (rows of other passes read
another pass's stream: callers keep a pass's own rows, ``row_pass``). Packing reads any row of the
mini-batch from any shard: the padded token ids, [B_m, W] int32, are gathered whole (a small
all-gather), and each pass's stream [S Q] floats is gathered whole to unpack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pacs_jax.models.qwen import positions_from_mask
from pacs_jax.rl.micro_batches import mini_batch_totals, split_micro_batches
from pacs_jax.sharding import batch_shards, constrain


@struct.dataclass
class PackedPlanArrays:
    """A plan's arrays as one pytree (host or device arrays; shapes in the module docstring): the
    packing of an update batch (rl/update_batch.py), a pi_old pass's or the critic's.

    pack_index     [M S K N, Lp] int32
    stream_index   [M S K, Q] int32
    stream_length  [M K, 1] int32
    unpack_index   [B, R] int32
    row_pass       [B] int32
    """

    pack_index: jax.Array
    stream_index: jax.Array
    stream_length: jax.Array
    unpack_index: jax.Array
    row_pass: jax.Array


class PassPlan(NamedTuple):
    """One pass of a mini-batch's plan (``pass_plan``): the pass's pack_index [S N, Lp], stream_index
    [S, Q] and stream_length [] int32, and the mini-batch's unpack_index [B_m, R] and row_pass [B_m].
    ``pass_slices`` holds the same with every pass's arrays stacked: [K, S N, Lp], [K, S, Q], [K]."""

    pack_index: jax.Array
    stream_index: jax.Array
    stream_length: jax.Array
    unpack_index: jax.Array
    row_pass: jax.Array


@dataclasses.dataclass(frozen=True)
class PackedPlan:
    """One pass's plan (see the module docstring): its arrays (``PackedPlanArrays``' fields, host
    arrays, the same on every process), N = ``rows`` packed rows a pass and shard, the passes each
    mini-batch runs, and the tokens the pass computes: real (prompt + response tokens of every
    sequence) and computed (sum of passes x S N Lp)."""

    pack_index: np.ndarray
    stream_index: np.ndarray
    stream_length: np.ndarray
    unpack_index: np.ndarray
    row_pass: np.ndarray
    rows: int
    passes: tuple[int, ...]
    tokens_real: int
    tokens_computed: int

    def arrays(self) -> PackedPlanArrays:
        """The plan's arrays (host)."""
        return PackedPlanArrays(self.pack_index, self.stream_index, self.stream_length, self.unpack_index,
                                self.row_pass)


def shards_for(rows: int, mesh_shards: int | None = None) -> int:
    """Batch shards of a micro-batch of ``rows`` rows on the mesh in context, or of a mesh whose
    batch axes make ``mesh_shards`` (1 when they do not divide: the rows are then replicated, as
    ``sharding.batch_sharding`` places them)."""
    shards = batch_shards() if mesh_shards is None else mesh_shards
    return shards if rows % shards == 0 else 1


def pass_rows(rows: int, padded_width: int, packed_length: int, *, unit: int, shards: int) -> int:
    """N, the packed rows of a pass on a shard, for padded micro-batches of ``rows`` rows a shard of
    ``padded_width`` tokens: a quarter of a micro-batch's rows (passes a quarter of its memory, so the
    last, partly filled pass of a mini-batch wastes little), and at least what one unit of ``unit``
    rows needs whatever its lengths (floor(Lp / W) sequences fit a packed row)."""
    per_row = max(1, packed_length // padded_width)
    return max(-(-rows // 4), -(-unit // (shards * per_row)))


def pass_slots(num_rows: int, padded_width: int, packed_length: int, *, unit: int, shards: int, rows: int) -> int:
    """K, the passes a mini-batch of ``num_rows`` rows may take with passes of ``shards`` x ``rows``
    packed rows: as many as it takes with every sequence in a slot of ``padded_width`` tokens (whole
    units a pass), the most any lengths need."""
    units_a_pass = shards * rows * max(1, packed_length // padded_width) // unit
    return -(-(num_rows // unit) // units_a_pass)


def plan_shape(num_rows: int, *, mini_batches: int, passes: int, shards: int, rows: int, packed_length: int,
               response_width: int) -> PackedPlanArrays:
    """The shapes of a plan's arrays, each a tuple in its ``PackedPlanArrays`` field (for the programs
    compiled before step 1)."""
    M, K, S, N = mini_batches, passes, shards, rows
    return PackedPlanArrays(pack_index=(M * S * K * N, packed_length), stream_index=(M * S * K, N * packed_length),
                            stream_length=(M * K, 1), unpack_index=(num_rows, response_width), row_pass=(num_rows,))


def _place(lengths: np.ndarray, free: np.ndarray, capacity: int) -> list[tuple[int, int]] | None:
    """Each item of ``lengths`` (in that order) into the first bin of ``free`` (room left in each bin of
    ``capacity``) that takes it: [(bin, offset)], ``free`` updated; None, ``free`` untouched, when one
    does not fit."""
    trial, placed = free.copy(), []
    for length in lengths:
        fits = np.flatnonzero(trial >= length)
        if not len(fits):
            return None
        b = int(fits[0])
        placed.append((b, capacity - int(trial[b])))
        trial[b] -= length
    free[:] = trial
    return placed


def _passes(lengths: np.ndarray, units: list[np.ndarray], bins: int, capacity: int) -> list[list[tuple]] | None:
    """Units (arrays of row indices into ``lengths``, each placed whole in one pass) into passes of
    ``bins`` bins of ``capacity``: the largest unit first, into the first pass that takes it, its rows
    longest first (first fit decreasing) -> per pass [(row, bin, offset)]; None when a unit fits no
    empty pass."""
    passes: list[tuple[np.ndarray, list]] = []
    for rows in sorted(units, key=lambda u: -int(lengths[u].sum())):
        rows = rows[np.argsort(-lengths[rows], kind="stable")]
        for free, placed in passes + [(np.full(bins, capacity), [])]:
            got = _place(lengths[rows], free, capacity) if free.max() >= lengths[rows[0]] else None
            if got is not None:
                if not placed:
                    passes.append((free, placed))
                placed += [(int(j), b, offset) for j, (b, offset) in zip(rows, got)]
                break
        else:
            return None
    return [placed for _, placed in passes]


def plan_packing(prompt_lengths: np.ndarray, response_lengths: np.ndarray, *, prompt_width: int,
                 response_width: int, packed_length: int, mini_batches: int, passes: int, unit: int,
                 shards: int, rows: int) -> PackedPlan:
    """The plan of one pass over B sequences: prompt_lengths, response_lengths [B] (real tokens;
    prompts left-padded to ``prompt_width``, responses right-padded to ``response_width`` in the
    padded rows), in ``mini_batches`` contiguous mini-batches of at most ``passes`` passes of
    ``shards`` x ``rows`` packed rows of ``packed_length`` tokens, whole blocks of ``unit`` rows in a
    pass (see the module docstring). When first fit decreasing needs more than ``passes`` passes, a
    mini-batch's sequences take W-token slots in order (``pass_slots`` passes hold them).
    """
    prompt_lengths, response_lengths = np.asarray(prompt_lengths, np.int64), np.asarray(response_lengths, np.int64)
    B, W, R, Lp = len(prompt_lengths), prompt_width + response_width, response_width, packed_length
    M, K, S, N, Q = mini_batches, passes, shards, rows, rows * packed_length
    seq_lengths = prompt_lengths + response_lengths
    if seq_lengths.max() > Lp:
        raise ValueError(f"a sequence of {seq_lengths.max()} tokens does not fit packed rows of {Lp}")
    if prompt_lengths.min() < 1:
        raise ValueError("every sequence needs a prompt token (the position that predicts its first response token)")
    Bm = B // M
    pack_index = np.full((M, S, K, N, Lp), -1, np.int32)
    stream_index = np.zeros((M, S, K, Q), np.int32)
    stream_length = np.zeros((M, K), np.int32)
    unpack_index = np.zeros((B, R), np.int32)
    row_pass = np.zeros((B,), np.int32)
    counts = []
    for m in range(M):
        lengths = seq_lengths[m * Bm:(m + 1) * Bm]
        placed = _passes(lengths, list(np.arange(Bm).reshape(-1, unit)), S * N, Lp)
        if placed is None or len(placed) > K:  # every sequence in a W-token slot: whole units, in order
            per_row = Lp // W
            per_pass = S * N * per_row // unit * unit
            placed = [[(j, (j - k) // per_row, (j - k) % per_row * W) for j in range(k, min(k + per_pass, Bm))]
                      for k in range(0, Bm, per_pass)]
        counts.append(len(placed))
        for p, cells in enumerate(placed):
            used = np.zeros(S, np.int64)
            for j, b, offset in sorted(cells):
                s, n, row = b % S, b // S, m * Bm + j  # the pass's rows interleaved over the shards
                length, prompt = int(seq_lengths[row]), int(prompt_lengths[row])
                start = j * W + prompt_width - prompt  # the row's first real token, flat in [B_m, W]
                pack_index[m, s, p, n, offset:offset + length] = start + np.arange(length)
                # response token t sits at offset + prompt + t; the token before it predicts it
                t = np.arange(min(int(response_lengths[row]), R - 1) + 1)
                stream_index[m, s, p, used[s]:used[s] + len(t)] = n * Lp + offset + prompt - 1 + t
                unpack_index[row, :len(t)] = s * Q + used[s] + t
                row_pass[row] = p
                used[s] += len(t)
            stream_length[m, p] = used.max()
    return PackedPlan(pack_index.reshape(M * S * K * N, Lp), stream_index.reshape(M * S * K, Q),
                      stream_length.reshape(M * K, 1), unpack_index, row_pass, N, tuple(counts),
                      int(seq_lengths.sum()), sum(counts) * S * N * Lp)


# ------------------------------------------------------------------------------------------------
# on the device


def pass_slices(plan: PackedPlanArrays) -> PassPlan:
    """A mini-batch's plan with its pass arrays by pass: pack_index [K, S N, Lp], stream_index
    [K, S, Q], stream_length [K]."""
    K = plan.stream_length.shape[0]
    S = plan.stream_index.shape[0] // K
    N = plan.pack_index.shape[0] // (K * S)
    return PassPlan(constrain(split_micro_batches(plan.pack_index, N, K), (None, "batch", None)),
                    constrain(split_micro_batches(plan.stream_index, 1, K), (None, "batch", None)),
                    plan.stream_length[:, 0], plan.unpack_index, plan.row_pass)


def pass_plan(plan: PackedPlanArrays, p: jax.Array) -> PassPlan:
    """Pass ``p`` (int32 []) of a mini-batch's plan."""
    return _index_pass(pass_slices(plan), p)


def _index_pass(slices: PassPlan, p) -> PassPlan:
    """Pass p of ``slices`` (``pass_slices``)."""
    one = lambda x: jax.lax.dynamic_index_in_dim(x, p, keepdims=False)  # noqa: E731
    return slices._replace(pack_index=one(slices.pack_index), stream_index=one(slices.stream_index),
                           stream_length=one(slices.stream_length))


def run_passes(body: Callable, plan: PackedPlanArrays, init):
    """``carry = body(p, pass_plan, carry)`` for each pass p of a mini-batch's plan (a loop of as many
    trips as it has passes; ``pass_plan`` above)."""
    slices = pass_slices(plan)
    return jax.lax.fori_loop(0, jnp.sum(slices.stream_length > 0),
                             lambda p, carry: body(p, _index_pass(slices, p), carry), init)


def map_passes(forward: Callable, plan: PackedPlanArrays, init):
    """``forward(pass_plan)`` -> a pytree of [B_m, ...] arrays, of which the pass's own rows are kept
    (``row_pass``): the mini-batch's values over all its passes (``init``: the same pytree, its
    starting values)."""
    return run_passes(lambda p, one, acc: keep_own_rows(one, p, acc, forward(one)), plan, init)


def keep_own_rows(pass_plan: PassPlan, p, acc, out):
    """``acc`` (a pytree of [B_m, ...] arrays) with pass ``p``'s own rows taken from ``out`` (the same pytree)."""
    return jax.tree.map(lambda a, o: jnp.where(own_rows(pass_plan, p, o.ndim), o, a), acc, out)


def own_rows(pass_plan: PassPlan, p, ndim: int = 2) -> jax.Array:
    """[B_m, 1, ...] (``ndim`` dims): whether each row of the mini-batch belongs to pass ``p``."""
    return (pass_plan.row_pass == p).reshape(-1, *(1,) * (ndim - 1))


def packed_inputs(input_ids: jax.Array, attention_mask: jax.Array, pack_index: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A mini-batch's padded rows input_ids, attention_mask [B_m, W] and a pass's pack_index
    [S N, Lp] -> the pass's packed (tokens, segment_ids, positions, targets), each [S N, Lp] int32:
    targets[n, c] is the token at c + 1 (the one that position c predicts)."""
    W = input_ids.shape[1]
    index = jnp.maximum(pack_index, 0)
    real = pack_index >= 0
    whole = lambda x: constrain(x.reshape(-1).astype(jnp.int32), (None,))  # noqa: E731 (small: int32 ids)
    rows = lambda x: constrain(jnp.where(real, x, 0), ("batch", None))  # noqa: E731
    tokens = rows(whole(input_ids)[index])
    positions = rows(whole(positions_from_mask(attention_mask))[index])
    segment_ids = rows(index // W + 1).astype(jnp.int32)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    return tokens, segment_ids, positions, targets


def packed_routing(routing: jax.Array, pack_index: jax.Array) -> jax.Array:
    """A mini-batch's routing record [B_m, W, L, k] (the experts of every token in every layer,
    rl/update_batch.py ``UpdateBatch.routing``) -> the pass's packed rows' [S N, Lp, L, k] (padding:
    expert 0, never read by a scored position)."""
    flat = routing.reshape(-1, *routing.shape[2:])  # [B_m W, L, k]
    out = jnp.where((pack_index >= 0)[..., None, None], flat[jnp.maximum(pack_index, 0)], 0)
    return constrain(out.astype(routing.dtype), ("batch",) + (None,) * (out.ndim - 1))


def unpacked_routing(packed: jax.Array, pack_index: jax.Array, acc: jax.Array) -> jax.Array:
    """The inverse of ``packed_routing``: a pass's packed routing [S N, Lp, L, k] written into the
    mini-batch's record ``acc`` [B_m, W, L, k] at the tokens the pass holds (the others unchanged)."""
    B, W = acc.shape[:2]
    at = jnp.where(pack_index >= 0, pack_index, B * W).reshape(-1)  # padding: out of bounds, dropped
    flat = acc.reshape(B * W, *acc.shape[2:]).at[at].set(packed.reshape(-1, *packed.shape[2:]).astype(acc.dtype),
                                                         mode="drop")
    return constrain(flat.reshape(acc.shape), ("batch",) + (None,) * (acc.ndim - 1))


def response_stream(x: jax.Array, stream_index: jax.Array) -> jax.Array:
    """Per-position values of a pass's packed rows, x [S N, Lp, ...], -> its response stream
    [S, Q, ...] (``stream_index`` [S, Q]; a gather within each shard)."""
    S, features = stream_index.shape[0], x.ndim - 2
    flat = x.reshape(S, -1, *x.shape[2:])
    where = stream_index.reshape(S, -1, *(1,) * features)
    out = jnp.take_along_axis(flat, where, axis=1)
    return constrain(out, ("batch",) + (None,) * (out.ndim - 1))


def unpack(stream: jax.Array, unpack_index: jax.Array) -> jax.Array:
    """Per-position values of a pass's response stream [S, Q] -> [B_m, R] at ``unpack_index``
    [B_m, R] (rows of other passes read garbage: see ``own_rows``)."""
    whole = constrain(stream.reshape(-1), (None,))
    return constrain(whole[unpack_index], ("batch", None))


def accumulate_passes(forward: Callable, loss: Callable, params, rows, plan: PackedPlanArrays, held: jax.Array, *,
                      unit: int, num_micro_batches: int, extra: str | None = None) -> tuple[jax.Array, dict, object]:
    """Gradient accumulation over a packed mini-batch's passes (the packed ``accumulate_micro_batches``).

    forward(params, rows, pass_plan) -> [B_m, R] float32, per-token values of the pass's own rows
    (log-probs, the critic's values); loss(values [b, R], rows of b, totals) -> (scalar loss, metrics),
    for b the rows of a micro-batch or of the whole mini-batch. rows: the mini-batch's batch without
    its plan (rl/update_batch.py ``UpdateBatch`` or ``CriticBatch``, [B_m, ...] arrays); plan: its
    plan, whose passes hold whole blocks of ``unit`` rows: the loss couples only a block's rows (a
    prompt group), so pass p's gradient is that of the loss with the other passes' rows held at
    ``held`` [B_m, R] (constants: the batch's old_logp or old_values), and the passes' gradients sum
    to the mini-batch's. The loss and metrics are then those of the padded micro-batches (K =
    ``num_micro_batches`` strided blocks of ``unit`` rows), at the values the passes computed.

    With ``extra`` (a metric's name), forward returns (values, a scalar loss term of the pass's own): its gradient
    joins the pass's, and its sum over the passes is added to the loss and reported as the metric ``extra``.

    Returns (summed loss, metrics averaged over micro-batches, summed float32 gradients).
    """
    totals = mini_batch_totals(rows)
    held = jax.lax.stop_gradient(held.astype(jnp.float32))

    def pass_loss(params, one, p):
        if not extra:  # no term: the program as before ``extra`` existed
            out = forward(params, rows, one)
            return loss(jnp.where(own_rows(one, p), out, held), rows, totals)[0], (out,)
        out, term = forward(params, rows, one)
        return loss(jnp.where(own_rows(one, p), out, held), rows, totals)[0] + term, (out, term)

    grad_fn = jax.value_and_grad(pass_loss, has_aux=True)

    def body(p, one, carry):
        grads, values, *terms = carry
        (_, (out, *term)), pass_grads = grad_fn(params, one, p)
        grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads, pass_grads)
        return grads, jnp.where(own_rows(one, p), out, values), *(a + b for a, b in zip(terms, term))

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
    grads, values, *terms = run_passes(body, plan, (zeros, held) + ((jnp.zeros((), jnp.float32),) if extra else ()))
    micro = jax.tree.map(lambda v: constrain(split_micro_batches(v, unit, num_micro_batches),
                                             (None, "batch") + (None,) * (v.ndim - 1)), (rows, values))
    losses, metrics = jax.lax.map(lambda mb: loss(mb[1], mb[0], totals), micro)
    total = jnp.sum(losses)
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
    if not extra:
        return total, metrics, grads
    return total + terms[0], {**metrics, extra: terms[0]}, grads
