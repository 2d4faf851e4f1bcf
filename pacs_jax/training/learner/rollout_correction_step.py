"""The step's rollout correction (docs/design.md section 6.7): verl's importance weights and rejection
mask (rl/rollout_correction.py) of the sampler's log-probs against pi_old, over the whole update batch.

    correct = correction_program(spec.algorithm.rollout_correction)        # training/step_programs.py
    weights, response_mask, metrics = correct(sampler log-probs per call, old_logp, response_mask)

One jitted program after pi_old: its [B, R] outputs are sharded as the update batch's rows and its
statistics are the whole batch's, whatever the mesh and whether the update's passes are padded or
packed (the passes gather the weights with the batch's other rows). The update batch then carries
``rollout_is_weights`` (the weights on the kept tokens; 1 on every kept token when only rejection is
on, so that PACS drops a response with no token kept) and the rejection mask as its
``response_mask``, which every objective's aggregation and the mini-batch totals read.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pacs_jax.rl.rollout_correction import correction_and_rejection_mask
from pacs_jax.sharding import batch_sharding, replicated
from pacs_jax.training.learner.rollout_consistency import sampler_rows


def correction_program(spec) -> jax.stages.Wrapped:
    """``(sampler log-probs per call [B / K, N], old_logp [B, R], response_mask [B, R]) -> (rollout_is_weights
    [B, R], response_mask [B, R], metrics)`` for a ``RolloutCorrectionSpec``, jitted; the metrics
    (``rollout_corr/...``) replicated on the mesh in context."""
    options = spec.options()

    def correct(sampler_logp: Sequence[jax.Array], old_logp: jax.Array, response_mask: jax.Array):
        rollout_logp = sampler_rows(sampler_logp, old_logp.shape[1])
        weights, kept, metrics = correction_and_rejection_mask(old_logp, rollout_logp, response_mask, **options)
        return (kept if weights is None else weights * kept), kept.astype(response_mask.dtype), metrics

    rows = batch_sharding((0, 0))
    return jax.jit(correct, out_shardings=(rows, rows, replicated()))
