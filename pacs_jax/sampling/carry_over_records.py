"""What carry-over hands its caller (sampling/carry_over.py tells the mechanism): a call's rows
(``CarryOverRows``), a chunk's progress (``CarryOverProgress``), the rows in flight exported after a
call (``InFlightRows``, one ``SavedRows`` a generation) and a resume's progress (``ReseatProgress``).

Shapes (as sampling/carry_over.py's): P prompts a call (padded), T prompt length, n samples a prompt,
G = max_staleness + 1 generations, R = G P n rows, C decode slots, B groups a call returns, N =
max_new_tokens, s page size, TP = ceil(T / s), F response pages, S queues (batch shards, or 1).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np


class CarryOverRows(NamedTuple):
    """One call's results (device arrays): B groups' rows, row k n + j sample j of group k (with queues
    per batch shard, queue q's B / S groups are groups q B / S ..; the indices are the call's).

    tokens:          [B n, N] int32, PAD_ID after the end
    logprobs:        [B n, N] float32, 0 after the end
    versions:        [B n, N] int32, the policy version that sampled each token, 0 after the end
    response_mask:   [B n, N] int32, 1 on generated tokens
    lengths:         [B n] int32
    stopped:         [B n] bool, True at a stop id, False at the budget
    group_version:   [B] int32, the version (call) whose prompt batch the group came from (-1: none)
    group_prompt:    [B] int32, its index in that batch (-1: none)
    group_valid:     [B] bool, False where fewer than B groups completed (no row left to run)
    dropped:         [P] bool, prompts of the batch of ``dropped_version`` dropped by this call
                     (unreturned when their generation retired: queue them again)
    dropped_version: [] int32, the version whose batch ``dropped`` indexes (-1: none retired)
    carried_rows:    [] int32, rows of earlier calls still running or waiting when this call began
    decode_steps:    [] int32, this call's decode steps (the most of any queue's)
    decoded_tokens:  [] int32, tokens its decode steps sampled (every row's, returned or not)
    slot_steps:      [] int32, C x decode steps (a queue's slots x its steps, summed over the queues)
    staleness_mean:  [] float32, mean of (this version - token version) over the returned tokens
    staleness_max:   [] int32, its max
    prompt_routing:  None, or (recording routing, ``EngineSpec.routing``) [B, T, L, k]: each group's prompt's
                     experts as its last prefill routed them (this call's weights: the insert's or a refresh)
    routing:         None, or [B n, N, L, k]: the experts of each response token as the decode step that fed
                     it routed it (the weights of that call: a carried row's are of several), 0 past the end
    """

    tokens: jax.Array
    logprobs: jax.Array
    versions: jax.Array
    response_mask: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    group_version: jax.Array
    group_prompt: jax.Array
    group_valid: jax.Array
    dropped: jax.Array
    dropped_version: jax.Array
    carried_rows: jax.Array
    decode_steps: jax.Array
    decoded_tokens: jax.Array
    slot_steps: jax.Array
    staleness_mean: jax.Array
    staleness_max: jax.Array
    prompt_routing: jax.Array | None = None
    routing: jax.Array | None = None

    @property
    def slot_utilisation(self) -> float:
        """Tokens sampled by this call's decode steps / slot steps (1: no slot ever idle)."""
        return int(self.decoded_tokens) / int(self.slot_steps) if int(self.slot_steps) else 1.0


class CarryOverProgress(NamedTuple):
    """A call's progress after a chunk: groups complete (not yet returned), rows running, and
    whether the call's decode is done (B groups complete, or no row runs)."""

    groups: int
    running: int
    done: bool

    @classmethod
    def read(cls, progress: jax.Array) -> CarryOverProgress:
        """From the chunk program's replicated [3] array."""
        groups, running, done = np.asarray(progress.addressable_data(0)).tolist()
        return cls(groups, running, bool(done))


class SavedRows(NamedTuple):
    """One generation's rows as exported (``InFlightRows``), the arguments of the restore program.

    tokens, logprobs, versions: [P n, N] (int32, float32, int32; PAD_ID / 0 / 0 past a row's length)
    lengths:  [P n] int32, tokens made so far
    stopped:  [P n] bool
    budgets:  [P n] int32
    row_keys: [P n, k] uint32, each row's key data
    live:     [P] bool, the prompts neither returned nor dropped
    """

    tokens: jax.Array
    logprobs: jax.Array
    versions: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    budgets: jax.Array
    row_keys: jax.Array
    live: jax.Array


class InFlightRows(NamedTuple):
    """What a resume needs of the rows in flight after a call, on the host (numpy; every process the
    same): ``CarryOverSampler.export`` -> ``CarryOverSampler.resume``. Their K/V is not in it: a
    resume recomputes it with the weights it is given.

    version:     the version of the call after which they were exported
    generations: the versions whose prompt batches still hold live prompts, oldest first
    rows:        one ``SavedRows`` of numpy arrays a generation (the rows of its prompts not live
                 emptied: length 0)
    slots:       [C] int32, the row each decode slot held (-1: idle)
    """

    version: int
    generations: tuple[int, ...]
    rows: tuple[SavedRows, ...]
    slots: np.ndarray

    @property
    def running(self) -> int:
        """Rows in decode slots (their K/V is what a resume recomputes)."""
        return int(np.sum(self.slots >= 0))

    @property
    def tokens(self) -> int:
        """Tokens sampled so far by the rows in flight."""
        return int(sum(rows.lengths.sum() for rows in self.rows))

    @property
    def row_count(self) -> int:
        """Rows in flight: rows of live prompts with a token."""
        return int(sum(np.sum(rows.lengths > 0) for rows in self.rows))


class ReseatProgress(NamedTuple):
    """A resume's replay after a chunk (``reseat_program``): the positions left to feed (the most of any
    slot) and whether every slot's are fed."""

    left: int
    done: bool

    @classmethod
    def read(cls, progress: jax.Array) -> ReseatProgress:
        """From the reseat program's replicated [2] array."""
        left, done = np.asarray(progress.addressable_data(0)).tolist()
        return cls(left, bool(done))
