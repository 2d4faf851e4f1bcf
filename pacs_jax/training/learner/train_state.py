"""The learner's training state: the actor's parameters, its AdamW state and PPO's critic's, one record.

    state = TrainState(params, opt_state, critic=CriticTrainState(critic_params, critic_opt_state) or None)
    save(checkpointer, step, state, meta, force=...)          # the checkpoint's items as before (checkpoints.py)
    restored = restore_latest(checkpointer, state, warn=...)  # (step, state, meta) or None

A checkpoint holds ``params``, ``opt_state`` and, for PPO, ``critic_params`` and ``critic_opt_state``
(checkpoints.py ``TrainCheckpointer``): the record is saved and restored as those items, so checkpoints
written before it existed restore. With LoRA (``Trainable.adapters_only``) ``params`` is the adapters
alone: the base weights are the run's model.path, restored by loading it, and never written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from flax import nnx

from pacs_jax.checkpoints import TrainCheckpointer
from pacs_jax.training.learner.trainable import Trainable


class CriticTrainState(NamedTuple):
    """PPO's critic: its parameters and AdamW state (device arrays)."""

    params: nnx.State
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class TrainState:
    """The actor's ``params`` (nnx.State) and ``opt_state`` (AdamW's), and PPO's ``critic`` (None otherwise);
    the update donates them, so a state is used once."""

    params: nnx.State
    opt_state: Any
    critic: CriticTrainState | None = None

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class RestoredState:
    """A checkpoint restored: its step, the state (in the template's shardings) and its meta (JSON)."""

    step: int
    state: TrainState
    meta: dict


def save(checkpointer: TrainCheckpointer, step: int, state: TrainState, meta: dict | Callable[[], dict], *,
         force: bool = False, trainable: Trainable = Trainable(adapters_only=False)) -> bool:
    """``checkpointer.save`` of ``state`` at ``step``, its parameters ``trainable``'s trained leaves (LoRA: the
    adapters); returns whether it saved (meta: as there)."""
    return checkpointer.save(step, trainable.of(state.params), state.opt_state, meta, force=force,
                             critic=None if state.critic is None else tuple(state.critic))


def restore_latest(checkpointer: TrainCheckpointer, template: TrainState, *, warn,
                   trainable: Trainable = Trainable(adapters_only=False)) -> RestoredState | None:
    """The newest intact checkpoint (``checkpointer.restore_latest``) restored into ``template``'s shardings,
    or None without one; with LoRA its adapters join ``template``'s base weights."""
    trained, frozen = trainable.split(template.params)
    restored = checkpointer.restore_latest(trained, template.opt_state,
                                           None if template.critic is None else tuple(template.critic), warn=warn)
    if restored is None:
        return None
    critic = None if restored.critic is None else CriticTrainState(*restored.critic)
    params = trainable.join(restored.params, frozen)
    return RestoredState(restored.step, TrainState(params, restored.opt_state, critic), restored.meta)
