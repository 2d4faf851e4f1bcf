"""PPO's critic in the trainer (docs/design.md sections 3.5a and 6.6): its state and the two programs it adds to a step.

    programs = StepPrograms(spec, ..., critic=abstract_critic(spec, cfg))   # the critic's programs (critic_programs)
    critic = PPOCritic.from_spec(spec, actor)                 # value model + its AdamW, sharded like the actor
    state, actor_batch, metrics = critic_step(programs.critic, critic.state(), rollout.batch)  # values -> GAE -> update
    params, opt_state, ... = programs.update(params, opt_state, actor_batch)  # objective "ppo" reads its advantages

``step`` runs, on the device and on the update batch's row sharding:
  values     one jitted program per update-batch shape: the critic's values [B, R] of the response
             tokens (``rl.micro_batched_values``, in ``train.logprob_micro_batches`` forward passes,
             times verl's critic mask ``rl.critic.value_mask``: the response and the slot after it),
             then ``rl.compute_gae`` with each response's 0/1 reward on its last token
             (``critic.gamma``, ``critic.lam``): whitened advantages [B, R] and returns [B, R]
  update     ``train.mini_batches`` AdamW steps of the critic (its own optimizer: ``critic.lr``,
             ``critic.grad_clip``) on the clipped value loss (``critic.clip_range_value``, no 1/2, over
             verl's critic mask; aggregated by ``critic.loss_agg_mode``, "actor": the actor's
             ``loss_agg_mode`` and ``norm_length``, as verl's critic inherits them) of the same
             mini-batches as the actor's, ``train.micro_batches`` micro-batches each; parameters and
             optimizer state donated
The critic starts as a copy of the actor's backbone (or of the model at ``critic.path``) with a fresh
scalar head; its parameters and optimizer state are checkpointed with the actor's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax import checkpoints
from pacs_jax.models import Qwen, value_model_from_actor
from pacs_jax.rl import compute_gae, critic_loss_and_grad_fn, last_token_rewards, micro_batched_values, value_mask
from pacs_jax.rl.packing import PackedPlanArrays
from pacs_jax.rl.update_batch import CriticBatch, UpdateBatch
from pacs_jax.sharding import abstract_optimizer_state, batch_sharding, state_shardings
from pacs_jax.training.learner.optim import make_optimizer
from pacs_jax.training.learner.train_state import CriticTrainState
from pacs_jax.training.learner.update_step import MiniBatchUpdates, mini_batch_updates
from pacs_jax.training.model_spec import model_config, run_options
from pacs_jax.training.passes import Passes
from pacs_jax.training.spec import CriticSpec, RunSpec

# The critic update's metrics (MiniBatchUpdates' and rl.value_loss's) -> the names a step reports. The value
# loss is the mini-batch's (the sum of its micro-batches' shares); explained variance and clip fraction
# are the means of their micro-batches'.
METRIC_NAMES = {"loss": "value_loss", "critic/explained_variance": "explained_variance",
                "critic/value_clipfrac": "value_clip_fraction", "grad_norm": "critic_grad_norm",
                "skipped": "critic_skipped"}


class CriticPrograms(NamedTuple):
    """The critic's two jitted programs of a step (``critic_programs``)."""

    values: Callable  # (params, UpdateBatch, packing) -> (advantages, values, returns), each [B, R]
    update: MiniBatchUpdates  # (params, opt_state, CriticBatch) -> (params, opt_state, M metrics dicts)


@dataclasses.dataclass(frozen=True)
class CriticState:
    """What the critic's programs are made from: its graph, its (params, opt_state) (device arrays or
    abstract ``jax.ShapeDtypeStruct``s with shardings) and its AdamW."""

    graphdef: nnx.GraphDef
    state: tuple
    optimizer: object


class PPOCritic:
    """The critic's parameters and AdamW state (device arrays, updated in place by its programs)."""

    def __init__(self, critic: nnx.Module, optimizer):
        self.graphdef, params = nnx.split(critic)
        self.optimizer = optimizer
        # AdamW's moments sharded like the parameters (as the actor's, and as ``abstract_critic`` has them)
        opt_shardings = jax.tree.map(lambda x: x.sharding, abstract_optimizer_state(optimizer, params))
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
        self.shardings = state_shardings((params, opt_state))
        self.params, self.opt_state = jax.device_put((params, opt_state), self.shardings)

    @classmethod
    def from_spec(cls, spec: RunSpec, actor: Qwen) -> PPOCritic:
        """The critic of ``spec.critic``: the actor's backbone (or ``critic.path``'s model, an HF
        directory or pacs_jax checkpoint with the actor's vocabulary) and a head seeded by ``spec.seed``."""
        cc = spec.critic
        source = actor
        if cc.path:
            source = checkpoints.from_pretrained(cc.path, **run_options(spec))
            if source.cfg.vocab_size != actor.cfg.vocab_size:
                raise ValueError(f"config.critic.path: {cc.path} has a vocabulary of {source.cfg.vocab_size} "
                                 f"tokens, the actor {actor.cfg.vocab_size}")
        return cls(value_model_from_actor(source, seed=spec.seed), critic_optimizer(cc))

    def spec(self) -> CriticState:
        return CriticState(self.graphdef, (self.params, self.opt_state), self.optimizer)

    def state(self) -> CriticTrainState:
        """Its parameters and AdamW state, for the run's ``TrainState``."""
        return CriticTrainState(self.params, self.opt_state)

    def step(self, programs: CriticPrograms, batch: UpdateBatch, packing: Passes[PackedPlanArrays] | None = None
             ) -> tuple[UpdateBatch, list[dict[str, jax.Array]]]:
        """``critic_step`` on this critic's state, which it then holds."""
        (self.params, self.opt_state), batch, metrics = critic_step(programs, self.state(), batch, packing)
        return batch, metrics


def critic_step(programs: CriticPrograms, state: CriticTrainState, batch: UpdateBatch,
                packing: Passes[PackedPlanArrays] | None = None
                ) -> tuple[CriticTrainState, UpdateBatch, list[dict[str, jax.Array]]]:
    """Values, GAE and the critic's update on the update ``batch`` (``UpdateBatch`` with rewards;
    dispatched, nothing waits; ``state`` donated). packing: the step's plan arrays (training/records.py
    ``Rollout.packing``: the logprob pass's for the values, the critic pass's for the update) or None.
    Returns the critic's new state, the actor's batch (``batch`` with advantages [B, R]) and the critic's
    metrics, a dict a mini-batch."""
    values_plan, update_plan = (None, None) if packing is None else (packing.logprob, packing.critic)
    advantages, values, returns = programs.values(state.params, batch.replace(packing=None), values_plan)
    critic_batch = CriticBatch(batch.input_ids, batch.attention_mask, batch.response_mask, values, returns,
                               update_plan)
    params, opt_state, metrics = programs.update(state.params, state.opt_state, critic_batch)
    return (CriticTrainState(params, opt_state), batch.replace(advantages=advantages),
            [{name: m[key] for key, name in METRIC_NAMES.items()} for m in metrics])


def abstract_critic(spec: RunSpec, actor_cfg) -> CriticState | None:
    """The critic's state as ``PPOCritic.from_spec`` will make it, abstract (``jax.ShapeDtypeStruct``s with
    the shardings it gets on the mesh in context), known before the critic is made (after the warm-start);
    None without one (objective other than "ppo"). actor_cfg: the actor's QwenConfig; ``critic.path``: that
    model's config instead."""
    from pacs_jax import models
    from pacs_jax.models.value import ValueModel

    cc = spec.critic
    if cc is None:
        return None
    cfg = actor_cfg
    if cc.path:
        cfg = model_config(dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=cc.path, preset="")))
        if cfg is None:
            raise ValueError(f"config.critic.path={cc.path!r}: no config.json / model_config.json to read")
    graphdef, params = models.abstract_model(cfg, cls=ValueModel)
    optimizer = critic_optimizer(cc)
    return CriticState(graphdef, (params, abstract_optimizer_state(optimizer, params)), optimizer)


def critic_optimizer(cc: CriticSpec):
    """The critic's AdamW (``critic``: its own lr, betas, weight decay, grad clip; constant lr)."""
    optimizer, _ = make_optimizer(cc.lr, b1=cc.b1, b2=cc.b2, weight_decay=cc.weight_decay, schedule="constant",
                                  grad_clip=cc.grad_clip)
    return optimizer


def critic_options(spec: RunSpec) -> dict:
    """``critic_programs``' options as ``spec`` asks for them (training/step_programs.py makes them); the
    value loss's aggregation: ``RunSpec.critic_loss_agg``."""
    cc, tc = spec.critic, spec.train
    loss_agg_mode, norm_length = spec.critic_loss_agg
    return dict(gamma=cc.gamma, lam=cc.lam, clip_range_value=cc.clip_range_value, loss_agg_mode=loss_agg_mode,
                norm_length=norm_length, loss_scale=cc.loss_scale,
                verl_micro_batch_size=cc.verl_micro_batch_size, num_mini_batches=tc.mini_batches,
                num_micro_batches=tc.micro_batches)


def critic_programs(graphdef: nnx.GraphDef, optimizer, shardings, *, gamma: float,
                    lam: float, clip_range_value: float, loss_scale: str, verl_micro_batch_size: int,
                    num_mini_batches: int, num_micro_batches: int, values_micro_batches: int,
                    loss_agg_mode: str = "token-mean", norm_length: int | None = None) -> CriticPrograms:
    """The critic's two jitted programs (the module docstring), for real or abstract state:
    ``values(params, batch, packing=None) -> (advantages, values, returns)`` and
    ``update(params, opt_state, critic_batch) -> (params, opt_state, metrics)`` (rl/update_batch.py
    ``UpdateBatch`` and ``CriticBatch``). ``shardings``: the
    (params, opt_state) shardings the update keeps. values_micro_batches: forward passes of the values pass."""
    rows = batch_sharding((0, 0))  # the update batch's rows always divide (the spec)

    def values_and_advantages(params, batch, packing=None):
        """The update batch -> (whitened advantages, values, returns), each [B, R] float32; values times
        verl's critic mask (what verl's compute_values returns: the value loss's old values). packing:
        None or the values pass's plan."""
        mask = batch.response_mask.astype(jnp.float32)
        critic_mask = value_mask(batch.attention_mask, mask.shape[1])
        values = micro_batched_values(nnx.merge(graphdef, params), batch.input_ids, batch.attention_mask,
                                      mask.shape[1], num_micro_batches=values_micro_batches,
                                      packing=packing) * critic_mask
        advantages, returns = compute_gae(last_token_rewards(batch.rewards, mask), values, mask, gamma, lam,
                                          value_mask=critic_mask)
        return advantages, values, returns

    values = jax.jit(values_and_advantages, out_shardings=(rows, rows, rows))
    loss_and_grad = critic_loss_and_grad_fn(graphdef, num_micro_batches=num_micro_batches,
                                            clip_range_value=clip_range_value, loss_agg_mode=loss_agg_mode,
                                            norm_length=norm_length, loss_scale=loss_scale,
                                            verl_micro_batch_size=verl_micro_batch_size)
    update = mini_batch_updates(loss_and_grad, optimizer, num_mini_batches=num_mini_batches,
                                state_shardings=shardings)
    return CriticPrograms(values, update)
