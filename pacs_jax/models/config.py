"""Qwen model configuration: read from / written to a Hugging Face config.json, plus presets.

One dataclass covers Qwen2, Qwen2.5 (model_type "qwen2": q/k/v biases) and Qwen3 (model_type
"qwen3": per-head RMSNorm on q and k, explicit head_dim, no biases).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from etils import epath

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")  # see pacs_jax/models/attention.py
# The linear layers LoRA adapters may target, by PEFT's names for a Qwen (models/lora.py)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The experts' weights LoRA adapters may target on a Qwen3-MoE model, by PEFT's ``target_parameters`` names (their
# path in a decoder layer of transformers' Qwen3MoeForCausalLM, whose experts are parameters [E, out, in], not Linear
# modules): the fused gate and up projections [E, 2I, D], the down projection [E, D, I]
LORA_EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# The modules a LoRA run may train whole beside its adapters (PEFT's modules_to_save): our name -> the HF module
# ("{}": each decoder layer's); PEFT's rule picks them: a module is saved when its HF name ends with a given name
# ("norm": all five kinds of norm, "layernorm": a decoder layer's two, "embed_tokens": the embedding)
SAVED_MODULES = {"embedding": "model.embed_tokens", "lm_head": "lm_head", "final_norm": "model.norm",
                 "input_norm": "model.layers.{}.input_layernorm",
                 "post_attn_norm": "model.layers.{}.post_attention_layernorm",
                 "q_norm": "model.layers.{}.self_attn.q_norm", "k_norm": "model.layers.{}.self_attn.k_norm"}


def saved_kinds(names, *, tied: bool, qk_norm: bool) -> frozenset[str]:
    """Our modules (SAVED_MODULES' keys) that PEFT's ``modules_to_save`` ``names`` name on a model whose LM head
    is its embedding (``tied``) or not, with q/k norms or not, by PEFT's rule: an HF module is saved when its name
    ends with one of the names. ValueError naming modules_to_save for a name that matches no module there, or a
    linear layer (LoRA's adapters train those: target_modules)."""
    present = {kind: hf.format(0) for kind, hf in SAVED_MODULES.items()
               if (kind != "lm_head" or not tied) and (kind not in ("q_norm", "k_norm") or qk_norm)}
    linear = [f"model.layers.0.{'self_attn' if m in LORA_MODULES[:4] else 'mlp'}.{m}" for m in LORA_MODULES]
    saved = set()
    for name in names:
        if any(hf.endswith(name) for hf in linear):
            raise ValueError(f"modules_to_save: {name!r} names a linear layer; LoRA's adapters train those "
                             "(target_modules), a whole linear layer beside them is not served")
        found = {kind for kind, hf in present.items() if hf.endswith(name)}
        if not found:
            why = " (this model ties its LM head to the embedding: 'embed_tokens' trains both)" if (
                "lm_head".endswith(name) and tied) else ""
            raise ValueError(f"modules_to_save: {name!r} matches no module of this model{why}; there are "
                             + ", ".join(SAVED_MODULES[kind].format("{i}") for kind in present))
        saved |= found
    return frozenset(saved)


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """Architecture of a Qwen decoder plus the dtypes and remat policy used to run it."""

    model_type: str = "qwen2"
    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = True  # q/k/v biases (always on for qwen2)
    max_position_embeddings: int = 32768
    bos_token_id: int | None = 151643
    eos_token_id: int | tuple[int, ...] | None = 151643
    # Qwen3-MoE's sparse blocks (models/moe.py); 0 experts = a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0       # k: the experts a token is routed to
    moe_intermediate_size: int = 0     # an expert's SwiGLU width
    norm_topk_prob: bool = True        # the k chosen probabilities renormalised to sum 1 (every released Qwen3-MoE)
    decoder_sparse_step: int = 1       # layer i is sparse when (i + 1) % step == 0 and i is not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP (intermediate_size) among the sparse ones
    # How to run it (not part of the HF architecture):
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype; "bfloat16" on accelerators
    remat: str = "none"  # one of REMAT_POLICIES; applies to the gradient path only
    attention: str = "auto"  # one of ATTENTION_IMPLS: auto = splash on TPU, cudnn on GPU, xla elsewhere
    attention_block_size: int = 512  # key/value block of the blockwise attention
    expert_parallel: bool = False  # the experts split over "fsdp", tokens exchanged (models/moe.py local_dispatch)
    # LoRA adapters (models/lora.py): rank 0 = none; their scale is lora_alpha / lora_rank
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()  # of LORA_MODULES and LORA_EXPERT_PARAMETERS
    lora_saved: tuple[str, ...] = ()    # PEFT's modules_to_save: names whose modules train whole (``saved_modules``)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not supported; expected one of "
                             f"{SUPPORTED_MODEL_TYPES}")
        if isinstance(self.eos_token_id, list):  # keep the config hashable (a static jit argument)
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}: expected one of {REMAT_POLICIES}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention={self.attention!r}: expected one of {ATTENTION_IMPLS}")
        if self.attention_block_size < 1:
            raise ValueError(f"attention_block_size={self.attention_block_size}: must be >= 1")
        for field in ("param_dtype", "dtype"):
            if getattr(self, field) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{field}={getattr(self, field)!r}: expected float32, bfloat16 or float16")
        if (self.model_type == "qwen3_moe") != (self.num_experts > 0):
            raise ValueError(f"model_type={self.model_type!r} with num_experts={self.num_experts}: a qwen3_moe "
                             f"model has experts (num_experts > 0), and only a qwen3_moe model has them")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.decoder_sparse_step < 1 or not all(0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers={self.mlp_only_layers}: "
                             f"a step >= 1 and layers among the {self.num_hidden_layers}")
        if self.num_experts and len(self.layer_runs()) > 1 and self.lora_rank:
            raise ValueError(f"lora_rank={self.lora_rank}: LoRA on a model with dense layers among its sparse ones "
                             "(decoder_sparse_step, mlp_only_layers) is not served yet")
        if self.lora_rank and self.num_experts and set(self.lora_targets) & {"gate_proj", "up_proj", "down_proj"}:
            raise ValueError(f"lora_targets={self.lora_targets}: a mixture-of-experts model has no gate_proj, up_proj "
                             f"or down_proj Linear (its experts are parameters, as in transformers): target_modules "
                             f"'self_attn' for its attention, and target_parameters {list(LORA_EXPERT_PARAMETERS)} "
                             f"for its experts (PEFT's names)")
        if self.lora_rank and not self.num_experts and set(self.lora_targets) & set(LORA_EXPERT_PARAMETERS):
            raise ValueError(f"lora_targets={self.lora_targets}: target_parameters {list(LORA_EXPERT_PARAMETERS)} "
                             f"name a mixture-of-experts model's experts, and this model has none (num_experts 0)")
        if self.num_experts < 0 or (self.num_experts > 0 and not (
                1 <= self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0)):
            raise ValueError(f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}, "
                             f"moe_intermediate_size={self.moe_intermediate_size}: with experts, 1 <= "
                             f"num_experts_per_tok <= num_experts and moe_intermediate_size > 0")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if self.lora_rank < 0 or (self.lora_rank > 0 and (self.lora_alpha <= 0 or not self.lora_targets)):
            raise ValueError(f"lora_rank={self.lora_rank}, lora_alpha={self.lora_alpha}, lora_targets="
                             f"{self.lora_targets}: a rank >= 0, and with a rank > 0 an alpha > 0 and targets")
        unknown = set(self.lora_targets) - set(LORA_MODULES + LORA_EXPERT_PARAMETERS)
        if unknown:
            raise ValueError(f"lora_targets: {sorted(unknown)} are not among {LORA_MODULES + LORA_EXPERT_PARAMETERS}")
        object.__setattr__(self, "lora_saved", tuple(self.lora_saved))
        if self.lora_saved and not self.lora_rank:
            raise ValueError(f"modules_to_save={list(self.lora_saved)}: modules trained whole beside LoRA's adapters need "
                             "lora_rank > 0 (full fine-tuning trains every module)")
        self.saved_modules  # noqa: B018 (the check)

    @property
    def saved_modules(self) -> frozenset[str]:
        """Our modules (SAVED_MODULES' keys) that ``lora_saved`` names on this architecture (``saved_kinds``)."""
        return saved_kinds(self.lora_saved, tied=self.tie_word_embeddings, qk_norm=self.qk_norm)

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe")

    def sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` holds a sparse block (transformers' Qwen3MoeDecoderLayer rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def layer_runs(self) -> tuple[tuple[bool, int, int], ...]:
        """The decoder as runs of consecutive layers of one kind: (sparse, first layer, layers) each; one run
        for a dense model and for one whose every layer is sparse (models/qwen.py scans a run at a time)."""
        runs: list[list] = []
        for layer in range(self.num_hidden_layers):
            sparse = self.sparse_layer(layer)
            if runs and runs[-1][0] == sparse:
                runs[-1][2] += 1
            else:
                runs.append([sparse, layer, 1])
        return tuple(tuple(run) for run in runs)

    def replace(self, **changes) -> QwenConfig:
        return dataclasses.replace(self, **changes)

    def without_adapters(self) -> QwenConfig:
        """This model's base: the same architecture and run options without LoRA adapters."""
        return self.replace(lora_rank=0, lora_alpha=0.0, lora_targets=(), lora_saved=())

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config.json", **overrides) -> QwenConfig:
        """Build from the dict of an HF config.json; ``source`` names it in error messages."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: model_type={model_type!r} is not supported "
                             f"(expected one of {SUPPORTED_MODEL_TYPES})")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported (only 'default')")
        if hf.get("use_sliding_window", False):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing}")
        kwargs = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )
        if model_type == "qwen3_moe":
            kwargs.update(_hf_experts(hf, source))
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_hf_file(cls, path: str | os.PathLike, **overrides) -> QwenConfig:
        """The config of an HF model directory (or its config.json), local or on a store (``gs://``, read
        through ``etils.epath``). A generation_config.json beside it adds its eos_token_id(s) to the stop
        ids (``eos_token_id``), as transformers' generate stops on them: Qwen3 lists [151645, 151643]
        there and only 151645 in config.json."""
        path = epath.Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json")
        hf = _read_json(path)
        generation = path.with_name("generation_config.json")
        if generation.is_file() and "eos_token_id" not in overrides:
            overrides["eos_token_id"] = merge_eos_ids(hf.get("eos_token_id"), _read_json(generation).get("eos_token_id"))
        return cls.from_hf_dict(hf, source=str(path), **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json dict (transformers' Qwen2Config / Qwen3Config fields)."""
        arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}[self.model_type]
        out = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
        }
        if self.model_type in ("qwen3", "qwen3_moe"):
            out["attention_bias"] = self.attention_bias
        if self.num_experts:
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                       router_aux_loss_coef=0.0)
        return out


def layer_stacks(cfg: QwenConfig) -> tuple[tuple[str, bool, int, int], ...]:
    """The model's stacks of decoder layers, (attribute, sparse, first layer, layers) each, in order: one
    stack "layers" of all L (a dense model, or every layer sparse); a Qwen3-MoE with dense layers among its
    sparse ones (``decoder_sparse_step``, ``mlp_only_layers``) has a stack a run of one kind, "layers",
    "layers_1", ... (``QwenConfig.layer_runs``; models/qwen.py, hf_weights.py)."""
    return tuple(("layers" if i == 0 else f"layers_{i}", *run) for i, run in enumerate(cfg.layer_runs()))


def _hf_experts(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """A Qwen3-MoE config.json's expert fields (``num_experts``, or ``num_local_experts`` as transformers
    5 writes it) and which layers are sparse (``decoder_sparse_step``, ``mlp_only_layers``)."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                              ("moe_intermediate_size", hf.get("moe_intermediate_size"))) if v is None]
    if missing:
        raise ValueError(f"{source}: missing field(s) {missing} of a qwen3_moe model")
    return dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                decoder_sparse_step=hf.get("decoder_sparse_step", 1), mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))  # transformers' default when absent


def _read_json(path: epath.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


def merge_eos_ids(*eos_fields: int | list[int] | None) -> int | tuple[int, ...] | None:
    """The union of HF ``eos_token_id`` fields (each an id, a list of ids or None), in order of first
    appearance: one id as an int, several as a tuple, none as None."""
    ids = []
    for field in eos_fields:
        for token in [] if field is None else [field] if isinstance(field, int) else field:
            if token not in ids:
                ids.append(int(token))
    return None if not ids else ids[0] if len(ids) == 1 else tuple(ids)


def _preset(model_type, vocab, hidden, inter, layers, heads, kv, tie, max_pos, head_dim=None,
            eos=151643, **experts):
    return QwenConfig(**experts, model_type=model_type, vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=head_dim, rope_theta=1_000_000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=tie, attention_bias=model_type == "qwen2",
                      max_position_embeddings=max_pos, bos_token_id=151643, eos_token_id=eos)


# Values from the published config.json files of the base models on the Hugging Face hub.
PRESETS: dict[str, QwenConfig] = {
    "Qwen2.5-0.5B": _preset("qwen2", 151936, 896, 4864, 24, 14, 2, True, 32768),
    "Qwen2.5-1.5B": _preset("qwen2", 151936, 1536, 8960, 28, 12, 2, True, 131072),
    "Qwen2.5-3B": _preset("qwen2", 151936, 2048, 11008, 36, 16, 2, True, 32768),
    "Qwen2.5-7B": _preset("qwen2", 152064, 3584, 18944, 28, 28, 4, False, 131072),
    "Qwen3-0.6B": _preset("qwen3", 151936, 1024, 3072, 28, 16, 8, True, 40960, 128, 151645),
    "Qwen3-1.7B": _preset("qwen3", 151936, 2048, 6144, 28, 16, 8, True, 40960, 128, 151645),
    "Qwen3-4B": _preset("qwen3", 151936, 2560, 9728, 36, 32, 8, True, 40960, 128, 151645),
    "Qwen3-8B": _preset("qwen3", 151936, 4096, 12288, 36, 32, 8, False, 40960, 128, 151645),
    "Qwen3-30B-A3B": _preset("qwen3_moe", 151936, 2048, 6144, 48, 32, 4, False, 40960, 128, 151645,
                             num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "Qwen3-235B-A22B": _preset("qwen3_moe", 151936, 4096, 12288, 94, 64, 4, False, 40960, 128, 151645,
                               num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536),
}


def preset(name: str, **overrides) -> QwenConfig:
    """A named preset (see PRESETS), with dtype / remat overrides."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
