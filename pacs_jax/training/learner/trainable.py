"""Which of the actor's parameters the learner trains: every one (full fine-tuning) or LoRA's adapters alone.

    trainable = Trainable(adapters_only=spec.model.lora_rank > 0)
    trained, frozen = trainable.split(params)     # frozen None when every parameter trains
    params = trainable.join(trained, frozen)

The optimizer's state, the gradients and the update cover ``trained`` alone; with adapters the base
weights are ``frozen``, held once (the update passes them through, donated: the same buffers), and a
checkpoint holds the adapters alone (training/learner/train_state.py).
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from pacs_jax.models import lora


@dataclasses.dataclass(frozen=True)
class Trainable:
    adapters_only: bool

    def split(self, params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
        """(the trained leaves, the frozen rest or None)."""
        return lora.split(params) if self.adapters_only else (params, None)

    def join(self, trained: nnx.State, frozen: nnx.State | None) -> nnx.State:
        return trained if frozen is None else nnx.merge_state(trained, frozen)

    def of(self, params: nnx.State) -> nnx.State:
        """The trained leaves of ``params``."""
        return self.split(params)[0]
