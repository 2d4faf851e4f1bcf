"""Static shapes for the sampler: bucketed prompt length and batch, and left-padding.

Every distinct (batch, prompt length) pair is one compilation of the sampler program, so both are
rounded up: the prompt length to a multiple of ``length_multiple`` (64 by default), the number of
prompts to a power of two and a multiple of the number of batch shards of the mesh. A training run with a fixed batch size then compiles once per prompt
length bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def bucket_length(longest: int, multiple: int, limit: int) -> int:
    """The padded prompt length: ``longest`` rounded up to ``multiple``, but never above ``limit``."""
    return max(longest, min(round_up(longest, multiple), limit))


def bucket_batch(num_prompts: int, batch_shards: int = 1) -> int:
    """The padded number of prompts: a power of two >= num_prompts, rounded up to a multiple of
    ``batch_shards`` (the data x fsdp mesh size), so every batch shard holds whole prompts and the
    sampler keeps one queue per shard (padding prompts are never decoded)."""
    return round_up(1 << max(num_prompts - 1, 0).bit_length(), batch_shards)


def left_pad(prompts: Sequence[Sequence[int]], batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists into (tokens [batch, length] int32, mask [batch, length] int32).

    Rows beyond ``len(prompts)`` are all-padding (mask 0): the sampler treats them as finished.
    """
    tokens = np.zeros((batch, length), np.int32)
    mask = np.zeros((batch, length), np.int32)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            tokens[row, length - len(prompt):] = prompt
            mask[row, length - len(prompt):] = 1
    return tokens, mask
