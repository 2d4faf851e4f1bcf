"""Run by tests/test_gpu_compile.py with the GPU-compiling interpreter (tests/gpu_compiler.py): the paged
decode kernel for a compile-only H200, over every page-table width a grid of (prompt bucket, budget,
page size) reaches. Prints one JSON object.

The kernel's program depends on a table width M only through its block (``compute_block``: a power
of 2 pages) and the padded width; so every width is walked (its block checked: a power of 2, >= 16
tokens) and one width of each (page size, block, padded or not) class is compiled, plus the widths
named on the command line. The library kernel is compiled too at a width whose largest divisor
<= 8 is no power of 2, with the block rule this project used before (the lowering error of issue 40).
"""

from __future__ import annotations

import json
import sys

from pacs_jax import topologies

DEVICES = topologies.abstract_devices("h200x8")  # before anything else initializes JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from pacs_jax import sharding  # noqa: E402
from pacs_jax.models import kernels, paged_attention_gpu  # noqa: E402
from pacs_jax.models.paged_attention import PageView, paged_decode_attention  # noqa: E402
from pacs_jax.sampling.paged import table_width  # noqa: E402

B, H, K, DH, LAYERS, POOL = 8, 12, 2, 128, 2, 64  # Qwen2.5-1.5B's heads
HEADS = [(16, 2), (28, 4), (32, 8), (4, 4)]  # Qwen2.5-3B, Qwen2.5-7B, Qwen3-4B / 8B; one query head a K/V head


def compile_call(width: int, page_size: int, *, library: bool = False, heads: tuple[int, int] = (H, K)) -> None:
    H, K = heads  # query and K/V heads (the kernel reads each K/V head's G = H / K query rows in place)
    mesh = sharding.make_mesh(1, 1, 1, devices=DEVICES[:1])
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731

    def call(q, k_pool, v_pool, table, lengths):
        view = PageView(table, lengths, lengths, lengths)
        if not library:
            return paged_decode_attention(q, k_pool, v_pool, 1, view, impl="gpu")
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        block = max(d for d in range(1, min(8, width) + 1) if width % d == 0)  # the rule used before
        pages = (x.reshape(K, LAYERS * POOL, page_size, DH) for x in (k_pool, v_pool))
        return paged_attention(q[:, 0], *pages, table, lengths, pages_per_compute_block=block, k_splits=1)

    pool = (K, LAYERS, POOL, page_size, DH)
    with jax.set_mesh(mesh):
        jax.jit(call).lower(spec((B, 1, H, DH), jnp.bfloat16), spec(pool, jnp.bfloat16), spec(pool, jnp.bfloat16),
                            spec((B, width), jnp.int32), spec((B,), jnp.int32)).compile()


def main(grid: dict) -> dict:
    widths = {(table_width(t, n, s), s) for t in grid["prompt_buckets"] for n in grid["budgets"]
              for s in grid["page_sizes"]}
    classes, bad = {}, []
    also = sorted(tuple(x) for x in grid["also"])  # first: a named width stands for its class (one compile less)
    for width, s in also + sorted(widths - set(also)):
        if kernels.paged_decode("cudnn", head_dim=DH, page_size=s, dtype=jnp.bfloat16).impl != "gpu":
            bad.append([width, s, "not chosen"])
            continue
        block = paged_attention_gpu.compute_block(width, s)
        if block & (block - 1) or block * s < 16:
            bad.append([width, s, f"block {block}"])
        classes.setdefault((s, block, width % block == 0), width)
    compiled, failed = [], []
    for width, s in sorted({(w, key[0]) for key, w in classes.items()} | {tuple(x) for x in grid["also"]}):
        try:
            compile_call(width, s)
            compiled.append([width, s])
        except Exception as e:  # a lowering error: reported, the test fails on it
            failed.append([width, s, str(e).splitlines()[0][:300]])
    for h, k in HEADS:  # the paper models' query heads a K/V head (G = 8, 7, 4), and one
        try:
            compile_call(132, 16, heads=(h, k))
            compiled.append(["heads", h, k])
        except Exception as e:
            failed.append(["heads", h, k, str(e).splitlines()[0][:300]])
    try:
        compile_call(grid["library_width"], 16, library=True)
        library = "compiled"
    except Exception as e:
        library = str(e).splitlines()[0][:300]
    return {"widths": len(widths), "classes": len(classes), "compiled": compiled, "failed": failed, "bad": bad,
            "library": library}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
