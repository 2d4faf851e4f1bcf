"""What every objective checks about its inputs, and the normalisers of a (micro-)batch.

Shapes: B responses (B = number of prompts x group_size; rows i*n .. i*n+n-1 share a prompt),
T response tokens.

The checks run on static facts (shapes, group size) and, when the rewards / mask are concrete
arrays (not tracers inside ``jax.jit``), on their values, so bad input raises a ValueError that
names the argument before anything is traced or computed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np


class BatchTotals(NamedTuple):
    """Normalisers of the whole mini-batch when an objective sees one micro-batch of it.

    num_sequences: responses in the mini-batch (the B of a mean over responses).
    num_tokens: response tokens in the mini-batch (sum of its response mask; the token-mean
      denominator), a scalar array.
    With these, the losses of equal-sized micro-batches add up to the mini-batch loss exactly.
    """

    num_sequences: int
    num_tokens: jax.Array


def _concrete(x) -> np.ndarray | None:
    """x as a NumPy array when its values are known now (a NumPy or JAX array, not a tracer), else None."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, (np.ndarray, jax.Array)):
        return None
    return np.asarray(x)


def check_batch(logp, old_logp, response_mask, rewards, group_size: int, *, min_group_size: int,
                binary_rewards: bool) -> None:
    """Raise ValueError naming the offending argument when the batch is malformed.

    logp, old_logp, response_mask: [B, T]; rewards: [B];
    B divisible by group_size >= min_group_size; rewards in {0, 1} when ``binary_rewards``
    (otherwise finite); response_mask in {0, 1}. Value checks only run on concrete arrays.
    """
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got shape {logp.shape}")
    for name, x in (("old_logp", old_logp), ("response_mask", response_mask)):
        if x.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape [B, T]={logp.shape}, got {x.shape}")
    batch = logp.shape[0]
    if rewards.shape != (batch,):
        raise ValueError(f"rewards must be [B]=({batch},) (one per response), got shape {rewards.shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
    if group_size < min_group_size:
        raise ValueError(f"group_size={group_size}: this objective needs at least {min_group_size} "
                         f"responses per prompt")
    if batch % group_size:
        raise ValueError(f"batch of {batch} responses is not divisible by group_size={group_size}: "
                         f"a batch must hold whole groups")
    values = _concrete(rewards)
    if values is not None:
        if binary_rewards and not np.isin(values, (0.0, 1.0)).all():
            bad = values[~np.isin(values, (0.0, 1.0))]
            raise ValueError(f"rewards must be 0 or 1 (verifiable reward labels), got {bad[:5].tolist()}")
        if not np.isfinite(values).all():
            raise ValueError("rewards must be finite")
    mask = _concrete(response_mask)
    if mask is not None and not np.isin(mask, (0, 1)).all():
        raise ValueError("response_mask must hold only 0 and 1")


def group_view(x: jax.Array, group_size: int) -> jax.Array:
    """[B, ...] -> [B / n, n, ...]: one row per prompt (rows i*n .. i*n+n-1 are a group)."""
    return x.reshape(x.shape[0] // group_size, group_size, *x.shape[1:])
