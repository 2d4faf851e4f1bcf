"""The model on meshes of 8 simulated CPU devices: parameters really sharded, logits unchanged.

Both reference architectures have 8 query heads and 2 KV heads, so the tensor axis of 8 shows the
GQA case of docs/design.md section 5.3: K/V projections replicated over "tensor", query heads split 8 ways.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from pacs_jax import checkpoints, models
from pacs_jax.sharding import make_mesh
from conftest import REPO
from qwen_reference import ARCHS, hf_logits, max_rel_err, padded_batch, save_random_hf_model
from train_helpers import train_env

LENGTHS = [16, 9, 4, 13, 16, 1, 11, 6]  # B = 8: divisible by every batch split below
T = 16
MESHES = [(8, 1, 1), (2, 2, 2), (1, 1, 8)]

# Expected PartitionSpecs (data, fsdp, tensor) for a few parameters of each architecture.
# vocab 160, hidden 64, MLP 128 (qwen2) / 96 (qwen3), 8 query heads, 2 KV heads.
EXPECTED_SPECS = {
    (8, 1, 1): {  # pure data parallelism: parameters replicated
        "embedding": P(None, None),
        "layers.attn.q_kernel": P(None, None, None, None),
        "layers.mlp.gate_kernel": P(None, None, None),
    },
    (2, 2, 2): {
        "embedding": P("tensor", "fsdp"),
        "layers.attn.q_kernel": P(None, "fsdp", "tensor", None),
        "layers.attn.k_kernel": P(None, "fsdp", "tensor", None),  # 2 KV heads split over tensor=2
        "layers.attn.o_kernel": P(None, "tensor", None, "fsdp"),
        "layers.mlp.gate_kernel": P(None, "fsdp", "tensor"),
        "layers.mlp.down_kernel": P(None, "tensor", "fsdp"),
        "layers.input_norm.scale": P(None, None),
    },
    (1, 1, 8): {
        "embedding": P("tensor", None),
        "layers.attn.q_kernel": P(None, None, "tensor", None),
        "layers.attn.k_kernel": P(None, None, None, None),  # 2 KV heads < tensor=8: replicated
        "layers.attn.v_kernel": P(None, None, None, None),
        "layers.attn.o_kernel": P(None, "tensor", None, None),
        "layers.mlp.up_kernel": P(None, None, "tensor"),
    },
}
EXPECTED_LOGITS_SPEC = {  # [B, T, V]: batch over (data, fsdp), vocab over tensor
    (8, 1, 1): ("data", None, None),
    (2, 2, 2): (("data", "fsdp"), None, "tensor"),
    (1, 1, 8): (None, None, "tensor"),
}
EXPECTED_EXTRA = {  # architecture-specific parameters
    ("qwen2_untied_bias", (1, 1, 8)): {"lm_head": P(None, "tensor"), "layers.attn.q_bias": P(None, "tensor", None),
                                       "layers.attn.k_bias": P(None, None, None)},
    ("qwen2_untied_bias", (2, 2, 2)): {"lm_head": P("fsdp", "tensor"), "layers.attn.v_bias": P(None, "tensor", None)},
    ("qwen3_tied_head_dim24", (1, 1, 8)): {"layers.attn.q_norm.scale": P(None, None)},
}


def _spec(array: jax.Array) -> tuple:
    """The array's PartitionSpec as a tuple with one entry per dim (trailing Nones spelled out)."""
    spec = tuple(array.sharding.spec)
    return spec + (None,) * (array.ndim - len(spec))


def _forward(model, tokens, mask):
    return model(tokens, attention_mask=mask)


forward = nnx.jit(_forward)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharding")
    return {arch: (root / arch, save_random_hf_model(arch, root / arch, seed=10 + i)) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def batch():
    return padded_batch(160, LENGTHS, T, "left", seed=11)


@pytest.fixture(scope="module")
def single_device_logits(hf_models, batch):
    """Logits on a (1, 1, 1) mesh, per architecture, checked against transformers first."""
    tokens, mask = batch
    out = {}
    for arch, (path, hf_model) in hf_models.items():
        with jax.set_mesh(make_mesh(1, 1, 1, devices=jax.devices()[:1])):
            model = checkpoints.from_pretrained(path)
            logits = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(mask)))
        assert max_rel_err(logits, hf_logits(hf_model, tokens, mask), mask) <= 1e-4
        out[arch] = logits
    return out


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_sharded_logits_match(hf_models, batch, single_device_logits, arch, mesh_shape):
    path, hf_model = hf_models[arch]
    mesh = make_mesh(*mesh_shape)
    with jax.set_mesh(mesh):
        model = checkpoints.from_pretrained(path)
    params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    expected = {**EXPECTED_SPECS[mesh_shape], **EXPECTED_EXTRA.get((arch, mesh_shape), {})}
    for name, spec in expected.items():
        array = params[name]
        assert array.sharding.mesh.shape == dict(zip(("data", "fsdp", "tensor"), mesh_shape))
        assert _spec(array) == tuple(spec), name
        # Each device really holds only its slice (shape divided along the sharded dims).
        ways = [np.prod([mesh.shape[a] for a in ((s,) if isinstance(s, str) else (s or ()))]) for s in spec]
        assert array.addressable_shards[0].data.shape == tuple(d // w for d, w in zip(array.shape, ways)), name
        assert len(array.addressable_shards) == 8

    tokens, mask = batch
    with jax.set_mesh(mesh):
        logits = forward(model, jnp.asarray(tokens), jnp.asarray(mask))
    assert _spec(logits) == EXPECTED_LOGITS_SPEC[mesh_shape]
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()
    assert max_rel_err(logits, single_device_logits[arch], mask) <= 1e-4
    assert max_rel_err(logits, hf_logits(hf_model, tokens, mask), mask) <= 1e-4


def test_fewer_kv_heads_than_tensor_axis_on_published_shape():
    """Qwen2.5-3B (16 query heads, 2 KV heads) on tensor=8: K/V replicated, Q split (abstract, no memory)."""
    with jax.set_mesh(make_mesh(1, 1, 8)):
        _, state = models.abstract_model(models.preset("Qwen2.5-3B"))
    attn = state["layers"]["attn"]
    assert attn["q_kernel"].get_value().sharding.spec == P(None, None, "tensor", None)
    assert attn["q_bias"].get_value().sharding.spec == P(None, "tensor", None)
    for name in ("k_kernel", "v_kernel", "k_bias", "v_bias"):
        assert all(axis is None for axis in attn[name].get_value().sharding.spec), name
    assert state["layers"]["mlp"]["gate_kernel"].get_value().sharding.spec == P(None, None, "tensor")


def test_the_layers_weight_gradients_are_summed_across_a_v5ps_chips_in_float32():
    """A small bfloat16 Qwen's gradient compiled for two v5p chips splitting the batch (tests/gpu/layer_dots.py,
    libtpu compile-only): the layers' weight gradients are summed across the chips in float32, the remat still
    saving the gemm outputs in bfloat16. When the layers cast their float32 master weights to bfloat16 before
    ``_dot_rounded`` (models/qwen.py), the gradient of that bfloat16 copy was bfloat16 and XLA:TPU summed the 32
    shards of a paper run in bfloat16 before casting back (the H200's compile summed in float32:
    tests/test_gpu_compile.py)."""
    result = subprocess.run([sys.executable, "tests/gpu/layer_dots.py", "v5p-64"], cwd=REPO, env=train_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"mlp": ["bf16"], "q/o": ["bf16"], "k/v": ["bf16"], "grad_sums": ["f32"]}, report
