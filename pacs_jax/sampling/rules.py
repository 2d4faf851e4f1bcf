"""Token selection rules: greedy, temperature, top-k, top-p (nucleus).

The returned log-prob of a token is always taken from the full-vocabulary distribution
log_softmax(logits / T), before top-k / top-p restriction: that is the distribution the trainer
recomputes with its own forward pass. For greedy decoding (T = 0) the log-prob is log_softmax(logits),
i.e. T is treated as 1, so a greedy rollout reports the policy's own probability of its argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def restrict_to_top(scaled: jax.Array, top_k: int, top_p: jax.Array | None) -> jax.Array:
    """Set logits outside the top-k / top-p set to -inf: [B, V] -> [B, V] (float32).

    top_k = 0 disables top-k; top_p = None disables top-p. As in Hugging Face, top-k applies first,
    and top-p keeps the smallest set of the highest-probability survivors whose mass (renormalised
    over the survivors) reaches top_p; the most likely token is always kept. Ties with the last kept
    logit are kept too.
    """
    if top_k == 0 and top_p is None:
        return scaled
    values, _ = jax.lax.top_k(scaled, top_k or scaled.shape[-1])  # [B, k], descending
    threshold = values[:, -1]
    if top_p is not None:
        probs = jax.nn.softmax(values, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.sum(mass_before < top_p, axis=-1)  # >= 1: the first token has mass_before 0
        threshold = jnp.take_along_axis(values, (kept - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def select_tokens(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array, *,
                  top_k: int) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row: logits [B, V] float32 -> (tokens [B] int32, log-probs [B] float32).

    ``temperature`` (0 = greedy) and ``top_p`` (1 = off) are traced scalars that choose a branch at
    run time (``lax.cond``: only the taken branch runs), so greedy evaluation and sampled training
    rollouts share one compiled program. ``top_k`` is static (it is a shape).
    """
    logits = logits.astype(jnp.float32)

    def greedy():
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens, jax.nn.log_softmax(logits, axis=-1)

    def sample():
        scaled = logits / temperature
        allowed = jax.lax.cond(top_p < 1.0, lambda: restrict_to_top(scaled, top_k, top_p),
                               lambda: restrict_to_top(scaled, top_k, None))
        tokens = jax.random.categorical(key, allowed, axis=-1).astype(jnp.int32)
        return tokens, jax.nn.log_softmax(scaled, axis=-1)

    tokens, log_probs = jax.lax.cond(temperature > 0.0, sample, greedy)
    return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
