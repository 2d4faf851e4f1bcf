"""The training prompt stream: a grain pipeline of prompt batches.

    train, warm, held_out, counts = training_problems(config.data, seed=0)     # data/sources.py
    examples, dropped = build_prompts(train, tokenizer, max_prompt_length=512)
    batches = prompt_iterator(examples, PipelineConfig(batch_size=1024, seed=0, num_epochs=1))
    batch = next(batches)            # the step's list of PromptExample (the same on every process)
    state = batches.get_state()      # JSON-able; prompt_iterator(..., state=state) resumes exactly

Order: every epoch is a fresh deterministic shuffle of all examples (grain reseeds by epoch), cut
into global batches of ``batch_size`` whole prompts (an epoch's remainder is dropped). Every process
iterates the same global batches; which rows a process places on its devices is decided by the
batch sharding (training/rollout.py, pacs_jax.distributed.put_rows), not here: on a real mesh the
device order, not the process order, decides which rows a process holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import grain

from pacs_jax.data.prompts import PromptExample


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    batch_size: int              # prompts per step over all processes
    seed: int = 0                # shuffle seed, 0 <= seed < 2**32
    shuffle: bool = True
    num_epochs: int | None = 1   # None: repeat forever


def prompt_batches(examples: Sequence[PromptExample], config: PipelineConfig) -> grain.MapDataset:
    """A grain MapDataset whose elements are the global batches: lists of ``batch_size`` examples."""
    if config.batch_size < 1:
        raise ValueError(f"batch_size={config.batch_size}: must be positive")
    if len(examples) < config.batch_size:
        raise ValueError(f"{len(examples)} prompts do not fill one batch of batch_size={config.batch_size}")
    if config.num_epochs is not None and config.num_epochs < 1:
        raise ValueError(f"num_epochs={config.num_epochs}: must be >= 1 or None (forever)")
    if not 0 <= config.seed < 2**32:
        raise ValueError(f"seed={config.seed}: must be in [0, 2**32)")
    dataset = grain.MapDataset.source(list(examples))
    if config.shuffle:
        dataset = dataset.shuffle(seed=config.seed)
    dataset = dataset.batch(config.batch_size, drop_remainder=True, batch_fn=list)
    return dataset.repeat(config.num_epochs)


def prompt_iterator(examples: Sequence[PromptExample], config: PipelineConfig, *,
                    state: dict[str, Any] | None = None) -> grain.DatasetIterator:
    """Iterator over ``prompt_batches``; ``state`` (from ``get_state()``) resumes where that iterator was."""
    iterator = iter(prompt_batches(examples, config).to_iter_dataset())
    if state is not None:
        iterator.set_state(state)
    return iterator
