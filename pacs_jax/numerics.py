"""Numerics shared by the model and the losses: operands of batched dots on XLA:CPU.

XLA:CPU (JAX 0.10) rejects batched dots (dot_general with batch dimensions) of bfloat16 operands
with a float32 result ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"), the
form every float32-accumulated attention and per-shard gradient dot takes. On CPU such operands are
cast to float32 first (decided at trace time); on TPU and GPU they keep their dtype and the dot
accumulates in float32 (``preferred_element_type``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pacs_jax import sharding


def batched_dot_operand(x: jax.Array) -> jax.Array:
    """``x`` as an operand of a float32-accumulated batched dot: float32 on CPU, unchanged elsewhere."""
    return x.astype(jnp.float32) if sharding.platform() == "cpu" and x.dtype != jnp.float32 else x
