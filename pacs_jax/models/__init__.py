"""Qwen2 / Qwen2.5 / Qwen3 models in Flax NNX: config, model, HF and Orbax loading, PPO's value model.

    with jax.set_mesh(mesh):                           # optional: sharded on it (default: one device)
        model = models.load_hf(path, dtype="float32")  # or checkpoints.from_pretrained
    logits = model(tokens, attention_mask=mask)        # [B, T, V] float32
    critic = models.value_model_from_actor(model)      # critic(tokens, mask) -> values [B, T] float32
"""

from __future__ import annotations

from pacs_jax.models.config import PRESETS, QwenConfig, preset
from pacs_jax.models.loading import abstract_model, export_hf, init_random, load_hf
from pacs_jax.models.qwen import KVCache, Qwen, positions_from_mask
from pacs_jax.models.value import ValueModel, response_values, value_model_from_actor

__all__ = ["PRESETS", "QwenConfig", "preset", "Qwen", "KVCache", "positions_from_mask", "abstract_model",
           "init_random", "load_hf", "export_hf", "ValueModel", "response_values",
           "value_model_from_actor"]

