"""The KL loss to a reference model (verl 0.9.1's actor ``use_kl_loss``: core_algos.py ``kl_penalty`` and
workers/utils/losses.py): added to every objective's loss as ``kl_loss_coef`` times the estimator's
aggregate over the response tokens.

    kld = kl_penalty(logp, ref_logp, "low_var_kl")                       # [B, T]
    loss, metrics = with_kl_loss(objective, "low_var_kl", 0.001, agg)     # the objective + coef * agg(kld)

Estimators of KL(pi_theta || pi_ref) per token, d = logp - ref_logp (J. Schulman, "Approximating KL
divergence", 2020): k1 ("kl") d; "abs" |d|; k2 ("mse") d^2 / 2; k3 ("low_var_kl") exp(-d) + d - 1 with
-d clamped to [-20, 20] and the result to [-10, 10]. A "+" suffix (k1+, k3+, ...) keeps the estimator's
value and takes k2's gradient (verl's straight-through). verl 0.9.1's "full" raises NotImplementedError
there: the config refuses it (training/spec.py).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_LOSS_TYPES = KL_TYPES + tuple(f"{t}+" for t in KL_TYPES)


def _forward(d: jax.Array, kind: str) -> jax.Array:
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return jnp.abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    if kind in ("low_var_kl", "k3"):
        kl = jnp.clip(-d, -20.0, 20.0)
        return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)
    raise ValueError(f"kl type {kind!r}: expected one of {KL_LOSS_TYPES}")


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str) -> jax.Array:
    """The per-token estimate of KL(pi_theta || pi_ref): logp, ref_logp [B, T] -> [B, T] float32 (verl's
    ``kl_penalty``, "+" its straight-through form)."""
    d = logp.astype(jnp.float32) - jax.lax.stop_gradient(ref_logp.astype(jnp.float32))
    base = kind[:-1] if kind.endswith("+") else kind
    value = _forward(d, base)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * d * d
    return k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(value)


def with_kl_loss(objective: Callable[..., tuple], kind: str, coef: float,
                 aggregate: Callable[[jax.Array, jax.Array, object], jax.Array]) -> Callable[..., tuple]:
    """``objective`` (a bound objective, rl/objectives.py) with coef x the aggregated KL estimate added to
    its loss; it then takes ``ref_logp`` [B, T] (the reference model's log-probs of the response tokens) and
    reports ``actor/kl_loss`` (the aggregate, as verl names it) and ``actor/kl_coef``. aggregate(kld [B, T],
    response_mask [B, T], totals) -> scalar: the objective's own token aggregation (its loss_agg_mode and
    loss_scale; token-mean for PACS, as verl's actor default)."""

    def objective_with_kl(logp, old_logp, response_mask, rewards, group_size, *, ref_logp, totals=None, **batch):
        loss, metrics = objective(logp, old_logp, response_mask, rewards, group_size, totals=totals, **batch)
        kl_loss = aggregate(kl_penalty(logp, ref_logp, kind), response_mask, totals)
        kl_metrics = {"actor/kl_loss": jax.lax.stop_gradient(kl_loss), "actor/kl_coef": jnp.float32(coef)}
        return loss + coef * kl_loss, {**metrics, **kl_metrics}

    return objective_with_kl
