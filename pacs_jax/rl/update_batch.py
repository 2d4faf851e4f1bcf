"""The learner's batches, each one registered pytree: the actor's update batch (``UpdateBatch``), PPO's
critic update batch (``CriticBatch``) and the supervised warm-start's (``SFTBatch``).

Shapes: B rows (responses; rows i*n .. i*n+n-1 answer the same prompt), P the prompt width
(left-padded), R the response width (right-padded), L = P + R. An optional field is None when the
step has no such array; a batch with it and one without are different pytrees (and programs), as
the step's config decides before step 1. The programs slice every array of a batch by rows
(mini-batches, micro-batches) with ``jax.tree.map``; a packing plan's arrays are cut by
mini-batch the same way (rl/packing.py).
"""

from __future__ import annotations

import jax
from flax import struct

from pacs_jax.rl.packing import PackedPlanArrays


@struct.dataclass
class UpdateBatch:
    """The actor's update batch (the verl layout; rl/loss_and_grad.py reads it).

    input_ids           [B, L] int32    prompt left-padded to P tokens, then the response right-padded to R
    attention_mask      [B, L] int32    1 on real tokens (prompt and response)
    response_mask       [B, R] float32  1 on the response tokens the loss sees (with the rollout
                                        correction: its rejection mask)
    old_logp            [B, R] float32  log pi_old of the response tokens (training/learner/old_policy.py; bypass
                                        mode: the sampler's)
    rewards             [B] float32     verifiable rewards; None until the rows are scored
    advantages          [B, R] float32  objective "ppo": GAE's whitened advantages (training/learner/critic_step.py)
    rollout_is_weights  [B, R] float32  the rollout correction's weights (rl/rollout_correction.py)
    ref_logp            [B, R] float32  the KL loss's reference model's log-probs of the response tokens
                                        (``algorithm.use_kl_loss``; rl/kl.py)
    routing             [B, L, layers, k] uint8 (int16 past 256 experts)  a model with experts, routing replay
                        (``train.router_replay`` "R2"): the experts pi_old's router chose for every token in
                        every layer, which the update replays (models/moe.py)
    packing             the update's packing plan (``train.packing``): the batch then runs as its
                        packed passes (``rl.packing.accumulate_passes``), not as micro-batches
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    old_logp: jax.Array
    rewards: jax.Array | None = None
    advantages: jax.Array | None = None
    rollout_is_weights: jax.Array | None = None
    ref_logp: jax.Array | None = None
    routing: jax.Array | None = None
    packing: PackedPlanArrays | None = None


@struct.dataclass
class CriticBatch:
    """PPO's critic update batch (rl/critic.py reads it; training/learner/critic_step.py makes it from the
    update batch and the values pass).

    input_ids, attention_mask  [B, L] int32    the update batch's
    response_mask              [B, R] float32  the update batch's (the loss reads verl's critic mask
                                               from attention_mask: ``rl.critic.value_mask``)
    old_values                 [B, R] float32  the critic's values before the update, times its mask
    returns                    [B, R] float32  GAE's returns
    packing                    the critic update's packing plan (``train.packing``), or None
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    old_values: jax.Array
    returns: jax.Array
    packing: PackedPlanArrays | None = None


@struct.dataclass
class SFTBatch:
    """The supervised warm-start's batch (training/learner/warmstart.py): prompts left-padded to P tokens,
    target responses right-padded to R.

    input_ids, attention_mask  [B, P + R] int32
    response_mask              [B, R] float32  1 on the target's tokens
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
