"""pacs_jax.models.attention against float64 NumPy references.

On CPU: the "xla" implementation (values, gradients, no [T, T] buffer in the compiled HLO, bfloat16,
GSPMD sharding), decode_attention (and which cache blocks it reads), the cuDNN roll/unroll logic
around the xla core, and the splash wrapper with the kernel in the Pallas interpreter.
The "cudnn" path against the "xla" one: on a GPU with the cuDNN kernel (run there with
JAX_PLATFORMS=cuda,cpu; jax.debug.callback needs a CPU device), elsewhere with the kernel call, its
only GPU part, run by JAX's own implementation of the same call.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax.models import attention as attention_module
from pacs_jax.models.attention import ATTENTION_IMPLS, attention, decode_attention, resolve_impl


@pytest.fixture(autouse=True)
def _full_precision_float32_dots():
    """float32 dots at full precision on every backend (GPUs default to TF32)."""
    with jax.default_matmul_precision("highest"):
        yield


# ---------------------------------------------------------------------------------------------
# float64 NumPy references


def ref_masked_attention(q, k, v, mask):
    """q [B, T, H, Dh], k/v [B, S, K, Dh], mask [B, T, S] bool -> (out [B, T, H, Dh], probs [B, H, T, S])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    G = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    mask = np.asarray(mask)[:, None]
    s = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    top = s.max(-1, keepdims=True)
    e = np.where(mask, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total == 0, 1.0, total)
    return np.einsum("bhts,bshd->bthd", p, v), p


def causal_mask(valid):
    """valid [B, T] -> [B, T, T]: query t sees key s iff valid[b, s] and s <= t."""
    T = valid.shape[1]
    return np.asarray(valid)[:, None, :] & np.tril(np.ones((T, T), bool))[None]


def ref_attention(q, k, v, valid):
    return ref_masked_attention(q, k, v, causal_mask(valid))[0]


def ref_attention_grads(q, k, v, valid, dout):
    """Analytic softmax backward of sum(out * dout) -> (dq, dk, dv), float64."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    B, T, H, Dh = q.shape
    K = k.shape[2]
    G = H // K
    _, p = ref_masked_attention(q, k, v, causal_mask(valid))  # [B, H, T, S]
    kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    dv = np.einsum("bhts,bthd->bshd", p, dout)
    dp = np.einsum("bthd,bshd->bhts", dout, vr)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) / math.sqrt(Dh)
    dq = np.einsum("bhts,bshd->bthd", ds, kr)
    dk = np.einsum("bhts,bthd->bshd", ds, q)
    group = lambda x: x.reshape(B, T, K, G, Dh).sum(3)  # noqa: E731  (sum over each KV head's queries)
    return dq, group(dk), group(dv)


def test_reference_grads_match_finite_differences():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 4, 2, 3)), rng.normal(size=(1, 4, 1, 3)), rng.normal(size=(1, 4, 1, 3))
    valid = np.array([[False, True, True, True]])
    dout = rng.normal(size=q.shape)
    loss = lambda q, k, v: np.sum(ref_attention(q, k, v, valid) * dout)  # noqa: E731
    args = [q, k, v]
    for which, grad in enumerate(ref_attention_grads(q, k, v, valid, dout)):
        numeric = np.zeros_like(grad)
        for index in np.ndindex(grad.shape):
            hi, lo = [a.copy() for a in args], [a.copy() for a in args]
            hi[which][index] += 1e-6
            lo[which][index] -= 1e-6
            numeric[index] = (loss(*hi) - loss(*lo)) / 2e-6
        np.testing.assert_allclose(grad, numeric, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# inputs


def padded_valid(B, T):
    """[B, T] bool rows cycling through: left + right padding, none, all padding, left only."""
    spans = [(max(1, T // 6), T - max(1, T // 8)), (0, T), (0, 0), (T // 2, T)]
    valid = np.zeros((B, T), bool)
    for b in range(B):
        start, end = spans[b % len(spans)]
        valid[b, start:end] = True
    return valid


def random_qkv(B, T, H, K, Dh, seed=0, S=None):
    rng = np.random.default_rng(seed)
    S = T if S is None else S
    return (rng.normal(size=(B, T, H, Dh)).astype(np.float32),
            rng.normal(size=(B, S, K, Dh)).astype(np.float32),
            rng.normal(size=(B, S, K, Dh)).astype(np.float32))


def sees_a_key(valid):
    return np.cumsum(valid, axis=1) > 0  # [B, T]


def out_and_grads(fn, q, k, v, dout):
    """(fn(q, k, v), the gradients of sum(fn(q, k, v) * dout) in q, k and v), from one compiled program."""
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * dout), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


# (B, T, H, K, Dh, block): T < block, T = block, T not a multiple of block, T = 4 blocks;
# GQA groups 1, 2, 7; B >= 3 includes an all-padding row.
CASES = [(3, 5, 2, 2, 8, 16), (4, 16, 4, 2, 8, 16), (3, 23, 7, 1, 8, 8), (3, 64, 4, 2, 16, 16)]


@pytest.mark.parametrize("B,T,H,K,Dh,block", CASES)
def test_xla_matches_reference(B, T, H, K, Dh, block):
    q, k, v = random_qkv(B, T, H, K, Dh)
    valid = padded_valid(B, T)
    dout = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)
    fn = lambda q, k, v: attention(q, k, v, valid, impl="xla", block_size=block)  # noqa: E731

    out, grads = out_and_grads(fn, q, k, v, dout)
    out = np.asarray(out)
    np.testing.assert_allclose(out, ref_attention(q, k, v, valid), atol=1e-5)
    assert np.all(out[~sees_a_key(valid)] == 0)  # queries that see no key: exactly 0

    dq, dk, dv = (np.asarray(g) for g in grads)
    for got, want in zip((dq, dk, dv), ref_attention_grads(q, k, v, valid, dout)):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.all(dq[~sees_a_key(valid)] == 0)
    padding_rows = ~valid.any(1)
    assert np.all(dk[padding_rows] == 0) and np.all(dv[padding_rows] == 0)


def test_resolve_impl():
    assert resolve_impl("auto", "tpu") == "splash"
    assert resolve_impl("auto", "gpu") == "cudnn"
    assert resolve_impl("auto", "cpu") == "xla"
    assert resolve_impl("auto") == resolve_impl("auto", jax.default_backend())
    assert all(resolve_impl(name, "tpu") == name for name in ATTENTION_IMPLS[1:])
    with pytest.raises(ValueError, match="splash"):
        resolve_impl("flash")
    q, k, v = random_qkv(1, 4, 2, 1, 8)
    with pytest.raises(ValueError, match="expected one of"):
        attention(q, k, v, np.ones((1, 4), bool), impl="naive")


# ---------------------------------------------------------------------------------------------
# no [T, T] buffer


def oversized_buffers(hlo_text, T, limit):
    """Shapes in HLO text whose two last dims are [T, T] or with >= limit elements."""
    found = []
    for dims in re.findall(r"\b(?:pred|[subf]\d+|bf16)\[([\d,]*)\]", hlo_text):
        shape = [int(d) for d in dims.split(",") if d]
        if shape[-2:] == [T, T] or math.prod(shape) >= limit:
            found.append(shape)
    return found


def naive_attention(q, k, v, valid):
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.asarray(causal_mask(valid))[:, None], s, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def test_compiled_grad_has_no_quadratic_buffer():
    B, H, K, T, Dh, block = 2, 4, 2, 64, 16, 16  # q has B*T*H*Dh = 8192 elements
    q, k, v = random_qkv(B, T, H, K, Dh)
    valid = padded_valid(B, T)
    limit = B * H * T * T // 2  # half of one [B, H, T, T] (= [B, K, G, T, T]) buffer

    def hlo(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v, valid) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()

    blockwise = lambda q, k, v, valid: attention(q, k, v, valid, impl="xla", block_size=block)  # noqa: E731
    assert oversized_buffers(hlo(blockwise), T, limit) == []
    assert [B, H, T, T] in oversized_buffers(hlo(naive_attention), T, limit)  # the check would catch it


# ---------------------------------------------------------------------------------------------
# bfloat16 and sharding


def test_bfloat16_runs_on_cpu_and_is_close_to_float32():
    B, T, H, K, Dh, block = 3, 24, 4, 2, 8, 8
    q, k, v = random_qkv(B, T, H, K, Dh)
    valid = padded_valid(B, T)
    dout = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)
    fn = lambda q, k, v: attention(q, k, v, valid, impl="xla", block_size=block)  # noqa: E731
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]

    out, grads = out_and_grads(fn, *bf16, jnp.asarray(dout, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_attention(q, k, v, valid), atol=3e-2)
    for got, want in zip(grads, ref_attention_grads(q, k, v, valid, dout)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=6e-2)


@pytest.mark.parametrize("K", [4, 2])  # K=2 < tensor=4: k/v replicated over the tensor axis
def test_sharded_matches_unsharded(K):
    assert len(jax.devices()) == 8, "conftest.py's 8 simulated CPU devices"
    B, T, H, Dh, block = 4, 40, 8, 8, 16
    q, k, v = random_qkv(B, T, H, K, Dh)
    valid = padded_valid(B, T)
    dout = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    kv_spec = P("data", None, "tensor") if K % 4 == 0 else P("data")
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    sharded = (put(q, P("data", None, "tensor")), put(k, kv_spec), put(v, kv_spec))
    valid_sharded = put(valid, P("data"))

    def loss(q, k, v, valid):
        out = attention(q, k, v, valid, impl="xla", block_size=block)
        return jnp.sum(out * dout), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    if K % 4 == 0:  # batch and head shardings propagate through: no collective but the loss's
        hlo = step.lower(*sharded, valid_sharded).compile().as_text()
        collectives = re.findall(r"= (.*?) (?:all-gather|all-to-all|all-reduce|collective-permute)\(", hlo)
        assert all(re.fullmatch(r"\w+\[\]", result) for result in collectives), collectives  # scalars
    (_, want_out), want_grads = step(q, k, v, valid)
    (_, out), grads = step(*sharded, valid_sharded)
    assert out.sharding.spec[0] == "data"
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# decode


def ref_decode(q, k_cache, v_cache, valid, filled):
    S = k_cache.shape[1]
    mask = (np.asarray(valid) & (np.arange(S) < filled))[:, None, :]  # [B, 1, S]
    clean = lambda x: np.where(np.isnan(x), 0.0, x)  # noqa: E731  (the unwritten slots are masked)
    return ref_masked_attention(q, clean(k_cache), clean(v_cache), mask)[0]


def test_decode_matches_reference_and_reads_only_filled_blocks(monkeypatch):
    """Caches filled to 1, 8, 13, 16 and 20 of 20 slots (within the first block, one block exactly, within
    the shifted last block, all of it), one compiled step: ``filled`` is an argument of the program."""
    B, S, H, K, Dh, block = 3, 20, 4, 2, 8, 8  # S not a multiple of the block: the last is shifted
    q, k_full, v_full = random_qkv(B, 1, H, K, Dh, S=S)
    valid = np.ones((B, S), bool)
    valid[0, :3] = False  # a left-padded prompt
    valid[2] = False  # batch padding

    starts = []
    read = attention_module._read_cache_block

    def recording_read(cache, start, size):
        jax.debug.callback(lambda s: starts.append(int(s)), start)
        return read(cache, start, size)

    monkeypatch.setattr(attention_module, "_read_cache_block", recording_read)
    step = jax.jit(lambda q, k, v, valid, filled: decode_attention(q, k, v, valid, filled, block_size=block))
    heads_first = lambda c: np.swapaxes(c, 1, 2)  # noqa: E731  the cache layout [B, K, S, Dh]
    for filled in (1, 8, 13, 16, 20):
        k_cache, v_cache = k_full.copy(), v_full.copy()
        k_cache[:, filled:] = np.nan  # not yet written
        v_cache[:, filled:] = np.nan
        starts.clear()
        out = np.asarray(step(q, heads_first(k_cache), heads_first(v_cache), valid, jnp.int32(filled)))
        jax.effects_barrier()

        assert np.isfinite(out).all(), filled
        np.testing.assert_allclose(out, ref_decode(q, k_cache, v_cache, valid, filled), atol=1e-5, err_msg=str(filled))
        assert np.all(out[2] == 0), filled
        blocks = -(-filled // block)  # both caches read once per block, blocks past `filled` never
        assert sorted(starts) == sorted(2 * [min(j * block, S - block) for j in range(blocks)]), filled


def test_decode_step_equals_last_row_of_attention():
    B, T, H, K, Dh = 2, 12, 4, 2, 8
    q, k, v = random_qkv(B, T, H, K, Dh)
    valid = padded_valid(B, T)
    valid[:, -1] = True  # the decoded token is real
    full = attention(q, k, v, valid, impl="xla", block_size=4)
    step = decode_attention(q[:, -1:], jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), valid, T, block_size=5)
    np.testing.assert_allclose(np.asarray(step), np.asarray(full[:, -1:]), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# cuDNN roll/unroll logic, splash wrapper


def lengths_core(block):
    """A stand-in for cuDNN on CPU: causal + per-row lengths through the xla core; query rows past
    q_len hold NaN (cuDNN leaves them unspecified)."""

    def core(q, k, v, q_len, kv_len):
        T = q.shape[1]
        kv_valid = jnp.arange(T)[None, :] < kv_len[:, None]
        out = attention_module._xla_attention(q, k, v, kv_valid, block)
        return jnp.where((jnp.arange(T)[None, :] < q_len[:, None])[:, :, None, None], out, jnp.nan)

    return core


def test_cudnn_roll_logic_matches_reference():
    B, T, H, K, Dh, block = 4, 21, 4, 2, 8, 8
    q, k, v = random_qkv(B, T, H, K, Dh)
    valid = padded_valid(B, T)
    dout = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)
    core = lengths_core(block)

    def fn(q, k, v):
        return attention_module._rolled_attention(q, k, v, jnp.asarray(valid), core)

    out, grads = out_and_grads(fn, q, k, v, dout)
    out = np.asarray(out)
    np.testing.assert_allclose(out, ref_attention(q, k, v, valid), atol=1e-5)
    assert np.all(out[~sees_a_key(valid)] == 0)
    for got, want in zip(grads, ref_attention_grads(q, k, v, valid, dout)):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_splash_wrapper_in_interpreter_matches_reference():
    B, T, H, K, Dh = 4, 100, 4, 2, 16  # T padded to 128 inside
    q, k, v = random_qkv(B, T, H, K, Dh)
    valid = padded_valid(B, T)
    dout = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)
    def fn(q, k, v):
        return attention_module._splash_attention(q, k, v, jnp.asarray(valid), interpret=True)

    out, grads = out_and_grads(fn, q, k, v, dout)
    out = np.asarray(out)
    np.testing.assert_allclose(out, ref_attention(q, k, v, valid), atol=1e-5)
    assert np.all(out[~sees_a_key(valid)] == 0)
    for got, want in zip(grads, ref_attention_grads(q, k, v, valid, dout)):
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_splash_wrapper_under_mesh_in_interpreter():
    assert len(jax.devices()) == 8, "conftest.py's 8 simulated CPU devices"
    B, T, H, K, Dh = 2, 128, 8, 2, 16  # K=2 does not divide over tensor=4: k/v repeated to H
    q, k, v = random_qkv(B, T, H, K, Dh)
    valid = padded_valid(B, T)
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    fn = jax.jit(lambda q, k, v: attention_module._splash_attention(q, k, v, valid, interpret=True))
    with jax.set_mesh(mesh):
        out = fn(q, k, v)
    np.testing.assert_allclose(np.asarray(out), ref_attention(q, k, v, valid), atol=1e-5)


@pytest.fixture
def cudnn_kernel_on_cpu(monkeypatch):
    """Off a GPU, the one cuDNN-only part of the "cudnn" path, the kernel call, runs as JAX's own
    implementation of the same call (same arguments: causal, per-row lengths); everything around it
    (rolling, casting, padding T to a multiple of 64, slicing back, zeroing) is the real code.
    On a GPU the kernel itself runs."""
    if jax.default_backend() == "gpu":
        return
    kernel = jax.nn.dot_product_attention

    def on_cpu(*args, implementation=None, **kwargs):
        assert implementation == "cudnn"
        return kernel(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", on_cpu)


@pytest.mark.parametrize("T", [40, 128, 203])
def test_cudnn_path_matches_xla(T, cudnn_kernel_on_cpu):
    B, H, K, Dh = 4, 8, 2, 64
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(B, T, H, K, Dh))
    valid = padded_valid(B, T)
    dout = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.bfloat16)
    cudnn = lambda q, k, v: attention(q, k, v, valid, impl="cudnn")  # noqa: E731
    xla = lambda q, k, v: attention(q, k, v, valid, impl="xla", block_size=64)  # noqa: E731

    out, grads = out_and_grads(cudnn, q, k, v, dout)
    want_out, want_grads = out_and_grads(xla, q, k, v, dout)
    out = np.asarray(out, np.float32)
    np.testing.assert_allclose(out, np.asarray(want_out, np.float32), rtol=1e-2, atol=2e-2)
    assert np.all(out[~sees_a_key(valid)] == 0)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=1e-2, atol=5e-2)
