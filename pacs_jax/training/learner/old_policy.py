"""pi_old of a training step, one pass at a time: the log-probs and entropies of the sampled responses
under the weights that sampled them (docs/design.md section 3.4).

    passes = old_policy_passes(graphdef, temperature=T, num_micro_batches=K)   # training/step_programs.py
    batch, entropy_means = passes(params, prompt_tokens, prompt_mask, tokens, response_mask)   # an UpdateBatch
    # packed (train.packing): passes(..., packing=the plan's PackedPlanArrays, passes=the plan's pass count)

One jitted program computes one pass (``rl.logprobs_of_pass``: a padded micro-batch of B / K strided
rows, or a packed pass of the plan) into the step's log-prob and entropy buffers, which it donates
and returns; the host enqueues the K passes at once (nothing waits between two), and each call's
``entropy_mean`` is ready when its pass is done: the trainer's progress lines count the passes done
(training/progress.py). Pass k is an int32 argument, so one program serves every pass. The
buffers start as zeros put on the device by the host (no program compiles for them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pacs_jax import distributed, sharding
from pacs_jax.rl import logprobs_of_pass
from pacs_jax.rl.packing import PackedPlanArrays
from pacs_jax.rl.update_batch import UpdateBatch
from pacs_jax.sharding import batch_sharding, constrain
from pacs_jax.training.learner.rollout_consistency import sampler_rows


@dataclasses.dataclass(frozen=True)
class OldPolicyPasses:
    """``(params, prompt_tokens, prompt_mask, tokens, response_mask, packing=None, passes=None, replay=None) ->
    (update batch without rewards, entropy_means)``: prompts [P, Tp], responses [P*n, R] -> the update
    batch (rl/update_batch.py ``UpdateBatch``: input_ids, attention_mask [P*n, Tp + R] int32;
    response_mask, old_logp [P*n, R] float32; with ``routing``, the experts pi_old's router chose [P*n,
    Tp + R, layers, k]) and, a pass, the mean entropy of the response tokens of the passes so far ([]
    float32 each: the last one's is the step's). replay: None, or a routing record [P*n, Tp + R, layers, k]
    pi_old runs on (R3: the sampler's); its router's own choice is still what ``routing`` records.

    program: jitted ``(params, prompt_tokens, prompt_mask, tokens, response_mask, old_logp, entropy,
    routing, k, packing, replay) -> (batch, entropy, entropy_mean)``, pass k (int32 []); old_logp, entropy
    and routing (None without a record) donated.
    num_micro_batches: K, the passes of padded rows.
    routing: None, or a record's (layers, k, dtype) per token (``train.router_replay`` "R2": the update
    replays what pi_old's router chose; "R3": the learner's choice against the sampler's; models/moe.py
    ``routing_shape``, ``routing_dtype``).
    """

    program: Callable
    num_micro_batches: int
    routing: tuple[int, int, np.dtype] | None = None

    def __call__(self, params, prompt_tokens, prompt_mask, tokens, response_mask,
                 packing: PackedPlanArrays | None = None, passes: int | None = None, replay: jax.Array | None = None
                 ) -> tuple[UpdateBatch, list[jax.Array]]:
        if (packing is None) != (passes is None):
            raise ValueError("packed pi_old takes the plan's arrays and its number of passes together")
        logp, entropy = (distributed.put_rows(np.zeros(tokens.shape, np.float32), batch_sharding(tokens.shape))
                         for _ in range(2))
        routing = None
        if self.routing is not None:
            shape = self._routing_shape(prompt_tokens, tokens)
            routing = distributed.put_rows(np.zeros(shape, self.routing[2]), batch_sharding(shape))
        means = []
        for k in range(self.num_micro_batches if passes is None else passes):
            batch, entropy, mean = self.program(params, prompt_tokens, prompt_mask, tokens, response_mask,
                                                logp, entropy, routing, np.int32(k), packing, replay)
            logp, routing = batch.old_logp, batch.routing
            means.append(mean)
        return batch, means

    def _routing_shape(self, prompt_tokens, tokens) -> tuple[int, ...]:
        """The routing record of the update batch's rows: [P*n, Tp + R, layers, k]."""
        layers, k, _ = self.routing
        return (tokens.shape[0], prompt_tokens.shape[1] + tokens.shape[1], layers, k)

    def lower(self, params, prompt_tokens, prompt_mask, tokens, response_mask, packing: PackedPlanArrays | None = None,
              replay: jax.ShapeDtypeStruct | None = None) -> jax.stages.Lowered:
        """The one program of every pass, lowered on (abstract) arguments."""
        buffer = jax.ShapeDtypeStruct(tokens.shape, jnp.float32, sharding=batch_sharding(tokens.shape))
        routing = None
        if self.routing is not None:
            shape = self._routing_shape(prompt_tokens, tokens)
            routing = jax.ShapeDtypeStruct(shape, self.routing[2], sharding=batch_sharding(shape))
        return self.program.lower(params, prompt_tokens, prompt_mask, tokens, response_mask, buffer, buffer, routing,
                                  jax.ShapeDtypeStruct((), jnp.int32), packing, replay)


def update_rows(prompt_tokens, prompt_mask, tokens, response_mask) -> tuple[jax.Array, jax.Array]:
    """Prompts [P, Tp] and their n responses each [P*n, R] -> the update batch's input_ids and
    attention_mask [P*n, Tp + R] (each prompt repeated before its responses), sharded as rows."""
    n = tokens.shape[0] // prompt_tokens.shape[0]
    ids = jnp.concatenate([jnp.repeat(prompt_tokens, n, axis=0), tokens], axis=1)
    mask = jnp.concatenate([jnp.repeat(prompt_mask, n, axis=0), response_mask], axis=1)
    return constrain(ids, ("batch", None)), constrain(mask, ("batch", None))


def sampler_as_old_policy() -> jax.stages.Wrapped:
    """The rollout correction's bypass mode (rl/bypass.py), in place of the pi_old passes: the jitted
    ``(sampler log-probs per call [P*n / K, N], prompt_tokens, prompt_mask, tokens, response_mask) ->
    update batch without rewards`` whose old_logp [P*n, R] are the sampler's log-probs (at the rollout
    temperature, as pi_old's would be); no forward pass."""
    rows = batch_sharding((0, 0))

    def assemble(sampler_logp, prompt_tokens, prompt_mask, tokens, response_mask):
        ids, mask = update_rows(prompt_tokens, prompt_mask, tokens, response_mask)
        return UpdateBatch(ids, mask, response_mask.astype(jnp.float32), sampler_rows(sampler_logp, tokens.shape[1]))

    return jax.jit(assemble, out_shardings=rows)


def old_policy_passes(graphdef: nnx.GraphDef, *, temperature: float, num_micro_batches: int,
                      chunk_size: int | None = None, routing: tuple[int, int, np.dtype] | None = None
                      ) -> OldPolicyPasses:
    """pi_old at the rollout ``temperature`` (logits / T, as verl) in ``num_micro_batches`` padded
    passes, or a packing plan's passes; ``routing`` (layers, k, dtype): the passes also record the
    experts pi_old's router chose for every token (routing replay: R2 replays them in the update, R3
    compares them with the sampler's, which pi_old then runs on)."""
    rows = batch_sharding((0, 0))  # the update batch's rows always divide (the spec)
    extra = {} if chunk_size is None else {"chunk_size": chunk_size}
    K = num_micro_batches

    def one_pass(params, prompt_tokens, prompt_mask, tokens, response_mask, old_logp, entropy, routing, k, packing,
                 replay):
        ids, mask = update_rows(prompt_tokens, prompt_mask, tokens, response_mask)
        out = logprobs_of_pass(
            nnx.merge(graphdef, params), ids, mask, tokens.shape[1], (old_logp, entropy), k, num_micro_batches=K,
            temperature=temperature, with_entropy=True, packing=packing, routing=routing, routed=replay, **extra)
        (old_logp, entropy), routing = out if routing is not None else (out, None)
        response_mask = response_mask.astype(jnp.float32)
        entropy_mean = jnp.sum(entropy * response_mask) / jnp.maximum(jnp.sum(response_mask), 1.0)
        return UpdateBatch(ids, mask, response_mask, old_logp, routing=routing), entropy, entropy_mean

    out = (rows, rows, sharding.replicated())  # every array of the batch: rows
    return OldPolicyPasses(jax.jit(one_pass, donate_argnums=(5, 6, 7), out_shardings=out), K, routing)
