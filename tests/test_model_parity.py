"""Our Qwen2 / Qwen3 logits against transformers (PyTorch CPU) on the same random weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import checkpoints
from pacs_jax.models.config import REMAT_POLICIES
from qwen_reference import ARCHS, hf_logits, max_rel_err, padded_batch, save_random_hf_model

LENGTHS = [12, 7, 3, 10]  # different lengths in one batch of T = 12
T = 12


@nnx.jit(static_argnames="return_hidden")
def run(model, tokens, mask=None, return_hidden=False):
    """The model's __call__, jitted (one compilation per model config and shape, not one per op)."""
    return model(jnp.asarray(tokens), attention_mask=None if mask is None else jnp.asarray(mask),
                 return_hidden=return_hidden)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{arch: (directory, transformers model)} saved with save_pretrained."""
    root = tmp_path_factory.mktemp("parity")
    return {arch: (root / arch, save_random_hf_model(arch, root / arch, seed=i)) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def fp32_models(hf_models):
    return {arch: checkpoints.from_pretrained(path, dtype="float32") for arch, (path, _) in hf_models.items()}


def test_configs_exercise_the_hard_cases(fp32_models):
    q2, q3 = fp32_models["qwen2_untied_bias"], fp32_models["qwen3_tied_head_dim24"]
    assert q2.cfg.model_type == "qwen2" and not q2.cfg.tie_word_embeddings and q2.cfg.attention_bias
    assert np.abs(np.asarray(q2.layers.attn.q_bias[...][0])).min() > 0  # the random biases were loaded
    assert q3.cfg.model_type == "qwen3" and q3.cfg.tie_word_embeddings and not hasattr(q3, "lm_head")
    assert q3.cfg.head_dim == 24 != q3.cfg.hidden_size // q3.cfg.num_attention_heads
    for model in (q2, q3):
        assert model.cfg.num_key_value_heads < model.cfg.num_attention_heads


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(hf_models, fp32_models, arch, side):
    _, hf_model = hf_models[arch]
    tokens, mask = padded_batch(ARCHS[arch]["vocab_size"], LENGTHS, T, side, seed=1)
    logits = np.asarray(run(fp32_models[arch], tokens, mask))
    assert logits.shape == (len(LENGTHS), T, ARCHS[arch]["vocab_size"]) and logits.dtype == np.float32
    assert np.isfinite(logits).all()  # pad positions too: a NaN there would poison masked losses
    assert max_rel_err(logits, hf_logits(hf_model, tokens, mask), mask) <= 1e-4


@pytest.mark.parametrize("arch", list(ARCHS))
def test_padding_does_not_change_real_positions(fp32_models, arch):
    """A row alone and unpadded gives the same logits as inside a left-padded batch."""
    model = fp32_models[arch]
    tokens, mask = padded_batch(ARCHS[arch]["vocab_size"], LENGTHS, T, "left", seed=2)
    batch_logits = np.asarray(run(model, tokens, mask))
    row, n = 2, LENGTHS[2]
    alone = np.asarray(run(model, tokens[row:row + 1, T - n:]))
    np.testing.assert_allclose(batch_logits[row, T - n:], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_compute(hf_models, arch):
    """bf16 compute on fp32 parameters: fp32 logits close to the fp32 reference (bf16 tolerance)."""
    path, hf_model = hf_models[arch]
    model = checkpoints.from_pretrained(path, dtype="bfloat16")
    assert model.embedding[...].dtype == jnp.float32  # master weights stay fp32
    tokens, mask = padded_batch(ARCHS[arch]["vocab_size"], LENGTHS, T, "left", seed=3)
    hidden = nnx.eval_shape(lambda m: m(jnp.asarray(tokens), attention_mask=jnp.asarray(mask), return_hidden=True),
                            model)
    assert hidden.dtype == jnp.bfloat16
    logits = np.asarray(run(model, tokens, mask))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    err = max_rel_err(logits, hf_logits(hf_model, tokens, mask), mask)
    assert 1e-5 < err <= 5e-2  # really bf16 (not fp32), and still close


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hidden_times_lm_head_equals_logits(fp32_models, arch):
    model = fp32_models[arch]
    tokens, mask = padded_batch(ARCHS[arch]["vocab_size"], LENGTHS, T, "left", seed=4)
    hidden = np.asarray(run(model, tokens, mask, return_hidden=True), np.float64)
    assert hidden.shape == (len(LENGTHS), T, ARCHS[arch]["hidden_size"])
    kernel = np.asarray(model.lm_head_kernel(), np.float64)  # [D, V]
    expected_kernel = (np.asarray(model.embedding[...]).T if model.cfg.tie_word_embeddings
                       else np.asarray(model.lm_head[...]))
    np.testing.assert_array_equal(kernel, expected_kernel)
    logits = np.asarray(run(model, tokens, mask))
    np.testing.assert_allclose(logits, hidden @ kernel, rtol=1e-5, atol=1e-5)


def _remat_policies_in(jaxpr) -> list:
    """The ``policy`` of every remat equation in a (nested) jaxpr."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("remat") or eqn.primitive.name == "checkpoint":
            found.append(eqn.params["policy"])
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found.extend(_remat_policies_in(inner))
    return found


def test_remat_policies_same_logits_and_grads(hf_models):
    """Every remat policy: one remat region, the scanned decoder layer; loss and every gradient unchanged."""
    path, _ = hf_models["qwen2_untied_bias"]
    arch = ARCHS["qwen2_untied_bias"]
    tokens, mask = (jnp.asarray(a) for a in padded_batch(arch["vocab_size"], LENGTHS, T, "left", seed=5))
    weights = jax.random.normal(jax.random.key(0), (len(LENGTHS), T, arch["vocab_size"]))
    split = {policy: nnx.split(checkpoints.from_pretrained(path, remat=policy)) for policy in REMAT_POLICIES}

    def loss_fn(policy):
        def loss(state):
            logits = nnx.merge(split[policy][0], state)(tokens, attention_mask=mask)
            return jnp.sum(logits * weights * mask[..., None])
        return loss

    for policy, (_, state) in split.items():
        found = _remat_policies_in(jax.make_jaxpr(jax.grad(loss_fn(policy)))(state).jaxpr)
        if policy == "none":
            assert found == []
            continue
        assert len(found) == 1  # the body of the one scan over layers
        if policy == "full":
            assert all(p is None for p in found)
        else:  # JAX's own policy of that name (since 0.11 a function, no longer a DotsSaveable object)
            assert all(p is getattr(jax.checkpoint_policies, policy) for p in found)

    # One program for all policies (XLA compiles once; each policy reads its own copy of the weights).
    states = {policy: state for policy, (_, state) in split.items()}
    results = jax.jit(lambda states: {p: jax.value_and_grad(loss_fn(p))(states[p]) for p in states})(states)
    flat = {p: {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}
            for p, (_, grads) in results.items()}
    ref_loss, ref_grads = float(results["none"][0]), flat["none"]
    assert all(np.abs(g).max() > 0 for g in ref_grads.values())
    for policy in REMAT_POLICIES[1:]:
        np.testing.assert_allclose(float(results[policy][0]), ref_loss, rtol=1e-6)
        assert flat[policy].keys() == ref_grads.keys()
        for name, g in flat[policy].items():
            np.testing.assert_allclose(g, ref_grads[name], rtol=1e-5, atol=1e-6 * np.abs(ref_grads[name]).max(),
                                       err_msg=f"remat={policy}: gradient of {name}")
