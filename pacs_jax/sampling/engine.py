"""The sampler's programs: one prefill per prompt, then its n samples decoded by a fixed number of
slots in jitted loops (continuous batching, as vLLM and JetStream keep their decode batch full), run
a chunk of decode steps per program so the host can read the call's progress and stop it between two.
The one-call scheduler over the engine's public seam (sampling/seam.py: layout, prefill, queues,
chunks), which carry-over (sampling/carry_over.py) schedules differently.

Shapes: P prompts (padded), T prompt length (left-padded), n samples per prompt, Q = P * n rows (row
i*n + j is sample j of prompt i), C decode slots (``settings.slots``; C = Q is static batching),
N = max_new_tokens, S = T + N cache slots per decode slot, V vocabulary, L layers, D hidden.

    layout   the parameters cast to the compute dtype and laid out for decode once per call:
             replicated over the batch axes ("data", "fsdp"), split over "tensor" only, so no decode
             step gathers a weight over the network (docs/design.md section 3.2; ``seam.decode_model``)
    prefill  (``seam.prefill``) [P, T] prompts -> K/V [L, P, T] and the last prompt position's logits [P, V]; token 0 of
             every row is selected from them (the prompt is processed once, not n times)
    decode   one queue's decode loop (sampling/decode.py) over a K/V store: each of the C slots
             holds one row at a time; a step feeds every busy slot its last token and selects its
             token t; a row that stops (stop id, or its own budget) frees its slot in that step, and
             the slot takes the next waiting row at once. The loop ends when no row is left waiting
             or running. The store (``EngineSpec.kind``): "static" and "continuous" a cache row of
             S slots per decode slot (sampling/contiguous.py; static: C = Q), "paged" a page pool,
             each prompt's K/V stored once for its n rows (sampling/paged.py).
    tail     with ``settings.tail_slots``, once no row is waiting the decode batch narrows as rows
             end (``narrowing_widths``): the running rows move to the first w slots and a loop of
             width w goes on, so the long tail does not decode C mostly idle slots (vLLM's batch
             shrinks the same way as its requests finish).

Queues per batch shard: on a mesh whose batch axes split P and C, the decode loop runs under
``shard_map`` (``seam.on_queues``), manual over the batch axes, so a shard's slots take only its own prompts' rows and a
refill never crosses devices; the "tensor" axis stays automatic (tensor-parallel layers inside).
Before the prefill, the real prompts' rows are spread evenly over the P batch positions
(``seam.spread_rows``): batch-padding prompts (an all-zero mask row) hold no work, so without this the
shards holding them would idle while the others ran all the rows. A position p takes a copy of one
real prompt and a contiguous range of its samples (a real prompt gets about P / (real prompts)
positions and its n samples are split over them), so every position, and every shard, holds n x
(real prompts) / P rows up to rounding. The outputs are scattered back to rows i*n + j. Without
batch padding every prompt keeps its own position and all its samples (the identity).

Results do not depend on scheduling: token t of row (i, j) is selected with the key
``fold_in(fold_in(fold_in(key, i), j), t)`` and from that row's logits alone, so the same row gets the
same tokens whatever slot, position or shard it ran in, when, and beside which other rows (up to the
float round-off of a matmul over a different batch).

A sampler call (``sample``) is three ``jax.jit`` programs of pure functions (docs/design.md 3.2):
``_start_program`` (layout, prefill, each queue's store and first refill), ``_chunk_program`` (up to
``EngineSpec.chunk_steps`` decode steps of every queue, its loop state donated; it returns the
call's progress, replicated), called until every queue is done, and ``_finish_program`` (the rows
back in place). The model is ``nnx.split`` by the caller and its graphdef is a static argument, so
calls with the same shapes reuse one compilation of each. Static: shapes, the ``EngineSpec``
(sampler kind, n, max_new_tokens, slots, tail_slots, pages, chunk_steps) and top_k. Traced:
temperature (0 = greedy), top_p (with top_k the ``Selection``), the key, the per-row budgets and the
stop ids, so greedy evaluation and sampled training share programs. The K/V cache is allocated by
the start program, kept on the device between chunks and freed when the call's results are made.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from pacs_jax.models.moe import routing_dtype, routing_shape
from pacs_jax.models.qwen import KVCache
from pacs_jax.sampling import decode
from pacs_jax.sampling.contiguous import RowStore
from pacs_jax.sampling.narrowing import WidthLoop, start_widths
from pacs_jax.sampling.paged import PageStore, default_pages
from pacs_jax.sampling.seam import (PAD_ID, EngineSpec, QueueInputs, abstract_results, decode_model, device_bytes,
                                    on_queues, prefill, queue_shards, queues, run_chunks, sampling_model,
                                    stop_id_array)
from pacs_jax.sampling.selection import Selection
from pacs_jax.sampling.settings import SamplingSettings, row_pages
from pacs_jax.sharding import MeshRules, constrain, current_mesh, current_rules, decode_rules, replicated

_TRACE_COUNT = 0


def compile_count() -> int:
    """How many times the sampler's start program has been traced (= compiled) in this process: once
    per call shape (its chunk and finish programs come with it)."""
    return _TRACE_COUNT


class SampleArrays(NamedTuple):
    """Device arrays of one sampler call; rows i*n .. i*n+n-1 are the samples of prompt i.

    tokens:        [Q, N] int32, generated ids (stop id included), PAD_ID after the end
    logprobs:      [Q, N] float32, log_softmax(logits / T) of each generated token (T = 1 if greedy), 0 after the end
    response_mask: [Q, N] int32, 1 on generated tokens
    lengths:       [Q] int32, generated tokens per row (stop id included)
    stopped:       [Q] bool, True if the row ended at a stop id ("stop"), False at its budget ("length")
    prefill_tokens: [] int32, real prompt tokens of the call, its prompts' lengths summed (a prompt is
                   prefilled once; one spread to several batch positions, once at each, where
                   batch-padding prompts would have been)
    decode_steps:  [] int32, decode steps of the call (of its slowest queue when the batch is sharded)
    slot_steps:    [] int32, decode slots x decode steps, summed over the decode batch widths (a queue
                   narrowing in its tail runs fewer slots a step); the slowest queue's times the queues
                   when the batch is sharded (the others wait for it)
    free_pages:    [] int32, the paged sampler: response pages free at the end of the call, summed over
                   the queues (all of them when every page came back); 0 for the contiguous samplers
    prompt_routing: None, or (``SamplingSettings.record_routing``) [P, T, L, k] uint8 (int16 past 256 experts):
                   the experts of every prompt token in every layer, as the prefill routed it
    routing:       None, or [Q, N, L, k]: the experts of response token t in every layer, as the decode step that
                   fed it routed it (a row's last token and the padding after it: 0, never fed)
    """

    tokens: jax.Array
    logprobs: jax.Array
    response_mask: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    prefill_tokens: jax.Array
    decode_steps: jax.Array
    slot_steps: jax.Array
    free_pages: jax.Array
    prompt_routing: jax.Array | None = None
    routing: jax.Array | None = None


def slot_utilisation(lengths: np.ndarray, slot_steps: int) -> float:
    """Tokens made by decode steps / slot steps (``SampleArrays.slot_steps``: slots x decode steps at
    each decode batch width): how full the decoded slots were (1 = never idle).

    lengths: [Q] generated tokens per row; token 0 of each row comes from the prefill, not a decode step.
    """
    decoded = int(np.sum(np.maximum(np.asarray(lengths, np.int64) - 1, 0)))
    return decoded / slot_steps if slot_steps else 1.0


def decode_layer_weights(graphdef: nnx.GraphDef, state) -> dict[str, jax.ShapeDtypeStruct]:
    """The layers' weights as the decode layout holds them (``seam.decode_layout``) on the mesh in context,
    to count their copies in a compiled decode (``hlo.weight_copies``): {name: [L, ...], each layer's
    buffer as one device holds it, in the compute dtype}, the stacked parameters of rank >= 2 a layer.
    state: the model's parameters (arrays or abstract ones)."""
    dtype = jnp.dtype(nnx.merge(graphdef, state).cfg.dtype)
    rules = decode_rules(current_rules())
    weights = {}
    for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        axes, shape = getattr(var, "logical_axes", None), var.get_value().shape
        if axes and axes[0] == "layers" and len(shape) >= 3:
            layer = rules.sharding(axes[1:], shape[1:]).shard_shape(shape[1:])
            weights[str(path[-1].key)] = jax.ShapeDtypeStruct((shape[0], *layer), dtype)
    return weights


def _queue_groups(prompts: int, slots: int) -> tuple[str, ...]:
    """The mesh axes the decode loop is split over (one queue per shard, ``queues``), or none."""
    rules = current_rules()
    axes = rules.batch_axes()
    shards = math.prod(rules.mesh.shape[a] for a in axes)
    return axes if axes and queues(prompts, slots, shards) == shards else ()


def narrowing_widths(slots: int, tail_slots: int | None) -> tuple[int, ...]:
    """The decode batch widths of one queue, widest first: ``slots`` while rows wait, then, once the
    queue is empty, each width of the ladder 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and 3 x 2^(k-1):
    each about 2/3 or 3/4 of the one above) below ``slots`` and at least ``tail_slots``. A width
    takes over when the rows still running fit it. ``tail_slots`` None (or >= slots): no narrowing.
    """
    if tail_slots is None or tail_slots >= slots:
        return (slots,)
    ladder = {w for k in range(slots.bit_length()) for w in (2 ** k, 3 * 2 ** k // 2)}
    return (slots, *sorted((w for w in ladder if max(tail_slots, 1) <= w < slots), reverse=True))


def _queue_start(model, inputs: QueueInputs, spec: EngineSpec) -> tuple[decode.Queue, decode.KVStore,
                                                                         decode.DecodeState]:
    """One queue's rows, its K/V store (contiguous rows, or pages when ``spec.kind`` is "paged") and
    the state before its first decode step."""
    prompt_lengths = jnp.sum(inputs.prompt_real, axis=-1, dtype=jnp.int32)  # [P]
    queue = decode.make_queue(inputs.real, inputs.first_tokens, inputs.budgets, inputs.row_keys, prompt_lengths,
                              inputs.stop_ids)
    if spec.kind == "paged":
        store = PageStore.build(inputs.prompt_cache, inputs.prompt_real, inputs.budgets, n=spec.n,
                                page_size=spec.page_size, max_new_tokens=spec.max_new_tokens,
                                pages=spec.pages or default_pages(spec.slots, spec.page_size, spec.max_new_tokens))
    else:
        store = RowStore(inputs.prompt_cache, inputs.prompt_real, spec.max_new_tokens)
    cfg = model.cfg
    routing = (*routing_shape(cfg), routing_dtype(cfg.num_experts)) if spec.routing else None
    state = decode.start(model, queue, store, inputs.real, inputs.first_logp, spec.max_new_tokens, spec.slots, PAD_ID,
                         routing)
    return queue, store, state


def _queue_spec(spec: EngineSpec, axes: tuple[str, ...]) -> EngineSpec:
    """The spec of one queue (one per batch shard with ``axes``)."""
    return spec.per_queue(queue_shards(axes)) if axes else spec


class Started(NamedTuple):
    """What the sampler's start program (``_start_program``) gives the chunk and finish programs; the
    per-queue parts stacked on a leading queue axis when the batch shards run their own queues."""

    layout: nnx.State  # the model's state in the decode layout
    queue: decode.Queue  # each queue's rows waiting for a slot
    store: object  # each queue's K/V store, its carried arrays (``KVStore.carried``)
    loop: WidthLoop  # each queue's decode state before its first decode step (donated to the chunks)
    origin: jax.Array  # [Q] int32: the call's row i*n + j of each queue position's row
    prefill_tokens: jax.Array  # [] int32: prompt tokens the prefill computed
    prompt_routing: jax.Array | None  # [P, T, L, k]: the prompts' experts (``EngineSpec.routing``), else None


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec",))
def _start_program(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array, prompt_mask: jax.Array,
                   budgets: jax.Array, key: jax.Array, selection: Selection, stop_ids: jax.Array, *,
                   spec: EngineSpec) -> Started:
    """The sampler's first program: the prefill, then each queue's rows, K/V store and decode state
    before its first decode step."""
    global _TRACE_COUNT
    _TRACE_COUNT += 1
    axes = _queue_groups(prompt_tokens.shape[0], spec.slots)
    prefilled = prefill(decode_model(graphdef, state), prompt_tokens, prompt_mask, budgets, key, selection, stop_ids,
                        n=spec.n, spread=bool(axes), record_routing=spec.routing)
    queue_spec = _queue_spec(spec, axes)

    def per_queue(layout, inputs):
        queue, store, decode_state = _queue_start(sampling_model(graphdef, layout), inputs, queue_spec)
        return queue, store.carried(), start_widths(decode_state)

    split, whole = PartitionSpec(axes), PartitionSpec()
    cache_split = KVCache(PartitionSpec(None, axes), PartitionSpec(None, axes))
    layout = nnx.state(prefilled.model)
    queue, store, loop = on_queues(per_queue, axes, (layout,), (prefilled.inputs,), split_in=(
        QueueInputs(cache_split, split, split, split, split, split, split, whole),))
    return Started(layout, queue, store, loop, prefilled.origin, prefilled.prefill_tokens, prefilled.prompt_routing)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("spec", "axes", "loop_shardings"),
                   donate_argnames=("loop",))
def _chunk_program(graphdef: nnx.GraphDef, layout: nnx.State, queue: decode.Queue, store, selection: Selection,
                   loop: WidthLoop, *, spec: EngineSpec, axes: tuple[str, ...], loop_shardings: tuple | None):
    """Up to ``spec.chunk_steps`` decode steps of every queue (``loop`` donated) -> (loops, progress
    [4] int32, replicated: rows done, rows, tokens so far, 1 once every queue is done).

    loop_shardings: with one queue (no ``axes``), the shardings of ``loop``'s leaves as the start
    program gave them (``_carry_shardings``), which the loops returned keep: left to XLA, some per-slot
    arrays came back batch-sharded, and every later chunk was a new signature to compile. (Per-queue
    loops are pinned by ``shard_map``'s out_specs.)"""
    queue_spec = _queue_spec(spec, axes)
    widths = narrowing_widths(queue_spec.slots, queue_spec.tail_slots)

    def per_queue(layout, selection, queue, store, loop):
        loop = decode.decode_chunk(sampling_model(graphdef, layout), queue, store, selection, loop, widths,
                                   spec.chunk_steps)
        return loop, decode.progress(queue, loop, widths)

    loop, progress = on_queues(per_queue, axes, (layout, selection), (queue, store, loop))
    if loop_shardings is not None:
        loop = jax.lax.with_sharding_constraint(loop, jax.tree.unflatten(jax.tree.structure(loop), loop_shardings))
    if axes:  # [queues, 4] -> the call's
        progress = jnp.concatenate([jnp.sum(progress[:, :3], axis=0), jnp.min(progress[:, 3:], axis=0)])
    return loop, constrain(progress, (None,))  # replicated: every process reads its own copy


@functools.partial(jax.jit, static_argnames=("spec", "axes"))
def _finish_program(store, loop: WidthLoop, origin: jax.Array, prefill_tokens: jax.Array,
                    prompt_routing: jax.Array | None, *, spec: EngineSpec, axes: tuple[str, ...]) -> SampleArrays:
    """The queues' results (stacked per queue, or one) as the call's ``SampleArrays``."""
    result = decode.result(store, loop)
    if axes:
        # each position's rows back to rows i*n + j (the rows of batch-padding prompts stay empty)
        def rows_back(x, empty):
            if x is None:  # no routing record
                return None
            flat = x.reshape(-1, *x.shape[2:])  # [queues, Q / queues, ...] -> [Q, ...]
            return constrain(jnp.full_like(flat, empty).at[origin].set(flat, mode="drop"),
                             ("batch",) + (None,) * (flat.ndim - 1))

        tokens, logprobs, lengths, stopped, routing = (
            rows_back(x, empty) for x, empty in zip((*result[:4], result.routing), (PAD_ID, 0.0, 0, False, 0)))
        result = decode.QueueResult(tokens, logprobs, lengths, stopped, jnp.max(result.steps),
                                    jnp.max(result.slot_steps) * result.slot_steps.shape[0], jnp.sum(result.free_pages),
                                    routing)
    response_mask = (jnp.arange(spec.max_new_tokens)[None, :] < result.lengths[:, None]).astype(jnp.int32)
    return SampleArrays(result.tokens, result.logprobs, response_mask, result.lengths, result.stopped, prefill_tokens,
                        result.steps, result.slot_steps, result.free_pages, prompt_routing, result.routing)


def _carry_shardings(loop, axes: tuple[str, ...]) -> tuple | None:
    """``_chunk_program``'s ``loop_shardings``: the shardings of the leaves of ``loop`` (arrays, or
    abstract ones with shardings) with one queue, else None."""
    return None if axes else tuple(leaf.sharding for leaf in jax.tree.leaves(loop))


class DecodeProgress(NamedTuple):
    """A sampler call's progress after a chunk of decode steps: rows done of ``rows`` (rows with a
    sample), ``tokens`` made so far, and whether every queue is done."""

    rows_done: int
    rows: int
    tokens: int
    done: bool

    @classmethod
    def read(cls, progress: jax.Array) -> DecodeProgress:
        """From the chunk program's replicated [4] array (this process's copy: no collective)."""
        rows_done, rows, tokens, done = np.asarray(progress.addressable_data(0)).tolist()
        return cls(rows_done, rows, tokens, bool(done))


def _program_args(prompt_tokens, prompt_mask, settings: SamplingSettings, key, budgets=None, *,
                  abstract: bool = False):
    """The sampler program's positional arguments and its ``EngineSpec``.

    budgets: None (every row may use max_new_tokens) or [Q] ints in [1, max_new_tokens], each row's
    own budget (vLLM's per-request max_tokens).
    The key is placed replicated on the mesh in context (a real call's key may come committed or not).
    abstract: the key (replicated), the budgets, the scalars and the stop ids come as
    ``jax.ShapeDtypeStruct``s, the others without a sharding (as the uncommitted arrays of a real call,
    so the lowering is the same program),
    and nothing is placed on any device: the program can be lowered for devices this process cannot
    use (compile-only TPU devices on a CPU host). ``key`` is then None (a typed key) or anything
    with the key's shape and dtype.
    """
    if prompt_tokens.ndim != 2 or prompt_tokens.shape != prompt_mask.shape:
        raise ValueError(f"prompt_tokens {prompt_tokens.shape} and prompt_mask {prompt_mask.shape} "
                         "must both be [P, T]")
    if prompt_tokens.shape[0] < 1 or prompt_tokens.shape[1] < 1:
        raise ValueError(f"prompt_tokens: empty shape {prompt_tokens.shape}")
    rows = prompt_tokens.shape[0] * settings.n
    slots = rows if settings.slots is None else settings.slots
    if slots > rows:
        raise ValueError(f"slots={slots}: more decode slots than rows ({prompt_tokens.shape[0]} prompts x "
                         f"n={settings.n}); use at most {rows}")
    stop_ids = stop_id_array(settings.stop_token_ids)
    tail_slots = None if settings.tail_slots is None or settings.tail_slots >= slots else settings.tail_slots
    if settings.pages is not None and settings.pages < row_pages(settings.page_size, settings.max_new_tokens):
        raise ValueError(f"pages={settings.pages}: a queue's pool must hold one row's response pages, "
                         f"{row_pages(settings.page_size, settings.max_new_tokens)} of {settings.page_size} tokens "
                         f"(max_new_tokens={settings.max_new_tokens})")
    spec = EngineSpec(settings.sampler, settings.n, settings.max_new_tokens, slots, tail_slots, settings.page_size,
                      settings.pages, settings.chunk_steps, settings.record_routing)
    if abstract:
        key = jax.eval_shape(jax.random.key, 0) if key is None else key
        abstract = jax.ShapeDtypeStruct
        args = (prompt_tokens, prompt_mask, abstract((rows,), jnp.int32),
                abstract(key.shape, key.dtype, sharding=replicated()),
                Selection(abstract((), jnp.float32), abstract((), jnp.float32), settings.top_k),
                abstract(stop_ids.shape, jnp.int32))
        return args, spec
    if budgets is None:
        budgets = np.full(rows, settings.max_new_tokens, np.int32)
    budgets = np.asarray(budgets)
    if budgets.shape != (rows,) or not np.issubdtype(budgets.dtype, np.integer):
        raise ValueError(f"budgets: expected {rows} integers (one per row), got {budgets.dtype} {budgets.shape}")
    if budgets.min() < 1 or budgets.max() > settings.max_new_tokens:
        raise ValueError(f"budgets: every row's budget must be in [1, max_new_tokens={settings.max_new_tokens}], "
                         f"got {int(budgets.min())} .. {int(budgets.max())}")
    # numpy, not jnp: made on the host without compiling anything (no eager op per call shape)
    args = (prompt_tokens, prompt_mask, budgets.astype(np.int32), jax.device_put(key, replicated()),
            Selection(np.float32(settings.temperature), np.float32(settings.top_p), settings.top_k), stop_ids)
    return args, spec


def sample(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array, prompt_mask: jax.Array,
           settings: SamplingSettings, key: jax.Array, budgets=None, *,
           wait: Callable[[jax.Array, DecodeProgress | None], None] | None = None) -> SampleArrays:
    """The sampler's programs on padded arrays (what the trainer calls): the prefill and the queues'
    start, then chunks of ``settings.chunk_steps`` decode steps until every queue is done, then the
    results.

    graphdef, state: ``nnx.split(model)`` (split once, reuse across calls).
    prompt_tokens, prompt_mask: [P, T] prompts, mask 1 on real tokens (left padding, as buckets.left_pad
    makes, wastes no attention; right padding works too); an all-zero mask row is batch padding
    (its samples come back empty). Bucket P and T (see buckets.py) to bound
    the number of compilations. key: a JAX PRNG key for this call. budgets: None, or [Q] per-row
    budgets in [1, settings.max_new_tokens].
    wait(progress, last): called with each chunk's progress array (``DecodeProgress.read`` reads it)
    while the next chunk runs, and the last one read (None at first); it may wait for it (the
    trainer polls, writing progress lines) and may raise to abandon the call. Without it the host
    blocks on each read. Every process reads the same replicated values, so all of them run the
    same number of chunks.
    Returns SampleArrays with Q = P * n rows grouped by prompt.
    """
    args, spec = _program_args(prompt_tokens, prompt_mask, settings, key, budgets)
    axes = _queue_groups(prompt_tokens.shape[0], spec.slots)
    started = _start_program(graphdef, state, *args, spec=spec)
    loop_shardings = _carry_shardings(started.loop, axes)
    loop = run_chunks(lambda loop: _chunk_program(graphdef, started.layout, started.queue, started.store, args[4], loop,
                                                  spec=spec, axes=axes, loop_shardings=loop_shardings),
                      started.loop, DecodeProgress.read, wait)
    return _finish_program(started.store, loop, started.origin, started.prefill_tokens, started.prompt_routing,
                           spec=spec, axes=axes)


@dataclasses.dataclass(frozen=True)
class SamplerCompiled:
    """The sampler's three compiled programs (start, chunk, finish), read as one: ``as_text()`` their
    HLO, ``memory_analysis()`` that of the fullest, counting the parameters (``parameter_bytes`` per
    device) among the arguments of the chunk and finish programs, which run while they stay on the
    device."""

    programs: tuple[jax.stages.Compiled, ...]
    parameter_bytes: int

    def as_text(self) -> str:
        return "\n".join(program.as_text() for program in self.programs)

    def memory_analysis(self):
        def counted(k, mem):
            extra = self.parameter_bytes if k else 0
            peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0) or (
                mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
            return types.SimpleNamespace(argument_size_in_bytes=mem.argument_size_in_bytes + extra,
                                         output_size_in_bytes=mem.output_size_in_bytes,
                                         alias_size_in_bytes=mem.alias_size_in_bytes,
                                         temp_size_in_bytes=mem.temp_size_in_bytes, peak_memory_in_bytes=peak + extra)
        return max((counted(k, p.memory_analysis()) for k, p in enumerate(self.programs)),
                   key=lambda mem: mem.peak_memory_in_bytes)


@dataclasses.dataclass(frozen=True)
class SamplerLowered:
    """The sampler lowered on abstract arguments (``lower_sample``): ``compile()`` compiles its
    start program, then the chunk and finish programs on the abstract results of the one before
    (their shapes and the shardings the compiled programs give them, as a real call's arrays come)."""

    start: jax.stages.Lowered
    graphdef: nnx.GraphDef
    selection: Selection
    spec: EngineSpec
    axes: tuple[str, ...]
    parameter_bytes: int

    def compile(self) -> SamplerCompiled:
        start = self.start.compile()
        started = abstract_results(self.start, start)
        chunk_lowered = _chunk_program.lower(self.graphdef, started.layout, started.queue, started.store,
                                             self.selection, started.loop, spec=self.spec, axes=self.axes,
                                             loop_shardings=_carry_shardings(started.loop, self.axes))
        chunk = chunk_lowered.compile()
        loop = abstract_results(chunk_lowered, chunk)[0]
        finish = _finish_program.lower(started.store, loop, started.origin, started.prefill_tokens,
                                       started.prompt_routing, spec=self.spec, axes=self.axes).compile()
        return SamplerCompiled((start, chunk, finish), self.parameter_bytes)


def lower_sample(graphdef: nnx.GraphDef, state, prompt_tokens, prompt_mask, settings: SamplingSettings,
                  key=None) -> SamplerLowered:
    """The sampler's programs lowered for abstract arguments (``jax.ShapeDtypeStruct`` with shardings):
    ``.compile()`` them ahead of time (warm-up, memory planning).

    Nothing concrete is made: the key (default: an abstract typed key; a given key only lends its
    shape and dtype), the budgets, the temperature, top_p and stop ids are abstract and unsharded,
    like the uncommitted arrays of a real call, so the programs can be compiled for devices this
    process cannot use (compile-only TPU devices on a CPU host) and are the ones a real call runs.
    """
    args, spec = _program_args(prompt_tokens, prompt_mask, settings, key, abstract=True)
    return SamplerLowered(_start_program.lower(graphdef, state, *args, spec=spec), graphdef, args[4], spec,
                          _queue_groups(prompt_tokens.shape[0], spec.slots), device_bytes(state))


class Preamble(NamedTuple):
    """The arguments of one queue's decode step (``lower_decode_step``) as the sampler's preamble
    leaves them."""

    layout: nnx.State  # the model's state in the decode layout
    queue: decode.Queue
    store: decode.KVStore
    decode_state: decode.DecodeState
    selection: Selection


def _preamble(graphdef: nnx.GraphDef, spec: EngineSpec) -> Callable:
    """The sampler program's preamble for one queue of all the call's slots: (parameter state, the
    program's arguments) -> ``Preamble``."""

    def preamble(state, *args):
        prefilled = prefill(decode_model(graphdef, state), *args, n=spec.n, spread=False)
        return Preamble(nnx.state(prefilled.model), *_queue_start(prefilled.model, prefilled.inputs, spec), args[4])

    return preamble


def lower_prefill(graphdef: nnx.GraphDef, state, prompt_tokens, prompt_mask, settings: SamplingSettings
                  ) -> jax.stages.Lowered:
    """What the sampler does before its decode loops (the decode layout, the prefill, token 0 of every
    row), lowered alone for abstract arguments: ``.compile()`` it for its cost."""
    args, spec = _program_args(prompt_tokens, prompt_mask, settings, None, abstract=True)

    def prefill_program(state, *args):
        prefilled = prefill(decode_model(graphdef, state), *args, n=spec.n, spread=False)
        return prefilled._replace(model=nnx.state(prefilled.model))  # the model's state: a program's output

    return jax.jit(prefill_program).lower(state, *args)


def lower_decode_step(graphdef: nnx.GraphDef, state, prompt_tokens, prompt_mask, settings: SamplingSettings, *,
                      refills: bool = True) -> jax.stages.Lowered:
    """One decode step of the sampler (``decode.decode_step``) lowered alone, for abstract arguments:
    the state the sampler program's preamble (decode layout, prefill, first refill) would give for
    these shapes, of one queue of all the call's slots (``refills``: a step of the first width, which
    refills its slots; False: of a narrower one). ``.compile()`` it for a step's cost; nothing
    concrete is made. The decode state (the page pool or cache rows in it) is donated, as the decode
    loop carries it: the step updates it in place."""
    args, spec = _program_args(prompt_tokens, prompt_mask, settings, None, abstract=True)
    pre = jax.eval_shape(_preamble(graphdef, spec), state, *args)

    def step(layout, queue, store, selection, decode_state):
        return decode.decode_step(sampling_model(graphdef, layout), queue, store, selection, decode_state,
                                  refills=refills)

    return jax.jit(step, donate_argnums=4).lower(_placed_layout(pre.layout), pre.queue, pre.store, pre.selection,
                                                 pre.decode_state)


def _placed_layout(layout: nnx.State) -> nnx.State:
    """The decode layout's abstract parameters (``jax.eval_shape`` gives them no sharding) placed as
    ``seam.decode_layout`` places them: split over "tensor" by their logical axes, replicated over the batch
    axes (a stacked parameter held a buffer a layer: each by the axes after "layers"). Left unplaced, a
    lowered decode step took a parameter XLA had no constraint on whole on every device (the experts'
    [E, D, I] kernels of a mixture-of-experts model: a must-read 4x a v5p-64 device's own share)."""
    rules = decode_rules(MeshRules(current_mesh()))  # a concrete mesh: the arguments' shardings are lowered

    def placed(x, axes):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rules.sharding(axes, x.shape))

    def place(var: nnx.Variable) -> nnx.Variable:
        axes, value = getattr(var, "logical_axes", None), var.get_value()
        if axes is None:
            return var
        if isinstance(value, tuple):  # one buffer a layer
            return var.replace(value=tuple(placed(x, axes[1:]) for x in value))
        return var.replace(value=placed(value, axes))

    return jax.tree.map(place, layout, is_leaf=lambda x: isinstance(x, nnx.Variable))
