"""Loss and gradient over the model parameters for one mini-batch of whole prompt groups.

Batch layout (the verl layout; L = P + R):
  input_ids       [B, L] int32   prompt left-padded to P tokens, then the response right-padded to R
  attention_mask  [B, L]         1 on real tokens (prompt and response)
  response_mask   [B, R]         1 on the response tokens the loss sees
  old_logp        [B, R] float   log pi_old of the response tokens (``micro_batched_logprobs``)
  rewards         [B]    float   verifiable rewards; rows i*n .. i*n+n-1 answer the same prompt
  advantages      [B, R] float   optional: per-token advantages (objective "ppo", rl.compute_gae)
The hidden state at position P - 1 + t predicts response token t, so the response log-probs are
the fused log-probs (pacs_jax.rl.logprobs) of hidden[:, P-1:L-1] against input_ids[:, P:].

Gradient accumulation: the mini-batch is split into ``num_micro_batches`` micro-batches of whole
groups; a ``lax.scan`` runs forward + backward on one micro-batch at a time and sums the gradients.
Micro-batch k holds groups k, k + K, k + 2K, ... (K = num_micro_batches), so when the batch axis
is sharded over ("data", "fsdp") every micro-batch is spread over all devices. Each micro-batch
loss is normalised by the totals of the whole mini-batch (``BatchTotals``), so the accumulated
loss and gradient equal those of the whole mini-batch at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.rl.batch import BatchTotals
from pacs_jax.rl.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs, token_logprobs_and_entropy
from pacs_jax.rl.objectives import get_objective
from pacs_jax.sharding import MeshRules, constrain

Batch = Mapping[str, jax.Array]


def response_logprobs(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array, response_length: int, *,
                      temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      rules: MeshRules | None = None, with_entropy: bool = False):
    """log pi(response token t | everything before it): input_ids, attention_mask [B, P + R] -> [B, R] float32.

    The one log-prob path of the trainer (pi_old after the rollout, pi_theta in the update). With
    ``with_entropy``, returns (log-probs [B, R], entropy of each token's distribution [B, R]).
    """
    prompt_length = input_ids.shape[1] - response_length
    hidden = model(input_ids, attention_mask=attention_mask, return_hidden=True)  # [B, L, D]
    args = (hidden[:, prompt_length - 1:-1], model.lm_head_kernel(), input_ids[:, prompt_length:])
    kwargs = dict(temperature=temperature, chunk_size=chunk_size, rules=rules)
    return token_logprobs_and_entropy(*args, **kwargs) if with_entropy else token_logprobs(*args, **kwargs)


def micro_batched_logprobs(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array, response_length: int,
                           *, num_micro_batches: int = 1, temperature: float = 1.0,
                           chunk_size: int = DEFAULT_CHUNK_SIZE, rules: MeshRules | None = None,
                           with_entropy: bool = False):
    """``response_logprobs`` without gradient, as ``num_micro_batches`` forward passes of B / K rows
    each (``lax.map``), so activation memory is bounded by a micro-batch, not the batch.

    Micro-batch k holds rows k, k + K, ... (strided, like the update's), so with the batch axis
    sharded every micro-batch is spread over all devices. Returns [B, R] (and entropy [B, R]).
    """
    B = input_ids.shape[0]
    if B % num_micro_batches:
        raise ValueError(f"num_micro_batches={num_micro_batches} does not divide the batch of {B} rows")
    split = lambda x: constrain(_split_micro_batches(x, 1, num_micro_batches), rules, (None, "batch", None))  # noqa: E731
    out = jax.lax.map(lambda ids_mask: response_logprobs(model, *ids_mask, response_length, temperature=temperature,
                                                         chunk_size=chunk_size, rules=rules, with_entropy=with_entropy),
                      (split(input_ids), split(attention_mask)))
    return jax.lax.stop_gradient(jax.tree.map(lambda x: _merge_micro_batches(x, 1), out))


def _split_micro_batches(x: jax.Array, unit: int, num_micro_batches: int) -> jax.Array:
    """[B, ...] -> [K, B / K, ...] by blocks of ``unit`` rows: micro-batch k holds blocks k, k + K, ..."""
    K = num_micro_batches
    blocks = x.reshape(x.shape[0] // (unit * K), K, unit, *x.shape[1:])
    return jnp.moveaxis(blocks, 1, 0).reshape(K, x.shape[0] // K, *x.shape[1:])


def _merge_micro_batches(x: jax.Array, unit: int) -> jax.Array:
    """Inverse of ``_split_micro_batches``: [K, B / K, ...] -> [B, ...]."""
    K, rows = x.shape[:2]
    blocks = x.reshape(K, rows // unit, unit, *x.shape[2:])
    return jnp.moveaxis(blocks, 0, 1).reshape(K * rows, *x.shape[2:])


def loss_and_grad_fn(graphdef: nnx.GraphDef, objective: str, *, group_size: int,
                     objective_options: Mapping[str, Any] | None = None, num_micro_batches: int = 1,
                     temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                     rules: MeshRules | None = None) -> Callable[[nnx.State, Batch], tuple]:
    """The pure (un-jitted) ``(params, batch) -> (loss, metrics, grads)``, to compose into a train step.

    graphdef/params: ``nnx.split(model)`` of a model whose state is all parameters. objective: a name
    in pacs_jax.rl.OBJECTIVES, with ``objective_options`` bound. grads: same structure as params, in
    float32. metrics: the objective's metrics averaged over micro-batches (means are exact; a
    "_std" metric is the mean of the micro-batch stds). rules: shard micro-batches over the mesh.
    """
    fn = get_objective(objective, **(objective_options or {}))
    K = num_micro_batches

    def micro_loss(params, micro, totals):
        model = nnx.merge(graphdef, params)
        R = micro["response_mask"].shape[1]
        logp = response_logprobs(model, micro["input_ids"], micro["attention_mask"], R, temperature=temperature,
                                 chunk_size=chunk_size, rules=rules)
        extra = {"advantages": micro["advantages"]} if "advantages" in micro else {}
        return fn(logp, micro["old_logp"], micro["response_mask"], micro["rewards"], group_size, totals=totals,
                  **extra)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def loss_and_grad(params: nnx.State, batch: Batch):
        return accumulate_micro_batches(grad_fn, params, batch, unit=group_size, num_micro_batches=K, rules=rules)

    return loss_and_grad


def accumulate_micro_batches(grad_fn: Callable, params: nnx.State, batch: Batch, *, unit: int, num_micro_batches: int,
                             rules: MeshRules | None = None) -> tuple[jax.Array, dict, nnx.State]:
    """Gradient accumulation: ``grad_fn(params, micro_batch, totals) -> ((loss, metrics), grads)`` over
    ``num_micro_batches`` micro-batches of ``batch`` (blocks of ``unit`` rows, strided, see
    ``_split_micro_batches``) in a ``lax.scan``. ``totals`` are the whole batch's (its rows and
    response tokens), so an objective normalised by them sums to the whole batch's loss.

    Returns (summed loss, metrics averaged over micro-batches, summed float32 gradients).
    """
    batch = dict(batch)
    totals = BatchTotals(num_sequences=batch["response_mask"].shape[0],
                         num_tokens=jnp.sum(batch["response_mask"].astype(jnp.float32)))
    micro = {k: _split_micro_batches(v, unit, num_micro_batches) for k, v in batch.items()}
    micro = {k: constrain(v, rules, (None, "batch") + (None,) * (v.ndim - 2)) for k, v in micro.items()}

    def step(acc, mb):
        loss_sum, grad_sum = acc
        (loss, metrics), grads = grad_fn(params, mb, totals)
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        return (loss_sum + loss, grad_sum), metrics

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (loss, grads), metrics = jax.lax.scan(step, (jnp.zeros((), jnp.float32), zeros), micro)
    return loss, jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics), grads
