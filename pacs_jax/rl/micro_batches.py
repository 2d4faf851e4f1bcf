"""Micro-batches of rows: one layout for every pass that bounds its activation memory by running a
batch K = ``num_micro_batches`` rows-blocks at a time.

    out = map_micro_batches(fn, (input_ids, attention_mask), num_micro_batches=4)   # forward, no gradient
    rows = strided_micro_batch(input_ids, 4, k)     # micro-batch k alone (a pass dispatched on its own)
    loss, metrics, grads = accumulate_micro_batches(grad_fn, params, batch, unit=n, num_micro_batches=4)

Layout: a batch [B, ...] is cut into blocks of ``unit`` rows (``unit`` = group size when micro-batches
must hold whole prompt groups, else 1), and micro-batch k holds blocks k, k + K, k + 2K, ... (strided),
so when the batch axis is sharded over ("data", "fsdp") every micro-batch is spread over all devices.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.rl.batch import BatchTotals
from pacs_jax.sharding import constrain


def split_micro_batches(x: jax.Array, unit: int, num_micro_batches: int) -> jax.Array:
    """[B, ...] -> [K, B / K, ...] by blocks of ``unit`` rows: micro-batch k holds blocks k, k + K, ...

    Raises ValueError when K = ``num_micro_batches`` micro-batches of whole blocks do not make B."""
    K = num_micro_batches
    if K < 1 or x.shape[0] % (unit * K):
        blocks = "" if unit == 1 else f" into micro-batches of whole blocks of {unit} rows"
        raise ValueError(f"num_micro_batches={K} does not divide the batch of {x.shape[0]} rows{blocks}")
    blocks = x.reshape(x.shape[0] // (unit * K), K, unit, *x.shape[1:])
    return jnp.moveaxis(blocks, 1, 0).reshape(K, x.shape[0] // K, *x.shape[1:])


def merge_micro_batches(x: jax.Array, unit: int) -> jax.Array:
    """Inverse of ``split_micro_batches``: [K, B / K, ...] -> [B, ...]."""
    K, rows = x.shape[:2]
    blocks = x.reshape(K, rows // unit, unit, *x.shape[2:])
    return jnp.moveaxis(blocks, 0, 1).reshape(K * rows, *x.shape[2:])


def strided_micro_batch(x: jax.Array, num_micro_batches: int, k: jax.Array) -> jax.Array:
    """Micro-batch ``k`` (an int32 [] array) of ``split_micro_batches(x, 1, num_micro_batches)``
    without the others: x [B, ...] -> rows k, k + K, k + 2K, ... [B / K, ...]."""
    K = num_micro_batches
    if K < 1 or x.shape[0] % K:
        raise ValueError(f"num_micro_batches={K} does not divide the batch of {x.shape[0]} rows")
    return jax.lax.dynamic_index_in_dim(x.reshape(x.shape[0] // K, K, *x.shape[1:]), k, axis=1, keepdims=False)


def put_strided_micro_batch(x: jax.Array, rows: jax.Array, num_micro_batches: int, k: jax.Array) -> jax.Array:
    """The inverse of ``strided_micro_batch``: x [B, ...] with its rows k, k + K, ... replaced by ``rows``
    [B / K, ...]."""
    K = num_micro_batches
    strided = x.reshape(x.shape[0] // K, K, *x.shape[1:])
    return jax.lax.dynamic_update_index_in_dim(strided, rows.astype(x.dtype), k, axis=1).reshape(x.shape)


def map_micro_batches(fn: Callable, arrays: tuple[jax.Array, ...], *, num_micro_batches: int):
    """``fn(*arrays)`` without gradient, as ``num_micro_batches`` calls (``lax.map``) on strided
    micro-batches of rows (unit 1): arrays, each [B, L] -> fn's outputs (a pytree of [B, ...] arrays),
    equal to one call on the whole batch. Each micro-batch's rows are sharded over the batch axes of the mesh in context.
    """
    micro = tuple(constrain(split_micro_batches(x, 1, num_micro_batches), (None, "batch", None)) for x in arrays)
    out = jax.lax.map(lambda xs: fn(*xs), micro)
    return jax.lax.stop_gradient(jax.tree.map(lambda x: merge_micro_batches(x, 1), out))


def mini_batch_totals(batch) -> BatchTotals:
    """The normalisers of a mini-batch's loss: its rows and its ``response_mask`` [B, R] tokens (batch:
    rl/update_batch.py ``UpdateBatch`` or ``CriticBatch``)."""
    return BatchTotals(num_sequences=batch.response_mask.shape[0],
                       num_tokens=jnp.sum(batch.response_mask.astype(jnp.float32)))


def accumulate_micro_batches(grad_fn: Callable, params: nnx.State, batch, *, unit: int,
                             num_micro_batches: int) -> tuple[jax.Array, dict, nnx.State]:
    """Gradient accumulation: ``grad_fn(params, micro_batch, totals) -> ((loss, metrics), grads)`` over
    ``num_micro_batches`` micro-batches of ``batch`` (rl/update_batch.py ``UpdateBatch`` or
    ``CriticBatch`` without a packing plan, each array [B, ...]; blocks of ``unit`` rows, strided) in a
    ``lax.scan``. ``totals`` are the whole batch's (its rows and ``response_mask`` tokens), so an
    objective normalised by them sums to the whole batch's loss.

    Returns (summed loss, metrics averaged over micro-batches, summed float32 gradients).
    """
    totals = mini_batch_totals(batch)
    micro = jax.tree.map(lambda v: constrain(split_micro_batches(v, unit, num_micro_batches),
                                             (None, "batch") + (None,) * (v.ndim - 1)), batch)

    def step(acc, mb):
        loss_sum, grad_sum = acc
        (loss, metrics), grads = grad_fn(params, mb, totals)
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        return (loss_sum + loss, grad_sum), metrics

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (loss, grads), metrics = jax.lax.scan(step, (jnp.zeros((), jnp.float32), zeros), micro)
    return loss, jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics), grads
