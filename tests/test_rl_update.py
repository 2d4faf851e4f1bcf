"""The trainer's loss-and-gradient (``rl.loss_and_grad_fn``, jitted as the update step jits it) over a
tiny Qwen: response log-prob alignment, finite differences, micro-batch accumulation, sharded
meshes, the batches it refuses, no [B, T, V] buffer."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import models, rl, sharding
from pacs_jax.rl.update_batch import UpdateBatch
from test_rl_policy_gradient import numeric_gradient, verl_mini_batch_loss, verl_objective
from test_rl_ppo import ref_ppo_token_losses

CFG = models.QwenConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=4)
N, PROMPT, RESPONSE = 4, 5, 6  # group size, prompt and response lengths


@pytest.fixture(scope="module")
def tiny():
    """(graphdef, params) of a one-layer Qwen with random weights."""
    return nnx.split(models.init_random(CFG, seed=0))


def jitted_loss_and_grad(graphdef, objective="pacs", **kwargs):
    """``jax.jit(rl.loss_and_grad_fn(...))``: (params, batch) -> (loss, metrics, grads)."""
    return jax.jit(rl.loss_and_grad_fn(graphdef, objective, group_size=N, chunk_size=4, **kwargs))


@pytest.fixture(scope="module")
def pacs_update(tiny):
    """The jitted PACS loss-and-gradient with two micro-batches, shared by several tests."""
    return jitted_loss_and_grad(tiny[0], num_micro_batches=2, objective_options=dict(beta=2.0))


def make_batch(groups, seed=0):
    """Left-padded prompts then right-padded responses (ragged), perturbed old log-probs, rewards with
    one unbalanced group, one all-correct group, one all-wrong group, ..."""
    rs = np.random.RandomState(seed)
    B, L = N * groups, PROMPT + RESPONSE
    input_ids = rs.randint(0, CFG.vocab_size, (B, L)).astype(np.int32)
    attention_mask = np.zeros((B, L), np.int32)
    for i in range(B):
        attention_mask[i, PROMPT - rs.randint(1, PROMPT + 1):PROMPT] = 1
        attention_mask[i, PROMPT:PROMPT + rs.randint(1, RESPONSE + 1)] = 1
    patterns = ([1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0])
    rewards = np.concatenate([patterns[g % 4] for g in range(groups)]).astype(np.float32)
    return UpdateBatch(input_ids=input_ids, attention_mask=attention_mask,
                       response_mask=attention_mask[:, PROMPT:].astype(np.float32),
                       old_logp=(-4.2 + 0.3 * rs.randn(B, RESPONSE)).astype(np.float32), rewards=rewards)


def test_response_logprobs_align_with_the_models_full_logits(tiny):
    graphdef, params = tiny
    batch = make_batch(groups=4)
    ids, mask = jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)
    one_pass = jax.jit(lambda p, out, k: rl.logprobs_of_pass(nnx.merge(graphdef, p), ids, mask, RESPONSE, out, k,
                                                             num_micro_batches=2, chunk_size=4))
    got = jnp.full(ids[:, PROMPT:].shape, np.nan, jnp.float32)
    for k in (1, 0):  # the two micro-batches' passes, in either order, fill every row
        got = one_pass(params, got, np.int32(k))
    full_logits = jax.jit(lambda p: nnx.merge(graphdef, p)(ids, attention_mask=mask))
    logits = np.asarray(full_logits(params), np.float64)
    want = np.zeros((len(logits), RESPONSE))
    for i in range(len(logits)):
        for t in range(RESPONSE):  # the logits at position P - 1 + t predict response token t
            z = logits[i, PROMPT - 1 + t]
            want[i, t] = z[batch.input_ids[i, PROMPT + t]] - np.log(np.exp(z - z.max()).sum()) - z.max()
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def _flat(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


FD_BLOCKS = ("embedding", "o_kernel", "v_kernel", "down_kernel", "final_norm")  # blocks with sizeable gradients


def test_finite_differences_through_the_jitted_update(tiny, pacs_update):
    _, params = tiny
    batch = make_batch(groups=4, seed=1)
    _, _, grads = pacs_update(params, batch)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [np.asarray(x) for _, x in paths_leaves]
    paths = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
    grad_leaves = _flat(grads)
    rs = np.random.RandomState(0)
    eps = 1e-2
    # one random direction over all parameters, then one inside each of a few parameter blocks
    for block in (None,) + FD_BLOCKS:
        direction = [rs.randn(*x.shape).astype(np.float32) * (block is None or block in path)
                     for x, path in zip(leaves, paths)]
        norm = np.sqrt(sum(float((d ** 2).sum()) for d in direction))
        direction = [d / norm for d in direction]
        shifted = lambda s: jax.tree.unflatten(treedef, [x + s * eps * d for x, d in zip(leaves, direction)])  # noqa: E731
        fd = (float(pacs_update(shifted(1), batch)[0]) - float(pacs_update(shifted(-1), batch)[0])) / (2 * eps)
        analytic = sum(float((g * d).sum()) for g, d in zip(grad_leaves, direction))
        # |analytic| <= scale (a unit direction); fp32 rounding of the loss adds ~1e-7 / eps
        scale = np.sqrt(sum(float(((g * (d != 0)) ** 2).sum()) for g, d in zip(grad_leaves, direction)))
        assert scale > 1e-2, block
        assert abs(fd - analytic) <= 1e-2 * scale + 1e-5, (block, fd, analytic, scale)


@pytest.mark.parametrize("objective, options", [
    ("pacs", dict(beta=2.0)),
    ("grpo", dict(loss_agg_mode="token-mean")),  # token-mean needs the mini-batch token count
])
def test_micro_batch_accumulation_equals_the_whole_batch(tiny, pacs_update, objective, options):
    graphdef, params = tiny
    batch = make_batch(groups=4, seed=2)
    whole = jitted_loss_and_grad(graphdef, objective, objective_options=options)
    split = pacs_update if objective == "pacs" else jitted_loss_and_grad(
        graphdef, objective, objective_options=options, num_micro_batches=2)
    loss1, metrics1, grads1 = whole(params, batch)
    loss2, metrics2, grads2 = split(params, batch)
    np.testing.assert_allclose(float(loss2), float(loss1), rtol=1e-5)
    for a, b in zip(_flat(grads2), _flat(grads1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    for key in metrics1:
        if key.endswith("_mean") or key.endswith("accuracy"):
            np.testing.assert_allclose(float(metrics2[key]), float(metrics1[key]), rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("mode", rl.LOSS_AGG_MODES)
def test_verl_scale_through_micro_batches_equals_verls_loss_and_gradient(tiny, mode):
    # verl 0.3.1's actor on micro-batches of S = 8 responses (float64 transcription of agg_loss with
    # gradient accumulation), against our update over 2 micro-batches of whole groups: the loss, and
    # the parameter gradient as the pullback of verl's d loss / d logp through the model's log-probs.
    graphdef, params = tiny
    batch = make_batch(groups=4, seed=5)
    S, K = 8, 2
    options = dict(loss_agg_mode=mode, loss_scale="verl", verl_micro_batch_size=S)
    loss, _, grads = jitted_loss_and_grad(graphdef, "grpo", objective_options=options, num_micro_batches=K)(params, batch)

    def logprobs(p):
        return rl.response_logprobs(nnx.merge(graphdef, p), jnp.asarray(batch.input_ids),
                                    jnp.asarray(batch.attention_mask), RESPONSE, chunk_size=4)

    logp, pullback = jax.vjp(logprobs, params)
    # the rows of update micro-batch k (groups k, k + K, ...) in order: verl's micro-batches are S of them
    order = np.concatenate([np.arange(g * N, (g + 1) * N) for k in range(K) for g in range(k, 4, K)])
    rows = lambda x: np.asarray(x, np.float64)[order]  # noqa: E731
    old_logp, mask, rewards = rows(batch.old_logp), rows(batch.response_mask), rows(batch.rewards)
    reference = lambda lp: verl_objective("grpo", lp, old_logp, mask, rewards, N, mode, S, ranks=1)  # noqa: E731
    np.testing.assert_allclose(float(loss), reference(rows(logp)), rtol=1e-5)
    d_logp = np.zeros(logp.shape)
    d_logp[order] = numeric_gradient(reference, rows(logp))
    (want,) = pullback(jnp.asarray(d_logp, jnp.float32))
    for a, b in zip(_flat(grads), _flat(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_ppo_objective_through_micro_batches_matches_numpy(tiny):
    # objective "ppo": the batch's per-token advantages, verl's scale (micro-batches of 4 responses)
    graphdef, params = tiny
    batch = make_batch(groups=4, seed=6)
    batch = batch.replace(advantages=np.random.RandomState(6).randn(*batch.old_logp.shape).astype(np.float32))
    options = dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale="verl", verl_micro_batch_size=4)
    loss, _, grads = jitted_loss_and_grad(graphdef, "ppo", objective_options=options, num_micro_batches=2)(params, batch)
    logp = rl.response_logprobs(nnx.merge(graphdef, params), jnp.asarray(batch.input_ids),
                                jnp.asarray(batch.attention_mask), RESPONSE, chunk_size=4)
    order = np.concatenate([np.arange(g * N, (g + 1) * N) for k in range(2) for g in range(k, 4, 2)])
    token_losses = ref_ppo_token_losses(np.asarray(logp)[order], batch.old_logp[order], batch.advantages[order])
    want = verl_mini_batch_loss(token_losses, batch.response_mask[order], "seq-mean-token-sum-norm", 4, ranks=1)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    whole_loss, _, whole_grads = jitted_loss_and_grad(graphdef, "ppo", objective_options=options)(params, batch)
    np.testing.assert_allclose(float(whole_loss), float(loss), rtol=1e-5)  # S = 4 = one group: any split agrees
    for a, b in zip(_flat(grads), _flat(whole_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="needs the update batch's 'advantages'"):
        jitted_loss_and_grad(graphdef, "ppo")(params, batch.replace(advantages=None))


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2), (1, 1, 8)])
def test_sharded_update_equals_single_device(tiny, pacs_update, mesh_shape):
    _, params = tiny
    batch = make_batch(groups=4, seed=3)
    want_loss, _, want_grads = pacs_update(params, batch)

    mesh = sharding.make_mesh(*mesh_shape)
    with jax.set_mesh(mesh):
        mesh_graphdef, abstract = models.abstract_model(CFG)
        mesh_params = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), params, abstract)
        rows = NamedSharding(mesh, P(("data", "fsdp")))
        mesh_batch = jax.device_put(batch, rows)
        loss_and_grad = jitted_loss_and_grad(mesh_graphdef, num_micro_batches=2, objective_options=dict(beta=2.0))
        loss, _, grads = loss_and_grad(mesh_params, mesh_batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for a, b in zip(_flat(grads), _flat(want_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bad_batches_and_options_raise_naming_them(tiny, pacs_update):
    """What the objective checks when the update traces it, and the objective's name and options."""
    graphdef, params = tiny
    good = make_batch(groups=2)
    with pytest.raises(ValueError, match="old_logp must have"):
        pacs_update(params, good.replace(old_logp=good.old_logp[:, 1:]))
    with pytest.raises(ValueError, match="group_size=1"):
        jax.jit(rl.loss_and_grad_fn(graphdef, "pacs", group_size=1))(params, good)
    with pytest.raises(ValueError, match="objective='sft'"):
        rl.loss_and_grad_fn(graphdef, "sft", group_size=N)
    with pytest.raises(ValueError, match="objective .pacs.: no option"):
        rl.loss_and_grad_fn(graphdef, "pacs", group_size=N, objective_options=dict(kl_coef=0.1))


def test_compiled_update_holds_no_batch_by_length_by_vocab_buffer():
    # A wide vocabulary makes B * L * V far larger than any legitimate buffer (the embedding is V * D).
    cfg = CFG.replace(vocab_size=32768)
    B, R, L = 8, 48, 64
    graphdef, abstract = models.abstract_model(cfg)
    specs = UpdateBatch(input_ids=jax.ShapeDtypeStruct((B, L), jnp.int32),
                        attention_mask=jax.ShapeDtypeStruct((B, L), jnp.int32),
                        response_mask=jax.ShapeDtypeStruct((B, R), jnp.float32),
                        old_logp=jax.ShapeDtypeStruct((B, R), jnp.float32),
                        rewards=jax.ShapeDtypeStruct((B,), jnp.float32))
    fn = rl.loss_and_grad_fn(graphdef, "pacs", group_size=N, num_micro_batches=2, chunk_size=16)
    hlo = jax.jit(fn).lower(abstract, specs).compile().as_text()
    sizes = [int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"\[(\d+(?:,\d+)*)\]", hlo)]
    assert max(sizes) < (B // 2) * R * cfg.vocab_size  # not even one micro-batch's logits
    assert max(sizes) >= cfg.vocab_size * cfg.hidden_size  # the scan does see the embedding-sized buffers
