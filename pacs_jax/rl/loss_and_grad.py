"""The actor's loss and gradient over its parameters for one mini-batch of whole prompt groups
(``loss_and_grad_fn``; the optimizer step around it is training/update_step.py's).

Batch layout (the verl layout; L = P + R):
  input_ids       [B, L] int32   prompt left-padded to P tokens, then the response right-padded to R
  attention_mask  [B, L]         1 on real tokens (prompt and response)
  response_mask   [B, R]         1 on the response tokens the loss sees
  old_logp        [B, R] float   log pi_old of the response tokens (``micro_batched_logprobs``)
  rewards         [B]    float   verifiable rewards; rows i*n .. i*n+n-1 answer the same prompt
  advantages      [B, R] float   optional: per-token advantages (objective "ppo", rl.compute_gae)
  pack_index, stream_index, stream_length, unpack_index   optional: a packing plan of this layout
                                 (rl/packing.py): every micro-batch then runs on its packed rows
The hidden state at position P - 1 + t predicts response token t: log pi_theta of the response
tokens is ``rl.logprobs.response_logprobs`` (packed: ``packed_response_logprobs``), the same path
as pi_old's.

Gradient accumulation (``rl.micro_batches.accumulate_micro_batches``): the mini-batch is split into
``num_micro_batches`` micro-batches of whole groups; a ``lax.scan`` runs forward + backward on one
micro-batch at a time and sums the gradients. Micro-batch k holds groups k, k + K, k + 2K, ...
(K = num_micro_batches), so when the batch axis is sharded over ("data", "fsdp") every micro-batch
is spread over all devices. Each micro-batch loss is normalised by the totals of the whole
mini-batch (``BatchTotals``), so the accumulated loss and gradient equal those of the whole
mini-batch at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from pacs_jax.rl.logprobs import DEFAULT_CHUNK_SIZE, packed_response_logprobs, response_logprobs
from pacs_jax.rl.micro_batches import accumulate_micro_batches
from pacs_jax.rl.objectives import get_objective
from pacs_jax.rl.packing import PACKING_KEYS, packed_units

Batch = Mapping[str, jax.Array]


def loss_and_grad_fn(graphdef: nnx.GraphDef, objective: str, *, group_size: int,
                     objective_options: Mapping[str, Any] | None = None, num_micro_batches: int = 1,
                     temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Callable[[nnx.State, Batch], tuple]:
    """The pure (un-jitted) ``(params, batch) -> (loss, metrics, grads)``, to compose into a train step.

    graphdef/params: ``nnx.split(model)`` of a model whose state is all parameters. objective: a name
    in pacs_jax.rl.OBJECTIVES, with ``objective_options`` bound. grads: same structure as params, in
    float32. metrics: the objective's metrics averaged over micro-batches (means are exact; a
    "_std" metric is the mean of the micro-batch stds).
    """
    fn = get_objective(objective, **(objective_options or {}))
    K = num_micro_batches

    def micro_loss(params, micro, totals):
        model = nnx.merge(graphdef, params)
        R = micro["response_mask"].shape[1]
        kwargs = dict(temperature=temperature, chunk_size=chunk_size)
        if "pack_index" in micro:
            logp = packed_response_logprobs(model, micro["input_ids"], micro["attention_mask"],
                                            {k: micro[k] for k in PACKING_KEYS}, **kwargs)
        else:
            logp = response_logprobs(model, micro["input_ids"], micro["attention_mask"], R, **kwargs)
        extra = {"advantages": micro["advantages"]} if "advantages" in micro else {}
        return fn(logp, micro["old_logp"], micro["response_mask"], micro["rewards"], group_size, totals=totals,
                  **extra)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def loss_and_grad(params: nnx.State, batch: Batch):
        units = packed_block_sizes(batch, K)
        return accumulate_micro_batches(grad_fn, params, batch, unit=group_size, num_micro_batches=K, units=units)

    return loss_and_grad


def packed_block_sizes(batch: Batch, num_micro_batches: int) -> dict[str, int]:
    """The block sizes of a packed batch's plan arrays (rl/packing.py) for ``accumulate_micro_batches``;
    {} for a padded batch."""
    if "pack_index" not in batch:
        return {}
    return packed_units(batch, batch["response_mask"].shape[0], num_micro_batches)
