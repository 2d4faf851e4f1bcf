"""The records the two roles of a training step hand each other (training/engine/ and training/learner/,
which import neither each other nor anything above them): a step's prompts, the engine's sampled rows, their
scores and its collected rows (with its phases' seconds), and the rollout the learner trains on.

    PromptBatch -> engine: SampledRows, Scores -> Collected -> learner: Rollout (the update batch, metrics)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from pacs_jax import sampling
from pacs_jax.rl.packing import PackedPlanArrays
from pacs_jax.rl.update_batch import UpdateBatch
from pacs_jax.training.passes import Passes


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Prompts of one step: token ids, gold answers and where each came from (same length)."""

    prompt_ids: Sequence[Sequence[int]]
    ground_truths: Sequence[str]
    data_sources: Sequence[str]


class CallRows(NamedTuple):
    """One sampler call's rows: tokens, logprobs [B / K, N] (int32, float32), lengths [B / K] int32; routing None,
    or (``train.router_replay`` "R3") [B / K, Tp + N, L, k]: the experts the sampler chose for each row's prompt
    (left-padded to the largest prompt bucket Tp) and response tokens in every sparse layer
    (``engine.sampler_programs.call_routing``)."""

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    routing: jax.Array | None = None


@dataclasses.dataclass
class Rollout:
    """One step's rollout: the update batch (global device arrays) and what the host saw."""

    batch: UpdateBatch  # with rewards [B]; packed: with the update's plan
    rewards: np.ndarray  # [B] every row's reward (the same on every process)
    metrics: dict[str, float]  # over all rows of all processes
    packing: Passes[PackedPlanArrays] | None = None  # the passes' plan arrays when packed (PPO's critic reads
    #                                                   the logprob pass's for its values, the critic pass's for its update)


@dataclasses.dataclass
class SampledRows:
    """The rows of a batch of prompts' sampler calls (``RowCollector.sample``, training/engine/collect.py): P prompts, n rows each,
    B = P n rows, K sampler calls, N = max_new_tokens, R the response bucket, Tp the prompt bucket
    (packed passes: R and Tp the largest buckets)."""

    prompts: PromptBatch
    calls: tuple[CallRows, ...]  # each call's tokens, log-probs [B / K, N], lengths [B / K] (device)
    prompt_tokens: jax.Array  # [P, Tp] int32, left-padded (device, sharded over the rows)
    prompt_mask: jax.Array  # [P, Tp] int32
    tokens: jax.Array  # [B, R] int32
    response_mask: jax.Array  # [B, R] int32
    prompt_lengths: np.ndarray  # [B] every row's prompt tokens (host, the same on every process)
    lengths: np.ndarray  # [B] every row's response tokens
    stopped: np.ndarray  # [B] bool: ended at a stop id
    prompt_bucket: int  # the sampler's
    response_bucket: int
    decode_steps: int  # of the calls, summed
    slot_steps: int  # of the calls, summed (engine.SampleArrays.slot_steps)
    local_rows: np.ndarray  # [b] the rows this process holds, sorted
    local_tokens: np.ndarray  # [b, R] their tokens (host)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the sampler's own (carry-over's)
    routing: jax.Array | None = None  # [B, Tp + R, L, k] (train.router_replay "R3"): the experts the sampler chose
    #                                   for every prompt and response token in every layer, as the update rows hold them

    @property
    def sampler_logprobs(self) -> tuple[jax.Array, ...]:
        """Each call's log-probs of its tokens, [B / K, N]."""
        return tuple(call.logprobs for call in self.calls)

    @property
    def slot_utilisation(self) -> float:
        """Decoded tokens / slot steps (engine.slot_utilisation)."""
        return sampling.slot_utilisation(self.lengths, self.slot_steps)


@dataclasses.dataclass(frozen=True)
class Scores:
    """Every row's reward [B] float32 and status [B] (rewards.STATUSES) on every process, the rows' token
    checksums [B] int32 (``row_checksums``), and the scoring's counts (summed over the processes; the
    seconds, the slowest process's)."""

    rewards: np.ndarray
    statuses: list[str]
    checksums: np.ndarray
    restarts: int
    seconds: float
    deadline_retried: int


@dataclasses.dataclass
class PhaseTimes:
    """The seconds of a step's rollout phases: sampling (every gen batch's), scoring, pi_old's passes."""

    sample: float = 0.0
    reward: float = 0.0
    old_logprob: float = 0.0

    def metrics(self) -> dict[str, float]:
        """As a step's metrics name them."""
        return {"time_sample": self.sample, "time_reward": self.reward, "time_old_logprob": self.old_logprob}


@dataclasses.dataclass
class Collected:
    """The rollout engine's part of a step (``RowCollector.collect``): its rows, their scores, the
    engine's own metrics (dynamic sampling's, carry-over's) and its phases' seconds (sampling, scoring)."""

    sampled: SampledRows
    scores: Scores
    metrics: dict[str, float]
    times: PhaseTimes
