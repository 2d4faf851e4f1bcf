"""Analytic per-device memory of a training config, from the config alone (no mesh, no devices).

    plan = estimate_memory(config, num_devices=32)
    plan.peak                      # bytes per device at the step's fullest moment
    print(plan.table()); print(plan.advice())

The mesh sizes come from ``config.mesh`` (-1 resolved against ``num_devices``) and every parameter's
sharding from the same rule table as the real model (``sharding.partition_spec``), so the
parameter, optimizer and gradient bytes are exact; the activation terms are an accounting of the
largest buffers each program holds, checked against XLA's own numbers for the TPU programs
(tools/plan_memory.py compiles the three programs ahead of time and prints both side by side).

A step has three phases, each one program (docs/design.md section 3); the parameters and the AdamW
state stay on the device through all of them::

    resident  params + AdamW mu, nu (param dtype)
    sampler   KV cache [L, slots, S, K, Dh] x 2 (k and v; slots = rollout.slots, or every row when
              static) + the prefill's [L, prompts, T, K, Dh], the params in the compute dtype in the
              decode layout (replicated over data and fsdp), decode temporaries (full-vocabulary
              logits of every slot)
    pi_old    one forward micro-batch (train.logprob_micro_batches): one layer's tensors, the
              final hidden states and one chunk of logits
    update    gradient accumulator + one micro-batch's gradients (float32), the step's batch, and
              one micro-batch's activations (train.micro_batches) under the remat policy: the
              per-layer tensors the backward reads times L ("full": the layer inputs only), the
              final hidden states, and the larger of one layer's backward working set (plus the
              blockwise attention's scores [rows, H / tensor, T, block] f32) and one chunk of the
              fused log-prob backward ([rows, 512, V / tensor] f32), which come one after the other

    peak = resident + max(sampler, pi_old, update)

PPO (``algorithm.objective == "ppo"``) adds its critic (training/critic_step.py): a second model (the
backbone without an lm_head, and a scalar value head) whose parameters and AdamW state are resident
too, and two programs between pi_old and the actor's update::

    resident       + critic params + AdamW mu, nu (param dtype)
    critic_values  one forward micro-batch of the critic (no logits: the values are one number per
                   token) + the batch it reads and the advantages, values, returns [B, R] it returns
    critic_update  the critic's gradient accumulator + one micro-batch's gradients (float32), its
                   batch (ids, masks, old values, returns), one micro-batch's activations under the
                   remat policy (as the actor's, without the logits chunk; with the embedding's gradient)

and the actor's update batch gains the advantages [B, R] float32.

Against XLA's per-device peaks of the compiled TPU programs (tools/plan_memory.py; the paper's
models on v5p-64 and v6e-64, remat full and dots, 1 to 8 rows per device and micro-batch) the
estimate is within -3% .. +12% for the sampler and the update, the phases that bound a step, and
up to +30% for pi_old.

Sizes per device: rows are split over the batch axes (data x fsdp) when they divide, heads, MLP
width and vocabulary over "tensor"; K/V heads over "tensor" only when they divide it (else
replicated, as the model does).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import ml_collections

from pacs_jax.sharding import MESH_AXES, partition_spec, shard_count

GiB = 1 << 30
LOGITS_CHUNK = 512  # pacs_jax.rl.logprobs.DEFAULT_CHUNK_SIZE
QWEN_VOCAB = 151936  # the vocabulary assumed when config.model.vocab_size is 0 (taken from the tokenizer)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ------------------------------------------------------------------------------------------ config
def resolve_mesh(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """{axis: size} of ``config.mesh`` on ``num_devices`` devices (-1 filled in), without devices."""
    sizes = {a: int(config.mesh[a]) for a in MESH_AXES}
    unknown = [a for a, s in sizes.items() if s == -1]
    known = math.prod(s for s in sizes.values() if s != -1)
    if len(unknown) > 1 or any(s == 0 or s < -1 for s in sizes.values()):
        raise ValueError(f"mesh {sizes}: sizes must be positive, at most one -1")
    if unknown:
        if num_devices % known:
            raise ValueError(f"mesh.{unknown[0]}=-1: {num_devices} devices are not divisible by {known}")
        sizes[unknown[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices, not {num_devices}")
    return sizes


def run_options(config: ml_collections.ConfigDict, **overrides) -> dict:
    """The QwenConfig fields of how to run the model (dtypes, remat, attention), from config.model."""
    m = config.model
    run = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, attention=m.attention,
               attention_block_size=m.attention_block_size)
    run.update(overrides)
    return run


def model_config(config: ml_collections.ConfigDict, *, vocab_size: int | None = None, **overrides):
    """The QwenConfig a run of ``config`` builds (as training/run.build_model does), or None when
    it cannot be known without loading anything (a model.path that holds no readable config).

    model.path: its config.json (HF dir) or model_config.json (pacs_jax checkpoint); else
    model.preset; else the architecture fields of config.model (vocab_size 0, "the tokenizer's",
    becomes ``vocab_size`` or a Qwen vocabulary). ``overrides``: QwenConfig fields to replace.
    """
    from pacs_jax import models

    m = config.model
    run = run_options(config, **overrides)
    if m.path:
        path = pathlib.Path(m.path)
        try:
            if (path / "config.json").is_file():
                return models.QwenConfig.from_hf_file(path, **run)
            if (path / "model_config.json").is_file():
                raw = json.loads((path / "model_config.json").read_text())
                raw.pop("pacs_jax", None)
                return models.QwenConfig.from_hf_dict(raw, source=str(path), **run)
        except (OSError, ValueError):
            return None
        return None
    if m.preset:
        return models.preset(m.preset, **run)
    fields = dict(
        model_type=m.model_type, vocab_size=m.vocab_size or vocab_size or QWEN_VOCAB, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
        rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
        attention_bias=m.model_type == "qwen2", bos_token_id=None, eos_token_id=None)
    return models.QwenConfig(**{**fields, **run})


def parameter_shapes(cfg, *, critic: bool = False) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """(dotted name, shape, logical axes) of every parameter of ``Qwen(cfg)`` (with ``critic``: of PPO's
    ``ValueModel(cfg)``) (abstract: nothing allocated)."""
    from flax import nnx

    from pacs_jax.models.qwen import Qwen
    from pacs_jax.models.value import ValueModel

    cls = ValueModel if critic else Qwen
    state = nnx.state(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return [(".".join(map(str, path)), tuple(var.get_value().shape), tuple(var.logical_axes))
            for path, var in nnx.to_flat_state(state)]


# ------------------------------------------------------------------------------------------ plan
@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of each part of a training step (see the module docstring)."""

    mesh: dict[str, int]
    num_devices: int
    params: int  # parameters (param dtype)
    optimizer: int  # AdamW mu + nu (param dtype)
    gradients: int  # float32 accumulator + one micro-batch's gradients
    update_batch: int  # the step's update batch (ids, masks, old log-probs, rewards)
    update_activations: int  # one update micro-batch under the remat policy
    kv_cache: int  # one sampler call's KV cache
    sampler_temp: int  # prefill, compute-dtype params copy, decode temporaries
    pi_old_activations: int  # one pi_old micro-batch (forward only) + the program's inputs/outputs
    # shapes behind the numbers (per device)
    critic: int = 0  # PPO: the critic's parameters and AdamW state (resident like the actor's)
    critic_values: int = 0  # PPO: the critic's values pass (one forward micro-batch) + its inputs / outputs
    critic_gradients: int = 0  # PPO: the critic's float32 accumulator + one micro-batch's gradients
    critic_update_batch: int = 0  # PPO: the critic update's batch
    critic_update_activations: int = 0  # PPO: one critic update micro-batch under the remat policy
    rows_per_sampler_call: int = 0
    rows_per_update_micro_batch: int = 0
    rows_per_pi_old_micro_batch: int = 0
    sequence_length: int = 0
    remat: str = ""

    @property
    def resident(self) -> int:
        return self.params + self.optimizer + self.critic

    @property
    def phases(self) -> dict[str, int]:
        """Bytes on top of the resident state in each phase (PPO: with the critic's two)."""
        phases = {"sampler": self.kv_cache + self.sampler_temp, "pi_old": self.pi_old_activations}
        if self.critic:
            phases["critic_values"] = self.critic_values
            phases["critic_update"] = self.critic_gradients + self.critic_update_batch + self.critic_update_activations
        phases["update"] = self.gradients + self.update_batch + self.update_activations
        return phases

    @property
    def peak(self) -> int:
        return self.resident + max(self.phases.values())

    def phase_total(self, phase: str) -> int:
        return self.resident + self.phases[phase]

    def components(self) -> list[tuple[str, int, str]]:
        """(what, bytes, the config fields that shrink it), largest first."""
        parts = [
            ("update activations", self.update_activations,
             "train.micro_batches" + ("" if self.remat == "full" else " / model.remat")),
            ("KV cache", self.kv_cache, "rollout.slots / rollout.micro_batches"),
            ("pi_old activations", self.pi_old_activations, "train.logprob_micro_batches"),
            ("params + optimizer + gradients", self.params + self.optimizer + self.gradients, "mesh.fsdp / mesh.tensor"),
            ("sampler temporaries", self.sampler_temp, "rollout.micro_batches / mesh.tensor"),
            ("update batch", self.update_batch, "train.prompts_per_step / mesh.fsdp"),
            ("critic params + optimizer", self.critic, "mesh.fsdp / mesh.tensor"),
            ("critic update activations", self.critic_update_activations,
             "train.micro_batches" + ("" if self.remat == "full" else " / model.remat")),
            ("critic gradients", self.critic_gradients, "mesh.fsdp / mesh.tensor"),
            ("critic values pass", self.critic_values, "train.logprob_micro_batches"),
        ]
        return sorted(parts, key=lambda p: -p[1])

    def advice(self) -> str:
        """The config fields to change, for the largest parts first, e.g.
        "train.micro_batches / model.remat (update activations 41.2 GiB), rollout.micro_batches (KV cache 20.1 GiB), ..."."""
        return ", ".join(f"{fields} ({what} {size / GiB:.1f} GiB)" for what, size, fields in self.components()
                         if size > 0)

    def table(self) -> str:
        rows = [("params", self.params), ("optimizer (AdamW mu + nu)", self.optimizer),
                ("critic params + AdamW (PPO)", self.critic),
                ("critic gradients (PPO)", self.critic_gradients),
                ("critic update batch (PPO)", self.critic_update_batch),
                ("critic update activations (PPO)", self.critic_update_activations),
                ("critic values pass (PPO)", self.critic_values),
                ("gradients (accumulator + micro-batch)", self.gradients), ("update batch", self.update_batch),
                ("update activations", self.update_activations), ("KV cache", self.kv_cache),
                ("sampler temporaries", self.sampler_temp), ("pi_old activations", self.pi_old_activations)]
        lines = [f"{name:<40}{size / GiB:>9.2f} GiB" for name, size in rows]
        lines += [f"{'phase ' + k + ' (with resident)':<40}{self.phase_total(k) / GiB:>9.2f} GiB" for k in self.phases]
        lines.append(f"{'peak':<40}{self.peak / GiB:>9.2f} GiB")
        return "\n".join(lines)


def _rows_per_device(rows: int, sizes: dict[str, int]) -> int:
    """Rows of a [rows, ...] activation on one device: split over the batch axes when they divide."""
    return rows // shard_count(partition_spec(("batch", None), (rows, 1), sizes), sizes)


def _per_device(shape, logical_axes, sizes) -> int:
    """Elements of one device's shard of an array (the real model's sharding rules)."""
    return math.prod(shape) // shard_count(partition_spec(logical_axes, shape, sizes), sizes)


def estimate_memory(config: ml_collections.ConfigDict, num_devices: int, *, vocab_size: int | None = None,
                    cfg=None) -> MemoryPlan | None:
    """The analytic per-device memory of a training step of ``config`` on ``num_devices`` devices.

    No mesh is built and no device is touched. ``cfg``: the QwenConfig (default: ``model_config``);
    returns None when the architecture cannot be known (see ``model_config``).
    """
    cfg = cfg if cfg is not None else model_config(config, vocab_size=vocab_size)
    if cfg is None:
        return None
    sizes = resolve_mesh(config, num_devices)
    tc, rc = config.train, config.rollout
    cb, pb = _DTYPE_BYTES[cfg.dtype], _DTYPE_BYTES[cfg.param_dtype]
    L, D, H, K, Dh, F, V = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    t = sizes["tensor"]
    per = lambda shape, axes: _per_device(shape, axes, sizes)  # noqa: E731
    hq = per((H * Dh,), ("heads",))  # query (and attention output) width per device
    hk = per((K, Dh), ("kv_heads", None))  # key / value width per device (replicated unless K divides)
    f = per((F,), ("mlp",))
    v = per((V,), ("vocab",))
    heads = H // t if H % t == 0 else H

    # ---- parameters, AdamW, gradients (exact: the model's own shapes and sharding rules)
    shapes = parameter_shapes(cfg)
    param_elems = sum(per(shape, axes) for _, shape, axes in shapes)
    layer_elems = sum(math.prod(shape[1:]) for _, shape, axes in shapes if axes[:1] == ("layers",))
    params = param_elems * pb
    optimizer = 2 * param_elems * pb
    gradients = 2 * param_elems * 4
    # PPO's critic: a second model's parameters and AdamW state (its programs' memory is below)
    ppo = config.algorithm.objective == "ppo"
    critic_elems = sum(per(shape, axes) for _, shape, axes in parameter_shapes(cfg, critic=True)) if ppo else 0
    critic = 3 * pb * critic_elems

    # ---- per-token bytes of one decoder layer (per device)
    # every tensor of the forward pass that the backward pass reads ("none" saves them all)
    all_layer = (4 * D * cb  # layer input, input norm, residual after attention, post-attention norm
                 + 2 * (hq + 2 * hk) * cb  # q, k, v before and after the rotary embedding
                 + hq * cb + heads * 4  # attention output, its log-sum-exp
                 + 2 * f * 4 + f * cb  # gate and up (float32 dots), silu(gate) * up
                 + 2 * D * 4)  # float32 outputs of the o and down projections
    # what one layer's forward pass holds at once (no gradient: the float32 dot outputs are fused away)
    forward_layer = 3 * D * cb + (hq + 2 * hk) * cb + 2 * f * cb
    saved_per_layer = {
        "none": all_layer,
        "full": D * cb,  # only the layer input
        # the layer input, a normed projection input, and the dot outputs the backward reads (float32:
        # the projections accumulate in float32): q, k, v, gate, up (the o and down outputs only feed
        # residual adds); checked against XLA's TPU buffers within 10%
        "dots_saveable": 2 * D * cb + (hq + 2 * hk) * 4 + 2 * f * 4,
        "dots_with_no_batch_dims_saveable": 2 * D * cb + (hq + 2 * hk) * 4 + 2 * f * 4,
    }[cfg.remat]
    layer_weights = layer_elems // t * (cb + 4)  # one layer gathered (FSDP) in compute dtype + its f32 gradient

    max_prompt = max(config.data.prompt_buckets)
    max_response = max(tuple(rc.response_buckets) or (rc.max_new_tokens,))
    T = max_prompt + max_response
    block = min(cfg.attention_block_size, T)
    C = min(LOGITS_CHUNK, max_response)

    # ---- update: one micro-batch's activations
    total_rows = tc.prompts_per_step * rc.n
    micro_rows = total_rows // tc.mini_batches // tc.micro_batches
    r_up = _rows_per_device(micro_rows, sizes)
    tokens = r_up * T
    # The backward pass walks the logits chunks first, then the layers: at its fullest it holds the
    # saved tensors plus the larger of one layer's working set and one logits chunk's.
    update_activations = (
        L * tokens * saved_per_layer  # saved across the layer scan
        + 2 * tokens * D * cb  # final hidden states and their cotangent
        + max(tokens * all_layer + r_up * heads * T * block * 4,  # one layer (recomputed) + attention scores
              r_up * C * v * (2 * 4 + cb))  # a logits chunk: z / p, dz (f32) and dz in compute dtype
        + D * v * (4 + cb)  # the lm_head gradient accumulator (f32) and the gathered lm_head
        + layer_weights)
    b_dev = _rows_per_device(total_rows, sizes)
    update_batch = b_dev * (2 * T * 4 + (3 if ppo else 2) * max_response * 4 + 4)  # PPO: + the advantages

    # ---- pi_old: one forward micro-batch, plus the program's inputs and outputs
    lp_micro = tc.logprob_micro_batches or tc.mini_batches * tc.micro_batches
    r_lp = _rows_per_device(total_rows // lp_micro, sizes)
    lp_tokens = r_lp * T
    pi_old_activations = (
        lp_tokens * 2 * D * cb  # a layer's input and output (the final hidden states at the end)
        + max(lp_tokens * forward_layer + r_lp * heads * T * block * 4,  # one layer's live tensors
              r_lp * C * v * 4 * 3 // 2)  # a logits chunk (float32) and its reductions
        + D * v * (pb + cb)  # the gathered embedding (param dtype) and lm_head (compute dtype)
        + layer_elems // t * cb  # one layer's weights, gathered
        + 3 * b_dev * T * 4 * 2  # ids and mask: assembled, split into micro-batches, returned
        + b_dev * max_response * 4 * 3)  # old log-probs, entropy, response mask

    # ---- sampler: one call. The decode cache holds one [S] row per slot (continuous: rollout.slots;
    # static: one per row), the prefill's cache one [max_prompt] row per prompt, through the loop.
    prompts_per_call = tc.prompts_per_step // rc.micro_batches
    p_dev = _rows_per_device(prompts_per_call, sizes)
    rows_call = _rows_per_device(prompts_per_call * rc.n, sizes)
    slots = min(rc.slots, prompts_per_call * rc.n) if rc.sampler == "continuous" else prompts_per_call * rc.n
    slots_dev = _rows_per_device(slots, sizes)
    S = max_prompt + rc.max_new_tokens
    kv_cache = L * (slots_dev * S + p_dev * max_prompt) * hk * 2 * cb
    decode_layout = sum(_per_device(shape, axes, {**sizes, "data": 1, "fsdp": 1}) for _, shape, axes in shapes)
    sampler_temp = (
        decode_layout * cb  # the params in the compute dtype, replicated over the batch axes (decode layout)
        + max(p_dev, slots_dev) * V * 4 * 10  # full-vocabulary logits, top-k / top-p, noise (token 0, decode)
        + rows_call * rc.max_new_tokens * 4 * 3)  # tokens, log-probs, mask
    # ---- PPO's critic: its values pass and its update (as pi_old and the update, without logits)
    critic_values = critic_gradients = critic_update_batch = critic_update_activations = 0
    if ppo:
        critic_values = (
            lp_tokens * 2 * D * cb  # a layer's input and output (the final hidden states at the end)
            + lp_tokens * forward_layer + r_lp * heads * T * block * 4  # one layer's live tensors
            + lp_tokens * 4  # the micro-batch's values (float32)
            + D * v * pb  # the gathered embedding
            + layer_elems // t * cb  # one layer's weights, gathered
            + b_dev * T * 4 * 2 * 2  # ids and mask, split into micro-batches
            + b_dev * max_response * 4 * 8)  # rewards on the last token, values, GAE's terms, advantages, returns
        critic_gradients = 2 * critic_elems * 4
        critic_update_batch = b_dev * (2 * T * 4 + 3 * max_response * 4)  # ids, mask; response mask, values, returns
        critic_update_activations = (
            L * tokens * saved_per_layer  # saved across the layer scan
            + 2 * tokens * D * cb  # final hidden states and their cotangent
            + tokens * all_layer + r_up * heads * T * block * 4  # one layer (recomputed) + attention scores
            + 2 * tokens * 4  # values and their cotangent (float32)
            + D * v * 4  # the embedding's gradient (float32) before it is reduced over the batch axes
            + layer_weights)
    return MemoryPlan(
        mesh=sizes, num_devices=num_devices, params=params, optimizer=optimizer, gradients=gradients, critic=critic,
        critic_values=critic_values, critic_gradients=critic_gradients, critic_update_batch=critic_update_batch,
        critic_update_activations=critic_update_activations,
        update_batch=update_batch, update_activations=update_activations, kv_cache=kv_cache,
        sampler_temp=sampler_temp, pi_old_activations=pi_old_activations, rows_per_sampler_call=rows_call,
        rows_per_update_micro_batch=r_up, rows_per_pi_old_micro_batch=r_lp, sequence_length=T, remat=cfg.remat)


# ------------------------------------------------------------------------------------------ device limit
def device_memory_limit() -> int | None:
    """Bytes of memory one device offers (``memory_stats()["bytes_limit"]``), or None where the
    devices do not say (CPU)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 -- unsupported on this backend
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None
