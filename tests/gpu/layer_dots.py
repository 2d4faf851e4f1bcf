"""Run by tests/test_gpu_compile.py with the GPU-compiling interpreter: a small bfloat16 Qwen's gradient
(the trainer's remat, dots_with_no_batch_dims_saveable) compiled for a compile-only H200. Prints one
JSON object: the layer scan's stacked arrays ([L, B, T, ...]: what the remat saves for the backward
pass) of the MLP's and the attention projections' widths, by dtype. The layers' gemms write the compute
dtype (models/qwen.py ``_dot_rounded``), so the saved dot outputs are bfloat16; float32 ones there
were twice the bytes (issue 52)."""

from __future__ import annotations

import json
import math
import re

from pacs_jax import topologies

DEVICES = topologies.abstract_devices("h200x1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from pacs_jax import sharding  # noqa: E402
from pacs_jax.models.config import QwenConfig  # noqa: E402
from pacs_jax.models.qwen import Qwen  # noqa: E402

L, B, T, D, F, H, K, Dh = 2, 2, 128, 256, 768, 4, 2, 64  # F, H * Dh and K * Dh: widths no other array has


def main() -> dict:
    cfg = QwenConfig(vocab_size=1024, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                     num_key_value_heads=K, head_dim=Dh, dtype="bfloat16", remat="dots_with_no_batch_dims_saveable",
                     attention="cudnn")
    mesh = sharding.make_mesh(1, 1, 1, devices=DEVICES[:1])
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0))))

        def loss(params, tokens, mask):
            return jnp.sum(nnx.merge(graphdef, params)(tokens, attention_mask=mask))

        tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
        text = jax.jit(jax.grad(loss)).lower(params, tokens, tokens).compile().as_text()
    stacks = {}
    for width, name in ((F, "mlp"), (H * Dh, "q/o"), (K * Dh, "k/v")):
        for dtype, dims in re.findall(rf"\b(f32|bf16)\[{L},{B},{T},([\d,]+)\]", text):
            if math.prod(int(d) for d in dims.split(",")) == width:  # [L, B, T, width] or [L, B, T, heads, Dh]
                stacks.setdefault(name, set()).add(dtype)
    return {name: sorted(dtypes) for name, dtypes in stacks.items()}


if __name__ == "__main__":
    print(json.dumps(main()))
