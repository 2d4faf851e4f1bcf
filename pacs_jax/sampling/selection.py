"""Token selection rules: greedy, temperature, top-k, top-p (nucleus).

The returned log-prob of a token is always taken from the full-vocabulary distribution
log_softmax(logits / T), before top-k / top-p restriction: that is the distribution the trainer
recomputes with its own forward pass. For greedy decoding (T = 0) the log-prob is log_softmax(logits),
i.e. T is treated as 1, so a greedy sample reports the policy's own probability of its argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pacs_jax.models import kernels
from pacs_jax.models.attention import resolve_impl
from pacs_jax.sampling import fused_selection_gpu


def restrict_to_top(scaled: jax.Array, top_k: int, top_p: jax.Array | None) -> jax.Array:
    """Set logits outside the top-k / top-p set to -inf: [B, V] -> [B, V] (float32).

    top_k = 0 disables top-k; top_p = None disables top-p. As in Hugging Face, top-k applies first,
    and top-p keeps the smallest set of the highest-probability survivors whose mass (renormalised
    over the survivors) reaches top_p; the most likely token is always kept. Ties with the last kept
    logit are kept too.
    """
    scaled = _top_k(scaled, top_k)
    if top_p is None:
        return scaled
    return _keep_from(scaled, _top_p_floor(scaled, top_p))


def _top_k(scaled: jax.Array, top_k: int) -> jax.Array:
    """[B, V] -> [B, V]: the logits below the k-th largest of their row set to -inf (top_k 0: unchanged)."""
    if not top_k:
        return scaled
    threshold = jax.lax.top_k(scaled, top_k)[0][:, -1]  # [B]: the k-th largest
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def _top_p_floor(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B, V] -> [B] uint32: the order key (``_order_keys``) of the largest logit value whose survivors
    (the logits at or above it) hold a mass of at least top_p.

    Sorts nothing: a 32-step bisection over the float32 values' order-preserving integer keys (32
    masked sums over V per row, where a sort of a 152k vocabulary per row and decode step cost minutes
    on a CPU evaluation of 256 samples).
    """
    probs = jax.nn.softmax(scaled, axis=-1)  # renormalised over the top-k survivors
    keys = _order_keys(scaled)

    def bisect(_, bounds):  # invariant: mass(keys >= lo) >= top_p > mass(keys >= hi)
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(jnp.where(keys >= mid[:, None], probs, 0.0), axis=-1) >= top_p
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lowest, highest = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)  # the largest is a finite logit's:
    lo, _ = jax.lax.fori_loop(0, 32, bisect, (lowest, highest + jnp.uint32(1)))  # + 1 never wraps
    return lo


def _keep_from(scaled: jax.Array, floor: jax.Array) -> jax.Array:
    """[B, V] -> [B, V]: the logits whose order key is below their row's floor [B] set to -inf (floor
    0 keeps every one)."""
    return jnp.where(_order_keys(scaled) >= floor[:, None], scaled, -jnp.inf)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (-inf lowest; equal floats, equal keys)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def first_argmax(x: jax.Array) -> jax.Array:
    """Index of the first maximum along the last axis: [B, V] -> [B] int32 (as ``jnp.argmax``).

    Written as a max followed by a min over float indices (exact for V < 2**24): two plain
    reductions, which XLA vectorises, where ``jnp.argmax``'s (value, index) reduction is several
    times slower on CPU for a 150k vocabulary. NaN rows give index 0.
    """
    return first_index_of(x, jnp.max(x, axis=-1))


def first_index_of(x: jax.Array, best: jax.Array) -> jax.Array:
    """Index of the first element equal to ``best`` [B] along the last axis of x [B, V]: [B] int32
    (``first_argmax`` with the maximum given; 0 where none is)."""
    index = jnp.arange(x.shape[-1], dtype=jnp.float32)
    first = jnp.min(jnp.where(x == best[:, None], index, jnp.float32(x.shape[-1])), axis=-1)
    return jnp.where(first < x.shape[-1], first, 0.0).astype(jnp.int32)


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tokens [B] int, stop_ids [S] int (padded with -1, which matches nothing) -> [B] bool: a stop id."""
    return jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)


def select_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array, *,
                  top_k: int) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row: logits [B, V] float32, keys [B] (one PRNG key per row) -> (tokens [B]
    int32, log-probs [B] float32).

    Row b's noise comes from keys[b] alone, so a row's token depends on its own key and logits,
    never on which other rows share the batch (the sampler's results do not depend on scheduling).
    ``temperature`` (0 = greedy) and ``top_p`` (1 = off) are traced scalars that choose a branch at
    run time (``lax.cond``: only the taken branch runs), so greedy evaluation and sampled training
    sampler calls share one compiled program. ``top_k`` is static (it is a shape). Sampling is the
    Gumbel-max trick (as ``jax.random.categorical``) over the top-k / top-p restricted logits.
    """
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0.0, temperature, 1.0)
    best = jnp.max(scaled, axis=-1)  # the greedy token's; XLA merges it with the log-normaliser's own

    @jax.named_scope("greedy_selection")  # scopes name the branches for tools/plan_step.py (hlo_cost)
    def greedy():
        return first_index_of(scaled, best)

    def sample():
        # the branch gives only the top-p floor [B], not the logits: a branch that returned its operand
        # (top_p off) copied all [B, V] of them every decode step
        survivors = _top_k(scaled, top_k)
        floor = jax.lax.cond(top_p < 1.0, jax.named_scope("top_p_bisection")(lambda: _top_p_floor(survivors, top_p)),
                             lambda: jnp.zeros(survivors.shape[:1], jnp.uint32))
        allowed = _keep_from(survivors, floor)
        noise = jax.vmap(lambda key: jax.random.gumbel(key, allowed.shape[-1:], jnp.float32))(keys)
        return first_argmax(allowed + noise)

    tokens = jax.lax.cond(temperature > 0.0, sample, greedy)
    log_norm = jax.nn.logsumexp(scaled, axis=-1)
    return tokens, jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - log_norm


@struct.dataclass
class Selection:
    """The selection parameters of a sampler call, one pytree: temperature [] float32 (0 = greedy) and
    top_p [] float32 (1 = off) traced, top_k (0 = off) static (``select_tokens``)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: int = struct.field(pytree_node=False, default=0)

    def select(self, logits: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
        """logits [B, V], keys [B] -> (tokens [B] int32, log-probs [B] float32)."""
        return select_tokens(logits, keys, self.temperature, self.top_p, top_k=self.top_k)

    def select_from_hidden(self, model, hidden: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The decode step's: final-normed hidden states [B, D], keys [B] -> (tokens [B] int32, log-probs
        [B] float32), ``select`` on ``model.logits``. Where models/kernels.py chooses our fused GPU kernel
        (sampling/fused_selection_gpu.py: the head's logits never written), it runs when top_p is 1;
        a call with top_p < 1 takes the logits' path (a ``lax.cond``: one program for both)."""
        head, vocab_major = model.output_head()
        logits = lambda: self.select(model.logits(hidden[:, None])[:, 0], keys)  # noqa: E731
        by_logits = jax.named_scope("logits_selection")(logits)
        reason = fused_selection_gpu.unsupported(head.shape[0 if vocab_major else 1], hidden.shape[-1], hidden.dtype)
        if self.top_k:
            reason = f"top_k {self.top_k} (the kernel selects from the whole vocabulary)"
        if kernels.token_selection(resolve_impl(model.cfg.attention), reason).impl != "gpu":
            return by_logits()
        fused = lambda: fused_selection_gpu.select(hidden, head.astype(hidden.dtype), keys, self.temperature,  # noqa: E731
                                                   vocab_major=vocab_major)
        return jax.lax.cond(self.top_p < 1.0, by_logits, fused)
