"""The sampler's log-probs of its tokens against the trainer's pi_old of the same tokens, every step.

The sampler selects each token from the logits of its cached decode step and returns log_softmax(
logits / T) of it (sampling/engine.py ``SampleArrays.logprobs``); pi_old is the trainer's own forward
pass over the assembled rows, at the same temperature (training/step_programs.py). Both are log-probs
of the same policy, so they differ only by the numerics of two programs (cache vs one pass, another
batch width, bfloat16 rounding) or by a bug. As verl, slime and SkyRL do, each step reports, over the
response tokens (response_mask 1):

    rollout_logprob_diff_mean   mean |log pi_sampler - log pi_old|
    rollout_logprob_diff_max    max  |log pi_sampler - log pi_old|
    rollout_kl                  mean of the k3 estimate of KL(pi_sampler || pi_old) per token:
                                r - 1 - log r with r = pi_old / pi_sampler (>= 0; the tokens are drawn
                                from the sampler, so it estimates KL from the sampler's side; its
                                series where |log r| < 1e-2, so float32 round-off does not swamp it)

``rollout.max_logprob_diff`` > 0 refuses a step whose ``rollout_logprob_diff_max`` exceeds it
(``RolloutMismatchError``); 0 only reports.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pacs_jax.errors import PermanentError
from pacs_jax.sharding import replicated

METRICS = ("rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_kl")


class RolloutMismatchError(PermanentError):
    """The sampler's log-probs differ from pi_old by more than ``rollout.max_logprob_diff``."""


def _k3(x: jax.Array) -> jax.Array:
    """exp(x) - 1 - x (>= 0) in float32 without cancellation: for |x| < 1e-2 its series x^2 (1/2 + x/6 +
    x^2/24) (a float32 exp(x) - 1 - x of x ~ 1e-7 is rounding noise of either sign)."""
    small = jnp.abs(x) < 1e-2
    return jnp.where(small, x * x * (0.5 + x / 6 + x * x / 24), jnp.expm1(jnp.where(small, 0.0, x)) - x)


def sampler_rows(sampler_logp: Sequence[jax.Array], width: int) -> jax.Array:
    """K sampler calls' log-probs [B / K, N] -> [B, width] float32 (width <= N), rows in call order as the
    update batch's."""
    return jnp.concatenate(sampler_logp, axis=0)[:, :width].astype(jnp.float32)


def _consistency(sampler_logp: Sequence[jax.Array], old_logp: jax.Array, response_mask: jax.Array) -> dict:
    """K sampler calls' log-probs [B / K, N] (rows in call order, as the update batch's) against the
    update batch's old_logp and response_mask [B, R] (R <= N): the METRICS, each a float32 scalar."""
    sampled = sampler_rows(sampler_logp, old_logp.shape[1])  # [B, R]
    mask = response_mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    log_ratio = jnp.where(mask > 0, old_logp.astype(jnp.float32) - sampled, 0.0)  # log pi_old - log pi_sampler
    diff = jnp.abs(log_ratio)
    k3 = _k3(log_ratio)  # 0 where masked
    return {"rollout_logprob_diff_mean": jnp.sum(diff) / count, "rollout_logprob_diff_max": jnp.max(diff),
            "rollout_kl": jnp.sum(k3) / count}


def consistency_program() -> jax.stages.Wrapped:
    """The jitted comparison ``(sampler log-probs per call, old_logp, response_mask) -> METRICS``, its
    scalars replicated on the mesh in context (every process reads them)."""
    return jax.jit(_consistency, out_shardings=replicated())


def check(metrics: dict[str, float], max_logprob_diff: float) -> None:
    """Raise ``RolloutMismatchError`` (one line) when ``max_logprob_diff`` > 0 and the step's
    ``rollout_logprob_diff_max`` exceeds it."""
    worst = metrics["rollout_logprob_diff_max"]
    if max_logprob_diff > 0 and not worst <= max_logprob_diff:  # a NaN refuses too
        raise RolloutMismatchError(
            f"rollout.max_logprob_diff: the sampler's log-probs differ from pi_old by up to {worst:.3g} "
            f"(mean {metrics['rollout_logprob_diff_mean']:.3g}, KL {metrics['rollout_kl']:.3g}) over this step's "
            f"response tokens, above the {max_logprob_diff:g} allowed (sampler and trainer disagree: check "
            "model.dtype, or raise the limit)")
