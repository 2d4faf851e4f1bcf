"""Fused, chunked per-token log-probabilities (and entropies) from final hidden states, and the
response log-probs of a model built on them (``response_logprobs``; a pass of them: ``logprobs_of_pass``).

Shapes: B batch, T tokens, D hidden, V vocabulary, C chunk length (tokens per sequence per step).

The full logits ``hidden @ lm_head`` are [B, T, V]: 10 GB in float32 for one 16k-token sequence of a
Qwen vocabulary. Here they never exist. A loop walks the T axis in chunks of C tokens; each step
builds the [B, C, V] logits of its chunk, reduces them to a log-sum-exp, the target's logit and
(optionally) the entropy, and drops them. The backward pass (a ``jax.custom_vjp``) keeps only the
[B, T] log-sum-exp (and entropy) from the forward pass and walks the chunks again: it recomputes a
chunk's logits, forms d loss / d logits for that chunk, and turns it into the chunk's slice of
d hidden and a contribution to d lm_head (accumulated in float32).

Sharding: the chunk loop runs along T, so the batch axis keeps its ("data", "fsdp") sharding and
the vocabulary axis of ``lm_head`` its "tensor" sharding; the per-chunk reductions over V become
all-reduces that GSPMD inserts. The target logit is picked with a compare-and-sum over V (not a
gather) for the same reason: a gather on a vocab-sharded array would all-gather it. On a mesh (the
one in context), the d lm_head accumulator keeps one partial sum per batch shard, [S, D, V] with S sharded
like the batch, so the loop does no cross-device reduction of the [D, V] gradient: it is summed
over the S shards once, after the loop (otherwise GSPMD all-reduces it in every chunk).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.numerics import batched_dot_operand
from pacs_jax.rl.micro_batches import put_strided_micro_batch, strided_micro_batch
from pacs_jax.rl.packing import (PackedPlanArrays, PassPlan, keep_own_rows, packed_inputs, packed_routing, pass_plan,
                                 response_stream, unpack, unpacked_routing)
from pacs_jax.sharding import batch_shards, constrain

DEFAULT_CHUNK_SIZE = 512


def token_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *, temperature: float = 1.0,
                   chunk_size: int = DEFAULT_CHUNK_SIZE, valid: jax.Array | None = None) -> jax.Array:
    """log softmax(hidden @ lm_head / temperature)[targets], without a [B, T, V] array.

    hidden [B, T, D] (any float dtype), lm_head [D, V], targets [B, T] int -> log-probs [B, T] float32.
    Differentiable w.r.t. hidden and lm_head (gradients come back in their dtypes). chunk_size: tokens
    per sequence per loop step (each step holds [B, chunk_size, V] float32 logits). Sharded on the mesh
    in context (see the module docstring). valid: None, or an int32 scalar (may be traced): only the
    chunks holding positions < valid are computed (a loop with that many trips; later positions are
    0, with zero gradient), for a stream whose real positions come first (packed rows' responses).
    """
    _check(hidden, lm_head, targets, temperature, chunk_size)
    logp, _ = _fused(hidden, lm_head, targets, _valid(valid, hidden), float(temperature), int(chunk_size), False)
    return logp


def token_logprobs_and_entropy(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *,
                               temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                               valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Like ``token_logprobs``, plus the entropy of each token's distribution.

    Returns (log-probs [B, T] float32, entropy [B, T] float32); both are differentiable.
    """
    _check(hidden, lm_head, targets, temperature, chunk_size)
    return _fused(hidden, lm_head, targets, _valid(valid, hidden), float(temperature), int(chunk_size), True)


def _valid(valid, hidden) -> jax.Array | None:
    """The number of leading positions to compute, int32 [] (None: all of T, a loop of static length)."""
    return None if valid is None else jnp.asarray(valid, jnp.int32)


def response_logprobs(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array, response_length: int, *,
                      temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = False,
                      routed: jax.Array | None = None, with_routing: bool = False, with_balance: bool = False):
    """log pi(response token t | everything before it): input_ids, attention_mask [B, P + R] -> [B, R] float32.

    The one log-prob path of the trainer (pi_old after the rollout, pi_theta in the update, the
    warm-start): the hidden state at position P - 1 + t predicts response token t, so these are
    ``token_logprobs`` of hidden[:, P-1:L-1] against input_ids[:, P:]. With ``with_entropy``,
    returns (log-probs [B, R], entropy of each token's distribution [B, R]). A model with experts:
    ``routed`` [B, P + R, layers, k] replays those experts (routing replay, models/moe.py); with
    ``with_routing`` the return is (the above, the experts its router chose [B, P + R, layers, k] int32). With
    ``with_balance`` it is (the above, ``Balance``: the routers' load-balancing loss over the real tokens, and
    their number), last.
    """
    prompt_length = input_ids.shape[1] - response_length
    hidden, *extra = _forward_hidden(model, input_ids, routed, with_routing, with_balance,
                                     attention_mask=attention_mask)  # [B, L, D]
    args = (hidden[:, prompt_length - 1:-1], model.lm_head_kernel(), input_ids[:, prompt_length:])
    kwargs = dict(temperature=temperature, chunk_size=chunk_size)
    out = token_logprobs_and_entropy(*args, **kwargs) if with_entropy else token_logprobs(*args, **kwargs)
    return _with_extra(out, extra, with_balance, lambda: jnp.sum(attention_mask.astype(jnp.float32)))


def packed_response_logprobs(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array,
                             plan: PassPlan, *, temperature: float = 1.0,
                             chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = False,
                             routed: jax.Array | None = None, with_routing: bool = False,
                             with_balance: bool = False):
    """``response_logprobs`` of one pass's rows computed on its packed rows (rl/packing.py): input_ids,
    attention_mask [B_m, P + R] (the mini-batch's padded rows, read through ``plan.pack_index``
    [S N, Lp]) -> [B_m, R] float32 (and entropy [B_m, R]), the padded rows' numbers at every response
    token of the pass's own rows (``rl.packing.own_rows``), from S N x Lp tokens through the decoder
    and only the response stream [S, Q] through the LM head. plan: one pass's arrays
    (``rl.packing.run_passes``). routed [B_m, P + R, layers, k]: the experts to replay, packed as the
    tokens; with ``with_routing`` the return is (the above, the router's own choice [S N, Lp, layers, k]
    int32 on the packed rows: ``rl.packing.unpacked_routing`` puts it back in the rows); with ``with_balance``,
    the load-balancing loss of the pass's packed tokens last (``response_logprobs``).
    """
    tokens, segment_ids, positions, targets = packed_inputs(input_ids, attention_mask, plan.pack_index)
    replay = None if routed is None else packed_routing(routed, plan.pack_index)
    hidden, *extra = _forward_hidden(model, tokens, replay, with_routing, with_balance, segment_ids=segment_ids,
                                     positions=positions)  # [S N, Lp, D]
    args = (response_stream(hidden, plan.stream_index), model.lm_head_kernel(),
            response_stream(targets, plan.stream_index))  # [S, Q, D], [D, V], [S, Q]
    # chunks of at most R stream positions: the [S, chunk, V] logits of a trip no larger than a padded row's
    kwargs = dict(temperature=temperature, chunk_size=min(chunk_size, plan.unpack_index.shape[1]),
                  valid=plan.stream_length)
    if not with_entropy:
        out = unpack(token_logprobs(*args, **kwargs), plan.unpack_index)
    else:
        logp, entropy = token_logprobs_and_entropy(*args, **kwargs)
        out = unpack(logp, plan.unpack_index), unpack(entropy, plan.unpack_index)
    return _with_extra(out, extra, with_balance, lambda: jnp.sum((segment_ids > 0).astype(jnp.float32)))


class Balance(NamedTuple):
    """A forward pass's load-balancing loss of its routers (models/moe.py ``load_balance_loss``, float32 []) and
    the real tokens it is over (float32 [])."""

    loss: jax.Array
    tokens: jax.Array


def _forward_hidden(model, tokens, routed, with_routing: bool, with_balance: bool, **inputs) -> list:
    """[hidden [B, L, D], then the routing record with ``with_routing``, the balance loss with ``with_balance``]."""
    out = model(tokens, return_hidden=True, routed=routed, with_routing=with_routing, with_balance=with_balance,
                **inputs)
    return list(out) if with_routing or with_balance else [out]


def _with_extra(out, extra: list, with_balance: bool, tokens: Callable[[], jax.Array]):
    """``out`` alone, or (out, the routing record, ``Balance``) as asked (``extra``: the model's outputs after the
    hidden states; ``tokens()``: the pass's real tokens, counted only for the balance)."""
    if with_balance:
        extra = [*extra[:-1], Balance(extra[-1], tokens())]
    return (out, *extra) if extra else out


def logprobs_of_pass(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array, response_length: int,
                     out, k: jax.Array, *, num_micro_batches: int = 1, temperature: float = 1.0,
                     chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = False,
                     packing: PackedPlanArrays | None = None, routing: jax.Array | None = None,
                     routed: jax.Array | None = None):
    """Pass ``k`` (int32 []) of a batch's ``response_logprobs`` without gradient, its rows written into
    ``out`` (returned): log-probs [B, R] float32, or with ``with_entropy`` (log-probs, entropy). One
    pass is a micro-batch's forward: padded (``packing`` None), micro-batch k of ``num_micro_batches``
    of B / K strided rows (``rl.micro_batches.split_micro_batches``); packed, pass k of the plan
    (rl/packing.py ``PackedPlanArrays``), its own rows (``rl.packing.own_rows``). Every k
    (< K, or < the plan's passes) once, in any order, gives every row: pi_old dispatches one call a
    pass (training/learner/old_policy.py), so activation memory is a micro-batch's and the host sees each
    pass end. routing: a model with experts, the record [B, P + R, layers, k] the pass's rows' routing is
    written into (the experts pi_old's router chose); the return is then (out, routing). routed: None or
    [B, P + R, layers, k], the experts the pass runs on (routing replay R3: the sampler's)."""
    kwargs = dict(temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                  with_routing=routing is not None)
    if packing is not None:
        one = pass_plan(packing, k)
        new = packed_response_logprobs(model, input_ids, attention_mask, one, routed=routed, **kwargs)
        if routing is None:
            return jax.lax.stop_gradient(keep_own_rows(one, k, out, new))
        values, packed = new
        return jax.lax.stop_gradient((keep_own_rows(one, k, out, values),
                                      unpacked_routing(packed, one.pack_index, routing)))
    K = num_micro_batches
    micro = lambda x: constrain(strided_micro_batch(x, K, k), ("batch",) + (None,) * (x.ndim - 1))  # noqa: E731
    new = response_logprobs(model, micro(input_ids), micro(attention_mask), response_length,
                            routed=None if routed is None else micro(routed), **kwargs)
    full = out if routing is None else (out, routing)
    return jax.lax.stop_gradient(jax.tree.map(lambda a, v: put_strided_micro_batch(a, v, K, k), full, new))


def _check(hidden, lm_head, targets, temperature, chunk_size) -> None:
    """Shape and argument checks, on static facts only (works on tracers)."""
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, T, D], got shape {hidden.shape}")
    if lm_head.ndim != 2 or lm_head.shape[0] != hidden.shape[2]:
        raise ValueError(f"lm_head must be [D, V] with D={hidden.shape[2]} (hidden's last dim), "
                         f"got shape {lm_head.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets must be [B, T]={hidden.shape[:2]} like hidden, got {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _chunk_logits(h: jax.Array, w: jax.Array, temperature: float) -> jax.Array:
    """h [B, C, D], w [D, V] -> logits / temperature [B, C, V] float32 (one chunk only)."""
    z = jnp.einsum("bcd,dv->bcv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return z / temperature


def _target_logit(z: jax.Array, y: jax.Array) -> jax.Array:
    """z [B, C, V], y [B, C] -> z[b, c, y[b, c]] [B, C] via compare-and-sum (sharding-friendly)."""
    vocab = jax.lax.broadcasted_iota(y.dtype, z.shape, 2)
    return jnp.sum(jnp.where(vocab == y[..., None], z, 0.0), axis=-1)


def _pad_to_chunks(hidden, targets, chunk):
    """Pad T up to a multiple of the chunk length; returns (hidden, targets, number of chunks)."""
    T = hidden.shape[1]
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    return hidden, targets, n


def _trips(valid, C: int, n: int):
    """Chunks of C positions to compute: those holding positions < valid (at most n; n when None)."""
    return n if valid is None else jnp.minimum((valid + C - 1) // C, n)


def _forward(hidden, lm_head, targets, valid, temperature, chunk_size, with_entropy):
    """Returns (logp [B, T], entropy [B, T] or None, lse [B, T]) all float32."""
    B, T, _ = hidden.shape
    C = min(chunk_size, T)
    h_all, y_all, n = _pad_to_chunks(hidden, targets, C)

    def step(i, acc):
        h = jax.lax.dynamic_slice_in_dim(h_all, i * C, C, axis=1)
        y = jax.lax.dynamic_slice_in_dim(y_all, i * C, C, axis=1)
        z = _chunk_logits(h, lm_head, temperature)
        lse = jax.nn.logsumexp(z, axis=-1)
        out = {"logp": _target_logit(z, y) - lse, "lse": lse}
        if with_entropy:
            logp_all = z - lse[..., None]  # -sum p log p, not lse - sum p z: no cancellation
            out["ent"] = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return {k: jax.lax.dynamic_update_slice_in_dim(acc[k], v, i * C, axis=1) for k, v in out.items()}

    names = ("logp", "lse", "ent") if with_entropy else ("logp", "lse")
    acc = jax.lax.fori_loop(0, _trips(valid, C, n), step, {k: jnp.zeros((B, n * C), jnp.float32) for k in names})
    return acc["logp"][:, :T], (acc["ent"][:, :T] if with_entropy else None), acc["lse"][:, :T]





@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(hidden, lm_head, targets, valid, temperature, chunk_size, with_entropy):
    logp, ent, _ = _forward(hidden, lm_head, targets, valid, temperature, chunk_size, with_entropy)
    return logp, ent


def _fused_fwd(hidden, lm_head, targets, valid, temperature, chunk_size, with_entropy):
    logp, ent, lse = _forward(hidden, lm_head, targets, valid, temperature, chunk_size, with_entropy)
    return (logp, ent), (hidden, lm_head, targets, valid, lse, ent)


def _fused_bwd(temperature, chunk_size, with_entropy, residuals, cotangents):
    """d logp_t / d z_k = [k = y_t] - p_k;  d H_t / d z_k = -p_k (log p_k + H_t)."""
    hidden, lm_head, targets, valid, lse, ent = residuals
    g_logp, g_ent = cotangents
    B, T, D = hidden.shape
    C = min(chunk_size, T)
    S = batch_shards() if B % batch_shards() == 0 else 1  # the batch's shards on the mesh in context
    h_all, y_all, n = _pad_to_chunks(hidden, targets, C)
    pad = ((0, 0), (0, n * C - T))
    g_logp, lse = jnp.pad(g_logp, pad), jnp.pad(lse, pad)
    if with_entropy:
        g_ent, ent = jnp.pad(g_ent, pad), jnp.pad(ent, pad)

    def step(i, acc):
        d_hidden, d_head = acc
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, i * C, C, axis=1)  # noqa: E731
        h, y = sl(h_all), sl(y_all)
        z = _chunk_logits(h, lm_head, temperature)
        logp_all = z - sl(lse)[..., None]
        p = jnp.exp(logp_all)
        vocab = jax.lax.broadcasted_iota(y.dtype, z.shape, 2)
        dz = sl(g_logp)[..., None] * ((vocab == y[..., None]).astype(jnp.float32) - p)
        if with_entropy:
            dz = dz - sl(g_ent)[..., None] * p * (logp_all + sl(ent)[..., None])
        dz = (dz / temperature).astype(h.dtype)  # d loss / d (h @ w), in the compute dtype
        d_h = jnp.einsum("bcv,dv->bcd", dz, lm_head.astype(h.dtype), preferred_element_type=jnp.float32)
        d_hidden = jax.lax.dynamic_update_slice_in_dim(d_hidden, d_h.astype(d_hidden.dtype), i * C, axis=1)
        per_shard = jnp.einsum("sbcd,sbcv->sdv", batched_dot_operand(h.reshape(S, B // S, C, D)),
                               batched_dot_operand(dz.reshape(S, B // S, C, -1)), preferred_element_type=jnp.float32)
        return d_hidden, d_head + per_shard

    d_head = constrain(jnp.zeros((S, *lm_head.shape), jnp.float32), ("batch", None, "vocab"))
    d_hidden, d_head = jax.lax.fori_loop(0, _trips(valid, C, n), step, (jnp.zeros((B, n * C, D), hidden.dtype), d_head))
    return d_hidden[:, :T], jnp.sum(d_head, axis=0).astype(lm_head.dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd)
