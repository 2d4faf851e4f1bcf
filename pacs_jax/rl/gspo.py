"""GSPO (arXiv 2507.18071): PPO-clip on a sequence-level importance ratio, as verl's
``compute_policy_loss_gspo`` (docs/design.md section 6.8).

Shapes: B responses, T response tokens, m = response_mask [B, T], A the advantages ([B] or [B, T]).
Per response, the length-normalised log-ratio  s_i = sum_t m_it (log pi_theta - log pi_old) / max(sum_t m_it, 1);
per token, the ratio whose value is exp(s_i) and whose gradient is that of exp(s_i) through the token's
own log-prob only:
  log rho_it = log pi_theta(o_it) - sg[log pi_theta(o_it)] + sg[s_i],   clamped above at 10
  l_it = max(-A rho_it, -A clip(rho_it, 1 - eps_low, 1 + eps_high))    (no dual clip)
times the rollout-correction weights (if any), reduced by ``loss_agg_mode`` (default "seq-mean-token-mean",
the GSPO paper's; any of verl 0.9.1's ``agg_loss`` modes; rl/policy_gradient.py ``aggregate``): a seq-mean
divides by every row of the mini-batch, as verl 0.9.1's trainer, which gives ``agg_loss`` its
``global_batch_size`` (docs/design.md section 6.7, "Which verl a loss follows").
This is verl 0.9.1's ``compute_policy_loss_gspo`` (verl/trainer/ppo/core_algos.py lines 1545-1618: the
ratio lines 1578-1593, the clip lines 1595-1597, the weights lines 1600-1601, ``agg_loss`` lines 1605-1607;
its ``ppo_kl``, our "approx_kl_old", the unclamped log-ratio's token mean, line 1613).
GSPO's clip range is far narrower than PPO's: the registry's defaults are the paper's and verl's
recipe's 3e-4 / 4e-4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pacs_jax.rl.batch import BatchTotals
from pacs_jax.rl.policy_gradient import VERL091_LOSS_AGG_MODES, aggregate, group_policy_loss, token_mean, weighted

_MAX_LOG_RATIO = 10.0  # verl's clamp of the sequence log-ratio before the exp (above only)


def gspo_policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, response_mask: jax.Array, *,
                     clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4, clip_ratio_c: float = 3.0,
                     loss_agg_mode: str = "seq-mean-token-mean", loss_scale: str = "mean",
                     verl_micro_batch_size: int = 0, norm_length: int | None = None,
                     totals: BatchTotals | None = None, rollout_is_weights: jax.Array | None = None
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO's policy loss (module docstring): logp, old_logp, response_mask [B, T], advantages [B] or
    [B, T] (constants), rollout_is_weights [B, T] or None -> (scalar, metrics: "clipfrac",
    "approx_kl_old", token means). ``rl.ppo_policy_loss``'s keywords: clip_ratio_c is not read (GSPO
    has no dual clip), and loss_agg_mode is one of verl 0.9.1's (``VERL091_LOSS_AGG_MODES``)."""
    if loss_agg_mode not in VERL091_LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r}: GSPO takes one of {VERL091_LOSS_AGG_MODES} (verl 0.9.1's)")
    del clip_ratio_c
    logp, old_logp = logp.astype(jnp.float32), old_logp.astype(jnp.float32)
    mask = response_mask.astype(jnp.float32)
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    adv = adv[:, None] if adv.ndim == 1 else adv
    seq_log_ratio = jnp.sum((logp - old_logp) * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)  # [B]
    log_ratio = logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq_log_ratio)[:, None]
    ratio = jnp.exp(jnp.minimum(log_ratio, _MAX_LOG_RATIO))
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = weighted(jnp.maximum(unclipped, clipped), rollout_is_weights)
    loss = aggregate(losses, response_mask, loss_agg_mode, norm_length=norm_length, totals=totals,
                     loss_scale=loss_scale, verl_micro_batch_size=verl_micro_batch_size)
    metrics = {"clipfrac": token_mean((clipped > unclipped).astype(jnp.float32), mask),
               "approx_kl_old": token_mean(old_logp - logp, mask)}
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def gspo_loss(logp, old_logp, response_mask, rewards, group_size, **options):
    """The registry's "gspo": ``gspo_policy_loss`` (its options) on GRPO's group advantages of the
    rewards [B], as the GSPO paper. Unchecked: ``rl.get_objective`` checks the options and the batch."""
    return group_policy_loss(gspo_policy_loss, logp, old_logp, response_mask, rewards, group_size,
                             adv_estimator="grpo", **options)
