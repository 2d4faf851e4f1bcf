"""Run by tests/test_gpu_compile.py with the GPU-compiling interpreter: the packed-rows attention (our
block-sparse Pallas kernel, models/packed_attention_gpu.py) forward and backward for a compile-only H200,
at several lengths, head sizes, GQA groups and dtypes. Prints one JSON object: the shapes compiled (with
their Triton calls and the names of our kernels among them) and those that failed."""

from __future__ import annotations

import json
import re

from pacs_jax import topologies

DEVICES = topologies.abstract_devices("h200x8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from pacs_jax import sharding  # noqa: E402
from pacs_jax.models.attention import attention  # noqa: E402

SHAPES = [(2, 1000, 12, 2, 128, "bfloat16"), (1, 4608, 28, 4, 128, "bfloat16"), (2, 333, 16, 8, 64, "float32"),
          (1, 72, 4, 4, 96, "bfloat16")]  # B, T (not a multiple of the blocks), H, K, Dh (96: padded to 128), dtype


def main() -> dict:
    mesh = sharding.make_mesh(1, 1, 1, devices=DEVICES[:1])
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    compiled, failed = [], []
    for B, T, H, K, Dh, dtype in SHAPES:
        def loss(q, k, v, ids):
            out = attention(q, k, v, ids > 0, segment_ids=ids, impl="cudnn")
            return jnp.sum(out.astype(jnp.float32))
        args = (spec((B, T, H, Dh), dtype), spec((B, T, K, Dh), dtype), spec((B, T, K, Dh), dtype),
                spec((B, T), jnp.int32))
        try:
            with jax.set_mesh(mesh):
                text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
            names = sorted(set(re.findall(r"pacs_packed_attention_\w+", text)))
            compiled.append([B, T, H, K, Dh, dtype, text.count("__gpu$xla.gpu.triton"), names])
        except Exception as e:  # a lowering error: reported, the test fails on it
            failed.append([B, T, H, K, Dh, dtype, str(e).splitlines()[0][:300]])
    return {"compiled": compiled, "failed": failed}


if __name__ == "__main__":
    print(json.dumps(main()))
