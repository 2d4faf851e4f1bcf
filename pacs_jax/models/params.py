"""Our parameters' construction: each an ``nnx.Param`` (or ``nnx.LoRAParam``, ``SavedParam``) carrying its logical axes
(pacs_jax/sharding.py) and its init kind (models/loading.py ``init_random`` redraws from it), stacked over
layers ([L, ...]) when the module is a scanned stack."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


class SavedParam(nnx.LoRAParam):
    """A parameter a LoRA run trains whole beside its adapters (PEFT's ``modules_to_save``, QwenConfig
    ``lora_saved``): a ``LoRAParam`` for every filter that picks what trains, what a checkpoint holds and what
    one step off moves; models/lora.py keeps it in the base and exports it whole."""


def init_value(kind: str, key: jax.Array, shape, dtype) -> jax.Array:
    """A parameter's initial value: "normal" (std 0.02), "ones", "zeros", "lora_a": a stacked LoRA A
    [L, in..., r] uniform in +-1 / sqrt(fan_in), fan_in the product of its input dims (PEFT's default), or
    "expert_lora_a": the experts' A [..., E, in, r], fan_in each expert's ``in`` (PEFT's ParamWrapper)."""
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    if kind in ("lora_a", "expert_lora_a"):
        bound = 1.0 / math.sqrt(shape[-2] if kind == "expert_lora_a" else math.prod(shape[1:-1]))
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return 0.02 * jax.random.normal(key, shape, dtype)


def make_param(rngs: nnx.Rngs, shape, logical_axes, dtype, init="normal", layers: int | None = None,
               kind: type[nnx.Param] = nnx.Param, **metadata) -> nnx.Param:
    """A parameter of ``shape`` (with a leading [layers] axis, logical name "layers", when stacked).

    Its metadata keeps the logical axes (for sharding) and the init kind (for ``init_random``); ``kind``:
    its variable type (``nnx.LoRAParam`` for an adapter).
    """
    if layers is not None:
        shape, logical_axes = (layers, *shape), ("layers", *logical_axes)
    key = rngs.params() if init in ("normal", "lora_a", "expert_lora_a") else None
    return kind(init_value(init, key, shape, dtype), logical_axes=tuple(logical_axes), init_kind=init, **metadata)
