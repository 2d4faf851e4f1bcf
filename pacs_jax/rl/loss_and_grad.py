"""The actor's loss and gradient over its parameters for one mini-batch of whole prompt groups
(``loss_and_grad_fn``; the optimizer step around it is training/learner/update_step.py's).

Batch: rl/update_batch.py ``UpdateBatch`` (input_ids, attention_mask [B, P + R]; response_mask,
old_logp [B, R]; rewards [B]; optionally advantages, rollout_is_weights [B, R] and the mini-batch's
packing plan, with which it runs as its packed passes, ``rl.packing.accumulate_passes``, not as
micro-batches).
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

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.rl.bypass import Bypass, bypass_objective
from pacs_jax.rl.kl import with_kl_loss
from pacs_jax.rl.logprobs import DEFAULT_CHUNK_SIZE, packed_response_logprobs, response_logprobs
from pacs_jax.rl.micro_batches import accumulate_micro_batches
from pacs_jax.rl.objectives import get_objective, objective_spec
from pacs_jax.rl.packing import accumulate_passes
from pacs_jax.rl.policy_gradient import aggregate
from pacs_jax.rl.update_batch import UpdateBatch

AUX_METRIC = "actor/router_aux_loss"  # the load-balancing loss, before its coefficient (router_aux_loss_coef)


def loss_and_grad_fn(graphdef: nnx.GraphDef, objective: str, *, group_size: int,
                     objective_options: Mapping[str, Any] | None = None, num_micro_batches: int = 1,
                     temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                     bypass: Bypass | None = None, kl: KLLoss | None = None,
                     router_aux_loss_coef: float = 0.0) -> Callable[..., tuple]:
    """The pure (un-jitted) ``(params, batch, frozen=None) -> (loss, metrics, grads)``, to compose into a
    train step.

    graphdef/params: ``nnx.split(model)`` of a model whose state is all parameters, or the trainable part of
    it (LoRA's adapters) with the rest as ``frozen`` (no gradient; grads then only for params). objective: a name
    in pacs_jax.rl.OBJECTIVES, with ``objective_options`` bound. grads: same structure as params, in
    float32. metrics: the objective's metrics averaged over micro-batches (means are exact; a
    "_std" metric is the mean of the micro-batch stds). bypass: the rollout correction's bypass mode
    (rl/bypass.py: the batch's old_logp are the sampler's, corrected in the loss); None: the objective.
    kl: the KL loss to the reference model (rl/kl.py; the batch then holds ``ref_logp``), aggregated as the
    objective aggregates its tokens. A batch with ``routing`` (routing replay) runs the model on those experts.
    router_aux_loss_coef > 0 (a model with experts): plus that times the routers' load-balancing loss
    (transformers' ``load_balancing_loss_func`` over a forward pass's real tokens, models/moe.py) of each micro-batch
    or packed pass, weighted by its share of the mini-batch's real tokens (one pass: exactly HF's); metric
    ``actor/router_aux_loss`` (the weighted mean, before the coefficient).
    """
    options = dict(objective_options or {})
    fn = get_objective(objective, **options) if bypass is None else bypass_objective(objective, bypass, **options)
    if kl is not None:
        fn = with_kl_loss(fn, kl.kind, kl.coef, kl_aggregate(objective, options))
    K = num_micro_batches
    balance = router_aux_loss_coef > 0
    kwargs = dict(temperature=temperature, chunk_size=chunk_size, with_balance=balance)

    def forward(params, rows, plan=None, frozen=()):
        """log pi_theta of the response tokens [b, R] (packed: of the pass ``plan``'s rows), and with ``balance``
        the pass's ``Balance``."""
        model = nnx.merge(graphdef, params, *frozen)
        replay = dict(kwargs, routed=rows.routing)  # routing replay (R2): pi_old's experts, None without
        if plan is not None:
            return packed_response_logprobs(model, rows.input_ids, rows.attention_mask, plan, **replay)
        return response_logprobs(model, rows.input_ids, rows.attention_mask, rows.response_mask.shape[1], **replay)

    def aux_term(b, seen):
        """A pass's share of the mini-batch's load-balancing loss: its loss weighted by its share of the ``seen``
        real tokens."""
        return b.loss * b.tokens / seen

    def loss(logp, rows, totals):
        extra = {} if kl is None else {"ref_logp": rows.ref_logp}
        return fn(logp, rows.old_logp, rows.response_mask, rows.rewards, group_size, totals=totals,
                  advantages=rows.advantages, rollout_is_weights=rows.rollout_is_weights, **extra)

    def loss_and_grad(params: nnx.State, batch: UpdateBatch, frozen: nnx.State | None = None):
        held = () if frozen is None else (frozen,)
        run = functools.partial(forward, frozen=held)
        seen = jnp.maximum(jnp.sum(batch.attention_mask.astype(jnp.float32)), 1.0) if balance else None  # its tokens
        if batch.packing is not None:
            def run_pass(params, rows, one):  # with ``balance``, each pass's term joins its loss
                logp, b = run(params, rows, one)
                return logp, router_aux_loss_coef * aux_term(b, seen)

            out = accumulate_passes(run_pass if balance else run, loss, params, batch.replace(packing=None),
                                    batch.packing, batch.old_logp, unit=group_size, num_micro_batches=K,
                                    extra=AUX_METRIC if balance else None)
            if balance:  # the metric before the coefficient
                total, metrics, grads = out
                out = total, {**metrics, AUX_METRIC: metrics[AUX_METRIC] / router_aux_loss_coef}, grads
        else:
            def micro_loss(params, micro, totals):
                if not balance:
                    return loss(run(params, micro), micro, totals)
                logp, b = run(params, micro)
                value, metrics = loss(logp, micro, totals)
                term = aux_term(b, seen)  # the micro-batches' metrics are averaged: K x its share sums to the loss
                return value + router_aux_loss_coef * term, {**metrics, AUX_METRIC: term * K}

            grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
            out = accumulate_micro_batches(grad_fn, params, batch, unit=group_size, num_micro_batches=K)
        if kl is None:
            return out
        total, metrics, grads = out  # each micro-batch's KL is normalised by the mini-batch's totals: their sum
        return total, {**metrics, "actor/kl_loss": metrics["actor/kl_loss"] * K}, grads  # is the mini-batch's

    return loss_and_grad


@dataclasses.dataclass(frozen=True)
class KLLoss:
    """``algorithm.use_kl_loss``'s loss: the estimator (rl/kl.py ``KL_LOSS_TYPES``) and its coefficient."""

    kind: str
    coef: float


def kl_aggregate(objective: str, options: Mapping[str, Any]) -> Callable:
    """The KL loss's token aggregation for ``objective`` with ``options`` (over its registry defaults): its own
    loss_agg_mode and loss_scale (verl's actor aggregates the KL as its policy loss), token-mean where it has
    none (PACS)."""
    options = {**objective_spec(objective).defaults, **options}
    keys = ("loss_scale", "verl_micro_batch_size", "norm_length")
    scale = {k: options[k] for k in keys if k in options}
    mode = options.get("loss_agg_mode", "token-mean")
    return lambda kld, mask, totals: aggregate(kld, mask, mode, totals=totals, **scale)
