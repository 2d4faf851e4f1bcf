"""Per-token KL penalty estimators against a reference policy: [B, T] log-probs -> [B, T].

Both estimate KL(pi_theta || pi_ref) from tokens sampled by the policy:
  k1          log pi_theta - log pi_ref                      (unbiased, high variance, can be < 0)
  low_var_kl  exp(d) - d - 1 with d = log pi_ref - log pi_theta   (Schulman's k3: unbiased, >= 0)
low_var_kl clips d to [-20, 20] before the exp and the result to [0, 10], so a single token whose
probability collapsed cannot produce an inf or dominate the loss.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    return logp - ref_logp


def low_var_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    d = jnp.clip(ref_logp - logp, -20.0, 20.0)
    return jnp.clip(jnp.exp(d) - d - 1.0, 0.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": k1,
    "low_var_kl": low_var_kl,
}


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str) -> jax.Array:
    """Per-token KL estimate [B, T] of the kind ``kind`` (see the module docstring)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl_type={kind!r}: expected one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp, ref_logp)
