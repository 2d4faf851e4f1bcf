"""The sampling engine's public seam: the parts a scheduler builds its sampler programs from. The
one-call sampler (engine.py: ``sample``, ``lower_sample``) and carry-over (carry_over*.py) are two
schedulers over them; neither reaches into the other's private functions.

Shapes: P prompts (padded), T prompt length (left-padded), n samples per prompt, Q = P n rows (row
i n + j is sample j of prompt i), C decode slots, N = max_new_tokens, S stop-id slots, V vocabulary,
L layers, K K/V heads, Dh head size.

    layout   ``decode_model(graphdef, state)``: the model with its parameters cast and laid out for
             decode once per program (``decode_layout``): replicated over the batch axes, split over
             "tensor" only
    prefill  ``prefill(model, ...)``: [P, T] prompts -> ``Prefilled``: each prompt's K/V and token 0 of
             each of its n rows (``QueueInputs``, the queue's inputs), where each row runs
             (``spread_rows``) and the prompt tokens computed
    queues   ``on_queues(fn, axes, whole, split)``: a per-queue function once per batch shard under
             ``shard_map`` (manual over the batch axes ``axes``, its results stacked on a leading queue
             axis), or once on the whole call; ``queues`` / ``queue_shards`` how many;
             ``queue_shares`` / ``input_shares`` a whole call's arrays as each queue's share
    insert, decode, harvest   one queue's state is a ``decode.DecodeState`` over a K/V store
             (sampling/decode.py): ``decode.refill`` puts waiting rows into free slots,
             ``decode.decode_step`` / ``decode.decode_chunk`` run decode steps, ``decode.result`` /
             the state's ``outputs`` hold the finished rows
    chunks   ``run_chunks``: a call's chunk programs, each queued before the last one's progress is
             read, until one says it is done
    lowering ``abstract_results`` (a compiled program's results as abstract arrays, to lower the next
             program on them) and ``device_bytes`` (bytes one device holds of a tree)

``EngineSpec`` is the static part of a call (sampler kind, n, N, C, ...); ``stop_id_array`` pads the
stop ids; ``PAD_ID`` is written after a row's end.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from pacs_jax.models.moe import MoE, routing_dtype
from pacs_jax.models.qwen import KVCache, positions_from_mask, unstack_layers
from pacs_jax.sampling.buckets import round_up
from pacs_jax.sampling.selection import Selection
from pacs_jax.sharding import constrain, current_rules, decode_rules, platform

PAD_ID = 0  # token id written after a sample's end (its response_mask is 0 there)
STOP_ID_SLOTS = 8  # stop ids are padded to a multiple of this, so changing them rarely recompiles


def stop_id_array(stop_token_ids) -> np.ndarray:
    """Stop ids padded with -1 (never matches) to a multiple of STOP_ID_SLOTS: [S] int32."""
    stop_ids = np.full(round_up(max(len(stop_token_ids), 1), STOP_ID_SLOTS), -1, np.int32)
    stop_ids[:len(stop_token_ids)] = stop_token_ids
    return stop_ids


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The static part of a sampler call (the program's one static argument): the sampler ``kind``
    ("static": a slot per row, "continuous": ``slots`` slots, both over contiguous cache rows;
    "paged": ``slots`` slots over a page pool of ``page_size``-token pages, ``pages`` response pages
    a queue or None: ``paged.default_pages``), n samples a prompt, max_new_tokens, the decode slots
    and tail_slots (None: no narrowing) of the call, and the decode steps a chunk program runs."""

    kind: str
    n: int
    max_new_tokens: int
    slots: int
    tail_slots: int | None
    page_size: int | None = None
    pages: int | None = None
    chunk_steps: int = 1
    routing: bool = False  # record every token's experts (a model with experts: ``SampleArrays.routing``)

    def per_queue(self, shards: int) -> "EngineSpec":
        """The spec of one of ``shards`` queues: their share of the slots and the tail."""
        tail = None if self.tail_slots is None else max(self.tail_slots // shards, 1)
        return dataclasses.replace(self, slots=self.slots // shards, tail_slots=tail)


def queues(prompts: int, slots: int, batch_shards: int) -> int:
    """The sampler's queues (decode loops) for a call: one per batch shard when the shards divide
    both the prompts and the slots, else one for the whole call."""
    return batch_shards if prompts % batch_shards == 0 and slots % batch_shards == 0 else 1


def queue_shards(axes: tuple[str, ...]) -> int:
    """S, the queues of a call split over ``axes`` of the mesh in context (1 for none)."""
    mesh = current_rules().mesh
    return math.prod(mesh.shape[a] for a in axes)


def on_queues(fn, axes: tuple[str, ...], whole: tuple, split: tuple, split_in=None):
    """``fn(*whole, *split)`` once per queue: with ``axes`` (the batch axes of the mesh in context, S =
    ``queue_shards(axes)`` queues), under ``shard_map`` manual over them (the other axes automatic),
    ``whole`` replicated to every queue, each queue's ``split`` arguments stacked on a leading queue
    axis [S, ...] (``split_in``: their partition specs instead, for arrays not stacked: each queue
    takes its block), its results stacked [S, ...]; without ``axes``, once on the whole call."""
    if not axes:
        return fn(*whole, *split)
    stacked = PartitionSpec(axes)
    specs = split_in if split_in is not None else tuple(stacked for _ in split)
    unstack = (lambda x: x) if split_in is not None else _unstacked
    return jax.shard_map(lambda *a: _stacked(fn(*a[:len(whole)], *unstack(a[len(whole):]))), mesh=current_rules().mesh,
                         in_specs=(*(PartitionSpec() for _ in whole), *specs), out_specs=stacked,
                         axis_names=set(axes), check_vma=False)(*whole, *split)


def queue_shares(tree, axes: tuple[str, ...], axis: int = 0):
    """With ``axes``, each array [..., S k, ...] of ``tree`` (S k its dim ``axis``) as each queue's share
    stacked, [S, ..., k, ...] (queue q takes q k .. q k + k - 1, as the one-call sampler's shards split the
    prompts); as it is without."""
    if not axes:
        return tree
    shards = queue_shards(axes)
    return jax.tree.map(lambda x: jnp.moveaxis(
        x.reshape(*x.shape[:axis], shards, x.shape[axis] // shards, *x.shape[axis + 1:]), axis, 0), tree)


def input_shares(inputs, axes: tuple[str, ...]):
    """A prefill's ``QueueInputs`` of the whole call as each queue's share (``queue_shares``: the K/V
    [L, P, K, T, Dh] split over P, the others over their first axis), its stop ids left out (None)."""
    return queue_shares(inputs._replace(prompt_cache=None, stop_ids=None), axes)._replace(
        prompt_cache=queue_shares(inputs.prompt_cache, axes, axis=1))


def _stacked(tree):
    """A queue's arrays with a leading queue axis (``shard_map`` joins the queues' along it)."""
    return jax.tree.map(lambda x: x[None], tree)


def _unstacked(tree):
    """The inverse of ``_stacked`` inside a queue's ``shard_map``."""
    return jax.tree.map(lambda x: x[0], tree)


def decode_layout(state: nnx.State, dtype) -> nnx.State:
    """The parameters as decode reads them: floats in the compute dtype, replicated over the batch
    axes of the mesh in context and split over "tensor" only (one gather per call, none per decode
    step), and, but on TPU, the layers' stacked [L, ...] parameters as L buffers [...] of their own
    (``qwen.unstack_layers``): XLA:GPU copies a layer scan's slice of a stack to a buffer of its own for
    each gemm inside a decode loop (7 a layer), XLA:TPU reads it in place (and its larger programs
    would compile slower unrolled)."""
    rules = decode_rules(current_rules())

    def place(x: jax.Array, logical_axes) -> jax.Array:
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        if logical_axes is None:
            return x
        return jax.lax.with_sharding_constraint(x, rules.sharding(logical_axes, x.shape))

    per_layer = platform() != "tpu"

    def cast(var: nnx.Variable) -> nnx.Variable:
        axes = getattr(var, "logical_axes", None)
        if per_layer and axes and axes[0] == "layers":
            return var  # placed a layer at a time by ``unstack_layers``
        return var.replace(value=place(var.get_value(), axes))

    state = jax.tree.map(cast, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return unstack_layers(state, place) if per_layer else state


def decode_model(graphdef: nnx.GraphDef, state: nnx.State) -> nnx.Module:
    """The model with its parameters in the decode layout (``decode_layout``), as the sampler runs it
    (``sampling_model``)."""
    return sampling_model(graphdef, decode_layout(state, jnp.dtype(nnx.merge(graphdef, state).cfg.dtype)))


def sampling_model(graphdef: nnx.GraphDef, layout: nnx.State) -> nnx.Module:
    """``nnx.merge(graphdef, layout)`` for the sampler's programs: a mixture of experts dispatches its tokens with every
    expert on every device, as the decode layout holds them (``model.expert_parallel`` is the learner's: its
    worst-case buffers would grow every prefill fsdp-fold for nothing)."""
    model = nnx.merge(graphdef, layout)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, MoE) and node.cfg.expert_parallel:
            node.cfg = dataclasses.replace(node.cfg, expert_parallel=False)
    return model


def spread_rows(real: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each real prompt's samples run: the rows of the R real prompts spread evenly over all P
    batch positions, so contiguous blocks of positions (batch shards) hold equal work whatever the
    number and places of the batch-padding prompts.

    real: [P] bool, False for batch-padding prompts. Real prompt k (in order, k < R) takes positions
    floor(k P / R) .. floor((k + 1) P / R) - 1 (one or more, adjacent); its m-th of c positions takes
    samples floor(m n / c) .. floor((m + 1) n / c) - 1. Without padding (R = P) this is the identity.
    Returns (prompt [P] int32: the prompt whose copy position p holds; first [P] int32: its first
    sample there; count [P] int32: how many, 0 .. n, summing to R x n; all 0 when R = 0).
    """
    P = real.shape[0]
    R = jnp.sum(real, dtype=jnp.int32)
    ranked = jnp.argsort(~real, stable=True).astype(jnp.int32)  # the real prompts first, in order
    p = jnp.arange(P, dtype=jnp.int32)
    divisor = jnp.maximum(R, 1)
    k = ((p + 1) * R + P - 1) // P - 1  # the real prompt of position p: floor(k P / R) <= p
    start = k * P // divisor
    copies = jnp.maximum((k + 1) * P // divisor - start, 1)
    m = p - start
    first = m * n // copies
    count = jnp.where(R > 0, (m + 1) * n // copies - first, 0)
    return ranked[jnp.clip(k, 0, P - 1)], first, count


class QueueInputs(NamedTuple):
    """One queue's share of a call (all of it, or a batch shard's under ``shard_map``).

    prompt_cache: K/V [L, P, K, T, Dh] of the prefill; prompt_real [P, T] bool; real [Q] bool, False
    for rows that hold no sample (those of batch-padding prompts); first_tokens [Q] int32,
    first_logp [Q] float32: token 0 of each row; budgets [Q] int32; row_keys [Q] PRNG keys;
    stop_ids [S] int32 (the same for every queue).
    """

    prompt_cache: KVCache
    prompt_real: jax.Array
    real: jax.Array
    first_tokens: jax.Array
    first_logp: jax.Array
    budgets: jax.Array
    row_keys: jax.Array
    stop_ids: jax.Array


class Prefilled(NamedTuple):
    """What ``prefill`` gives the queues (inside a program)."""

    model: nnx.Module  # the model in the decode layout
    inputs: QueueInputs  # the loop's inputs: the prompts' K/V, token 0 of every row, budgets, keys
    origin: jax.Array  # [Q] int32: each position's row i*n + j, Q where none
    prefill_tokens: jax.Array  # [] int32: prompt tokens the prefill computed
    prompt_routing: jax.Array | None = None  # [P, T, L, k]: each prompt's tokens' experts (``record_routing``)


def prefill(model: nnx.Module, prompt_tokens: jax.Array, prompt_mask: jax.Array, budgets: jax.Array,
            key: jax.Array, selection: Selection, stop_ids: jax.Array, *, n: int, spread: bool,
            record_routing: bool = False) -> Prefilled:
    """Everything before the decode loop (``model`` in the decode layout, ``decode_model``): the rows
    spread over the positions (``spread``: when the batch shards run their own queues, ``spread_rows``),
    the prefill and token 0 of every row.

    prompt_tokens, prompt_mask: [P, T] (an all-zero mask row is batch padding: its rows hold no
    sample); budgets [Q] ints, each row's; key: the call's PRNG key (row i n + j's is
    ``fold_in(fold_in(key, i), j)``); selection: temperature, top_p, top_k; stop_ids [S] int32.
    record_routing: a model with experts, the experts of every prompt token in every layer come back
    (``Prefilled.prompt_routing``, in the call's prompt order).
    """
    P, T = prompt_tokens.shape
    Q = P * n
    prefill_tokens = jnp.sum(prompt_mask != 0, dtype=jnp.int32)
    real = jnp.any(prompt_mask != 0, axis=-1)  # [P]: False for batch-padding prompts

    # Position p holds samples first[p] .. first[p] + count[p] - 1 of prompt source[p]: spread evenly
    # over the positions when each batch shard runs its own queue (one queue needs no spreading).
    if spread:
        source, first, count = spread_rows(real, n)
        prompt_tokens, prompt_mask = prompt_tokens[source], prompt_mask[source]
    else:
        source, first, count = jnp.arange(P), jnp.zeros(P, jnp.int32), jnp.where(real, n, 0)
    samples = first[:, None] + jnp.arange(n)  # [P, n]: sample j of each position's rows
    held = (jnp.arange(n) < count[:, None]).reshape(Q)  # [Q]: False for rows without a sample
    origin = jnp.where(held, (source[:, None] * n + samples).reshape(Q), Q)  # [Q]: row i*n + j, Q if none
    budgets = budgets.astype(jnp.int32)
    if spread:
        budgets = budgets[jnp.minimum(origin, Q - 1)]

    # Prefill. All-padding prompts (batch padding) get one visible slot so their attention is
    # defined; their rows come back empty.
    prompt_tokens = constrain(prompt_tokens.astype(jnp.int32), ("batch", "length"))
    prompt_real = constrain(prompt_mask.astype(bool), ("batch", "length"))
    padding_row = ~jnp.any(prompt_real, axis=-1)  # [P]
    visible = prompt_real.at[:, -1].set(prompt_real[:, -1] | padding_row)
    out = model.forward(prompt_tokens, positions_from_mask(visible), visible, model.init_cache(P, T), 0,
                        with_routing=record_routing)
    hidden, prompt_cache = out[:2]
    prompt_routing = None
    if record_routing:  # back to the call's prompt order (a prompt spread over positions: one copy's)
        experts = out[2].astype(routing_dtype(model.cfg.num_experts))
        prompt_routing = constrain(jnp.zeros_like(experts).at[source].set(experts), ("batch", None, None, None))
    last = jnp.max(jnp.where(visible, jnp.arange(T), 0), axis=-1)  # [P]: T - 1 when left-padded
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [P, 1, D]
    first_logits = model.logits(last_hidden)[:, 0]  # [P, V]: only the last real position is needed

    # Token 0 of every row, sample by sample (one [P, V] selection at a time, not [Q, V]); the key of
    # a row is that of its prompt and sample, wherever it runs.
    row_keys = jax.vmap(lambda i, js: jax.vmap(lambda j: jax.random.fold_in(jax.random.fold_in(key, i), j))(js))(
        source, samples)  # [P, n]
    first_tokens, first_logp = jax.lax.map(
        lambda keys: selection.select(first_logits, jax.vmap(jax.random.fold_in)(keys, jnp.zeros(P, jnp.int32))),
        row_keys.T)  # [n, P] each
    rows = lambda x: x.T.reshape(Q)  # [n, P] -> [Q], row p*n + j
    inputs = QueueInputs(prompt_cache, prompt_real, held, rows(first_tokens), rows(first_logp), budgets,
                         row_keys.reshape(Q), stop_ids)
    return Prefilled(model, inputs, origin, prefill_tokens, prompt_routing)


def run_chunks(chunk: Callable, loop, read: Callable, wait: Callable | None):
    """A call's chunk programs until one's progress says it is done: ``chunk(loop) -> (loop, progress
    array)``, ``read(progress) -> a progress with .done`` (``DecodeProgress.read``), ``wait(progress,
    last)`` as ``engine.sample``'s. The next chunk is queued before a chunk's progress is read, so the device
    never waits for the host (the chunk after the last runs no step). Returns the last loop state."""
    pending, last = None, None
    while True:
        loop, progress = chunk(loop)
        if pending is not None:
            if wait is not None:
                wait(pending, last)
            last = read(pending)
            if last.done:
                return loop
        pending = progress


def abstract_results(lowered: jax.stages.Lowered, compiled: jax.stages.Compiled):
    """A compiled program's results, abstract: ``jax.ShapeDtypeStruct``s of their shapes and the
    shardings it gives them (what the next program of a call is lowered on)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), lowered.out_info,
                        compiled.output_shardings)


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs (with shardings: its largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total
