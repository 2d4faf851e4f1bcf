"""The routers' load-balancing loss (``train.router_aux_loss_coef``, models/moe.py ``load_balance_loss``) against
transformers: its ``aux_loss`` (``output_router_logits``) of the same random Qwen3-MoE, a float64 NumPy statement of
``load_balancing_loss_func`` on its router logits for each micro-batch and packed pass, and the gradient PyTorch's
autograd gives its routers."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest
import torch
from flax import nnx

from pacs_jax import checkpoints, rl
from pacs_jax.rl import packing
from pacs_jax.rl.loss_and_grad import AUX_METRIC
from pacs_jax.rl.update_batch import UpdateBatch
from qwen_reference import padded_batch, save_random_hf_model

N, GROUPS, P, R = 4, 4, 6, 5  # responses a prompt, prompts, prompt and response widths
VOCAB, LAYERS, E, K = 128, 2, 8, 2
COEF = 0.5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers' float32 model, ours from its save_pretrained): 2 sparse layers of 8 experts, 2 a token."""
    path = tmp_path_factory.mktemp("aux") / "hf"
    hf = save_random_hf_model("qwen3_moe", path, seed=3, vocab_size=VOCAB, num_hidden_layers=LAYERS)
    return hf, checkpoints.from_pretrained(path, dtype="float32")


def _batch() -> UpdateBatch:
    """GROUPS x N rows: left-padded prompts, right-padded responses, mixed rewards."""
    prompts, prompt_mask = padded_batch(VOCAB, [6, 3, 5, 2] * N, P, "left", seed=1)
    responses, response_mask = padded_batch(VOCAB, [5, 1, 3, 4, 2, 5, 4, 1] * 2, R, "right", seed=2)
    rs = np.random.RandomState(3)
    return UpdateBatch(input_ids=np.concatenate([prompts, responses], 1).astype(np.int32),
                       attention_mask=np.concatenate([prompt_mask, response_mask], 1).astype(np.int32),
                       response_mask=response_mask.astype(np.float32),
                       old_logp=(-4.8 + 0.2 * rs.randn(GROUPS * N, R)).astype(np.float32),
                       rewards=np.array([1, 0, 0, 1] * GROUPS, np.float32))


def _hf_router_logits(hf, batch) -> np.ndarray:
    """transformers' router logits of every row's tokens, [layers, B, T, E] float64."""
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(batch.input_ids), attention_mask=torch.tensor(batch.attention_mask),
                 output_router_logits=True)
    B, T = batch.input_ids.shape
    return np.stack([np.asarray(r, np.float64).reshape(B, T, E) for r in out.router_logits])


def _reference(logits: np.ndarray, mask: np.ndarray) -> float:
    """float64 NumPy of transformers' load_balancing_loss_func over the real tokens (mask [B, T]) of router logits
    [L, B, T, E]: E sum_e f_e P_e, pooled over the layers (HF concatenates them)."""
    real = logits[:, mask.astype(bool)]                                     # [L, n, E]
    p = np.exp(real - real.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[..., :K]
    routed = np.zeros_like(p)
    np.put_along_axis(routed, top, 1.0, axis=-1)
    return float(E * np.sum(routed.reshape(-1, E).mean(0) * p.reshape(-1, E).mean(0)))


def _update(model, batch, coef, num_micro_batches=1):
    graphdef, params = nnx.split(model)
    fn = jax.jit(rl.loss_and_grad_fn(graphdef, "pacs", group_size=N, num_micro_batches=num_micro_batches,
                                     chunk_size=4, router_aux_loss_coef=coef))
    loss, metrics, grads = fn(params, jax.tree.map(jnp.asarray, batch))
    return float(loss), {k: float(v) for k, v in metrics.items()}, grads


def test_one_pass_adds_transformers_aux_loss_and_its_router_gradient(models):
    """One micro-batch: the metric is transformers' own ``aux_loss`` of the rows (1e-6), the loss grows by the
    coefficient times it, and the routers' gradient grows by the coefficient times PyTorch's gradient of it."""
    hf, ours = models
    batch = _batch()
    hf.zero_grad()
    out = hf(input_ids=torch.tensor(batch.input_ids), attention_mask=torch.tensor(batch.attention_mask),
             output_router_logits=True)
    out.aux_loss.backward()
    loss0, metrics0, grads0 = _update(ours, batch, 0.0)
    loss1, metrics1, grads1 = _update(ours, batch, COEF)
    assert AUX_METRIC not in metrics0
    np.testing.assert_allclose(metrics1[AUX_METRIC], float(out.aux_loss.detach()), rtol=1e-6)
    np.testing.assert_allclose(metrics1[AUX_METRIC], _reference(_hf_router_logits(hf, batch), batch.attention_mask),
                               rtol=1e-6)
    np.testing.assert_allclose(loss1 - loss0, COEF * metrics1[AUX_METRIC], rtol=1e-5)
    router0 = np.asarray(grads0["layers"]["mlp"]["router_kernel"].get_value())  # [L, D, E]
    router1 = np.asarray(grads1["layers"]["mlp"]["router_kernel"].get_value())
    want = np.stack([hf.model.layers[i].mlp.gate.weight.grad.numpy().T for i in range(LAYERS)])
    assert np.abs(want).max() > 1e-4
    np.testing.assert_allclose((router1 - router0) / COEF, want, rtol=1e-3, atol=1e-6 * np.abs(want).max())


def test_micro_batches_and_packed_passes_weigh_each_pass_by_its_real_tokens(models):
    """Two micro-batches (whole groups, strided) or a packing plan's passes: the metric is each forward pass's
    float64 load-balancing loss weighted by its share of the mini-batch's real tokens, and the loss grows by the
    coefficient times it."""
    hf, ours = models
    batch = _batch()
    logits = _hf_router_logits(hf, batch)
    mask = batch.attention_mask
    seen = mask.sum()
    groups = np.arange(GROUPS * N) // N
    micro = [groups % 2 == k for k in range(2)]  # micro-batch k holds groups k, k + 2 (rl/micro_batches.py)
    want = sum(mask[rows].sum() / seen * _reference(logits[:, rows], mask[rows]) for rows in micro)
    loss0, _, _ = _update(ours, batch, 0.0)  # the policy loss, which micro-batches accumulate exactly
    loss1, metrics, _ = _update(ours, batch, COEF, num_micro_batches=2)
    np.testing.assert_allclose(metrics[AUX_METRIC], want, rtol=1e-5)
    np.testing.assert_allclose(loss1 - loss0, COEF * want, rtol=1e-4)

    prompt_lengths, response_lengths = mask[:, :P].sum(1), batch.response_mask.sum(1).astype(int)
    plan = packing.plan_packing(prompt_lengths, response_lengths, prompt_width=P, response_width=R, packed_length=P + R,
                                mini_batches=1, passes=4, unit=N, shards=1, rows=4)
    row_pass = np.asarray(plan.arrays().row_pass).reshape(-1)  # one mini-batch: each row's pass
    passes = [row_pass == p for p in np.unique(row_pass)]
    assert len(passes) > 1
    want = sum(mask[rows].sum() / seen * _reference(logits[:, rows], mask[rows]) for rows in passes)
    packed = batch.replace(packing=jax.tree.map(jnp.asarray, plan.arrays()))
    _, metrics, _ = _update(ours, packed, COEF, num_micro_batches=2)
    np.testing.assert_allclose(metrics[AUX_METRIC], want, rtol=1e-5)
