"""LoRA adapters on the decoder's linear layers: which modules, attaching them, merging them, PEFT's names.

    targets = resolve_targets("all-linear")             # models/lora_targets.py: ("q_proj", ..., "down_proj")
    model = attach(base_model, rank=32, alpha=64, targets=targets, seed=0)   # B = 0: the base's logits
    model = attach(base_model, ..., modules_to_save=["embed_tokens", "norm"])  # those trained whole too
    adapters, base = split(params)                      # nnx.State of the LoRAParam leaves, of the rest
    merged = merge(model)                               # a Qwen without adapters: W + alpha / r * A @ B
    plain = base(model)                                 # a Qwen without adapters: W (the same arrays)
    tensors = peft_tensors(model)                       # {PEFT name: array}: adapter_model.safetensors
    print(summary(model))                               # "LoRA rank 32 (alpha 64) on ...: trainable params ..."

A target module's kernel W [in..., out...] (models/qwen.py: q/k/v [D, N, Dh], o [H, Dh, D], gate/up
[D, F], down [F, D]) gets A [in..., r] and B [r, out...], stacked over layers like W ([L, ...]) and
sharded with W's logical axes on their shared dims (r is not sharded); the layer computes
x W + (alpha / r) (x A) B (``models.qwen.Adapter``). A Qwen3-MoE's experts (PEFT's ``target_parameters``,
config.LORA_EXPERT_PARAMETERS) get each expert its own pair, A [E, in, r] and B [E, r, out...] (the fused gate and
up projection's B [E, r, I, 2]; models/moe.py ``ExpertAdapter``, applied inside the grouped matmuls), A drawn with
one expert's fan-in, exported in PEFT's ParamWrapper layout (``_peft_expert_tensors``). A starts uniform in +-1 / sqrt(fan_in) (PEFT's
default, Kaiming-uniform with a = sqrt(5)), B at 0, so a fresh adapter changes nothing. The adapters
are ``nnx.LoRAParam`` variables: the learner differentiates and optimises those leaves alone
(training/learner/trainable.py), and the reference model of the KL loss is the same parameters with
the adapters switched off (``switched_off``). Our own, not qwix's (docs/decisions/0013-lora.md).

Modules trained whole beside the adapters (PEFT's ``modules_to_save``: the embedding, the norms; QwenConfig
``lora_saved``) hold ``SavedParam`` variables, a kind of ``LoRAParam``: they train, are checkpointed and move to
the sampler with the adapters; ``base`` and ``merge`` keep their trained values, the PEFT export writes them
whole, and the KL reference puts back the values the run started from (``switched_off``'s ``originals``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pacs_jax.models.config import LORA_EXPERT_PARAMETERS, SAVED_MODULES, QwenConfig
from pacs_jax.models.lora_targets import PEFT_PARENTS
from pacs_jax.models.loading import abstract_model, host_array, random_param
from pacs_jax.models.params import SavedParam
from pacs_jax.models.qwen import Qwen

# PEFT's module (or experts' parameter) name -> (our sub-module of a decoder layer, the adapter's attribute there)
_PLACES = {"q_proj": ("attn", "q_lora"), "k_proj": ("attn", "k_lora"), "v_proj": ("attn", "v_lora"),
           "o_proj": ("attn", "o_lora"), "gate_proj": ("mlp", "gate_lora"), "up_proj": ("mlp", "up_lora"),
           "down_proj": ("mlp", "down_lora"), "mlp.experts.gate_up_proj": ("mlp", "gate_up_lora"),
           "mlp.experts.down_proj": ("mlp", "down_lora")}
# the kernels an adapter adds to, by the index of its B's last dim ([I, 2] for the experts' fused gate and up)
_KERNELS = {"q_proj": ("q_kernel",), "k_proj": ("k_kernel",), "v_proj": ("v_kernel",), "o_proj": ("o_kernel",),
            "gate_proj": ("gate_kernel",), "up_proj": ("up_kernel",), "down_proj": ("down_kernel",),
            "mlp.experts.gate_up_proj": ("gate_kernel", "up_kernel"), "mlp.experts.down_proj": ("down_kernel",)}


_ADAPTER = nnx.All(nnx.LoRAParam, nnx.Not(SavedParam))


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the trained leaves: the adapters' and the modules trained whole (``SavedParam``), every other leaf) of a
    model's state; ``nnx.merge_state`` joins them."""
    return nnx.split_state(params, nnx.LoRAParam, ...)


def saved(params: nnx.State) -> nnx.State:
    """The leaves of the modules a LoRA run trains whole beside its adapters (``SavedParam``; empty without)."""
    return nnx.split_state(params, SavedParam, ...)[0]


def attach(model: Qwen, *, rank: int, alpha: float, targets: Sequence[str], modules_to_save: Sequence[str] = (),
           seed: int = 0) -> Qwen:
    """``model`` (no adapters; its arrays reused, not copied) with fresh adapters of ``rank`` on the
    ``targets`` modules, in the shardings of the mesh in context: A drawn from ``seed``, B = 0; the modules
    ``modules_to_save`` names (PEFT's, QwenConfig ``lora_saved``) trained whole, from their values in ``model``."""
    cfg = model.cfg.replace(lora_rank=rank, lora_alpha=float(alpha), lora_targets=tuple(targets),
                            lora_saved=tuple(modules_to_save))
    graphdef, abstract = abstract_model(cfg)
    adapters, _ = nnx.split_state(abstract, _ADAPTER, ...)
    key = jax.random.key(seed)
    drawn = [(path, var.replace(value=random_param(var, jax.random.fold_in(key, i))))
             for i, (path, var) in enumerate(nnx.to_flat_state(adapters))]
    base_state = nnx.to_flat_state(nnx.state(model))
    kinds = dict(nnx.to_flat_state(abstract))
    retyped = [(path, type(kinds[path])(var.get_value(), **var.get_metadata())) for path, var in base_state]
    return nnx.merge(graphdef, nnx.from_flat_state(retyped), nnx.from_flat_state(drawn))


def summary(model: Qwen) -> str:
    """One line of a model's adapters, as a PEFT user reads ``print_trainable_parameters``: "LoRA rank 4 (alpha
    8) on q_proj, ..., mlp.experts.down_proj: trainable params 10,752 of all params 169,664 (6.34 %); the rest
    frozen", the modules trained whole named and counted among the trainable."""
    trained, frozen = split(nnx.state(model))
    count = lambda state: sum(x.size for x in jax.tree.leaves(state))  # noqa: E731
    trainable, everything = count(trained), count(trained) + count(frozen)
    cfg = model.cfg
    whole = f" and {', '.join(cfg.lora_saved)} trained whole" if cfg.lora_saved else ""
    return (f"LoRA rank {cfg.lora_rank} (alpha {cfg.lora_alpha:g}) on {', '.join(cfg.lora_targets)}{whole}: "
            f"trainable params {trainable:,} of all params {everything:,} ({100 * trainable / everything:.2f} %); "
            f"the rest frozen")


def switched_off(params: nnx.State, originals: nnx.State | None = None) -> nnx.State:
    """``params`` with every adapter's B at 0 and the modules trained whole back at ``originals`` (``saved`` of
    the weights the run started from; None without such modules): the base model's logits exactly (its arrays
    the same ones), the KL loss's reference model."""
    adapters, frozen = split(params)
    off = jax.tree.map(lambda var: var.replace(value=jnp.zeros_like(var.get_value())) if _is_b(var) else var,
                       adapters, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if len(nnx.to_flat_state(saved(params))) and originals is None:
        raise ValueError("switched_off: the model trains modules whole (lora_saved) and their originals are missing")
    return nnx.merge_state(frozen, off, *(() if originals is None else (originals,)))


def _is_b(var: nnx.Variable) -> bool:
    return getattr(var, "lora_factor", None) == "b"


def _adapter_arrays(model: Qwen) -> Iterator[tuple[str, jax.Array, jax.Array]]:
    """(PEFT module name, A [L, in..., r], B [L, r, out...]) of each adapted module of ``model``; of the experts'
    parameters (config.LORA_EXPERT_PARAMETERS), A [L, E, in, r] and B [L, E, r, out...]."""
    for name in model.cfg.lora_targets:
        sub, attr = _PLACES[name]
        adapter = getattr(getattr(model.layers, sub), attr)
        yield name, adapter.a[...], adapter.b[...]


def delta(a: jax.Array, b: jax.Array, scale: float, experts: bool = False) -> jax.Array:
    """scale * A @ B of one module's stacked adapter, [L, in..., r] x [L, r, out...] -> [L, in..., out...]
    in float32; of the experts' (``experts``), each expert's own: [L, E, in, r] x [L, E, r, out...] ->
    [L, E, in, out...]."""
    if experts:  # L and E kept apart: E may be split over fsdp (expert_parallel), a split merging them would lose
        flat = jnp.einsum("leir,lero->leio", a.astype(jnp.float32),
                          b.reshape(*b.shape[:3], -1).astype(jnp.float32))
        return scale * flat.reshape(*a.shape[:-1], *b.shape[3:])
    L, r = a.shape[0], a.shape[-1]
    flat = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r).astype(jnp.float32), b.reshape(L, r, -1).astype(jnp.float32))
    return scale * flat.reshape(*a.shape[:-1], *b.shape[2:])


def base(model: Qwen, kernels: dict[tuple[str, str], jax.Array] | None = None) -> Qwen:
    """``model`` without its adapters: its base (the same arrays, the modules trained whole as they are now), or
    with ``kernels`` ({(sub-module of the layers, kernel attribute): stacked kernel}) in place of those kernels."""
    trained, state = split(nnx.state(model))
    whole = [(path, nnx.Param(var.get_value(), **var.get_metadata())) for path, var in nnx.to_flat_state(saved(trained))]
    state = nnx.merge_state(state, nnx.from_flat_state(whole))
    for (sub, attr), kernel in (kernels or {}).items():
        state["layers"][sub][attr] = state["layers"][sub][attr].replace(value=kernel)
    base_cfg = model.cfg.without_adapters()
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Qwen(base_cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, state)


def merge(model: Qwen) -> Qwen:
    """A model without adapters whose target kernels are W + alpha / r * A @ B (in W's dtype): the model
    the adapters make, for an HF export or a sampler that reads merged weights (each expert its own A @ B; the
    experts' fused gate_up adapter's B split into the gate's and the up projection's columns)."""
    cfg = model.cfg
    scale = cfg.lora_alpha / cfg.lora_rank
    merged = {}
    for name, a, b in _adapter_arrays(model):
        sub, _ = _PLACES[name]
        added = delta(a, b, scale, experts=name in LORA_EXPERT_PARAMETERS)
        for i, attr in enumerate(_KERNELS[name]):
            w = getattr(getattr(model.layers, sub), attr)[...]
            part = added[..., i] if len(_KERNELS[name]) > 1 else added
            merged[sub, attr] = (w.astype(jnp.float32) + part).astype(w.dtype)
    return base(model, merged)


def peft_tensors(model: Qwen) -> Iterator[tuple[str, np.ndarray]]:
    """(PEFT tensor name, host array) of every adapter, one layer at a time, as PEFT saves a Qwen's LoRA, then
    of every module trained whole (``_peft_saved_tensors``):
    ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and ``...lora_B.weight``
    [out, r] with in / out the HF Linear's features (heads flattened); the experts' as ``_peft_expert_tensors``."""
    for name, a, b in _adapter_arrays(model):
        a, b = host_array(a), host_array(b)  # every process takes part in the gather
        if name in LORA_EXPERT_PARAMETERS:
            yield from _peft_expert_tensors(name, a, b, model.cfg.lora_targets)
            continue
        parent = PEFT_PARENTS[name]
        r = a.shape[-1]
        for layer in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            yield f"{prefix}.lora_A.weight", np.ascontiguousarray(a[layer].reshape(-1, r).T)
            yield f"{prefix}.lora_B.weight", np.ascontiguousarray(b[layer].reshape(r, -1).T)
    yield from _peft_saved_tensors(model)


def _peft_expert_tensors(name: str, a: np.ndarray, b: np.ndarray, targets) -> Iterator[tuple[str, np.ndarray]]:
    """(PEFT tensor name, array) of the experts' adapter on ``name`` (a LORA_EXPERT_PARAMETERS entry), A
    [L, E, in, r] and B [L, E, r, out...] (gate_up's [L, E, r, I, 2]), as PEFT's ParamWrapper holds it: ``lora_A.weight`` [E r, in] (expert e's
    A^T in rows e r .. e r + r - 1) and ``lora_B.weight`` [out, r E] (rank-major: column j E + e is expert e's j-th
    column of B^T), out the HF parameter's (gate_up_proj: the gate's I then the up projection's I). PEFT wraps the
    experts module once a targeted parameter, gate_up_proj innermost: with both targeted, gate_up_proj's tensors
    sit under ``mlp.experts.base_layer``, down_proj's under ``mlp.experts``."""
    nested = name == "mlp.experts.gate_up_proj" and "mlp.experts.down_proj" in targets
    L, E, r = a.shape[0], a.shape[1], a.shape[-1]
    for layer in range(L):
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts" + (".base_layer" if nested else "")
        yield f"{prefix}.lora_A.weight", np.ascontiguousarray(a[layer].transpose(0, 2, 1).reshape(E * r, -1))
        out = b[layer] if b.ndim == 4 else b[layer].swapaxes(-1, -2)  # gate_up's [E, r, I, 2] as HF's [gate; up]
        yield f"{prefix}.lora_B.weight", np.ascontiguousarray(out.reshape(E, r, -1).transpose(2, 1, 0)
                                                              .reshape(-1, r * E))


def _saved_arrays(model: Qwen) -> Iterator[tuple[str, jax.Array]]:
    """(config.SAVED_MODULES' HF module, its weight as HF holds it: [out, in] for the LM head; [L, ...] for a
    decoder layer's module) of each module ``model`` trains whole."""
    layers, kinds = model.layers, model.cfg.saved_modules
    held = {"embedding": lambda: model.embedding[...], "lm_head": lambda: model.lm_head[...].T,
            "final_norm": lambda: model.final_norm.scale[...], "input_norm": lambda: layers.input_norm.scale[...],
            "post_attn_norm": lambda: layers.post_attn_norm.scale[...],
            "q_norm": lambda: layers.attn.q_norm.scale[...], "k_norm": lambda: layers.attn.k_norm.scale[...]}
    for kind, hf in SAVED_MODULES.items():
        if kind in kinds:
            yield hf, held[kind]()
    if "embedding" in kinds and model.cfg.tie_word_embeddings:  # PEFT keeps the tied head beside it
        yield "lm_head", model.embedding[...]


def _peft_saved_tensors(model: Qwen) -> Iterator[tuple[str, np.ndarray]]:
    """(PEFT tensor name, host array) of every module trained whole, as PEFT saves a ``modules_to_save``
    module: ``base_model.model.model.norm.weight``, one a layer for a decoder layer's
    (``base_model.model.model.layers.{i}.input_layernorm.weight``)."""
    for hf, array in _saved_arrays(model):
        array = host_array(array)  # every process takes part in the gather
        if "{}" not in hf:
            yield f"base_model.model.{hf}.weight", np.ascontiguousarray(array)
            continue
        for layer in range(array.shape[0]):
            yield f"base_model.model.{hf.format(layer)}.weight", np.ascontiguousarray(array[layer])


def peft_config(cfg: QwenConfig, base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for these adapters (``base_model``: the base's path or name); the
    modules trained whole are its ``modules_to_save``, a tied embedding's head kept tied
    (``ensure_weight_tying``)."""
    tied = "embedding" in cfg.saved_modules and cfg.tie_word_embeddings
    modules = [t for t in cfg.lora_targets if t not in LORA_EXPERT_PARAMETERS]
    parameters = [t for t in cfg.lora_targets if t in LORA_EXPERT_PARAMETERS]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "target_modules": modules or None,
            "target_parameters": parameters or None,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": list(cfg.lora_saved) or None,
            "ensure_weight_tying": tied, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}}
