"""Which of the actor's parameters a learner program trains: every one (full fine-tuning), LoRA's adapters
alone (RL with LoRA), or every one but the adapters (the warm-start of a LoRA run, which trains its base).

    trainable = Trainable("adapters" if spec.model.lora_rank > 0 else "all")
    trained, frozen = trainable.split(params)     # frozen None when every parameter trains
    params = trainable.join(trained, frozen)

The optimizer's state, the gradients and the update cover ``trained`` alone; the ``frozen`` leaves are held
once (the update passes them through, donated: the same buffers), and a checkpoint of adapters holds the
adapters alone (training/learner/train_state.py). A warm-start of the base ("base") leaves the fresh
adapters as they are (B = 0): the model it trains has the base's logits and gradients, so it is the full-rank
warm-start of a run without adapters (tests/test_train_lora.py: the same weights).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from flax import nnx

from pacs_jax.models import lora


@dataclasses.dataclass(frozen=True)
class Trainable:
    part: Literal["all", "adapters", "base"] = "all"

    def __post_init__(self):
        if self.part not in ("all", "adapters", "base"):
            raise ValueError(f"Trainable part {self.part!r}: one of 'all', 'adapters', 'base'")

    @property
    def adapters_only(self) -> bool:
        """Whether the trained leaves are LoRA's adapters alone (the base frozen)."""
        return self.part == "adapters"

    def split(self, params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
        """(the trained leaves, the frozen rest or None)."""
        if self.part == "all":
            return params, None
        adapters, base = lora.split(params)
        return (adapters, base) if self.part == "adapters" else (base, adapters)

    def join(self, trained: nnx.State, frozen: nnx.State | None) -> nnx.State:
        return trained if frozen is None else nnx.merge_state(trained, frozen)

    def of(self, params: nnx.State) -> nnx.State:
        """The trained leaves of ``params``."""
        return self.split(params)[0]
