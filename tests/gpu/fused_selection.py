"""``python tests/gpu/fused_selection.py``: the decode step's fused LM head and token selection
(sampling/fused_selection_gpu.py) compiled for an H200 at the shipped models' shapes (run by
tests/test_gpu_compile.py with the GPU-compiling interpreter). Prints one JSON object: the shapes that
compiled, each with its Triton kernels, and the failures."""

from __future__ import annotations

import json
import re

from pacs_jax import topologies

DEVICES = topologies.abstract_devices("h200x1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from pacs_jax import sharding  # noqa: E402
from pacs_jax.sampling import fused_selection_gpu  # noqa: E402

# (rows, hidden, vocabulary, vocab-major head): Qwen2.5-1.5B at 256 slots and its 32-slot tail,
# Qwen2.5-7B's untied head, a 4,096-entry test vocabulary at 5 rows, float32
SHAPES = [(256, 1536, 151936, True, "bfloat16"), (32, 1536, 151936, True, "bfloat16"),
          (64, 3584, 152064, False, "bfloat16"), (5, 256, 4096, True, "float32")]


def compile_shape(B: int, D: int, V: int, vocab_major: bool, dtype: str) -> list[str]:
    head = (V, D) if vocab_major else (D, V)

    def call(hidden, w, k0, k1, temperature):
        return fused_selection_gpu.combine(fused_selection_gpu.partials(hidden, w, k0, k1, temperature,
                                                                        vocab_major=vocab_major))

    mesh = sharding.make_mesh(1, 1, 1, devices=DEVICES[:1])
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    with jax.set_mesh(mesh):  # Pallas Triton's lowering reads the target GPU from the mesh in context (JAX 0.12)
        text = jax.jit(call).lower(s((B, D), dtype), s(head, dtype), s((B,), jnp.uint32), s((B,), jnp.uint32),
                                   s((), jnp.float32)).compile().as_text()
    return sorted(set(re.findall(r'name="(pacs_fused_selection[^"]*)"', text)) or
                  set(re.findall(r"pacs_fused_selection\w*", text)))


def main() -> dict:
    compiled, failed = [], []
    for shape in SHAPES:
        try:
            compiled.append([*shape, compile_shape(*shape)])
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            failed.append([*shape, f"{type(e).__name__}: {str(e)[:2000]}"])
    return {"compiled": compiled, "failed": failed}


if __name__ == "__main__":
    print(json.dumps(main()))
