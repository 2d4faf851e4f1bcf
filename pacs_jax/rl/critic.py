"""The critic's loss and gradient for PPO: the clipped value loss (``rl.value_loss``) of a
``models.ValueModel`` over micro-batches, and its values without gradient in micro-batches
(docs/design.md section 6.6).

Batch: rl/update_batch.py ``CriticBatch`` (input_ids, attention_mask [B, P + R]; response_mask,
old_values, returns [B, R]; optionally a packing plan of the mini-batch, which then runs as its
packed passes).

Which values are compared with which returns (verl's dp_critic.py in the authors' copy, 0.3.1.dev:
``values[:, -R - 1:-1]`` in ``_forward_micro_batch``, mask ``attention_mask[:, -R - 1:-1]`` in
``compute_values`` and ``update_critic``): value t is the critic's output at position P - 1 + t, the
state in which response token t is chosen (as the log-probs), and it is masked by the attention
mask at that same position, i.e. the response mask shifted right by one slot with a 1 in front. For
a response of n < R tokens the value loss so covers t = 0 .. n: the n states before each response
token and the state after the last one (value read at the last response token, position P - 1 + n),
whose return is 0 (no reward follows). A response of n = R tokens has no such slot.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.models.value import ValueModel, response_values
from pacs_jax.rl.micro_batches import accumulate_micro_batches, map_micro_batches
from pacs_jax.rl.packing import (PackedPlanArrays, PassPlan, accumulate_passes, map_passes, packed_inputs,
                                 response_stream, unpack)
from pacs_jax.rl.ppo import value_loss
from pacs_jax.rl.update_batch import CriticBatch
from pacs_jax.sharding import constrain


def value_mask(attention_mask: jax.Array, response_length: int) -> jax.Array:
    """verl's critic mask: attention_mask [B, P + R] -> [B, R] float32, the attention mask at positions
    P - 1 .. P + R - 2 (where the values are read): 1 on the response tokens and on the slot after a
    response shorter than R (see the module docstring)."""
    return attention_mask[:, -response_length - 1:-1].astype(jnp.float32)


def critic_loss_and_grad_fn(graphdef: nnx.GraphDef, *, num_micro_batches: int = 1, clip_range_value: float = 0.5,
                            loss_agg_mode: str = "token-mean", norm_length: int | None = None,
                            loss_scale: str = "mean", verl_micro_batch_size: int = 0
                            ) -> Callable[[nnx.State, CriticBatch], tuple]:
    """The pure ``(critic params, batch) -> (loss, metrics, grads)`` of the value loss over verl's
    critic mask (``value_mask``), aggregated by ``loss_agg_mode`` (the trainer passes the actor's, as
    verl's critic inherits it; ``norm_length``: L_max of seq-mean-token-sum-norm) at
    ``loss_scale`` ("verl" with ``verl_micro_batch_size``: verl's mean over micro-batches),
    accumulated over ``num_micro_batches`` micro-batches of rows. grads: float32, like params.
    """

    def forward(params, rows, plan=None):
        """The critic's values [b, R] (packed: of the pass ``plan``'s rows)."""
        critic = nnx.merge(graphdef, params)
        if plan is not None:
            return packed_response_values(critic, rows.input_ids, rows.attention_mask, plan)
        return response_values(critic, rows.input_ids, rows.attention_mask, rows.response_mask.shape[1])

    def loss(values, rows, totals):
        return value_loss(values, rows.old_values, rows.returns, rows.response_mask,
                          clip_range_value=clip_range_value, loss_agg_mode=loss_agg_mode, norm_length=norm_length,
                          loss_scale=loss_scale, verl_micro_batch_size=verl_micro_batch_size, totals=totals)

    grad_fn = jax.value_and_grad(lambda params, micro, totals: loss(forward(params, micro), micro, totals),
                                 has_aux=True)

    def loss_and_grad(params: nnx.State, batch: CriticBatch):
        # the loss's mask (and the token count of token-mean's totals) is verl's critic mask, not the response's
        batch = batch.replace(response_mask=value_mask(batch.attention_mask, batch.response_mask.shape[1]))
        if batch.packing is not None:
            return accumulate_passes(forward, loss, params, batch.replace(packing=None), batch.packing,
                                     batch.old_values, unit=1, num_micro_batches=num_micro_batches)
        return accumulate_micro_batches(grad_fn, params, batch, unit=1, num_micro_batches=num_micro_batches)

    return loss_and_grad


def packed_response_values(critic: ValueModel, input_ids: jax.Array, attention_mask: jax.Array,
                           plan: PassPlan) -> jax.Array:
    """``models.response_values`` of one pass's rows computed on its packed rows (rl/packing.py, one
    pass's arrays): input_ids, attention_mask [B_m, P + R] -> values [B_m, R] (value t read at the
    token before response token t, within the sequence), valid on the pass's own rows."""
    tokens, segment_ids, positions, _ = packed_inputs(input_ids, attention_mask, plan.pack_index)
    values = critic(tokens, segment_ids=segment_ids, positions=positions)  # [S N, Lp]
    return unpack(response_stream(values, plan.stream_index), plan.unpack_index)


def micro_batched_values(critic: ValueModel, input_ids: jax.Array, attention_mask: jax.Array, response_length: int,
                         *, num_micro_batches: int = 1, packing: PackedPlanArrays | None = None) -> jax.Array:
    """``models.response_values`` without gradient: input_ids, attention_mask [B, P + R] -> values [B, R]
    float32, as ``num_micro_batches`` forward passes of strided micro-batches of rows
    (``rl.micro_batches.map_micro_batches``), so activation memory
    is bounded by one."""
    if packing is None:
        return map_micro_batches(lambda ids, mask: response_values(critic, ids, mask, response_length),
                                 (input_ids, attention_mask), num_micro_batches=num_micro_batches)
    zeros = constrain(jnp.zeros((input_ids.shape[0], response_length), jnp.float32), ("batch", None))
    out = map_passes(lambda plan: packed_response_values(critic, input_ids, attention_mask, plan), packing, zeros)
    return jax.lax.stop_gradient(out)
