"""Policy-gradient baselines: GRPO, RLOO and Dr.GRPO on one PPO-clip objective (verl semantics).

Shapes: B responses, n = group_size per prompt (rows i*n .. i*n+n-1 share a prompt), T tokens.

Per token, with ratio rho = exp(log pi_theta - log pi_old) and the response's advantage A:
  l = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))     (PPO clip)
  l = min(l, -A c)  where A < 0                                 (dual clip, c = clip_ratio_c)
Token losses reduce to a scalar by ``loss_agg_mode`` over the response mask m:
  token-mean               sum_it m l / sum_it m
  seq-mean-token-mean      (1/B) sum_i (sum_t m l / sum_t m)
  seq-mean-token-sum       (1/B) sum_i sum_t m l
  seq-mean-token-sum-norm  (1/B) sum_i sum_t m l / L_max   (L_max: max response length, Dr.GRPO)
(verl's "seq-mean-token-sum-norm" leaves the 1/B to its gradient-accumulation scaling, which makes
the loss scale depend on the micro-batch size; here it is a true mean over the responses.)

Advantages come from the rewards by a group estimator (pacs_jax.rl.advantages):
  GRPO     (y - mean) / (std + 1e-6), aggregation "seq-mean-token-sum-norm" (docs/design.md section 6.2)
  RLOO     y - mean of the other responses, aggregation "token-mean"
  Dr.GRPO  y - mean, aggregation "seq-mean-token-sum-norm"
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pacs_jax.rl.advantages import get_estimator
from pacs_jax.rl.batch import BatchTotals

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_MAX_LOG_RATIO = 20.0  # |log rho| bound before the exp: no inf ratios from stale log-probs


def aggregate(loss_mat: jax.Array, response_mask: jax.Array, mode: str, *, norm_length: int | None = None,
              totals: BatchTotals | None = None) -> jax.Array:
    """Reduce token losses [B, T] to a scalar by ``mode`` (see the module docstring).

    norm_length: L_max of "seq-mean-token-sum-norm" (default T). totals: normalisers of the whole
    mini-batch when this is one micro-batch of it.
    """
    mask = response_mask.astype(jnp.float32)
    token_sum = jnp.sum(loss_mat * mask, axis=-1)  # [B]
    num_sequences = loss_mat.shape[0] if totals is None else totals.num_sequences
    if mode == "token-mean":
        num_tokens = jnp.sum(mask) if totals is None else totals.num_tokens
        return jnp.sum(token_sum) / jnp.maximum(num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        return jnp.sum(token_sum / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)) / num_sequences
    if mode == "seq-mean-token-sum":
        return jnp.sum(token_sum) / num_sequences
    if mode == "seq-mean-token-sum-norm":
        length = loss_mat.shape[-1] if norm_length is None else norm_length
        return jnp.sum(token_sum) / (num_sequences * length)
    raise ValueError(f"loss_agg_mode={mode!r}: expected one of {LOSS_AGG_MODES}")


def clipped_token_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, *, clip_ratio_low: float,
                       clip_ratio_high: float, clip_ratio_c: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dual-clip PPO token losses: logp, old_logp [B, T], advantages [B] -> (losses, clipped, dual) [B, T].

    ``clipped`` marks tokens where the clipped branch is active, ``dual`` where the dual clip is.
    """
    log_ratio = jnp.clip(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    ppo = jnp.maximum(unclipped, clipped)
    dual = -adv * clip_ratio_c
    losses = jnp.where(adv < 0, jnp.minimum(ppo, dual), ppo)
    return losses, clipped > unclipped, (adv < 0) & (ppo > dual)


def policy_gradient_loss(logp: jax.Array, old_logp: jax.Array, response_mask: jax.Array, rewards: jax.Array,
                         group_size: int, *, adv_estimator: str, loss_agg_mode: str, clip_ratio_low: float = 0.2,
                         clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0, norm_length: int | None = None,
                         totals: BatchTotals | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO-clip loss with group advantages from the rewards (see the module docstring), unchecked:
    ``rl.get_objective(name, ...)`` checks the options and the batch from the registry (rl/objectives.py).

    logp, old_logp, response_mask: [B, T]; rewards: [B] (any finite values).
    Returns (scalar loss, metrics: pg loss, clip fractions, approx KL to pi_old, advantage mean/std).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c}: the dual clip bound must be > 1")
    estimator = get_estimator(adv_estimator)

    logp, old_logp = logp.astype(jnp.float32), old_logp.astype(jnp.float32)
    advantages = jax.lax.stop_gradient(estimator(rewards.astype(jnp.float32), group_size))
    losses, clipped, dual = clipped_token_loss(logp, old_logp, advantages, clip_ratio_low=clip_ratio_low,
                                               clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    agg = dict(norm_length=norm_length, totals=totals)
    pg_loss = aggregate(losses, response_mask, loss_agg_mode, **agg)
    mask = response_mask.astype(jnp.float32)
    token_mean = lambda x: jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)  # noqa: E731
    metrics = {
        "pg/loss": pg_loss,
        "pg/clipfrac": token_mean(clipped.astype(jnp.float32)),
        "pg/clipfrac_dual": token_mean(dual.astype(jnp.float32)),
        "pg/approx_kl_old": token_mean(old_logp - logp),
        "pg/advantage_mean": jnp.mean(advantages),
        "pg/advantage_std": jnp.std(advantages),
    }
    return pg_loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def grpo_loss(logp, old_logp, response_mask, rewards, group_size, *,
              loss_agg_mode: str = "seq-mean-token-sum-norm", **options):
    """GRPO: group-normalised advantages (unbiased std + 1e-6). Options: see policy_gradient_loss."""
    return policy_gradient_loss(logp, old_logp, response_mask, rewards, group_size, adv_estimator="grpo",
                                loss_agg_mode=loss_agg_mode, **options)


def rloo_loss(logp, old_logp, response_mask, rewards, group_size, *, loss_agg_mode: str = "token-mean",
              **options):
    """RLOO: leave-one-out baseline advantages. Options: see policy_gradient_loss."""
    return policy_gradient_loss(logp, old_logp, response_mask, rewards, group_size, adv_estimator="rloo",
                                loss_agg_mode=loss_agg_mode, **options)


def drgrpo_loss(logp, old_logp, response_mask, rewards, group_size, *,
                loss_agg_mode: str = "seq-mean-token-sum-norm", **options):
    """Dr.GRPO: mean-centred advantages (no std), token sums over a constant length. See policy_gradient_loss."""
    return policy_gradient_loss(logp, old_logp, response_mask, rewards, group_size, adv_estimator="drgrpo",
                                loss_agg_mode=loss_agg_mode, **options)
