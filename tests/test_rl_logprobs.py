"""Fused chunked log-probs / entropy: values vs float64 NumPy, gradients vs autodiff of the full
log_softmax, compiled memory and HLO buffer sizes, and equality on sharded meshes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import rl, sharding


def ref_logprobs_entropy(hidden, lm_head, targets, temperature):
    """float64 NumPy: log_softmax of the full logits at the targets, and the entropy."""
    z = np.einsum("btd,dv->btv", np.asarray(hidden, np.float64), np.asarray(lm_head, np.float64)) / temperature
    z = z - z.max(-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
    logp = np.take_along_axis(logp_all, np.asarray(targets)[..., None], -1)[..., 0]
    return logp, -(np.exp(logp_all) * logp_all).sum(-1)


def naive(hidden, lm_head, targets, temperature):
    """The [B, T, V] way, differentiated by JAX's own autodiff: the gradient reference."""
    logp_all = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", hidden, lm_head) / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, -1)


def inputs(B=2, T=37, D=24, V=80, seed=0):
    """hidden [B, T, D], lm_head [D, V] (logits of std ~3), targets [B, T], cotangent weights a, b [B, T]."""
    rs = np.random.RandomState(seed)
    hidden = rs.randn(B, T, D).astype(np.float32)
    lm_head = (rs.randn(D, V) * 3.0 / np.sqrt(D)).astype(np.float32)
    targets = rs.randint(0, V, (B, T)).astype(np.int32)
    a, b = rs.randn(B, T).astype(np.float32), rs.randn(B, T).astype(np.float32)
    return tuple(map(jnp.asarray, (hidden, lm_head, targets, a, b)))


@pytest.mark.parametrize("temperature, chunk_size", [(1.0, 8), (0.6, 37), (1.3, 512)])
def test_values_match_full_log_softmax(temperature, chunk_size):
    hidden, lm_head, targets, _, _ = inputs()
    want_logp, want_ent = ref_logprobs_entropy(hidden, lm_head, targets, temperature)
    logp, ent = rl.token_logprobs_and_entropy(hidden, lm_head, targets, temperature=temperature,
                                              chunk_size=chunk_size)
    only = rl.token_logprobs(hidden, lm_head, targets, temperature=temperature, chunk_size=chunk_size)
    assert logp.dtype == ent.dtype == jnp.float32 and logp.shape == targets.shape
    np.testing.assert_allclose(np.asarray(logp), want_logp, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(only), want_logp, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent), want_ent, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature, chunk_size", [(1.0, 8), (0.7, 16)])
def test_gradients_match_full_log_softmax(temperature, chunk_size):
    hidden, lm_head, targets, a, b = inputs()

    def objective(fn):
        def loss(h, w):
            logp, ent = fn(h, w)
            return jnp.sum(a * logp) + jnp.sum(b * ent)
        return jax.grad(loss, argnums=(0, 1))

    fused = lambda h, w: rl.token_logprobs_and_entropy(h, w, targets, temperature=temperature,  # noqa: E731
                                                       chunk_size=chunk_size)
    got = objective(fused)(hidden, lm_head)
    want = objective(lambda h, w: naive(h, w, targets, temperature))(hidden, lm_head)
    for g, w_, name in zip(got, want, ("hidden", "lm_head")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), atol=1e-5, rtol=1e-5, err_msg=name)
    # log-probs alone (no entropy cotangent path)
    got = jax.grad(lambda h, w: jnp.sum(a * rl.token_logprobs(h, w, targets, temperature=temperature,
                                                             chunk_size=chunk_size)), (0, 1))(hidden, lm_head)
    want = jax.grad(lambda h, w: jnp.sum(a * naive(h, w, targets, temperature)[0]), (0, 1))(hidden, lm_head)
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), atol=1e-5, rtol=1e-5)


def test_bfloat16_inputs_give_float32_logprobs_and_bfloat16_gradients():
    hidden, lm_head, targets, a, _ = inputs()
    h16, w16 = hidden.astype(jnp.bfloat16), lm_head.astype(jnp.bfloat16)
    logp = rl.token_logprobs(h16, w16, targets, chunk_size=8)
    assert logp.dtype == jnp.float32
    want, _ = ref_logprobs_entropy(h16.astype(jnp.float32), w16.astype(jnp.float32), targets, 1.0)
    np.testing.assert_allclose(np.asarray(logp), want, atol=0.1)
    gh, gw = jax.grad(lambda h, w: jnp.sum(a * rl.token_logprobs(h, w, targets, chunk_size=8)), (0, 1))(h16, w16)
    assert gh.dtype == gw.dtype == jnp.bfloat16


def _shapes_in_hlo(text):
    """Element counts of every array shape written in an HLO module's text."""
    return [int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"\[(\d+(?:,\d+)*)\]", text)]


def test_gradient_memory_is_an_eighth_of_naive_and_no_btv_buffer():
    B, T, D, V = 1, 16384, 896, 151936
    specs = (jax.ShapeDtypeStruct((B, T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
             jax.ShapeDtypeStruct((B, T), jnp.int32))

    def compiled(fn):
        return jax.jit(jax.grad(lambda h, w, y: jnp.sum(fn(h, w, y)), argnums=(0, 1))).lower(*specs).compile()

    fused = compiled(lambda h, w, y: rl.token_logprobs(h, w, y))
    full = compiled(lambda h, w, y: naive(h, w, y, 1.0)[0])
    fused_temp = fused.memory_analysis().temp_size_in_bytes
    full_temp = full.memory_analysis().temp_size_in_bytes
    assert fused_temp * 8 <= full_temp, (fused_temp, full_temp)
    assert max(_shapes_in_hlo(fused.as_text())) < B * T * V
    assert max(_shapes_in_hlo(full.as_text())) >= B * T * V  # the check sees such buffers when they exist
    forward = jax.jit(lambda h, w, y: rl.token_logprobs_and_entropy(h, w, y)).lower(*specs).compile()
    assert max(_shapes_in_hlo(forward.as_text())) < B * T * V


def _collectives_by_computation(hlo_text):
    """{computation name: [(op, element count), ...]} for the cross-device reductions in an HLO module."""
    out = {}
    for block in re.split(r"\n(?=\S)", hlo_text):
        name = block.split(" ", 2)[1] if block.startswith("ENTRY") else block.split(" ", 1)[0]
        for dims, op in re.findall(r"\w+\[(\d+(?:,\d+)*)\]\S* (all-reduce|reduce-scatter)\(", block):
            out.setdefault(name, []).append((op, int(np.prod([int(d) for d in dims.split(",")]))))
    return out


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2), (1, 1, 8)])
def test_sharded_equals_single_device(mesh_shape):
    hidden, lm_head, targets, a, b = inputs(B=8, T=20, D=16, V=512, seed=1)
    mesh = sharding.make_mesh(*mesh_shape)

    def loss_and_grads(h, w, y):
        def loss(h, w):
            logp, ent = rl.token_logprobs_and_entropy(h, w, y, temperature=0.8, chunk_size=4)
            return jnp.sum(a * logp) + jnp.sum(b * ent)
        return jax.value_and_grad(loss, argnums=(0, 1))(h, w)

    want = jax.jit(loss_and_grads)(hidden, lm_head, targets)  # no mesh set: one device
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    args = (jax.device_put(hidden, batch), jax.device_put(lm_head, NamedSharding(mesh, P("fsdp", "tensor"))),
            jax.device_put(targets, batch))
    sharded = jax.jit(loss_and_grads)
    with jax.set_mesh(mesh):
        got = sharded(*args)
        compiled_text = sharded.lower(*args).compile().as_text()
    assert got[1][1].sharding.num_devices == 8
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    for g, w_ in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), atol=1e-5, rtol=1e-5)
    # The [D, V]-sized lm_head gradient is reduced across devices once, outside the chunk loop (inside
    # it, only [B, C]- and [B, C, D]-sized reductions over the vocab shards, all smaller than D * V / 8).
    head_size = lm_head.size // mesh.shape["tensor"]
    for name, ops in _collectives_by_computation(compiled_text).items():
        if not name.startswith("%main"):
            assert all(size < head_size for _, size in ops), (name, ops)


def test_bad_arguments_raise():
    hidden, lm_head, targets, _, _ = inputs()
    with pytest.raises(ValueError, match="hidden must be"):
        rl.token_logprobs(hidden[0], lm_head, targets)
    with pytest.raises(ValueError, match="lm_head must be"):
        rl.token_logprobs(hidden, lm_head.T, targets)
    with pytest.raises(ValueError, match="targets must be"):
        rl.token_logprobs(hidden, lm_head, targets[:, :5])
    with pytest.raises(ValueError, match="integer token ids"):
        rl.token_logprobs(hidden, lm_head, targets.astype(jnp.float32))
    with pytest.raises(ValueError, match="temperature"):
        rl.token_logprobs(hidden, lm_head, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        rl.token_logprobs(hidden, lm_head, targets, chunk_size=0)
