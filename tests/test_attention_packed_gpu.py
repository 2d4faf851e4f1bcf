"""Packed rows on GPU: the "cudnn" attention path with segment ids runs our block-sparse Pallas (Triton)
flash-attention kernel (``models/packed_attention_gpu.py``, through ``models/attention.py``
``_packed_gpu_attention``). On CPU the kernel runs in the Pallas interpreter, on a GPU
(JAX_PLATFORMS=cuda,cpu) compiled by Triton, on packed layouts made by the trainer's own planner
(``rl.packing.plan_packing``: several sequences a row, padding after them, a row of padding only),
with GQA (H != K) and head sizes padded to a power of 2: values against a float64 NumPy reference and
the "xla" path, gradients of q, k and v against the "xla" path, float32 and bfloat16; and the blocks
each of its three kernels visits, recorded in the interpreter, against the blocks that hold a visible
(query, key) pair and the count a padded layout needs.
"""
from __future__ import annotations

import collections
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax.models import attention as attention_module
from pacs_jax.models import kernels, packed_attention_gpu
from pacs_jax.models.attention import attention
from pacs_jax.models.kernels import packed_gpu_unsupported
from pacs_jax.rl import packing


@pytest.fixture(autouse=True)
def _full_precision_float32_dots():
    """float32 dots at full precision on every backend (GPUs default to TF32)."""
    with jax.default_matmul_precision("highest"):
        yield


def packed_segment_ids(packed_length: int, rows: int, prompts=(5, 3, 7, 2, 4, 6, 8, 1),
                       responses=(9, 1, 12, 20, 3, 24, 15, 2), prompt_width: int = 8,
                       response_width: int = 24) -> np.ndarray:
    """[rows, packed_length] int32 segment ids (0: padding) of sequences of these prompt and response
    lengths (prompts left-padded to ``prompt_width``, responses right-padded to ``response_width``)
    packed by the trainer's planner into rows of ``packed_length``, two rows a pass; its first ``rows``
    rows."""
    prompts, responses, width = np.array(prompts), np.array(responses), prompt_width + response_width
    passes = packing.pass_slots(len(prompts), width, packed_length, unit=1, shards=1, rows=2)
    plan = packing.plan_packing(prompts, responses, prompt_width=prompt_width, response_width=response_width,
                                packed_length=packed_length, mini_batches=1, passes=passes, unit=1, shards=1, rows=2)
    index = plan.pack_index[:rows]
    return np.where(index >= 0, index // width + 1, 0).astype(np.int32)  # as rl.packing.packed_inputs


# (packed_length, rows, H, K, Dh): T = 48 (padded to 64 inside) in 4 rows: two full rows of 3
# sequences each, one of 2 sequences and padding, one of padding only; T = 80 (padded to 128) in 2 rows of
# 4 and 4 sequences, GQA groups of 2 and 3, Dh 24 padded to 32 inside the kernel.
LAYOUTS = [(48, 4, 4, 2, 16), (80, 2, 6, 2, 24)]


def test_layouts_are_packed():
    """The layouts hold what the tests claim: several sequences a row, padding, a padding-only row."""
    ids = packed_segment_ids(48, 4)
    per_row = [len(set(r[r > 0])) for r in ids]
    assert per_row == [3, 3, 2, 0] and (ids[2] == 0).sum() > 0
    assert [len(set(r[r > 0])) for r in packed_segment_ids(80, 2)] == [4, 4]


def reference(q, k, v, ids):
    """float64: query t sees key s iff s <= t and ids[b, s] == ids[b, t] > 0 -> [B, T, H, Dh]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    G = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    T = q.shape[1]
    mask = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] > 0) & np.tril(np.ones((T, T), bool))
    s = np.where(mask[:, None], np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1]), -np.inf)
    top = s.max(-1, keepdims=True)
    e = np.where(mask[:, None], np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhts,bshd->bthd", p, v)


def inputs(T, B, H, K, Dh, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, dout = (jnp.asarray(rng.normal(size=shape), dtype)
                     for shape in ((B, T, H, Dh), (B, T, K, Dh), (B, T, K, Dh), (B, T, H, Dh)))
    return q, k, v, dout


def kernel_path(ids):
    interpret = jax.default_backend() != "gpu"
    return lambda q, k, v: attention_module._packed_gpu_attention(q, k, v, jnp.asarray(ids), interpret=interpret)


def xla_path(ids):
    return lambda q, k, v: attention(q, k, v, jnp.asarray(ids > 0), segment_ids=jnp.asarray(ids), impl="xla",
                                     block_size=16)


def value_and_grads(fn, q, k, v, dout):
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out, np.float32), [np.asarray(g, np.float32) for g in grads]


# float32: the kernel against float64 and the "xla" path at float32 round-off; bfloat16: both paths
# round p to bfloat16 before P V (and ds before its dots) but sum in different orders.
TOLERANCES = {"float32": dict(rtol=1e-5, atol=2e-5), "bfloat16": dict(rtol=2e-2, atol=3e-2)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,B,H,K,Dh", LAYOUTS)
def test_kernel_matches_xla_path(T, B, H, K, Dh, dtype):
    ids = packed_segment_ids(T, B)
    q, k, v, dout = inputs(T, B, H, K, Dh, jnp.dtype(dtype))
    out, grads = value_and_grads(kernel_path(ids), q, k, v, dout)
    want_out, want_grads = value_and_grads(xla_path(ids), q, k, v, dout)
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(out, want_out, **tol)
    if dtype == "float32":
        np.testing.assert_allclose(out, reference(q, k, v, ids), rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads, want_grads):
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, **tol, err_msg=f"d{name}")
    padding = ids == 0  # queries that see no key: zero output, zero gradient; padding keys: zero gradient
    assert padding.any() and np.all(out[padding] == 0)
    assert all(np.all(g[padding] == 0) for g in grads)


def test_attention_dispatches_packed_rows_to_the_kernel(monkeypatch, caplog):
    """attention(impl="cudnn", segment_ids=...) takes the kernel path, values equal to the "xla" path;
    a head size the kernel does not take falls back to the "xla" path, saying why in one log line."""
    kernels._CHOSEN.clear()  # a choice is logged the first time it is made in a process
    calls = []
    kernel = attention_module._packed_gpu_attention

    def interpreted(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs, interpret=True)

    monkeypatch.setattr(attention_module, "_packed_gpu_attention", interpreted)
    ids = packed_segment_ids(48, 4)
    q, k, v, _ = inputs(48, 4, 4, 2, 16, jnp.float32)
    valid = jnp.asarray(ids > 0)
    cudnn = jax.jit(functools.partial(attention, impl="cudnn", segment_ids=jnp.asarray(ids)))
    np.testing.assert_allclose(np.asarray(cudnn(q, k, v, valid)), np.asarray(jax.jit(xla_path(ids))(q, k, v)),
                               rtol=1e-5, atol=2e-5)
    assert calls == [q.shape]
    q, k, v, _ = inputs(48, 4, 4, 2, 8, jnp.float32)  # Dh 8 < 16: the "xla" path
    with caplog.at_level("WARNING", logger=kernels.__name__):
        np.testing.assert_allclose(np.asarray(cudnn(q, k, v, valid)), reference(q, k, v, ids), rtol=1e-5, atol=1e-5)
    assert calls == [(4, 48, 4, 16)]
    assert [r.getMessage() for r in caplog.records] == [
        'kernel packed attention: xla (not the kernel: head_dim 8 (the kernel takes 9..128: padded to a power '
        'of 2 in 16..128))']
    assert kernels.chosen()[-1] == kernels.KernelChoice("packed attention", "xla", caplog.records[0].getMessage()
                                                        .split("not the kernel: ", 1)[1][:-1])


def test_packed_gpu_unsupported_names_the_limit():
    assert packed_gpu_unsupported(128, jnp.bfloat16) is None
    assert packed_gpu_unsupported(64, jnp.float32) is None
    assert packed_gpu_unsupported(9, jnp.float16) is None  # padded to 16
    assert "head_dim 8" in packed_gpu_unsupported(8, jnp.bfloat16)
    assert "head_dim 256" in packed_gpu_unsupported(256, jnp.bfloat16)
    assert "dtype float64" in packed_gpu_unsupported(128, jnp.float64)


def test_kernel_under_mesh_in_interpreter():
    """Under a mesh (batch over "data", heads over "tensor") the kernel runs in shard_map per shard."""
    assert len(jax.devices()) == 8, "conftest.py's 8 simulated CPU devices"
    ids = packed_segment_ids(48, 4)
    q, k, v, _ = inputs(48, 4, 4, 2, 16, jnp.float32)
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        fn = jax.jit(kernel_path(ids))
        assert "shard_map" in str(jax.make_jaxpr(fn)(q, k, v))
        out = fn(q, k, v)
    np.testing.assert_allclose(np.asarray(out), reference(q, k, v, ids), rtol=1e-5, atol=1e-5)


def visible_blocks(ids: np.ndarray, block: int) -> collections.Counter:
    """(query block, key block) -> in how many rows that block holds a visible (query, key) pair."""
    T = ids.shape[1]
    mask = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0) & np.tril(np.ones((T, T), bool))
    n = T // block
    held = mask.reshape(len(ids), n, block, n, block).any(axis=(2, 4))  # [B, n, n]
    return collections.Counter((int(i), int(j)) for _, i, j in np.argwhere(held))


# 24 sequences of 40 to 250 tokens (prompts left-padded to 64, responses right-padded to 192), packed
# into rows of 768: the padded layout holds each in a row of 256.
LONG = dict(prompts=np.arange(24) % 5 * 6 + 20, responses=(np.arange(24) * 37) % 181 + 11, prompt_width=64,
            response_width=192)


def test_kernels_visit_only_the_blocks_that_hold_a_visible_pair(monkeypatch):
    """In the Pallas interpreter, every block each kernel scores is recorded (forward, dq, dk/dv): each
    visits exactly the (query block, key block) pairs holding a query that sees a key, once per (row,
    head); none of a row's other sequences, none of padding. Fewer than a padded layout of the same
    sequences needs, and about a quarter of the blocks up to the diagonal (all that the kernel visited
    before, masking the others)."""
    block, H = 16, 2
    ids = packed_segment_ids(768, 4, **LONG)
    B, T = ids.shape
    width = LONG["prompt_width"] + LONG["response_width"]
    assert len(np.unique(ids[ids > 0])) == len(LONG["prompts"])  # every sequence in these rows
    padded = len(LONG["prompts"]) * (width // block) * (width // block + 1) // 2  # a causal triangle a sequence
    diagonal = B * (T // block) * (T // block + 1) // 2
    want = visible_blocks(ids, block)
    forward, dkv = packed_attention_gpu.blocks_visited(ids, block)
    assert forward == dkv == sum(want.values())
    print(f"blocks of {block} a head: packed {forward}, padded layout {padded}, packed up to the diagonal {diagonal}")
    assert forward < 0.8 * padded and forward < 0.3 * diagonal

    visited = []
    scores = packed_attention_gpu.block_scores

    def recorded(q, k, q_ids, k_ids, q_start, k_start, scale):
        jax.debug.callback(lambda i, j: visited.append((int(i) // block, int(j) // block)), q_start, k_start)
        return scores(q, k, q_ids, k_ids, q_start, k_start, scale)

    monkeypatch.setattr(packed_attention_gpu, "block_scores", recorded)
    q, k, v, dout = inputs(T, B, H, 1, 16, jnp.float32)
    fn = functools.partial(packed_attention_gpu.packed_attention, ids=jnp.asarray(ids), block=block, interpret=True)
    jax.block_until_ready(jax.jit(fn)(q, k, v))
    assert collections.Counter(visited) == collections.Counter({key: H * c for key, c in want.items()})
    visited.clear()
    jax.block_until_ready(jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * dout), argnums=(0, 1, 2)))(q, k, v))
    assert collections.Counter(visited) == collections.Counter({key: 3 * H * c for key, c in want.items()})
