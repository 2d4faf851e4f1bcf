"""The jitted optimizer steps of one training step: per mini-batch, loss and gradient, AdamW, non-finite skip.

Gradients are clipped at the global norm ``optim.grad_clip`` when it is > 0 (the optimizer's own
transformation, training/learner/optim.py; the paper's PACS runs use 0, the demo 1.0: docs/design.md section
6.4). A non-finite gradient norm skips the update (parameters and optimizer state unchanged) and is
reported in the metrics as ``skipped = 1``.
Parameters and optimizer state are donated: the update happens in place on the device. The
``num_mini_batches`` optimizer steps of a training step are one program dispatched once per
mini-batch (``MiniBatchUpdates``): the host enqueues all of them at once (nothing waits between two),
and each call's metrics, ready when its mini-batch is done, tell the trainer how far the update is
(training/progress.py). The actor's update (``make_update_step``) and PPO's critic update
(training/learner/critic_step.py) are both ``MiniBatchUpdates``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pacs_jax.rl import loss_and_grad_fn
from pacs_jax.rl.bypass import Bypass
from pacs_jax.rl.loss_and_grad import KLLoss
from pacs_jax.rl.update_batch import CriticBatch, UpdateBatch
from pacs_jax.sharding import constrain
from pacs_jax.training.learner.trainable import Trainable


@dataclasses.dataclass(frozen=True)
class MiniBatchUpdates:
    """``(params, opt_state, batch) -> (params, opt_state, metrics)``: ``num_mini_batches`` optimizer
    steps, mini-batch k being rows k * B / M .. (k + 1) * B / M - 1 of every [B, ...] array of the batch
    (rl/update_batch.py ``UpdateBatch`` or ``CriticBatch``; of a packing plan's pack_index
    [M S K N, Lp]: its k-th M-th), as M dispatches of ``program``.
    metrics: M dicts, one a mini-batch, each of [] arrays (loss_and_grad's metrics plus loss, grad_norm
    and skipped 0/1), computed when that mini-batch's step is.

    program: jitted ``(params, opt_state, batch, k) -> (params, opt_state, metrics)``, mini-batch k (an
    int32 [] array: one program for every k); params and opt_state donated.
    """

    program: Callable
    num_mini_batches: int

    def __call__(self, params, opt_state, batch: UpdateBatch | CriticBatch) -> tuple[Any, Any, list[dict]]:
        rows = batch.response_mask.shape[0]
        if rows % self.num_mini_batches:
            raise ValueError(f"num_mini_batches={self.num_mini_batches} does not divide the batch of {rows} rows")
        metrics = []
        for k in range(self.num_mini_batches):
            params, opt_state, mini = self.program(params, opt_state, batch, np.int32(k))
            metrics.append(mini)
        return params, opt_state, metrics

    def lower(self, params, opt_state, batch: UpdateBatch | CriticBatch) -> jax.stages.Lowered:
        """The one program of every mini-batch, lowered on (abstract) arguments."""
        return self.program.lower(params, opt_state, batch, jax.ShapeDtypeStruct((), jnp.int32))


def mini_batch_updates(loss_and_grad: Callable, optimizer: optax.GradientTransformation, *,
                       num_mini_batches: int = 1, state_shardings: tuple | None = None,
                       trainable: Trainable = Trainable(adapters_only=False)) -> MiniBatchUpdates:
    """The ``MiniBatchUpdates`` of ``loss_and_grad``: pure ``(params, mini-batch[, frozen]) -> (loss, metrics,
    float32 grads)``, and ``optimizer`` (its state over ``trainable``'s trained leaves alone: LoRA's
    adapters, or every parameter). state_shardings: (params, opt_state) shardings the outputs keep
    (default: chosen by XLA); pinning them keeps every later call on the same compiled program.
    """
    M = num_mini_batches

    def step(params, opt_state, batch, k):
        mini = jax.tree.map(lambda v: constrain(v.reshape(M, v.shape[0] // M, *v.shape[1:]),
                                                (None, "batch") + (None,) * (v.ndim - 1))[k], batch)
        trained, frozen = trainable.split(params)
        loss, metrics, grads = loss_and_grad(trained, mini, *(() if frozen is None else (frozen,)))
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trained)
        updates, new_opt_state = optimizer.update(grads, opt_state, trained)
        new_trained = optax.apply_updates(trained, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm, skipped=1.0 - finite.astype(jnp.float32))
        return trainable.join(keep(new_trained, trained), frozen), keep(new_opt_state, opt_state), metrics

    out_shardings = None if state_shardings is None else (*state_shardings, None)
    return MiniBatchUpdates(jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings), M)


def make_update_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, objective: str, *,
                     group_size: int, objective_options: Mapping[str, Any] | None = None,
                     num_mini_batches: int = 1, num_micro_batches: int = 1, temperature: float = 1.0,
                     chunk_size: int | None = None,
                     state_shardings: tuple | None = None, bypass: Bypass | None = None, kl: KLLoss | None = None,
                     trainable: Trainable = Trainable(adapters_only=False),
                     router_aux_loss_coef: float = 0.0) -> MiniBatchUpdates:
    """The actor's update: the ``MiniBatchUpdates`` of ``rl.loss_and_grad_fn`` (``objective``),
    ``(params, opt_state, batch) -> (params, opt_state, M mini-batches' metrics)``.

    batch: rl/update_batch.py ``UpdateBatch`` (objective "ppo": with advantages) holding whole groups of
    ``group_size``. bypass: the rollout correction's bypass mode (rl/bypass.py; old_logp
    are then the sampler's). kl: the KL loss (rl/kl.py; the batch then holds ref_logp). trainable: the
    parameters it trains (LoRA: the adapters alone). router_aux_loss_coef: a mixture-of-experts model's
    load-balancing loss's weight (``rl.loss_and_grad_fn``).
    """
    extra = {} if chunk_size is None else {"chunk_size": chunk_size}
    loss_and_grad = loss_and_grad_fn(graphdef, objective, group_size=group_size,
                                     objective_options=objective_options, num_micro_batches=num_micro_batches,
                                     temperature=temperature, bypass=bypass, kl=kl,
                                     router_aux_loss_coef=router_aux_loss_coef, **extra)
    return mini_batch_updates(loss_and_grad, optimizer, num_mini_batches=num_mini_batches,
                              state_shardings=state_shardings, trainable=trainable)
