"""verl's bypass mode of the rollout correction (docs/design.md section 6.7): the sampler's log-probs
stand for pi_old (no pi_old pass), and the correction is taken inside the loss, between pi_theta
(without gradient) and the sampler, as verl's ``compute_policy_loss_bypass_mode``.

Shapes: B responses, T response tokens; ``old_logp`` of the update batch is the sampler's log-probs.
In each (micro-)batch the loss sees, ``rl.correction_and_rejection_mask(sg[log pi_theta], log pi_rollout,
m)`` gives weights w and the rejection mask m', which replaces m; then by ``loss_type``:
  "ppo_clip"   the objective itself with pi_old = pi_rollout over m' (its ratio already is
               pi_theta / pi_rollout: w is not applied, as verl: it would count the ratio twice)
  "reinforce"  l_t = -A w_t log pi_theta(o_t) over m' (w = 1 without ``rollout_is``), aggregated as the
               objective's loss (``loss_agg_mode`` and ``loss_scale``), A the objective's advantages
               (its group estimator; PPO: the batch's per-token GAE advantages)
The mini-batch's normalisers (``BatchTotals``: token-mean's token count) are taken before the loss, so
they count the rejected tokens too, as verl's global batch info does in bypass mode. The correction's
``rollout_corr/`` metrics join the loss's. Its statistics are those of the batch the
loss sees (a micro-batch, or a packed pass's rows): verl's bypass computes them per micro-batch too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pacs_jax.rl.batch import BatchTotals, check_batch
from pacs_jax.rl.objectives import get_objective, objective_spec
from pacs_jax.rl.policy_gradient import aggregate, group_policy_loss, token_mean, weighted
from pacs_jax.rl.rollout_correction import BYPASS_LOSS_TYPES, correction_and_rejection_mask

# The group estimator of each objective's advantages, for loss_type "reinforce" ("ppo": GAE's, per token).
REINFORCE_ESTIMATORS = {"grpo": "grpo", "rloo": "rloo", "drgrpo": "drgrpo", "gspo": "grpo", "cispo": "grpo"}
_AGGREGATION = ("loss_agg_mode", "loss_scale", "verl_micro_batch_size", "norm_length")


@dataclasses.dataclass(frozen=True)
class Bypass:
    """Bypass mode's settings: ``loss_type`` ("ppo_clip" | "reinforce") and the keywords of
    ``rl.correction_and_rejection_mask`` (``RolloutCorrectionSpec.options()``)."""

    loss_type: str
    correction: dict[str, Any]

    def __post_init__(self):
        if self.loss_type not in BYPASS_LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: expected one of {BYPASS_LOSS_TYPES}")


def reinforce_policy_loss(logp: jax.Array, rollout_logp: jax.Array, advantages: jax.Array, response_mask: jax.Array, *,
                          loss_agg_mode: str = "seq-mean-token-sum", loss_scale: str = "mean",
                          verl_micro_batch_size: int = 0, norm_length: int | None = None,
                          totals: BatchTotals | None = None, rollout_is_weights: jax.Array | None = None
                          ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """verl's ``compute_policy_loss_reinforce``: logp, rollout_logp, response_mask [B, T], advantages [B]
    or [B, T] (constants), rollout_is_weights [B, T] or None -> (scalar, metrics: "approx_kl_old", the
    token mean of log pi_rollout - log pi_theta)."""
    logp = logp.astype(jnp.float32)
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    adv = adv[:, None] if adv.ndim == 1 else adv
    losses = weighted(-adv * logp, rollout_is_weights)
    loss = aggregate(losses, response_mask, loss_agg_mode, norm_length=norm_length, totals=totals,
                     loss_scale=loss_scale, verl_micro_batch_size=verl_micro_batch_size)
    kl = token_mean(rollout_logp.astype(jnp.float32) - logp, response_mask.astype(jnp.float32))
    return loss, {"approx_kl_old": jax.lax.stop_gradient(kl)}


def bypass_objective(name: str, bypass: Bypass, **options) -> Callable[..., tuple]:
    """The objective ``name`` (with ``options``) in bypass mode: called as a bound objective of
    rl/objectives.py, its ``old_logp`` the sampler's log-probs; see the module docstring."""
    if bypass.loss_type == "reinforce" and name not in (*REINFORCE_ESTIMATORS, "ppo"):
        raise ValueError(f"bypass loss_type 'reinforce' takes a policy-gradient objective "
                         f"({sorted(REINFORCE_ESTIMATORS) + ['ppo']}), not {name!r}")
    base, spec = get_objective(name, **options), objective_spec(name)
    aggregation = {k: v for k, v in {**spec.defaults, **options}.items() if k in _AGGREGATION}

    def objective(logp, rollout_logp, response_mask, rewards, group_size: int, *, totals=None, advantages=None,
                  rollout_is_weights=None):
        del rollout_is_weights  # bypass mode takes its own, from pi_theta
        weights, kept, metrics = correction_and_rejection_mask(jax.lax.stop_gradient(logp), rollout_logp,
                                                               response_mask, **bypass.correction)
        if bypass.loss_type == "ppo_clip":
            loss, loss_metrics = base(logp, rollout_logp, kept, rewards, group_size, totals=totals,
                                      advantages=advantages)
        elif name == "ppo":
            loss, pg = reinforce_policy_loss(logp, rollout_logp, advantages, kept, totals=totals,
                                             rollout_is_weights=weights, **aggregation)
            loss_metrics = {"ppo/policy_loss": jax.lax.stop_gradient(loss), "ppo/approx_kl_old": pg["approx_kl_old"]}
        else:
            check_batch(logp, rollout_logp, kept, rewards, group_size, min_group_size=spec.min_group_size,
                        binary_rewards=spec.binary_rewards)
            loss, loss_metrics = group_policy_loss(reinforce_policy_loss, logp, rollout_logp, kept, rewards, group_size,
                                                   adv_estimator=REINFORCE_ESTIMATORS[name], totals=totals,
                                                   rollout_is_weights=weights, **aggregation)
        return loss, {**loss_metrics, **metrics}

    return objective
