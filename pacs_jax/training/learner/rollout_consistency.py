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

A mixture-of-experts model replaying the sampler's routing (``train.router_replay`` "R3") reports how far the
learner's routers stray from it, over the positions that predict a response token (the last prompt token and
every response token but the last; the R3 paper, arXiv 2510.11370, measured ~10 % of decisions and 94 % of
tokens on Qwen3-30B-A3B):

    routing_mismatch_tokens     the share of those tokens whose experts (as a set) differ in at least one layer
                                between the sampler and pi_old's own router
    routing_mismatch_decisions  the share of their (token, layer) routing decisions that differ
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pacs_jax.errors import PermanentError
from pacs_jax.sharding import replicated

METRICS = ("rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_kl")
ROUTING_METRICS = ("routing_mismatch_tokens", "routing_mismatch_decisions")


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


def _routing_consistency(sampled: jax.Array, learner: jax.Array, response_mask: jax.Array) -> dict:
    """The sampler's routing record and pi_old's router's, [B, P + R, L, k] each (the update rows' layout),
    response_mask [B, R]: the ROUTING_METRICS over the positions P - 1 .. P + R - 2 whose next token is a
    response token (response_mask 1), each a float32 scalar."""
    R = response_mask.shape[1]
    predicting = slice(sampled.shape[1] - R - 1, sampled.shape[1] - 1)  # position P - 1 + t predicts token t
    same = jnp.all(jnp.sort(sampled[:, predicting], axis=-1) == jnp.sort(learner[:, predicting], axis=-1),
                   axis=-1)  # [B, R, L]: the same experts in that layer
    mask = response_mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    return {"routing_mismatch_tokens": jnp.sum(jnp.where(jnp.all(same, axis=-1), 0.0, mask)) / count,
            "routing_mismatch_decisions": jnp.sum(jnp.mean(1.0 - same, axis=-1) * mask) / count}


def routing_consistency_program() -> jax.stages.Wrapped:
    """The jitted ``(sampler's routing, pi_old's, response_mask) -> ROUTING_METRICS``, replicated scalars."""
    return jax.jit(_routing_consistency, out_shardings=replicated())


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
