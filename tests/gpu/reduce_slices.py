"""``python tests/gpu/reduce_slices.py``: a split-K gemm's partials as the decode step's consumers read
them, compiled for an H200 (run by tests/test_gpu_compile.py with the GPU-compiling interpreter).

partials f32[S, M, N] (a gemm's S split-K partials, as XLA:GPU writes them) are summed over S and
sliced by two consumers, q's columns [0, Q) and k's [N - K, N), each fused with the sum (as the decode
step's q rotary (once its padding) and K scatter are). Prints one JSON object: the fusions that sum the partials, each
with its output shape, and hlo_cost's bytes for the program."""

from __future__ import annotations

import json
import re

from pacs_jax import hlo_cost, topologies

DEVICES = topologies.abstract_devices("h200x1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

S, M, N, Q, K = 4, 256, 2048, 1536, 256


def consumers(partials: jax.Array, bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """partials [S, M, N] float32, bias [K] bfloat16 -> (q [M, Q] padded to [M, Q + 128], k [M, K]), bfloat16."""
    summed = jnp.sum(partials, axis=0).astype(jnp.bfloat16)
    return jnp.pad(summed[:, :Q] * 2, ((0, 0), (0, 128))), summed[:, N - K:] + bias


def main() -> dict:
    sharding = jax.sharding.SingleDeviceSharding(DEVICES[0])
    args = (jax.ShapeDtypeStruct((S, M, N), jnp.float32, sharding=sharding),
            jax.ShapeDtypeStruct((K,), jnp.bfloat16, sharding=sharding))
    text = jax.jit(consumers).lower(*args).compile().as_text()
    partials = re.compile(rf"%([\w.\-]+) = f32\[{S},{M},{N}\]\S* parameter\(")
    summing = set()  # the fused computations that sum the partials themselves (a reduce of that parameter)
    for computation in re.split(r"\n(?=\S)", text):
        found = partials.search(computation)
        if found and re.search(rf"reduce\(%{re.escape(found.group(1))}[,)]", computation):
            summing.add(computation.split(" ", 1)[0].lstrip("%"))
    fusions = sorted(m.group(1) for m in re.finditer(r"= (\S+) fusion\([^\n]*calls=%([\w.\-]+)", text)
                     if m.group(2) in summing)
    return {"fusions": fusions, "bytes": hlo_cost.program_cost(text).bytes}

if __name__ == "__main__":
    print(json.dumps(main()))
