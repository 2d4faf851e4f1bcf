"""PPO with a critic: the actor's dual-clip policy loss on per-token GAE advantages and the critic's
clipped value loss (verl's ``compute_policy_loss`` and ``compute_value_loss`` in the copy the PACS
authors bundle, src/verl, version 0.3.1.dev).

Shapes: B responses, T response tokens, m = response_mask [B, T] (for the value loss: the critic's
value mask, ``rl.critic.value_mask``).

Policy (per token, A from ``rl.compute_gae``, rho = exp(log pi_theta - log pi_old)), the group
baselines' ``policy_gradient.clipped_policy_loss`` on per-token advantages:
  l = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)),  and where A < 0:  l = min(l, -A c)
Value (per token, V_old the values at rollout time, V the critic's current prediction, R the returns):
  l_v = max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)
  value loss = aggregate(l_v)          (no 1/2: the authors' verl, core_algos.py line 515)
Both reduce with ``policy_gradient.aggregate`` (``loss_agg_mode``, ``norm_length`` and ``loss_scale``).
verl's critic takes its ``loss_agg_mode`` from the actor's (the authors' configs/ppo_trainer.yaml:
``critic.loss_agg_mode: ${actor_rollout_ref.actor.loss_agg_mode}``) and, like its actor, divides each
micro-batch's loss by the gradient accumulation count (``loss_scale="verl"``). Upstream verl
dropped the 1/2 of ``0.5 * masked_mean`` when it gave the critic ``loss_agg_mode`` (commit 9ddc725,
2025-05-23, in v0.4.0) and put it back on 2025-06-14 (commit 6e15bbe, v0.4.1); the authors' copy
lies between the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pacs_jax.rl.batch import BatchTotals
from pacs_jax.rl.policy_gradient import aggregate, clipped_policy_loss, token_mean


def ppo_policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, response_mask: jax.Array, *,
                    clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                    loss_agg_mode: str = "token-mean", loss_scale: str = "mean", verl_micro_batch_size: int = 0,
                    norm_length: int | None = None, totals: BatchTotals | None = None,
                    rollout_is_weights: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The actor's loss, ``policy_gradient.clipped_policy_loss`` on per-token advantages: logp, old_logp,
    advantages, response_mask [B, T] -> (scalar, metrics). rollout_is_weights [B, T]: rollout-correction
    weights multiplying the token losses (None: none).

    advantages are constants (no gradient flows into them). Metrics: the clip fractions of both
    clips and the approximate KL to pi_old, as token means.
    """
    loss, metrics = clipped_policy_loss(logp, old_logp, advantages, response_mask, loss_agg_mode=loss_agg_mode,
                                        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                        clip_ratio_c=clip_ratio_c, norm_length=norm_length, loss_scale=loss_scale,
                                        verl_micro_batch_size=verl_micro_batch_size, totals=totals,
                                        rollout_is_weights=rollout_is_weights)
    return loss, {"ppo/policy_loss": jax.lax.stop_gradient(loss), **{f"ppo/{k}": v for k, v in metrics.items()}}


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, response_mask: jax.Array, *,
               clip_range_value: float = 0.5, loss_agg_mode: str = "token-mean", loss_scale: str = "mean",
               verl_micro_batch_size: int = 0, norm_length: int | None = None, totals: BatchTotals | None = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The critic's clipped loss: values (current predictions), old_values, returns, response_mask [B, T]
    -> (scalar, metrics: value clip fraction, explained variance of the returns by the predictions).

    ``response_mask`` is the mask the loss is taken over; the trainer passes the critic's value mask
    (``rl.critic.value_mask``: the response and the slot after it, as verl's critic). Metrics are
    token means over that mask.
    """
    if not values.shape == old_values.shape == returns.shape == response_mask.shape:
        raise ValueError(f"values, old_values, returns and response_mask must share one [B, T] shape, got "
                         f"{values.shape}, {old_values.shape}, {returns.shape}, {response_mask.shape}")
    if clip_range_value <= 0:
        raise ValueError(f"clip_range_value={clip_range_value} must be > 0")
    values = values.astype(jnp.float32)
    old_values = jax.lax.stop_gradient(old_values.astype(jnp.float32))
    returns = jax.lax.stop_gradient(returns.astype(jnp.float32))
    clipped_values = jnp.clip(values, old_values - clip_range_value, old_values + clip_range_value)
    unclipped_loss, clipped_loss = jnp.square(values - returns), jnp.square(clipped_values - returns)
    loss = aggregate(jnp.maximum(unclipped_loss, clipped_loss), response_mask, loss_agg_mode, norm_length=norm_length,
                     totals=totals, loss_scale=loss_scale, verl_micro_batch_size=verl_micro_batch_size)
    mask = response_mask.astype(jnp.float32)
    residual_variance = token_mean(jnp.square(returns - values - token_mean(returns - values, mask)), mask)
    return_variance = token_mean(jnp.square(returns - token_mean(returns, mask)), mask)
    metrics = {"critic/value_loss": loss,
               "critic/value_clipfrac": token_mean((clipped_loss > unclipped_loss).astype(jnp.float32), mask),
               "critic/explained_variance": 1.0 - residual_variance / jnp.maximum(return_variance, 1e-8)}
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def ppo_objective(logp: jax.Array, old_logp: jax.Array, response_mask: jax.Array, rewards: jax.Array,
                  group_size: int, *, advantages: jax.Array | None = None,
                  totals: BatchTotals | None = None, **options) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The registry's "ppo" objective (pacs_jax.rl.objectives): ``ppo_policy_loss`` on the update
    batch's per-token ``advantages`` [B, T] (``compute_gae`` on the critic's values). The rewards
    already live in the advantages and responses need no groups, so ``rewards`` and ``group_size``
    are not read; no KL term (the paper's PPO has none). Options: see ``ppo_policy_loss``.
    """
    del rewards, group_size
    if advantages is None:
        raise ValueError("objective 'ppo' needs the update batch's 'advantages' [B, T] (rl.compute_gae with the "
                         "critic's values)")
    return ppo_policy_loss(logp, old_logp, advantages, response_mask, totals=totals, **options)
