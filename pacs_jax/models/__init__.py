"""Qwen2 / Qwen2.5 / Qwen3 models in Flax NNX: config, model, HF and Orbax loading, PPO's value model.

    model = models.from_pretrained(path, dtype="float32", mesh=None)
    logits = model(tokens, attention_mask=mask)        # [B, T, V] float32
    critic = models.value_model_from_actor(model)      # critic(tokens, mask) -> values [B, T] float32
"""

from __future__ import annotations

import pathlib

from jax.sharding import Mesh

from pacs_jax.models.config import PRESETS, QwenConfig, preset
from pacs_jax.models.loading import abstract_model, export_hf, init_random, load_hf
from pacs_jax.models.qwen import KVCache, Qwen, positions_from_mask
from pacs_jax.models.value import ValueModel, response_values, value_model_from_actor

__all__ = ["PRESETS", "QwenConfig", "preset", "Qwen", "KVCache", "positions_from_mask", "abstract_model",
           "init_random", "load_hf", "export_hf", "from_pretrained", "ValueModel", "response_values",
           "value_model_from_actor"]


def from_pretrained(path: str | pathlib.Path, dtype: str = "float32", mesh: Mesh | None = None, *,
                    param_dtype: str | None = "float32", remat: str = "none", **run_options) -> Qwen:
    """Load an HF directory (config.json + safetensors) or a pacs_jax Orbax checkpoint directory.

    dtype: compute dtype ("float32" for tests, "bfloat16" on accelerators); param_dtype: storage
    dtype of the parameters (fp32 master weights by default; None keeps the checkpoint's dtype).
    With a mesh, parameters are created directly in their sharding (see pacs_jax/sharding.py).
    run_options: other QwenConfig fields of how to run it (``attention``, ``attention_block_size``).
    """
    from pacs_jax import checkpoint  # checkpoint imports models: import lazily

    path = pathlib.Path(path)
    if (path / "config.json").is_file():
        return load_hf(path, mesh, dtype=dtype, param_dtype=param_dtype, remat=remat, **run_options)
    if path.is_dir():
        return checkpoint.load_model(path, mesh, dtype=dtype, param_dtype=param_dtype, remat=remat, **run_options)
    raise FileNotFoundError(f"{path}: not an HF model directory (config.json) nor a pacs_jax checkpoint")
