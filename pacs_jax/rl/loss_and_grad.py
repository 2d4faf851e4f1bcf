"""The actor's loss and gradient over its parameters for one mini-batch of whole prompt groups
(``loss_and_grad_fn``; the optimizer step around it is training/update_step.py's).

Batch layout (the verl layout; L = P + R):
  input_ids       [B, L] int32   prompt left-padded to P tokens, then the response right-padded to R
  attention_mask  [B, L]         1 on real tokens (prompt and response)
  response_mask   [B, R]         1 on the response tokens the loss sees
  old_logp        [B, R] float   log pi_old of the response tokens (``logprobs_of_pass``)
  rewards         [B]    float   verifiable rewards; rows i*n .. i*n+n-1 answer the same prompt
  advantages      [B, R] float   optional: per-token advantages (objective "ppo", rl.compute_gae)
  rollout_is_weights [B, R] float optional: rollout-correction weights (rl/rollout_correction.py;
                                 response_mask is then the rejection mask)
  pack_index, stream_index, stream_length, unpack_index, row_pass   optional: a packing plan of
                                 this mini-batch (rl/packing.py): it then runs as its packed passes
                                 (``rl.packing.accumulate_passes``), not as micro-batches
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

from pacs_jax.rl.bypass import Bypass, bypass_objective
from pacs_jax.rl.logprobs import DEFAULT_CHUNK_SIZE, packed_response_logprobs, response_logprobs
from pacs_jax.rl.micro_batches import accumulate_micro_batches
from pacs_jax.rl.objectives import get_objective
from pacs_jax.rl.packing import accumulate_passes

Batch = Mapping[str, jax.Array]


def loss_and_grad_fn(graphdef: nnx.GraphDef, objective: str, *, group_size: int,
                     objective_options: Mapping[str, Any] | None = None, num_micro_batches: int = 1,
                     temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                     bypass: Bypass | None = None) -> Callable[[nnx.State, Batch], tuple]:
    """The pure (un-jitted) ``(params, batch) -> (loss, metrics, grads)``, to compose into a train step.

    graphdef/params: ``nnx.split(model)`` of a model whose state is all parameters. objective: a name
    in pacs_jax.rl.OBJECTIVES, with ``objective_options`` bound. grads: same structure as params, in
    float32. metrics: the objective's metrics averaged over micro-batches (means are exact; a
    "_std" metric is the mean of the micro-batch stds). bypass: the rollout correction's bypass mode
    (rl/bypass.py: the batch's old_logp are the sampler's, corrected in the loss); None: the objective.
    """
    options = dict(objective_options or {})
    fn = get_objective(objective, **options) if bypass is None else bypass_objective(objective, bypass, **options)
    K = num_micro_batches
    kwargs = dict(temperature=temperature, chunk_size=chunk_size)

    def forward(params, rows, plan=None):
        """log pi_theta of the response tokens [b, R] (packed: of the pass ``plan``'s rows)."""
        model = nnx.merge(graphdef, params)
        if plan is not None:
            return packed_response_logprobs(model, rows["input_ids"], rows["attention_mask"], plan, **kwargs)
        return response_logprobs(model, rows["input_ids"], rows["attention_mask"], rows["response_mask"].shape[1],
                                 **kwargs)

    def loss(logp, rows, totals):
        extra = {k: rows[k] for k in ("advantages", "rollout_is_weights") if k in rows}
        return fn(logp, rows["old_logp"], rows["response_mask"], rows["rewards"], group_size, totals=totals, **extra)

    grad_fn = jax.value_and_grad(lambda params, micro, totals: loss(forward(params, micro), micro, totals),
                                 has_aux=True)

    def loss_and_grad(params: nnx.State, batch: Batch):
        if "pack_index" in batch:
            return accumulate_passes(forward, loss, params, batch, placeholder="old_logp", unit=group_size,
                                     num_micro_batches=K)
        return accumulate_micro_batches(grad_fn, params, batch, unit=group_size, num_micro_batches=K)

    return loss_and_grad
