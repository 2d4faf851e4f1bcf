"""Decode attention over a paged KV cache (pacs_jax/models/paged_attention.py): the XLA path against
a dense softmax over each row's gathered tokens, and the kernels (the library's TPU kernel, our GPU
kernel: Pallas interpret mode on CPU) against the XLA path, on random pools with ragged lengths and
scattered page tables (a table width of 5 pages: no power of 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax.models.paged_attention import PageView, paged_decode_attention, write

B, H, K, Dh, L, N, S, M = 4, 8, 2, 16, 2, 24, 4, 5  # rows, heads, kv heads, head dim, layers, pages, page size, table


def _case(seed=0, heads=H):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, 1, heads, Dh)).astype(np.float32)
    k_pool, v_pool = (rng.normal(size=(K, L, N, S, Dh)).astype(np.float32) for _ in range(2))
    table = rng.permutation(N)[:B * M].reshape(B, M).astype(np.int32)  # no page shared
    lengths = np.array([1, 7, 20, 0], np.int32)  # ragged: one token, mid-page, every page, none
    return q, k_pool, v_pool, table, lengths


def _dense(q, k_pool, v_pool, layer, table, lengths):
    """softmax(q k^T / sqrt(Dh)) v over each row's first lengths[b] tokens, in float64."""
    out, heads = np.zeros(q.shape, np.float64), q.shape[2]
    for b in range(B):
        if lengths[b] == 0:
            continue
        tokens = np.arange(lengths[b])
        k = k_pool[:, layer][:, table[b, tokens // S], tokens % S]  # [K, n, Dh]
        v = v_pool[:, layer][:, table[b, tokens // S], tokens % S]
        for h in range(heads):
            scores = k[h // (heads // K)] @ q[b, 0, h] / np.sqrt(Dh)
            p = np.exp(scores - scores.max())
            out[b, 0, h] = (p / p.sum()) @ v[h // (heads // K)]
    return out


@pytest.mark.parametrize("block_pages", [1, 2])
def test_xla_path_equals_a_dense_softmax_over_the_live_tokens(block_pages):
    q, k_pool, v_pool, table, lengths = _case()
    view = PageView(table, lengths, np.zeros(B, np.int32), np.zeros(B, np.int32))
    for layer in range(L):
        out = paged_decode_attention(q, k_pool, v_pool, layer, view, block_pages=block_pages)
        np.testing.assert_allclose(out, _dense(q, k_pool, v_pool, layer, table, lengths), rtol=1e-5, atol=1e-5)


def test_write_puts_each_rows_key_at_its_page_and_slot_of_the_layer():
    _, k_pool, _, table, _ = _case()
    x = np.random.default_rng(1).normal(size=(B, 1, K, Dh)).astype(np.float32)
    page, slot = table[:, 1], np.array([0, 3, 2, 1], np.int32)
    out = np.asarray(write(jnp.asarray(k_pool), x, 1, PageView(table, None, page, slot)))
    expected = k_pool.copy()
    expected[:, 1, page, slot] = x[:, 0].swapaxes(0, 1)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_kernel_equals_the_xla_path_in_interpret_mode(impl):
    """The kernels read a row's tokens only up to its length (the lengths include 0, mid-page and
    every page). The TPU kernel's dots run at the MXU's default precision (bfloat16 passes, which its
    interpreter reproduces), so it agrees to bfloat16 round-off; the GPU kernel's to float32's."""
    from jax.experimental.pallas import tpu as pltpu

    q, k_pool, v_pool, table, lengths = _case(2)
    view = PageView(table, lengths, np.zeros(B, np.int32), np.zeros(B, np.int32))
    expected = paged_decode_attention(q, k_pool, v_pool, 1, view)
    with pltpu.force_tpu_interpret_mode() if impl == "tpu" else jax.default_device(jax.devices("cpu")[0]):
        out = paged_decode_attention(q, k_pool, v_pool, 1, view, impl=impl, block_pages=1, interpret=True)
    tolerance = 1e-2 if impl == "tpu" else 1e-5
    np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("heads", [2, 12, 14])
def test_gpu_kernel_reads_and_writes_only_its_heads_rows_at_any_group_size(heads):
    """The kernel reads a KV head's G = heads / K query heads straight from q [B, H, Dh] as a tile of
    16 rows, the rows past G masked (another head's queries, the next row's, past the array's end),
    and writes only its G rows of the output: at G = 1, 6 (Qwen2.5-1.5B's) and 7 over K = 2, every
    head equals the float64 softmax (a row with no visible token: zeros)."""
    q, k_pool, v_pool, table, lengths = _case(5, heads=heads)
    view = PageView(table, lengths, np.zeros(B, np.int32), np.zeros(B, np.int32))
    with jax.default_device(jax.devices("cpu")[0]):
        out = paged_decode_attention(q, k_pool, v_pool, 1, view, impl="gpu", block_pages=2, interpret=True)
    np.testing.assert_allclose(out, _dense(q, k_pool, v_pool, 1, table, lengths), rtol=1e-5, atol=1e-5)


def test_gpu_kernel_runs_per_head_shard_on_a_mesh_and_equals_the_xla_path():
    """On the 2x2x2 mesh, the pool's heads split over "tensor": the kernel runs in shard_map over it
    (each device its own KV heads), inside jit, as in the sampler's decode step."""
    from pacs_jax.models.paged_attention import POOL_AXES
    from pacs_jax.sharding import constrain, make_mesh

    q, k_pool, v_pool, table, lengths = _case(3)
    view = PageView(table, lengths, np.zeros(B, np.int32), np.zeros(B, np.int32))
    expected = paged_decode_attention(q, k_pool, v_pool, 0, view)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        run = jax.jit(lambda q, k, v: paged_decode_attention(q, constrain(k, POOL_AXES), constrain(v, POOL_AXES), 0,
                                                             view, impl="gpu", block_pages=1, interpret=True))
        out = run(q, k_pool, v_pool)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_pages", [1, 8])
def test_gpu_kernel_in_bfloat16_has_the_xla_paths_arithmetic(block_pages):
    """bfloat16 pools and queries: our GPU kernel (float32 scores scaled in float32, float32
    accumulation, probabilities rounded to bfloat16 for p v as the XLA path does on a GPU, one rounding
    of the output) is within a bfloat16 rounding of the terms (|v| ~ 2) of the XLA path, and within
    1.5x of its distance to the float64 softmax (on CPU the XLA path keeps p in float32); tokens past
    a row's length hold NaN, never read into the output."""
    q, k_pool, v_pool, table, lengths = _case(4)
    q, k_pool, v_pool = (jnp.asarray(x, jnp.bfloat16) for x in (q, k_pool, v_pool))
    view = PageView(table, lengths, np.zeros(B, np.int32), np.zeros(B, np.int32))
    exact = _dense(*(np.asarray(x, np.float32) for x in (q, k_pool, v_pool)), 1, table, lengths)
    poisoned = []  # every token past a row's length: NaN
    for pool in (k_pool, v_pool):
        pool = np.asarray(pool, np.float32)
        for b in range(B):
            for i in range(lengths[b], M * S):
                pool[:, 1, table[b, i // S], i % S] = np.nan
        poisoned.append(jnp.asarray(pool, jnp.bfloat16))
    xla = np.asarray(paged_decode_attention(q, *poisoned, 1, view), np.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        ours = np.asarray(paged_decode_attention(q, *poisoned, 1, view, impl="gpu", block_pages=block_pages,
                                                 interpret=True), np.float32)
    assert np.isfinite(ours).all() and np.isfinite(xla).all()
    assert np.abs(ours - xla).max() <= 2.0 ** -7 * np.abs(xla).max()  # bfloat16's spacing at the largest value
    assert np.abs(ours - exact).max() <= 1.5 * np.abs(xla - exact).max() + 1e-6
