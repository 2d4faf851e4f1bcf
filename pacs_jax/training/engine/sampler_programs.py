"""The rollout engine's programs of a training step (docs/design.md section 3.6): the sampler calls, the
assembly of their rows into the update batch's, and dynamic sampling's selection of kept groups.

    engine = SamplerPrograms(spec, graphdef, params, stop_token_ids, mesh)   # on the engine's mesh
    engine.sample(params, prompt_tokens, prompt_mask, key, wait)       # one sampler call
    engine.programs()                                                  # its programs, for the warm-up and plans

The spec (training/spec.py ``RunSpec``) is read here for the sampler's side only: the sampler's
settings (rollout.*, its sampler section's slots, tail and pages), the prompt and response buckets,
the calls a step (``rollout.micro_batches``) and the packed passes' padded widths the assembly cuts to.
The learner's programs (pi_old, the update, PPO's critic) are training/learner/learner_programs.py's;
training/step_programs.py joins the two lists in the order a step runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from pacs_jax import hlo, sampling, sharding
from pacs_jax.models.moe import routing_dtype, routing_shape
from pacs_jax.sampling.carry_over import CarryOverSampler, queue_count
from pacs_jax.sampling.engine import decode_layer_weights, lower_sample, queues
from pacs_jax.sampling.paged import default_pages
from pacs_jax.sharding import abstract, batch_sharding
from pacs_jax.training import memory_check
from pacs_jax.training.engine.dynamic_sampling import CallRows, select_program
from pacs_jax.training.program import Program
from pacs_jax.training.spec import RunSpec


def sampling_settings(spec: RunSpec, stop_token_ids: Sequence[int], num_experts: int = 0) -> sampling.SamplingSettings:
    """The training sampler's settings: ``rollout.*`` and its sampler section for a call's responses; a
    sample stops at ``stop_token_ids`` (the model's and tokenizer's) and at ``rollout.stop_token_ids``; a model
    with ``num_experts`` records each token's experts where the run measures them (``RunSpec.measures_routing``)."""
    rc = spec.rollout
    stops = tuple(dict.fromkeys([*stop_token_ids, *rc.stop_token_ids]))
    return sampling.SamplingSettings(max_new_tokens=rc.max_new_tokens, n=rc.n, temperature=rc.temperature,
                                     top_p=rc.top_p, top_k=rc.top_k, stop_token_ids=stops,
                                     record_routing=spec.measures_routing(num_experts),
                                     **rc.sampler.call_settings(spec.call_responses))


def call_routing(prompt_routing: jax.Array, routing: jax.Array, prompt_width: int) -> jax.Array:
    """A sampler call's routing records (``SampleArrays.prompt_routing`` [P, Tp, L, k], ``routing`` [P n, N, L, k])
    -> its rows' [P n, prompt_width + N, L, k]: each prompt's record left-padded to ``prompt_width`` (the largest
    prompt bucket; its tokens are left-padded so) and repeated for its n responses, then the response's (routing
    replay R3: the experts the sampler's prefill and decode steps chose, rows as the update's)."""
    n = routing.shape[0] // prompt_routing.shape[0]
    pad = [(0, 0), (prompt_width - prompt_routing.shape[1], 0)] + [(0, 0)] * (prompt_routing.ndim - 2)
    return jnp.concatenate([jnp.repeat(jnp.pad(prompt_routing, pad), n, axis=0), routing], axis=1)


def assemble_routing(records: tuple[jax.Array, ...], largest_prompt: int, prompt_width: int, bucket: int) -> jax.Array:
    """K calls' row records (``call_routing``: [P n / K, Tp + N, L, k], Tp = ``largest_prompt``) -> the update rows'
    [P n, prompt_width + bucket, L, k] (training/learner/old_policy.py ``update_rows``): the last ``prompt_width``
    prompt positions (left-padded: the prompts' own) and the first ``bucket`` response ones."""
    rows = jnp.concatenate(records, axis=0)
    return rows[:, largest_prompt - prompt_width:largest_prompt + bucket]


class SamplerPrograms:
    """The engine's jitted programs of one step of ``spec``, made and run on its ``mesh``.

    ``sample(params, prompt_tokens, prompt_mask, key, wait)``: one sampler call (sampling.sample);
    ``assemble(tokens per call, lengths per call, bucket) -> (tokens, response_mask)``;
    ``select_groups`` (dynamic sampling's, training/engine/dynamic_sampling.py), None unless
    ``algorithm.filter_groups.enable``; ``carry_over``, the engine of ``rollout.carry_over``
    (``CarryOverSampler``, its decode state kept between steps), None without it. ``resident`` (bytes a device): the training state that stays on
    the engine's devices during its programs (the parameters, AdamW's state and PPO's critic when the
    two roles share the devices; the memory check counts it beside them, the parameters as the
    sampler's argument).
    """

    def __init__(self, spec: RunSpec, graphdef: nnx.GraphDef, params, stop_token_ids: Sequence[int], mesh: Mesh, *,
                 resident: int = 0):
        with jax.set_mesh(mesh):  # the helpers that place arrays, and the carry-over engine, read it
            self._make(spec, graphdef, params, stop_token_ids, mesh, resident)

    def _make(self, spec: RunSpec, graphdef: nnx.GraphDef, params, stop_token_ids: Sequence[int], mesh: Mesh,
              resident: int) -> None:
        tc, rc = spec.train, spec.rollout
        self.mesh = mesh
        self.graphdef, self.params = graphdef, abstract(params)
        cfg = nnx.merge(graphdef, params).cfg  # a routing record's [L, k] and dtype (the sampler records them)
        self.settings = sampling_settings(spec, stop_token_ids, cfg.num_experts)
        self.num_prompts, self.n = tc.prompts_per_step, rc.n
        self.prompt_buckets = spec.data.prompt_buckets  # strictly increasing, as the response buckets (the spec)
        self.response_buckets = rc.buckets
        self.sampler_calls = rc.micro_batches
        self.packing = tc.packing
        self.batch_shards = sharding.batch_shards(mesh)
        self.resident = resident
        rows = batch_sharding((0, 0), mesh)

        def assemble(tokens, lengths, bucket):
            """K sampler calls' [P*n/K, max_new] ids and [P*n/K] lengths -> [P*n, bucket] ids and mask."""
            tokens = jnp.concatenate(tokens, axis=0)[:, :bucket]
            lengths = jnp.concatenate(lengths, axis=0)
            return tokens, (jnp.arange(bucket)[None, :] < lengths[:, None]).astype(jnp.int32)

        self.assemble = jax.jit(assemble, static_argnums=2, out_shardings=(rows, rows))
        self.call_routing = jax.jit(call_routing, static_argnums=2, out_shardings=rows)
        self.assemble_routing = jax.jit(assemble_routing, static_argnums=(1, 2, 3), out_shardings=rows)
        self.routing = ((*routing_shape(cfg), routing_dtype(cfg.num_experts)) if self.settings.record_routing
                        else None)
        self.select_groups = (select_program(self.sampler_calls, routing=self.routing is not None)
                              if spec.algorithm.filter_groups.enable else None)
        # carry-over (sampling/carry_over.py): one call a step at the largest prompt bucket, B = P groups returned;
        # room for 2P prompts a call, so that P groups can be in flight between calls (training/engine/carry_over.py)
        self.carry_over = (CarryOverSampler(graphdef, self.settings, prompts=2 * self.num_prompts,
                                            prompt_length=self.prompt_buckets[-1], groups=self.num_prompts,
                                            max_staleness=rc.max_staleness, order=rc.carry_over_order)
                           if rc.carry_over else None)

    @property
    def pass_widths(self) -> tuple[int, int]:
        """Packed: the (prompt, response) widths of the passes' padded rows, the largest buckets."""
        return self.prompt_buckets[-1], self.settings.max_new_tokens

    def sample(self, params, prompt_tokens: jax.Array, prompt_mask: jax.Array, key: jax.Array,
               wait=None) -> sampling.SampleArrays:
        """One sampler call on [P / K, Tp] prompts (``rollout.micro_batches`` = K calls a step); wait:
        ``sampling.sample``'s, told of each chunk of decode steps."""
        with jax.set_mesh(self.mesh):
            return sampling.sample(self.graphdef, params, prompt_tokens, prompt_mask, self.settings, key, wait=wait)

    @property
    def slots(self) -> int:
        """Decode slots of one sampler call."""
        return self.settings.slots or self.num_prompts // self.sampler_calls * self.n

    def abstract_rows(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """A per-row array of a step, abstract, with its sharding."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(shape, self.mesh))

    def programs(self, largest_only: bool = False) -> list[Program]:
        """The engine's programs, for every bucket (``largest_only``: the largest prompt and response
        buckets), in the order a step runs them: sampler (carry-over: its six programs, a call's four and a
        resume's two, at the largest prompt bucket only), select_groups (dynamic sampling), assemble (packed: once, at the passes'
        padded width)."""
        P, n, K = self.num_prompts, self.n, self.sampler_calls
        B, rows = P * n, self.abstract_rows
        if self.carry_over is not None:  # one call a step, at the largest prompt bucket
            out = [self._carry_over_program()]
        else:
            buckets = self.prompt_buckets[-1:] if largest_only else self.prompt_buckets
            out = [self._sampler_program(p) for p in buckets]
        call_tokens = (rows((B // K, self.settings.max_new_tokens), jnp.int32),) * K
        call_lengths = (rows((B // K,), jnp.int32),) * K
        call_records = (None,) * K
        if self.routing is not None:  # R3: each call's routing record, at the largest prompt bucket
            out += self._call_routing_programs(largest_only)
            layers, k, dtype = self.routing
            call_records = (rows((B // K, self.prompt_buckets[-1] + self.settings.max_new_tokens, layers, k), dtype),) * K
        if self.select_groups is not None:
            call_logp = (rows((B // K, self.settings.max_new_tokens), jnp.float32),) * K
            calls = tuple(CallRows(*fields) for fields in zip(call_tokens, call_logp, call_lengths, call_records))
            args = (calls, calls, rows((B,), jnp.int32))
            out.append(Program("select_groups", f"a gen batch's kept groups into the step's {B} rows (dynamic sampling)",
                               lambda a=args: self.select_groups.lower(*a), args, self.resident))
        response_buckets = self.response_buckets[-1:] if largest_only else self.response_buckets
        for r in self.pass_widths[1:] if self.packing else response_buckets:  # packed: one padded width
            out.append(Program("assemble", f"{K} calls' responses -> {B} rows x {r} tokens",
                               lambda r=r: self.assemble.lower(call_tokens, call_lengths, r),
                               (call_tokens, call_lengths), self.resident))
            if self.routing is not None:
                out += self._assemble_routing_programs(call_records, r, largest_only)
        return [dataclasses.replace(p, mesh=self.mesh) for p in out]  # lowered and compiled on the engine's mesh

    def _call_routing_programs(self, largest_only: bool) -> list[Program]:
        """``call_routing`` of a call's routing records at each prompt bucket it may take (routing replay R3)."""
        P, B, K, rows = self.num_prompts, self.num_prompts * self.n, self.sampler_calls, self.abstract_rows
        layers, k, dtype = self.routing
        responses = rows((B // K, self.settings.max_new_tokens, layers, k), dtype)
        out = []
        for p in self.prompt_buckets[-1:] if largest_only else self.prompt_buckets:
            prompts = rows((P // K, p, layers, k), dtype)
            out.append(Program("call_routing", f"a call's routing: {P // K} prompts x {p} tokens and {B // K} "
                                               f"responses x {layers} layers x {k} experts",
                               lambda a=(prompts, responses, self.prompt_buckets[-1]): self.call_routing.lower(*a),
                               (prompts, responses), self.resident))
        return out

    def _assemble_routing_programs(self, records: tuple, bucket: int, largest_only: bool) -> list[Program]:
        """``assemble_routing`` of the calls' records into rows of ``bucket`` response tokens, at each prompt width
        the rows may take (packed: the passes'; routing replay R3)."""
        B, K, largest = self.num_prompts * self.n, self.sampler_calls, self.prompt_buckets[-1]
        widths = self.pass_widths[:1] if self.packing else self.prompt_buckets[-1:] if largest_only else \
            self.prompt_buckets
        return [Program("assemble_routing", f"{K} calls' routing -> {B} rows x {w}+{bucket} tokens",
                        lambda a=(records, largest, w, bucket): self.assemble_routing.lower(*a), (records,),
                        self.resident) for w in widths]

    def _sampler_program(self, prompt_tokens: int) -> Program:
        """The sampler (sampling/engine.py, lowered by ``lower_sample``) of one call, for prompts of
        ``prompt_tokens``: P / K prompts a call, K calls a step."""
        P, n, K = self.num_prompts, self.n, self.sampler_calls
        chunk = self.abstract_rows((P // K, prompt_tokens), jnp.int32)
        return Program(
            "sampler", f"{P // K} prompts x {prompt_tokens} tokens, n={n}: {P // K * n} rows in {self.slots} decode "
                       "slots"
                       + (f" (narrowing to {self.settings.tail_slots})" if self.settings.tail_slots else "")
                       + f" {self._kv_words(prompt_tokens)} per call ({K} calls)",
            lambda: lower_sample(self.graphdef, self.params, chunk, chunk, self.settings),
            (self.params, chunk, chunk), self.resident - memory_check.per_device_bytes(self.params))

    def _carry_over_program(self) -> Program:
        """Carry-over's sampler (sampling/carry_over.py, lowered by ``CarryOverSampler.lower``): one call
        a step of 2P prompts at the largest prompt bucket; its ``CarryState`` (G generations' rows and
        the page pool) is among its programs' arguments."""
        spec = self.carry_over.spec
        prompts = self.abstract_rows((spec.prompts, spec.prompt_length), jnp.int32)
        s = self.settings
        pages = f"{spec.generations * spec.prompts * spec.prompt_pages} prompt + {spec.engine.pages} response pages"
        shards = queue_count(spec.prompts, spec.engine.slots, spec.groups, self.batch_shards)
        split = f"; {shards} queues, one a batch shard, each 1/{shards} of the slots and the pool" if shards > 1 else ""
        return Program(
            "sampler", f"carry-over: {spec.prompts} prompts x {spec.prompt_length} tokens a call, n={self.n}, "
                       f"{spec.generations} generations (max_staleness + 1): {spec.rows} rows in {s.slots} decode "
                       f"slots over a page pool of {pages} of {s.page_size} tokens; {spec.groups} groups returned a "
                       f"call{split}",
            lambda: self.carry_over.lower(self.params, prompts, prompts), (self.params, prompts, prompts),
            self.resident - memory_check.per_device_bytes(self.params))

    def _kv_words(self, prompt_tokens: int) -> str:
        """The sampler's K/V store in words: the contiguous cache's slots, or the page pool of a batch
        shard (each prompt once, then the response pages: ``rollout.pages`` or every slot's longest row)."""
        s = self.settings
        if not s.page_size:
            return f"x {prompt_tokens + s.max_new_tokens} cache slots"
        prompts = self.num_prompts // self.sampler_calls
        shards = queues(prompts, self.slots, self.batch_shards)
        slots = self.slots // shards
        pages = s.pages or default_pages(slots, s.page_size, s.max_new_tokens)
        prompt_pages = prompts // shards * -(-prompt_tokens // s.page_size)
        return (f"over a page pool a batch shard of {prompt_pages} prompt + {pages} response pages of {s.page_size} "
                f"tokens ({pages * s.page_size // slots} response tokens a slot)")

    def loop_facts(self, text: str, prompt_tokens: int) -> tuple[str, ...]:
        """What the compiled sampler (HLO ``text``, prompts of ``prompt_tokens``) does inside its loops,
        each fact a line: a weight gathered there crosses the network every decode step; a copy of the
        page pool there reads and writes all of it every step; a [slots, prompt + max_new, ...] array
        there is the contiguous cache the paged sampler must not hold; what its loops launch
        (``hlo.loop_profile``: kernels, copies, loops whose trips sync with the host on a GPU); and the
        layers' weights it copies to buffers of their own inside its decode loops, each read and
        written again every decode step (``hlo.weight_copies``, a trip of each decode loop)."""
        gathers = hlo.gathers_of_shapes_in_loops(text, hlo.parameter_shapes(self.params))
        facts = [(f"{len(gathers)} parameter all-gathers inside its loops: "
                  + ", ".join(sorted({str(list(c.shape)) for c in gathers})))
                 if gathers else "no parameter all-gather inside its loops"]
        page_size, row = self.settings.page_size, prompt_tokens + self.settings.max_new_tokens
        if page_size:
            copies = [i for i in hlo.loop_instructions(text, ("copy",)) if len(i.shape) == 5 and i.shape[3] == page_size]
            facts.append(f"{len(copies)} copies of the page pool inside its loops: "
                         + ", ".join(sorted({str(list(c.shape)) for c in copies}))
                         if copies else "no copy of the page pool inside its loops")
            caches = {i.shape for i in hlo.loop_instructions(text) if len(i.shape) >= 4 and row in i.shape}
            facts.append(f"{row}-token cache rows inside its loops: {sorted(caches)}" if caches
                         else f"no {row}-token (prompt + max_new_tokens) cache row inside its loops")
        facts.append("its decode loops: " + hlo.loop_profile(text, device_trip_loops_only=True).describe())
        with jax.set_mesh(self.mesh):
            weights = decode_layer_weights(self.graphdef, self.params)
        copies = hlo.weight_copies(text, weights, device_trip_loops_only=True)
        facts.append("copies of a layer's weights inside its decode loops (a trip of each): "
                     + (", ".join(f"{name} {n}" for name, n in sorted(copies.items())) or "none"))
        return tuple(facts)
