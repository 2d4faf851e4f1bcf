"""Group advantage estimators: per-response scores [B] -> advantages [B], within prompt groups.

Rows i*n .. i*n+n-1 share a prompt (n = group_size). Every estimator is differentiable: PACS
back-propagates through it (its "scores" are the policy's own reward proxies); the policy-gradient
objectives apply them to constant rewards.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pacs_jax.rl.batch import group_view

GRPO_EPS = 1e-6


def rloo(scores: jax.Array, group_size: int) -> jax.Array:
    """Leave-one-out baseline: a_i = s_i - (1 / (n - 1)) * sum_{j != i, j in group} s_j."""
    g = group_view(scores, group_size)
    others = (jnp.sum(g, axis=1, keepdims=True) - g) / (group_size - 1)
    return (g - others).reshape(scores.shape)


def grpo(scores: jax.Array, group_size: int) -> jax.Array:
    """Group-normalised: a_i = (s_i - mean) / (std + 1e-6), std unbiased (ddof=1) over the group."""
    g = group_view(scores, group_size)
    centred = g - jnp.mean(g, axis=1, keepdims=True)
    std = jnp.std(g, axis=1, keepdims=True, ddof=1)
    return (centred / (std + GRPO_EPS)).reshape(scores.shape)


def group_mean_centred(scores: jax.Array, group_size: int) -> jax.Array:
    """Dr.GRPO: a_i = s_i - mean over the group (no division by the std)."""
    g = group_view(scores, group_size)
    return (g - jnp.mean(g, axis=1, keepdims=True)).reshape(scores.shape)


def naive(scores: jax.Array, group_size: int) -> jax.Array:
    """No baseline: a_i = s_i."""
    del group_size  # the identity needs no group structure
    return scores


AdvantageEstimator = Callable[[jax.Array, int], jax.Array]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "rloo": rloo,
    "grpo": grpo,
    "drgrpo": group_mean_centred,
    "naive": naive,
}


def get_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; ValueError names the choices."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"adv_estimator={name!r}: expected one of {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]
