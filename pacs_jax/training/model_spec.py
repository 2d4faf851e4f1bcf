"""The model a run's spec asks for, read from the spec alone (nothing loaded, no devices).

    run_options(spec)            the QwenConfig fields of how to run it (dtypes, remat, attention)
    lora_options(spec, base)     the QwenConfig fields of its LoRA adapters on the model ``base`` (none without)
    model_config(spec)           the QwenConfig a run trains: model.path's config, a preset, or the fields,
                                 with its adapters
    base_model_config(spec)      the same without its adapters

Read by the run (training/run.py builds the model with them), the resume check, PPO's critic
(``critic.path``) and tools/plan_memory.py. model.path is read through ``data.paths.path``: a local
folder, or one on ``gs://`` (its JSON files only, read from the store).
"""

from __future__ import annotations

import json

from pacs_jax.data import paths
from pacs_jax.models.lora_targets import ALL_LINEAR, DENSE_MLP_MODULES
from pacs_jax.training.spec import RunSpec

QWEN_VOCAB = 151936  # the vocabulary assumed when config.model.vocab_size is 0 (taken from the tokenizer)


def run_options(spec: RunSpec, **overrides) -> dict:
    """The QwenConfig fields of how to run the model (dtypes, remat, attention), from spec.model."""
    m = spec.model
    run = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, attention=m.attention,
               attention_block_size=m.attention_block_size, expert_parallel=m.expert_parallel)
    run.update(overrides)
    return run


def lora_options(spec: RunSpec, base) -> dict:
    """The QwenConfig fields of the run's LoRA adapters on the model ``base`` (a QwenConfig; models/lora.py; empty
    with model.lora_rank 0): a run builds or loads the base model with ``run_options`` and attaches them.
    ``target_modules`` "all-linear" is PEFT's: every Linear of the decoder, which on a model whose every layer holds
    experts is the attention's four (transformers holds the experts as parameters; ``target_parameters`` adapts
    them)."""
    m = spec.model
    if not m.lora_rank:
        return {}
    targets = m.lora_targets
    if m.target_modules == ALL_LINEAR and base.num_experts and len(base.layer_runs()) == 1:
        targets = tuple(t for t in targets if t not in DENSE_MLP_MODULES)
    return dict(lora_rank=m.lora_rank, lora_alpha=float(m.lora_alpha), lora_targets=targets,
                lora_saved=m.modules_to_save)


def model_config(spec: RunSpec, *, vocab_size: int | None = None, **overrides):
    """The QwenConfig a run of ``spec`` trains (as training/run.build_model builds it, LoRA's adapters
    included), or None when
    it cannot be known without loading anything (a model.path that holds no readable config).

    model.path: its config.json (HF dir) or model_config.json (pacs_jax checkpoint); else
    model.preset; else the architecture fields of spec.model (vocab_size 0, "the tokenizer's",
    becomes ``vocab_size`` or a Qwen vocabulary). ``overrides``: QwenConfig fields to replace.
    """
    base = base_model_config(spec, vocab_size=vocab_size, **overrides)
    return base.replace(**lora_options(spec, base)) if base is not None else None


def base_model_config(spec: RunSpec, *, vocab_size: int | None = None, **overrides):
    """``model_config`` without the run's adapters (the model they attach to)."""
    from pacs_jax import models

    m = spec.model
    run = run_options(spec, **overrides)
    if m.path:
        folder = paths.path(m.path)
        try:
            if (folder / "config.json").is_file():
                return models.QwenConfig.from_hf_file(folder, **run)
            if (folder / "model_config.json").is_file():
                raw = json.loads((folder / "model_config.json").read_text())
                raw.pop("pacs_jax", None)
                return models.QwenConfig.from_hf_dict(raw, source=str(folder), **run)
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
        attention_bias=m.model_type == "qwen2", bos_token_id=None, eos_token_id=None, num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.moe_intermediate_size)
    return models.QwenConfig(**{**fields, **run})

