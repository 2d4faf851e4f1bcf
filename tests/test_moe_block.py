"""The Qwen3-MoE sparse block (pacs_jax/models/moe.py) against transformers' ``Qwen3MoeSparseMoeBlock``
(PyTorch, float32, the same weights) and a float64 NumPy statement written from HF's definition; routing
replay (R3) against the same statement with the replayed experts; a config it cannot serve refused."""

from __future__ import annotations

import json
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pacs_jax.models import kernels
from pacs_jax.models.config import QwenConfig
from pacs_jax.models.moe import MoE

D, E, I, K = 32, 8, 16, 2


def _config(norm_topk_prob: bool = True, **changes) -> QwenConfig:
    fields = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=D, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=E, num_experts_per_tok=K,
                  moe_intermediate_size=I, norm_topk_prob=norm_topk_prob)
    return QwenConfig(**(fields | changes))


def _block(cfg: QwenConfig, seed: int = 0) -> MoE:
    """The block with every weight drawn normal (the router's wide enough that the top k are distinct)."""
    block = MoE(cfg, nnx.Rngs(seed))
    keys = jax.random.split(jax.random.key(seed + 1), 4)
    for key, (name, scale) in zip(keys, (("router_kernel", 1.0), ("gate_kernel", 0.2), ("up_kernel", 0.2),
                                          ("down_kernel", 0.2))):
        var = getattr(block, name)
        var.set_value(scale * jax.random.normal(key, var.get_value().shape, jnp.float32))
    return block


def _reference(x, router, gate, up, down, k, norm_topk_prob, experts=None):
    """float64 NumPy, token by token, as HF's router and experts: p = softmax(x W_r); the k largest (or
    ``experts``); weights p at them, renormalised; sum of w_j down(silu(gate x) * up x)."""
    x, router, gate, up, down = (np.asarray(a, np.float64) for a in (x, router, gate, up, down))
    flat = x.reshape(-1, x.shape[-1])
    out = np.zeros_like(flat)
    chosen = np.zeros((len(flat), k), np.int64)
    for n, token in enumerate(flat):
        logits = token @ router
        p = np.exp(logits - logits.max())
        p /= p.sum()
        idx = np.argsort(-p, kind="stable")[:k] if experts is None else np.asarray(experts).reshape(-1, k)[n]
        w = p[idx] / p[idx].sum() if norm_topk_prob else p[idx]
        for j, e in enumerate(idx):
            g, u = token @ gate[e], token @ up[e]
            out[n] += w[j] * ((g / (1 + np.exp(-g)) * u) @ down[e])
        chosen[n] = idx
    return out.reshape(x.shape), chosen.reshape(*x.shape[:-1], k)


def _weights(block: MoE):
    return [np.array(getattr(block, n).get_value()) for n in ("router_kernel", "gate_kernel", "up_kernel",
                                                                 "down_kernel")]


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_block_equals_transformers_and_float64_numpy(norm_topk_prob):
    cfg = _config(norm_topk_prob)
    block = _block(cfg)
    x = jax.random.normal(jax.random.key(7), (2, 5, D), jnp.float32)
    out, experts = block(x, with_experts=True)
    router, gate, up, down = _weights(block)

    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K,
                                               moe_intermediate_size=I, norm_topk_prob=norm_topk_prob)).float()
    with torch.no_grad():
        hf.gate.weight.copy_(torch.from_numpy(router.T))
        hf.experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([gate, up], axis=2).transpose(0, 2, 1)))
        hf.experts.down_proj.copy_(torch.from_numpy(down.transpose(0, 2, 1)))
        hf_out = hf(torch.from_numpy(np.array(x))).numpy()
        _, _, hf_experts = hf.gate(torch.from_numpy(np.array(x)).reshape(-1, D))
    np.testing.assert_allclose(np.asarray(out), hf_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.sort(np.asarray(experts).reshape(-1, K), -1), np.sort(hf_experts.numpy(), -1))

    want, want_experts = _reference(x, router, gate, up, down, K, norm_topk_prob)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    assert len(np.unique(np.asarray(experts))) > K  # the tokens spread over several groups of the grouped matmul


def test_replay_uses_the_given_experts_with_this_routers_weights_and_its_gradient_reaches_the_router():
    cfg = _config()
    block = _block(cfg)
    x = jax.random.normal(jax.random.key(3), (2, 4, D), jnp.float32)
    native, experts = block(x, with_experts=True)
    same, replayed = block(x, routed=experts, with_experts=True)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(native))  # replaying its own routing: bit for bit
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(experts))

    # another routing (the experts after the native ones, mod E): the statement with those experts
    other = (experts + K) % E
    out, chosen = block(x, routed=other, with_experts=True)
    np.testing.assert_array_equal(np.asarray(chosen), np.asarray(experts))  # what the router chooses, not what ran
    want, _ = _reference(x, *_weights(block), K, True, experts=np.asarray(other))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(out), np.asarray(native), atol=1e-3)

    graphdef, params = nnx.split(block)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(x, routed=other) ** 2)  # noqa: E731
    grads = jax.grad(loss)(params)
    assert float(jnp.abs(grads["router_kernel"].get_value()).max()) > 0  # the replayed gates' weights train the router


@pytest.mark.parametrize("changes, field", [(dict(num_experts_per_tok=E + 1), "num_experts_per_tok"),
                                            (dict(moe_intermediate_size=0), "moe_intermediate_size")])
def test_a_config_the_block_cannot_serve_is_refused_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        _config(**changes)


def test_the_grouped_matmul_choice_is_recorded_with_why_a_gpu_is_not_served_by_a_grouped_kernel():
    block = _block(_config())
    block(jnp.ones((1, 3, D), jnp.float32))
    assert kernels.KernelChoice("moe gemm", "ragged_dot") in kernels.chosen()  # the CPU: the reference path
    assert kernels.moe_gemm("gpu", jnp.bfloat16) == kernels.KernelChoice("moe gemm", "tokamax mosaic_gpu")
    gpu = kernels.moe_gemm("gpu", jnp.float32)
    assert "float32 operands" in gpu.reason and "moe gemm: ragged_dot (not the kernel:" in str(gpu)
    assert kernels.moe_gemm("tpu", jnp.bfloat16).reason == ""  # XLA:TPU's grouped kernel


@pytest.mark.slow(seconds=40)
def test_on_an_h200_a_bfloat16_block_runs_tokamaxs_grouped_kernel_its_width_split_over_tensor():
    """The block's gradient compiled for H200s (compile-only, tests/gpu/moe_gemm.py with the GPU-compiling
    interpreter) on 2 devices splitting the tokens x 2 splitting the experts' width: in bfloat16 its grouped
    matmuls are tokamax's Mosaic GPU kernel (a custom call; no dense [G, M, N] temporary: a tenth of float32's
    bytes or less), forward and backward, with the experts' width still split (their gradients 192 of 384 a
    device); float32 takes XLA's ragged_dot and says why. Qwen3-30B-A3B's block compiles too, 2 x 4 devices, its
    experts split over fsdp 2 (64 of 128 a device: expert parallelism, the kernel's rows past its groups dropped),
    and with LoRA on its experts (their adapters' grouped products on the same kernel)."""
    from gpu_compiler import REPO, gpu_python

    result = subprocess.run([str(gpu_python()), "tests/gpu/moe_gemm.py"], cwd=REPO, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    half, full = out["bfloat16"], out["float32"]
    assert "moe gemm: tokamax mosaic_gpu" in half["choices"] and "mosaic_gpu_v2" in half["custom_calls"]
    assert half["expert_grads"] == ["f32[16,192,512]", "f32[16,512,192]"] == full["expert_grads"]
    assert half["temp_bytes"] * 10 < full["temp_bytes"]
    assert not full["custom_calls"] and "float32 operands" in " ".join(full["choices"])
    paper = out["qwen3_30b_a3b"]  # the paper model's own block: tokamax's tiles at its shapes, a quarter a device
    assert "mosaic_gpu_v2" in paper["custom_calls"]
    assert paper["expert_grads"] == ["f32[64,192,2048]", "f32[64,2048,192]"]
    assert any(c.startswith("moe dispatch: per batch shard, experts over fsdp (64 a device") for c in paper["choices"])
    # with LoRA rank 32 on its experts: each adapter's two grouped products on tokamax's kernel too (4 more forward,
    # 8 more backward), each device's 64 experts' A and B beside their weights, B's width split as theirs
    lora = out["qwen3_30b_a3b_lora"]
    assert lora["kernel_calls"] == paper["kernel_calls"] + 12 and lora["custom_calls"] == ["mosaic_gpu_v2"]
    assert lora["expert_grads"] == sorted(paper["expert_grads"] + ["f32[64,2048,32]", "f32[64,32,192,2]",
                                                                   "f32[64,192,32]", "f32[64,32,2048]"])
    assert "libtpu" not in result.stderr and "TPU_WORKER" not in result.stderr  # tokamax's import held quiet
    assert "Autotuning cache miss" not in result.stderr  # nor its page of warnings a program


def test_each_batch_shard_sorts_its_own_tokens_its_experts_split_over_fsdp_and_tokens_that_do_not_divide_are_named():
    """On a 2x2x2 mesh (4 batch shards) the block dispatches each shard's tokens by itself (local_dispatch) and gives
    the single device's output and gradients: every expert's weights gathered to each shard (the default), or with
    ``expert_parallel`` its experts split over fsdp (4 of the 8 a device at rest and in the program: the tokens of
    the fsdp pair all-gathered, the sums reduce-scattered back, no expert's weights gathered); a batch of tokens the 4
    shards do not divide takes one global sort, named on the kernels line with why (every slot gathered to every
    device), with the same output."""
    from pacs_jax import sharding

    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    run = nnx.jit(lambda b, x: b(x))
    grad = nnx.jit(nnx.grad(lambda b, x: jnp.sum(jnp.sin(b(x)))))
    gathered = re.compile(r"f32\[8,(32,8|8,32)\]\{[\d,]+\} all-gather\(")  # an expert's weights, all 8 experts
    for rows, ep, impl in ((8, True, "per batch shard, experts over fsdp (4 a device: tokens all-gathered, sums "
                                     "reduce-scattered)"), (8, False, "per batch shard"), (6, True, "one global sort")):
        block = _block(_config(expert_parallel=ep))
        x = jax.random.normal(jax.random.key(rows), (rows, 1, D), jnp.float32)  # [B, T, D]: B tokens of one
        want, want_grads = np.asarray(block(x)), nnx.to_flat_state(grad(block, x))
        kernels._CHOSEN.clear()  # the record keeps a process's first of each choice: this run's alone
        with jax.set_mesh(mesh):
            state = nnx.state(block)
            nnx.update(block, jax.device_put(state, jax.tree.map(
                lambda v: sharding.placement(v.logical_axes, v.shape), state,
                is_leaf=lambda v: isinstance(v, nnx.Variable))))
            assert (block.gate_kernel.get_value().sharding.spec[0] == "fsdp") == ep  # 4 experts a device at rest
            got = np.asarray(run(block, x))
            got_grads = nnx.to_flat_state(grad(block, x))
            hlo = run.lower(block, x).compile().as_text()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for (name, g), (_, w) in zip(got_grads, want_grads):
            np.testing.assert_allclose(np.asarray(g.get_value()), np.asarray(w.get_value()), rtol=1e-4,
                                       atol=1e-6, err_msg=str(name))
        (choice,) = [c for c in kernels.chosen() if c.op == "moe dispatch"]
        assert choice.impl == impl
        if rows == 8 and ep:  # tokens move (the pair's 2 + 2 tokens: f32[4,32]), weights do not
            assert re.search(r"f32\[4,32\]\{1,0\} all-gather\(", hlo) and " reduce-scatter(" in hlo, hlo
            assert not gathered.search(hlo), hlo
        elif rows == 8:
            assert gathered.search(hlo) and " reduce-scatter(" not in hlo, hlo
    fallback = choice
    assert fallback.reason == ("6 tokens do not divide over the 4 batch shards (data x fsdp): every slot gathered "
                               "to every device")
