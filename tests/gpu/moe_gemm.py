"""``python tests/gpu/moe_gemm.py``: a Qwen3-MoE sparse block's gradient (models/moe.py) compiled for compile-only
H200s (pacs_jax/topologies.py h200x8; run by tests/test_moe_block.py with the GPU-compiling interpreter), on two
devices splitting the tokens ("data" 2: each shard dispatches its own, ``local_dispatch``) and two splitting the
experts' width ("tensor" 2), in bfloat16 and in float32. Prints one JSON object a dtype: the kernel choices the
trace recorded (kernels.moe_gemm), the compiled program's custom calls, its temporary bytes a device, and the
shapes its experts' weight gradients come back in a device (the width split over "tensor": 192 of 384); and the
same for Qwen3-30B-A3B's block in bfloat16 on 2 x 4 devices, its experts split over "fsdp" 2 (``expert_parallel``:
64 of the 128 a device, each applied to the pair's tokens, gathered), and that block with LoRA rank 32 on its
experts (``qwen3_30b_a3b_lora``: the adapters' grouped products on tokamax's kernel too, ``kernel_calls``)."""

from __future__ import annotations

import json
import re

from pacs_jax import topologies

DEVICES = topologies.abstract_devices("h200x8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from pacs_jax import sharding  # noqa: E402
from pacs_jax.models import kernels  # noqa: E402
from pacs_jax.models.config import LORA_EXPERT_PARAMETERS, QwenConfig  # noqa: E402
from pacs_jax.models.loading import abstract_model  # noqa: E402
from pacs_jax.models.moe import MoE  # noqa: E402

N, D, E, K, I = 2048, 512, 16, 4, 384  # tokens, width, experts, experts a token, an expert's width
# Qwen3-30B-A3B's block (2,048 wide, 128 experts of 768, 8 a token) on 2 x 4 devices: 64 experts and 192 of each
# one's width a device, tokamax's tiles at the paper model's own shapes
QWEN3_30B = dict(N=1024, D=2048, E=128, K=8, I=768, data=1, fsdp=2, tensor=4, expert_parallel=True)


def compiled(dtype: str, N=N, D=D, E=E, K=K, I=I, data=2, fsdp=1, tensor=2, expert_parallel=False,
             lora_rank=0) -> dict:
    lora = dict(lora_rank=lora_rank, lora_alpha=2.0 * lora_rank, lora_targets=LORA_EXPERT_PARAMETERS) if lora_rank \
        else {}
    cfg = QwenConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=D, intermediate_size=4 * D,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I, dtype=dtype,
                     expert_parallel=expert_parallel, **lora)
    mesh = sharding.make_mesh(data, fsdp, tensor, devices=DEVICES[:data * fsdp * tensor])
    kernels._CHOSEN.clear()
    with jax.set_mesh(mesh), sharding.tracing_device(mesh):
        graphdef, params = abstract_model(cfg, MoE)  # the experts' width split over "tensor"

        def loss(params, x):
            return jnp.sum(nnx.merge(graphdef, params)(x).astype(jnp.float32) ** 2)

        x = jax.ShapeDtypeStruct((N, 1, D), jnp.dtype(dtype))
        program = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    text = program.as_text()
    results = text[text.index("ENTRY"):].split("\n")[0].split("->")[1]
    return {"choices": [str(c) for c in kernels.chosen() if c.op.startswith("moe")],
            "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))),
            "kernel_calls": len(re.findall(r'custom_call_target="mosaic_gpu_v2"', text)),
            "temp_bytes": program.memory_analysis().temp_size_in_bytes,
            "expert_grads": sorted(set(re.findall(rf"f32\[{E // fsdp}(?:,\d+)+\]", results)))}


if __name__ == "__main__":
    print(json.dumps({**{dtype: compiled(dtype) for dtype in ("bfloat16", "float32")},
                      "qwen3_30b_a3b": compiled("bfloat16", **QWEN3_30B),
                      "qwen3_30b_a3b_lora": compiled("bfloat16", **QWEN3_30B, lora_rank=32)}))
