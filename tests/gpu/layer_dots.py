"""``python tests/gpu/layer_dots.py [TOPOLOGY]``: a small bfloat16 Qwen's gradient (the trainer's remat,
dots_with_no_batch_dims_saveable, the platform's attention kernel) compiled for compile-only devices of
TOPOLOGY (pacs_jax/topologies.py; default h200x8, run by tests/test_gpu_compile.py with the GPU-compiling
interpreter; v5p-64 by tests/test_model_sharding.py with libtpu). Prints one JSON object: the layer
scan's stacked arrays ([L, B, T, ...]: what the remat saves for the backward pass) of the MLP's and the
attention projections' widths, by dtype, and the dtypes of the all-reduces that sum the layers' weight
gradients ("grad_sums"), both read from one program on two devices splitting the batch ("data" 2, B rows
a device: a device saves what the one-device program saves, which was compiled besides until then, twice
the compile time). The layers' gemms write the compute dtype (models/qwen.py ``_dot_rounded``), so the
saved dot outputs are bfloat16 (float32 ones there were twice the bytes, issue 52), while their
derivative's dots, and so the sums of the gradients' shards, stay float32 (bfloat16 sums round at every
step of the reduction)."""

from __future__ import annotations

import json
import math
import re
import sys

from pacs_jax import topologies

TOPOLOGY = sys.argv[1] if len(sys.argv) > 1 else "h200x8"
DEVICES = topologies.abstract_devices(TOPOLOGY)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from pacs_jax import sharding  # noqa: E402
from pacs_jax.models.config import QwenConfig  # noqa: E402
from pacs_jax.models.qwen import Qwen  # noqa: E402

L, B, T, D, F, H, K, Dh = 2, 2, 128, 256, 768, 4, 2, 64  # F, H * Dh and K * Dh: widths no other array has; the
# vocabulary (512) makes the embedding smaller than an MLP weight (D * F), which grad_sums reads
ATTENTION = {"gpu": "cudnn", "tpu": "splash"}[topologies.TOPOLOGIES[TOPOLOGY].platform]


def _gradient_text(cfg: QwenConfig, data: int) -> str:
    """The compiled HLO of the model's gradient on ``data`` devices splitting the batch."""
    mesh = sharding.make_mesh(data, 1, 1, devices=DEVICES[:data])
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0))))

        def loss(params, tokens, mask):
            return jnp.sum(nnx.merge(graphdef, params)(tokens, attention_mask=mask))

        tokens = jax.ShapeDtypeStruct((B * data, T), jnp.int32)
        return jax.jit(jax.grad(loss)).lower(params, tokens, tokens).compile().as_text()


def main() -> dict:
    cfg = QwenConfig(vocab_size=512, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                     num_key_value_heads=K, head_dim=Dh, dtype="bfloat16", remat="dots_with_no_batch_dims_saveable",
                     attention=ATTENTION)
    text = _gradient_text(cfg, 2)
    stacks = {}
    for width, name in ((F, "mlp"), (H * Dh, "q/o"), (K * Dh, "k/v")):
        for dtype, dims in re.findall(rf"\b(f32|bf16)\[{L},{B},{T},([\d,]+)\]", text):
            if math.prod(int(d) for d in dims.split(",")) == width:  # [L, B, T, width] or [L, B, T, heads, Dh]
                stacks.setdefault(name, set()).add(dtype)
    sums = set()  # the all-reduces of at least one layer's MLP weights: the layers' weight gradients (XLA:TPU
    for result in re.findall(r"= (\(.*?\)|\S+) all-reduce(?:-start)?\(", text):  # sums tuples
        for dtype, dims in re.findall(r"(f32|bf16)\[([\d,]+)\]", result):
            if math.prod(int(d) for d in dims.split(",")) >= D * F:
                sums.add(dtype)
    return {**{name: sorted(dtypes) for name, dtypes in stacks.items()}, "grad_sums": sorted(sums)}


if __name__ == "__main__":
    print(json.dumps(main()))
