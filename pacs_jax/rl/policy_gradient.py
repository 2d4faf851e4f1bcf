"""Policy-gradient baselines: GRPO, RLOO and Dr.GRPO on one PPO-clip objective (verl semantics).

Shapes: B responses, n = group_size per prompt (rows i*n .. i*n+n-1 share a prompt), T tokens.

Per token, with ratio rho = exp(log pi_theta - log pi_old) and the response's advantage A:
  l = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))     (PPO clip)
  l = min(l, -A c)  where A < 0                                 (dual clip, c = clip_ratio_c)
``clipped_policy_loss`` is this loss, reduced as below, for advantages [B] (one per response, these
objectives) or [B, T] (one per token: PPO's actor, rl/ppo.py).
Token losses reduce to a scalar by ``loss_agg_mode`` over the response mask m, for one batch of B
responses (verl 0.3.1's ``agg_loss``):
  token-mean               sum_it m l / sum_it m
  seq-mean-token-mean      (1/B) sum_i (sum_t m l / sum_t m)
  seq-mean-token-sum       (1/B) sum_i sum_t m l
  seq-mean-token-sum-norm  sum_it m l / L_max               (L_max: ``norm_length``, default T)
B is every row of the mini-batch, a row the mask empties (padding, a rejection) included: the authors'
verl 0.3.1, and verl 0.9.1's trainer, whose ``agg_loss`` (core_algos.py lines 1140-1206) is given
``global_batch_size`` = the mini-batch's rows (docs/design.md section 6.7, "Which verl a loss follows").
verl 0.9.1 also has (GSPO and CISPO take it)
  token-sum                sum_it m l                       (lines 1176-1180, either loss_scale)
``loss_scale`` says over which batches, so that the gradient (and what ``optim.grad_clip`` clips)
has the scale of a chosen trainer:
  "verl"  as verl 0.3.1's actor without dynamic batch sizes (the paper's baselines): the mini-batch
          of B responses is cut into G = B / S micro-batches of S = ``verl_micro_batch_size``
          responses (verl: ppo_micro_batch_size_per_gpu), each is aggregated alone and the loss is
          their mean (verl divides each micro-batch's loss by the gradient accumulation count, and
          data-parallel ranks average their gradients). "token-mean" is then a mean of per-micro-batch
          token means, and "seq-mean-token-sum-norm" is S times the "mean" value. Which S responses
          share a verl micro-batch is not reproduced (verl balances sequence lengths over ranks);
          here they are consecutive rows of one update micro-batch.
  "mean"  the formulas above over the whole mini-batch, with the (1/B) of a mean over responses in
          "seq-mean-token-sum-norm": the loss does not depend on any micro-batch size.
"seq-mean-token-mean" and "seq-mean-token-sum" are the same under both.

Advantages come from the rewards by a group estimator (pacs_jax.rl.advantages):
  GRPO     (y - mean) / (std + 1e-6), aggregation "seq-mean-token-sum-norm" (docs/design.md section 6.2)
  RLOO     y - mean of the other responses, aggregation "token-mean"
  Dr.GRPO  y - mean, aggregation "seq-mean-token-sum-norm"
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pacs_jax.rl.advantages import get_estimator
from pacs_jax.rl.batch import BatchTotals

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# verl 0.9.1's agg_loss (core_algos.py lines 1170-1204), which GSPO's and CISPO's losses take
VERL091_LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                          "seq-mean-token-sum-norm")
_MAX_LOG_RATIO = 20.0  # |log rho| bound before the exp: no inf ratios from stale log-probs


LOSS_SCALES = ("verl", "mean")


def aggregate(loss_mat: jax.Array, response_mask: jax.Array, mode: str, *, norm_length: int | None = None,
              totals: BatchTotals | None = None, loss_scale: str = "mean",
              verl_micro_batch_size: int = 0) -> jax.Array:
    """Reduce token losses [B, T] to a scalar by ``mode`` and ``loss_scale`` (see the module docstring).

    response_mask: [B, T]. norm_length: L_max of "seq-mean-token-sum-norm" (default T). totals:
    normalisers of the whole mini-batch when this is one micro-batch of it (the losses of its
    micro-batches then add up to the mini-batch's). verl_micro_batch_size: S of ``loss_scale="verl"``;
    it must divide B.
    """
    if mode not in VERL091_LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r}: expected one of {VERL091_LOSS_AGG_MODES}")
    mask = response_mask.astype(jnp.float32)
    token_sum = jnp.sum(loss_mat * mask, axis=-1)  # [B]
    rows = loss_mat.shape[0]
    num_sequences = rows if totals is None else totals.num_sequences
    length = loss_mat.shape[-1] if norm_length is None else norm_length
    if mode == "token-sum":
        return jnp.sum(token_sum)
    if mode == "seq-mean-token-mean":
        return jnp.sum(token_sum / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)) / num_sequences
    if mode == "seq-mean-token-sum":
        return jnp.sum(token_sum) / num_sequences
    if loss_scale == "mean":
        if mode == "token-mean":
            num_tokens = jnp.sum(mask) if totals is None else totals.num_tokens
            return jnp.sum(token_sum) / jnp.maximum(num_tokens, 1.0)
        return jnp.sum(token_sum) / (num_sequences * length)
    _check_verl_micro_batch(verl_micro_batch_size, rows, num_sequences)
    num_verl_micro_batches = num_sequences // verl_micro_batch_size  # G over the whole mini-batch
    if mode == "token-mean":  # (1/G) sum over verl micro-batches of their token means
        blocks = token_sum.reshape(-1, verl_micro_batch_size)
        block_tokens = jnp.sum(mask.reshape(blocks.shape[0], -1), axis=-1)
        return jnp.sum(jnp.sum(blocks, axis=-1) / jnp.maximum(block_tokens, 1.0)) / num_verl_micro_batches
    return jnp.sum(token_sum) / (num_verl_micro_batches * length)  # (1/G) sum_g (sum_it m l) / L_max


def _check_verl_micro_batch(size: int, rows: int, num_sequences: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"loss_scale='verl' needs verl_micro_batch_size >= 1 (algorithm.<objective>."
                         f"verl_micro_batch_size, verl's ppo_micro_batch_size_per_gpu), got {size!r}")
    if rows % size or num_sequences % size:
        raise ValueError(f"verl_micro_batch_size={size} must divide the {rows} responses of an update "
                         f"micro-batch (train.prompts_per_step x rollout.n / train.mini_batches / "
                         f"train.micro_batches) and the {num_sequences} of its mini-batch")


def clipped_token_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, *, clip_ratio_low: float,
                       clip_ratio_high: float, clip_ratio_c: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dual-clip PPO token losses: logp, old_logp [B, T], advantages [B] (one per response) or [B, T]
    (one per token, PPO with GAE) -> (losses, clipped, dual) [B, T].

    ``clipped`` marks tokens where the clipped branch is active, ``dual`` where the dual clip is.
    """
    log_ratio = jnp.clip(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    ppo = jnp.maximum(unclipped, clipped)
    dual = -adv * clip_ratio_c
    losses = jnp.where(adv < 0, jnp.minimum(ppo, dual), ppo)
    return losses, clipped > unclipped, (adv < 0) & (ppo > dual)


def weighted(losses: jax.Array, rollout_is_weights: jax.Array | None) -> jax.Array:
    """Token losses [B, T] times the rollout-correction weights [B, T] (constants), or as they are for None."""
    if rollout_is_weights is None:
        return losses
    if rollout_is_weights.shape != losses.shape:
        raise ValueError(f"rollout_is_weights must be [B, T]={losses.shape}, got {rollout_is_weights.shape}")
    return losses * jax.lax.stop_gradient(rollout_is_weights.astype(jnp.float32))


def token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x [B, T] over the tokens where mask [B, T] is 1 (0 for an empty mask)."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def clipped_policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, response_mask: jax.Array, *,
                        loss_agg_mode: str, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
                        norm_length: int | None, loss_scale: str, verl_micro_batch_size: int,
                        totals: BatchTotals | None, rollout_is_weights: jax.Array | None = None
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The dual-clip PPO policy loss of every policy-gradient objective (group baselines and PPO):
    ``clipped_token_loss`` reduced by ``aggregate`` (see the module docstring).

    logp, old_logp, response_mask: [B, T]; advantages: [B] (one per response, the group objectives)
    or [B, T] (one per token, PPO with GAE), constants (no gradient flows into them).
    rollout_is_weights: [B, T] rollout-correction weights (rl/rollout_correction.py), constants that
    multiply the token losses before the aggregation (verl's); None: none.
    Returns (scalar loss, metrics without gradient: "clipfrac", "clipfrac_dual" and "approx_kl_old",
    token means over the response mask).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c}: the dual clip bound must be > 1")
    if not logp.shape == old_logp.shape == response_mask.shape or advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"logp, old_logp and response_mask must share one [B, T] shape and advantages be [B] or "
                         f"[B, T], got {logp.shape}, {old_logp.shape}, {response_mask.shape} and {advantages.shape}")
    logp, old_logp = logp.astype(jnp.float32), old_logp.astype(jnp.float32)
    advantages = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    losses, clipped, dual = clipped_token_loss(logp, old_logp, advantages, clip_ratio_low=clip_ratio_low,
                                               clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    losses = weighted(losses, rollout_is_weights)
    loss = aggregate(losses, response_mask, loss_agg_mode, norm_length=norm_length, totals=totals,
                     loss_scale=loss_scale, verl_micro_batch_size=verl_micro_batch_size)
    mask = response_mask.astype(jnp.float32)
    metrics = {"clipfrac": token_mean(clipped.astype(jnp.float32), mask),
               "clipfrac_dual": token_mean(dual.astype(jnp.float32), mask),
               "approx_kl_old": token_mean(old_logp - logp, mask)}
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def policy_gradient_loss(logp: jax.Array, old_logp: jax.Array, response_mask: jax.Array, rewards: jax.Array,
                         group_size: int, *, adv_estimator: str, loss_agg_mode: str, clip_ratio_low: float = 0.2,
                         clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0, norm_length: int | None = None,
                         loss_scale: str = "mean", verl_micro_batch_size: int = 0,
                         totals: BatchTotals | None = None, rollout_is_weights: jax.Array | None = None
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO-clip loss (``clipped_policy_loss``) with group advantages [B] from the rewards (see the
    module docstring), unchecked: ``rl.get_objective(name, ...)`` checks the options and the batch
    from the registry (rl/objectives.py).

    logp, old_logp, response_mask: [B, T]; rewards: [B] (any finite values).
    loss_scale, verl_micro_batch_size: the aggregation convention ("verl": verl 0.3.1's micro-batch
    means, over micro-batches of ``verl_micro_batch_size`` responses; "mean": one mean over the
    mini-batch). rollout_is_weights [B, T]: see ``clipped_policy_loss``.
    Returns (scalar loss, metrics: pg loss, clip fractions, approx KL to pi_old, advantage mean/std).
    """
    return group_policy_loss(clipped_policy_loss, logp, old_logp, response_mask, rewards, group_size,
                             adv_estimator=adv_estimator, loss_agg_mode=loss_agg_mode, clip_ratio_low=clip_ratio_low,
                             clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, norm_length=norm_length,
                             loss_scale=loss_scale, verl_micro_batch_size=verl_micro_batch_size, totals=totals,
                             rollout_is_weights=rollout_is_weights)


def group_policy_loss(policy_loss: Callable[..., tuple], logp: jax.Array, old_logp: jax.Array,
                      response_mask: jax.Array, rewards: jax.Array, group_size: int, *, adv_estimator: str,
                      **options) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``policy_loss`` (``clipped_policy_loss``'s arguments: PPO-clip, GSPO's, CISPO's) on the group
    advantages [B] of the rewards [B] by ``adv_estimator``; metrics under "pg/" with the advantages'
    mean and std."""
    advantages = get_estimator(adv_estimator)(rewards.astype(jnp.float32), group_size)  # [B]
    pg_loss, clip_metrics = policy_loss(logp, old_logp, advantages, response_mask, **options)
    metrics = {"pg/loss": pg_loss, **{f"pg/{k}": v for k, v in clip_metrics.items()},
               "pg/advantage_mean": jnp.mean(advantages), "pg/advantage_std": jnp.std(advantages)}
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
