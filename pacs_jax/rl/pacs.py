"""The PACS objective (arXiv 2509.02522; docs/design.md section 6.1): RLVR as binary classification.

Shapes: B responses, n = group_size responses per prompt (rows i*n .. i*n+n-1 share a prompt),
T response tokens.

  reward proxy  r_i = beta * sum_t m_it (log pi_theta(o_it) - log pi_old(o_it))     (method "1")
                r_i = beta * (sum_t m_it log pi_theta(o_it)) / sum_t m_it             (method "2")
  group score   psi = estimator(r) within each group (rloo: r_i - mean_{j != i} r_j), with the
                gradient flowing through every r_j
  loss          L = (1 / B) sum_i w_i [softplus(psi_i) - y_i psi_i]  (BCE with logits, y_i in {0, 1})
  weights       "question": w_i = n / (2 count(y_i in its group)), 1 when a group is all 0 or all 1;
                "only_positive": w = y; "only_negative": w = 1 - y; use_weight=False: w = 1.
  gradient      dL/dpsi_i = w_i (sigmoid(psi_i) - y_i) / B

Deviation from the released code: its reward proxy also sums the log-prob of one padded position
(and method "2" averages over unmasked positions); here both only see response tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pacs_jax.rl.advantages import get_estimator
from pacs_jax.rl.batch import BatchTotals, group_view
from pacs_jax.rl.rollout_correction import response_weights

WEIGHT_MODES = ("question", "only_positive", "only_negative")
REWARD_METHODS = ("1", "2")


def reward_proxy(logp: jax.Array, old_logp: jax.Array, response_mask: jax.Array, *, beta: float,
                 reward_method: str) -> jax.Array:
    """The implicit reward r [B] of each response (see the module docstring)."""
    mask = response_mask.astype(jnp.float32)
    if reward_method == "1":
        return beta * jnp.sum(mask * (logp - old_logp), axis=-1)
    if reward_method == "2":
        length = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
        return beta * jnp.sum(mask * logp, axis=-1) / length
    raise ValueError(f"reward_method={reward_method!r}: expected one of {REWARD_METHODS}")


def class_weights(labels: jax.Array, group_size: int, mode: str) -> jax.Array:
    """Per-response BCE weights w [B] from labels y [B] in {0, 1} (see the module docstring)."""
    if mode == "only_positive":
        return labels
    if mode == "only_negative":
        return 1.0 - labels
    if mode != "question":
        raise ValueError(f"weight_mode={mode!r}: expected one of {WEIGHT_MODES}")
    g = group_view(labels, group_size)  # [B/n, n]
    positives = jnp.sum(g, axis=1, keepdims=True)
    same_label = jnp.where(g > 0.5, positives, group_size - positives)
    mixed = (positives > 0) & (positives < group_size)
    w = jnp.where(mixed, group_size / (2.0 * jnp.maximum(same_label, 1.0)), 1.0)
    return w.reshape(labels.shape)


def pacs_loss(logp: jax.Array, old_logp: jax.Array, response_mask: jax.Array, rewards: jax.Array,
              group_size: int, *, beta: float = 1.0, use_weight: bool = True, weight_mode: str = "question",
              reward_method: str = "1", adv_estimator: str = "rloo", totals: BatchTotals | None = None,
              rollout_is_weights: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PACS loss and metrics, unchecked: ``rl.get_objective("pacs", ...)`` checks the options and the
    batch (group size >= 2, rewards in {0, 1}) from the registry (rl/objectives.py).

    logp, old_logp: [B, T] float log-probs of the response tokens under pi_theta / pi_old;
    response_mask: [B, T] 1 on response tokens; rewards: [B] verifiable rewards in {0, 1}.
    totals: normalisers of the whole mini-batch when this call sees one micro-batch (B of the 1/B
    is then ``totals.num_sequences``). rollout_is_weights: [B, T] rollout-correction weights
    (constants; rl/rollout_correction.py): response i's BCE term is multiplied by their mean over its
    tokens of ``response_mask`` (then the rejection mask), 0 when none is kept (docs/design.md 6.7).

    Returns (scalar loss, metrics): psi mean/std, accuracy of sigmoid(psi) > 0.5 as a predictor of
    the reward, the mean reward proxy, and weight mean/min/max.
    """
    estimator = get_estimator(adv_estimator)
    labels = rewards.astype(jnp.float32)
    r = reward_proxy(logp.astype(jnp.float32), old_logp.astype(jnp.float32), response_mask, beta=beta,
                     reward_method=str(reward_method))
    psi = estimator(r, group_size)
    if use_weight:
        w = class_weights(labels, group_size, weight_mode)
    else:
        w = jnp.ones_like(labels)
    if rollout_is_weights is not None:
        w = w * jax.lax.stop_gradient(response_weights(rollout_is_weights.astype(jnp.float32), response_mask))
    num_sequences = logp.shape[0] if totals is None else totals.num_sequences
    loss = jnp.sum(w * (jax.nn.softplus(psi) - labels * psi)) / num_sequences

    metrics = {
        "pacs/psi_mean": jnp.mean(psi),
        "pacs/psi_std": jnp.std(psi),
        "pacs/accuracy": jnp.mean(((psi > 0) == (labels > 0.5)).astype(jnp.float32)),
        "pacs/reward_proxy_mean": jnp.mean(r),
        "pacs/weight_mean": jnp.mean(w),
        "pacs/weight_min": jnp.min(w),
        "pacs/weight_max": jnp.max(w),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
