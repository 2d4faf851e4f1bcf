"""CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by a clipped, stop-gradient importance
ratio, as verl's ``compute_policy_loss_cispo`` (docs/design.md section 6.8).

Shapes: B responses, T response tokens, A the advantages ([B] or [B, T]). Per token, with
rho = exp(clip(log pi_theta - log pi_old, -20, 20)):
  l_t = -sg[clip(rho, 1 - eps_low, 1 + eps_high)] A log pi_theta(o_t)
so every token keeps a gradient (PPO's clip drops the clipped tokens' gradients; CISPO only bounds
their weight). The defaults are verl's examples/cispo_trainer and MiniMax-M1's: no lower bound
(eps_low 10), eps_high 0.2. Then times the rollout-correction weights (if any), reduced by ``loss_agg_mode`` (any
of verl 0.9.1's ``agg_loss`` modes) and ``loss_scale`` as the other policy-gradient losses (rl/policy_gradient.py
``aggregate``: a seq-mean divides by every row of the mini-batch, as verl 0.9.1's trainer).
This is verl 0.9.1's ``compute_policy_loss_cispo`` (verl/trainer/ppo/core_algos.py lines 2047-2105: the ratio
lines 2069-2072, the clipped weight and loss lines 2079-2084, the weights lines 2090-2091, ``agg_loss`` lines
2093-2095; its ``ppo_kl``, our "approx_kl_old", the token mean of minus the log-ratio clamped to +-20, lines
2071-2073).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pacs_jax.rl.batch import BatchTotals
from pacs_jax.rl.policy_gradient import VERL091_LOSS_AGG_MODES, aggregate, group_policy_loss, token_mean, weighted

_MAX_LOG_RATIO = 20.0  # verl's clamp before the exp


def cispo_policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, response_mask: jax.Array, *,
                      clip_ratio_low: float = 10.0, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                      loss_agg_mode: str = "token-mean", loss_scale: str = "mean", verl_micro_batch_size: int = 0,
                      norm_length: int | None = None, totals: BatchTotals | None = None,
                      rollout_is_weights: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO's policy loss (module docstring): logp, old_logp, response_mask [B, T], advantages [B] or
    [B, T] (constants), rollout_is_weights [B, T] or None -> (scalar, metrics: "clipfrac" (tokens whose
    ratio was clipped), "approx_kl_old", token means). ``rl.ppo_policy_loss``'s keywords;
    clip_ratio_c is not read (no dual clip); loss_agg_mode is one of ``VERL091_LOSS_AGG_MODES``."""
    if loss_agg_mode not in VERL091_LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r}: CISPO takes one of {VERL091_LOSS_AGG_MODES} (verl 0.9.1's)")
    del clip_ratio_c
    logp, old_logp = logp.astype(jnp.float32), old_logp.astype(jnp.float32)
    mask = response_mask.astype(jnp.float32)
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    adv = adv[:, None] if adv.ndim == 1 else adv
    log_ratio = jnp.clip(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = weighted(-jax.lax.stop_gradient(clipped_ratio) * adv * logp, rollout_is_weights)
    loss = aggregate(losses, response_mask, loss_agg_mode, norm_length=norm_length, totals=totals,
                     loss_scale=loss_scale, verl_micro_batch_size=verl_micro_batch_size)
    metrics = {"clipfrac": token_mean((ratio != clipped_ratio).astype(jnp.float32), mask),
               "approx_kl_old": token_mean(-log_ratio, mask)}
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def cispo_loss(logp, old_logp, response_mask, rewards, group_size, **options):
    """The registry's "cispo": ``cispo_policy_loss`` (its options) on GRPO's group advantages of the
    rewards [B], as MiniMax-M1. Unchecked: ``rl.get_objective`` checks the options and the batch."""
    return group_policy_loss(cispo_policy_loss, logp, old_logp, response_mask, rewards, group_size,
                             adv_estimator="grpo", **options)
