"""The learner's programs of a training step (docs/design.md section 3.6): pi_old, the rollout
consistency check and correction, the actor's update, PPO's critic and the supervised warm-start.

    learner = LearnerPrograms(spec, graphdef, params, mesh, critic=critic)   # on its mesh
    opt_state = learner.init_optimizer(params)
    learner.pi_old(...), learner.update(params, opt_state, batch), ...
    learner.programs()                                                 # its programs, for the warm-up and plans

The spec (training/spec.py ``RunSpec``) is read here for the learner's side: the pi_old and value
micro-batches (``RunSpec.logprob_micro_batches``), the packed passes' layouts (``RunSpec.packed_layouts``),
the actor's update (objective, options, mini- and micro-batches, optim.*), the rollout correction and,
for PPO, the critic's two programs. The state may be real arrays (the trainer) or
``jax.ShapeDtypeStruct``s with shardings (tools/plan_memory.py compiling for a TPU slice it cannot run
on): the programs only read shapes and shardings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import Mesh

from pacs_jax import sharding
from pacs_jax.models import lora
from pacs_jax.models.moe import routing_dtype, routing_shape
from pacs_jax.rl.bypass import Bypass
from pacs_jax.rl.packing import PackedPlan, PackedPlanArrays, plan_packing, plan_shape
from pacs_jax.rl.update_batch import CriticBatch, SFTBatch, UpdateBatch
from pacs_jax.sharding import abstract, abstract_optimizer_state, batch_sharding
from pacs_jax.training import memory_check
from pacs_jax.training.learner import warmstart
from pacs_jax.training.learner.critic_step import CriticState, critic_options, critic_programs
from pacs_jax.training.learner.old_policy import old_policy_passes, sampler_as_old_policy
from pacs_jax.training.learner.optim import make_optimizer
from pacs_jax.training.learner.rollout_consistency import consistency_program, routing_consistency_program
from pacs_jax.training.learner.rollout_correction_step import correction_program
from pacs_jax.training.learner.trainable import Trainable
from pacs_jax.training.learner.update_step import make_update_step
from pacs_jax.training.passes import PassLayout, Passes
from pacs_jax.training.program import Program
from pacs_jax.training.spec import RunSpec


def spec_optimizer(spec: RunSpec):
    """(AdamW transformation, learning-rate schedule) of ``spec.optim`` over the run's updates."""
    o = spec.optim
    return make_optimizer(o.lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, schedule=o.schedule,
                          total_steps=spec.total_updates, warmup_steps=o.warmup_steps, grad_clip=o.grad_clip)


class LearnerPrograms:
    """The learner's jitted programs of one step of ``spec``, made on its ``mesh`` (that of the parameters).

    ``update(params, opt_state, batch) -> (params, opt_state, M mini-batches' metrics)`` (one program
    dispatched once a mini-batch: training/learner/update_step.py ``MiniBatchUpdates``); ``pi_old(params,
    prompt_tokens, prompt_mask, tokens, response_mask) -> (update batch, mean entropy after each pass)``
    (one program dispatched once a pass: training/learner/old_policy.py ``OldPolicyPasses``);
    ``rollout_consistency(sampler log-probs per call, old_logp, response_mask) -> metrics``
    (training/learner/rollout_consistency.py); ``rollout_correction`` (the same arguments -> rollout_is_weights,
    response_mask, metrics; training/learner/rollout_correction_step.py), None unless the correction is on;
    ``sampler_as_old_policy`` (bypass mode's), None otherwise; PPO: ``critic``, the critic's ``values``
    and ``update`` (training/learner/critic_step.py ``CriticPrograms``), made from the critic's abstract state
    (``critic``: known before the critic is made from the actor after the warm-start, or from ``critic.path``);
    ``warmstart``: the supervised warm-start's step and optimizer (training/learner/warmstart.py ``SFTStep``;
    None when ``warmstart.steps`` is 0). pi_old and the update read the logits at the rollout's
    temperature.
    """

    def __init__(self, spec: RunSpec, graphdef: nnx.GraphDef, params, mesh: Mesh, *,
                 critic: CriticState | None = None, chunk_size: int | None = None):
        if (critic is None) != (spec.critic is None):
            raise ValueError(f"objective {spec.algorithm.objective!r}: the learner's critic state must be "
                             + ("given" if critic is None else "None"))
        with jax.set_mesh(mesh):  # the helpers that place arrays read it
            self._make(spec, graphdef, params, mesh, critic, chunk_size)

    def _make(self, spec: RunSpec, graphdef: nnx.GraphDef, params, mesh: Mesh, critic: CriticState | None,
              chunk_size: int | None) -> None:
        tc, rc = spec.train, spec.rollout
        self.mesh = mesh
        self.spec, self.graphdef = spec, graphdef
        self.optimizer, self.lr_schedule = spec_optimizer(spec)
        self.trainable = Trainable(adapters_only=spec.model.lora_rank > 0)  # LoRA: the adapters alone
        # (params, opt_state): AdamW's state over the trained leaves alone
        self.state = (abstract(params), abstract_optimizer_state(self.optimizer, self.trainable.of(params)))
        self.kl_loss = spec.algorithm.kl_loss
        self.num_prompts, self.n = tc.prompts_per_step, rc.n
        self.sampler_calls, self.max_new_tokens = rc.micro_batches, rc.max_new_tokens
        self.logprob_micro_batches = spec.logprob_micro_batches
        self.mini_batches, self.micro_batches = tc.mini_batches, tc.micro_batches
        self.packing = tc.packing
        self.batch_shards = sharding.batch_shards(mesh)
        if self.packing:  # one padded width for the passes (the gather source): no program per prompt/response bucket
            self.packed_length = spec.packed_length
        extra = {} if chunk_size is None else {"chunk_size": chunk_size}
        correction = spec.algorithm.rollout_correction
        self.bypass = Bypass(correction.loss_type, correction.options()) if correction.bypass_mode else None
        self.update = make_update_step(
            graphdef, self.optimizer, spec.algorithm.objective, group_size=rc.n,
            objective_options=spec.algorithm.options,
            num_mini_batches=tc.mini_batches, num_micro_batches=tc.micro_batches, temperature=rc.temperature,
            state_shardings=self.state_shardings, bypass=self.bypass, kl=self.kl_loss, trainable=self.trainable,
            router_aux_loss_coef=float(tc.router_aux_loss_coef), **extra)
        # routing replay: pi_old records each token's experts; R2: the update replays them; R3: pi_old and the
        # update run on the sampler's (``replays_sampler``); with R3, and without replay where the sampler records
        # (``RunSpec.measures_routing``), the record measures how far the learner's routers differ from the sampler's
        cfg = nnx.merge(graphdef, params).cfg
        measured = spec.measures_routing(cfg.num_experts)
        self.routing, self.replays_sampler = None, tc.router_replay == "R3"
        self.update_replays = tc.router_replay != "disabled"  # the update batch holds a routing record
        if self.update_replays or measured:
            self.routing = (*routing_shape(cfg), routing_dtype(cfg.num_experts))
        self.pi_old = old_policy_passes(graphdef, temperature=rc.temperature,
                                        num_micro_batches=self.logprob_micro_batches, chunk_size=chunk_size,
                                        routing=self.routing)
        self.rollout_consistency = consistency_program()
        self.routing_consistency = routing_consistency_program() if measured else None
        # decoupled (pi_old computed): the correction after pi_old; bypass: in the loss, the sampler's as pi_old
        self.rollout_correction = (correction_program(correction) if correction.enabled and self.bypass is None
                                   else None)
        self.sampler_as_old_policy = sampler_as_old_policy() if self.bypass is not None else None
        self.critic_state = critic
        self.critic = None if critic is None else critic_programs(
            critic.graphdef, critic.optimizer, jax.tree.map(lambda x: x.sharding, abstract(critic.state)),
            values_micro_batches=self.logprob_micro_batches, **critic_options(spec))
        wc = spec.warmstart
        # the warm-start trains the model without adapters, LoRA or not: it stands in for a pretrained model, so that
        # full fine-tuning and every rank start RL from one model (decision 0014; training/warm_base.py)
        self.warmstart = self.warmstart_params = None
        if wc.steps > 0:
            warm_graphdef, warm_params = (nnx.split(lora.base(nnx.merge(graphdef, params))) if spec.model.lora_rank
                                          else (graphdef, params))
            self.warmstart = warmstart.sft_step(warm_graphdef, wc, warm_params)
            self.warmstart_params = abstract(warm_params)  # the base's parameters (abstract, with shardings)
        self.warmstart_rows = (wc.batch_size, spec.data.max_prompt_length, wc.max_response_tokens)

    # ------------------------------------------------------------------------ packing (train.packing)
    @property
    def pass_widths(self) -> tuple[int, int]:
        """Packed: the (prompt, response) widths of the passes' padded rows, the largest buckets."""
        return self.spec.data.prompt_buckets[-1], self.max_new_tokens

    def layouts(self) -> Passes[PassLayout]:
        """Each packed pass's layout (``RunSpec.packed_layouts``) on the mesh the programs are made on."""
        return self.spec.packed_layouts(self.batch_shards, critic=self.critic is not None)

    def packing_plans(self, prompt_lengths, response_lengths) -> Passes[PackedPlan]:
        """The step's packing plan of each pass (pi_old's, the update's, PPO's critic update's) from every
        row's prompt and response lengths [B] (host arrays, the same on every process: no collective)."""
        P, R = self.pass_widths
        return self.layouts().map(lambda layout: plan_packing(
            prompt_lengths, response_lengths, prompt_width=P, response_width=R, packed_length=self.packed_length,
            **layout.options()))

    def abstract_packing(self, lay: PassLayout) -> PackedPlanArrays:
        """The plan arrays of a pass of layout ``lay``, abstract (int32 ``jax.ShapeDtypeStruct``s)."""
        shapes = plan_shape(self.num_prompts * self.n, mini_batches=lay.mini_batches, passes=lay.passes,
                            shards=lay.shards, rows=lay.rows, packed_length=self.packed_length,
                            response_width=self.pass_widths[1])
        return jax.tree.map(lambda shape: self.abstract_rows(shape, jnp.int32), shapes,
                            is_leaf=lambda x: isinstance(x, tuple))

    def init_optimizer(self, params):
        """AdamW's initial state for ``params``' trained leaves (LoRA: the adapters), in the shardings the
        update keeps."""
        return jax.jit(self.optimizer.init, out_shardings=self.state_shardings[1])(self.trainable.of(params))

    @property
    def state_shardings(self) -> tuple:
        """The (params, opt_state) shardings every program keeps."""
        return jax.tree.map(lambda x: x.sharding, self.state)

    def resident_bytes(self) -> int:
        """The training state a device of the learner holds between programs (bytes): the parameters,
        AdamW's state, PPO's critic and the KL loss's frozen reference copy."""
        critic = 0 if self.critic is None else memory_check.per_device_bytes(self.critic_state.state)
        return memory_check.per_device_bytes(self.state) + critic + self.reference_bytes()

    def reference_bytes(self) -> int:
        """The KL loss's frozen reference copy a device holds (bytes; 0 without the KL loss; with LoRA, whose
        reference is the weights with the adapters off, the modules it trains whole alone):
        training/learner/kl_reference.py."""
        if self.kl_loss is None:
            return 0
        params = self.state[0]
        return memory_check.per_device_bytes(lora.saved(params) if self.trainable.adapters_only else params)

    # ------------------------------------------------------------------------ abstract arguments
    def abstract_rows(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """A per-row array of a step, abstract, with its sharding."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(shape, self.mesh))

    def abstract_batch(self, prompt_bucket: int, response_bucket: int) -> UpdateBatch:
        """The actor's update batch of a (prompt bucket, response bucket), abstract (PPO: with advantages;
        the rollout correction: with its weights; no packing plan)."""
        B, rows = self.num_prompts * self.n, self.abstract_rows
        per_token = rows((B, response_bucket), jnp.float32)
        return UpdateBatch(input_ids=rows((B, prompt_bucket + response_bucket), jnp.int32),
                           attention_mask=rows((B, prompt_bucket + response_bucket), jnp.int32),
                           response_mask=per_token, old_logp=per_token, rewards=rows((B,), jnp.float32),
                           advantages=per_token if self.critic is not None else None,
                           rollout_is_weights=per_token if self.rollout_correction is not None else None,
                           ref_logp=per_token if self.kl_loss is not None else None,
                           routing=None if not self.update_replays else rows(
                               (B, prompt_bucket + response_bucket, *self.routing[:2]), self.routing[2]))

    # ------------------------------------------------------------------------ the list of programs
    def programs(self, prompt_buckets, response_buckets, with_warmstart: bool = False) -> list[Program]:
        """The learner's programs for these buckets, in the order a step runs them: pi_old (bypass:
        sampler_as_pi_old), PPO's critic_values and critic_update, update, then the small
        rollout_consistency check and the rollout_correction, which run after pi_old;
        ``with_warmstart``: the warm-start's step first (a phase of its own before RL, when
        ``warmstart.steps`` > 0). Packed (``train.packing``): the passes' programs once, on the largest
        buckets' padded rows (a mini-batch's passes are a loop of a dynamic trip count)."""
        params, opt_state = self.state
        B, K, rows = self.num_prompts * self.n, self.sampler_calls, self.abstract_rows
        critic_bytes = 0 if self.critic is None else memory_check.per_device_bytes(self.critic_state.state)
        actor_bytes = memory_check.per_device_bytes(self.state)
        opt_bytes = memory_check.per_device_bytes(opt_state)
        micro_rows = B // self.mini_batches // self.micro_batches
        out = []
        if with_warmstart and self.warmstart is not None:
            batch_rows, prompt, response = self.warmstart_rows
            warm_params = self.warmstart_params
            warm_state = (warm_params, abstract_optimizer_state(self.warmstart.optimizer, warm_params))
            warm_batch = SFTBatch(input_ids=rows((batch_rows, prompt + response), jnp.int32),
                                  attention_mask=rows((batch_rows, prompt + response), jnp.int32),
                                  response_mask=rows((batch_rows, response), jnp.float32))
            out.append(Program("warmstart", f"{batch_rows} prompts x {prompt}+{response} tokens",
                               lambda: self.warmstart.step.lower(*warm_state, warm_batch), (*warm_state, warm_batch),
                               0))  # before RL: neither RL's AdamW state nor a critic exists yet
        if self.packing:  # the passes' padded rows are always the largest buckets; one program per pass
            prompt_buckets, response_buckets = self.pass_widths[:1], self.pass_widths[1:]
        passes = f"{self.logprob_micro_batches} micro-batches of {B // self.logprob_micro_batches} rows"
        updates = f"{self.mini_batches} mini-batches x {self.micro_batches} micro-batches of {micro_rows} rows"
        for p in prompt_buckets:
            for r in response_buckets:
                shape = f"{B} rows x {p}+{r} tokens"
                if not self.packing:
                    batch = self.abstract_batch(p, r)
                    out += self._logprob_programs(batch, f"{shape}, {passes}", None, opt_bytes, actor_bytes,
                                                  critic_bytes)
                    out += self._critic_update_program(batch, f"{shape}, {updates}", None, opt_bytes, actor_bytes,
                                                       critic_bytes)
                    out += self._update_program(batch, f"{shape}, {updates}", None, opt_bytes, actor_bytes,
                                                critic_bytes)
                    continue
                layouts = self.layouts()
                for lay, make in ((layouts.logprob, self._logprob_programs), (layouts.critic, self._critic_update_program),
                                  (layouts.update, self._update_program)):
                    if lay is None:  # no critic
                        continue
                    packed = (f"{shape} packed in passes of {lay.shards * lay.rows} rows x {self.packed_length} "
                              f"tokens ({lay.rows} a shard), at most {lay.passes} a")
                    out += make(self.abstract_batch(p, r), f"{packed} step" if lay is layouts.logprob else
                                f"{packed} mini-batch, {self.mini_batches} mini-batches", self.abstract_packing(lay),
                                opt_bytes, actor_bytes, critic_bytes)
        call_logp = (rows((B // K, self.max_new_tokens), jnp.float32),) * K
        for r in response_buckets if self.bypass is None else ():  # bypass: no pi_old to compare with
            per_row = (rows((B, r), jnp.float32),) * 2  # old_logp, response_mask
            out.append(Program("rollout_consistency", f"{K} calls' sampler log-probs vs pi_old of {B} rows x {r} tokens",
                               lambda a=(call_logp, *per_row): self.rollout_consistency.lower(*a),
                               (call_logp, *per_row), actor_bytes + critic_bytes))
            if self.rollout_correction is not None:
                out.append(Program("rollout_correction", f"{K} calls' sampler log-probs vs pi_old of {B} rows x {r} "
                                   "tokens: IS weights and rejection mask",
                                   lambda a=(call_logp, *per_row): self.rollout_correction.lower(*a),
                                   (call_logp, *per_row), actor_bytes + critic_bytes))
        held = self.reference_bytes()  # the KL loss's frozen reference copy: resident through every program
        # lowered and compiled on the learner's mesh
        return [dataclasses.replace(p, mesh=self.mesh, outside=p.outside + held) for p in out]

    def _logprob_programs(self, batch: UpdateBatch, passes: str, plan: PackedPlanArrays | None, opt_bytes: int,
                          actor_bytes: int, critic_bytes: int) -> list[Program]:
        """The programs of the pi_old pass over an update batch (``plan``: its packing plan's arrays, or None:
        padded): pi_old (bypass mode: the sampler's log-probs as pi_old) and PPO's critic_values."""
        params, _ = self.state
        out = []
        prompts = self.abstract_rows((self.num_prompts, batch.input_ids.shape[1] - batch.old_logp.shape[1]),
                                     jnp.int32)
        responses = self.abstract_rows(batch.old_logp.shape, jnp.int32)
        if self.bypass is not None:
            K = self.sampler_calls
            call_logp = (self.abstract_rows((responses.shape[0] // K, self.max_new_tokens), jnp.float32),) * K
            args = (call_logp, prompts, prompts, responses, responses)
            out.append(Program("sampler_as_pi_old", "the sampler's log-probs as pi_old (bypass mode), " + passes,
                               lambda a=args: self.sampler_as_old_policy.lower(*a), args, actor_bytes + critic_bytes))
            if self.kl_loss is not None:  # the KL loss's reference log-probs: pi_old's program, which bypass lacks
                args = (params, prompts, prompts, responses, responses, *(() if plan is None else (plan,)))
                out.append(Program("reference_logprobs", "the KL loss's reference, " + passes,
                                   lambda a=args: self.pi_old.lower(*a), args, opt_bytes + critic_bytes))
        else:
            replay = batch.routing if self.replays_sampler else None  # R3: pi_old runs on the sampler's experts
            args = (params, prompts, prompts, responses, responses, plan, replay)
            out.append(Program("pi_old", passes, lambda a=args: self.pi_old.lower(*a), args, opt_bytes + critic_bytes))
            if self.routing_consistency is not None:
                record = self.abstract_rows((*batch.input_ids.shape, *self.routing[:2]), self.routing[2])
                args = (record, record, batch.response_mask)
                out.append(Program("routing_consistency", "the sampler's experts against pi_old's router's",
                                   lambda a=args: self.routing_consistency.lower(*a), args, actor_bytes + critic_bytes))
        if self.critic is not None:
            critic_params, critic_opt = self.critic_state.state
            args = (critic_params, batch.replace(advantages=None), plan)
            out.append(Program("critic_values", passes + ", then GAE", lambda a=args: self.critic.values.lower(*a),
                               args, actor_bytes + memory_check.per_device_bytes(critic_opt)))
        return out

    def _critic_update_program(self, batch: UpdateBatch, updates: str, plan: PackedPlanArrays | None, opt_bytes: int,
                               actor_bytes: int, critic_bytes: int) -> list[Program]:
        """PPO's critic_update over an update batch (``plan``: its packing plan's arrays, or None); none without
        a critic."""
        if self.critic is None:
            return []
        critic_params, critic_opt = self.critic_state.state
        critic_batch = CriticBatch(batch.input_ids, batch.attention_mask, batch.response_mask,
                                   old_values=batch.advantages, returns=batch.advantages, packing=plan)
        args = (critic_params, critic_opt, critic_batch)
        return [Program("critic_update", updates, lambda a=args: self.critic.update.lower(*a), args, actor_bytes)]

    def _update_program(self, batch: UpdateBatch, updates: str, plan: PackedPlanArrays | None, opt_bytes: int,
                        actor_bytes: int, critic_bytes: int) -> list[Program]:
        """The actor's update over an update batch (``plan``: its packing plan's arrays, or None)."""
        params, opt_state = self.state
        args = (params, opt_state, batch.replace(packing=plan))
        return [Program("update", updates, lambda a=args: self.update.lower(*a), args, critic_bytes)]
