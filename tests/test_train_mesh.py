"""One training step of the trainer (rollout batch -> pi_old -> two AdamW mini-batch updates) on the
(2, 2, 2) mesh gives the same old log-probs, losses and updated parameters as on one device: a dense model, and a
mixture of experts with its experts split over fsdp (model.expert_parallel)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import models, rl, sharding
from pacs_jax.rewards import RewardPool
from test_train_config import load_config
from pacs_jax.training.learner.optim import make_optimizer
from pacs_jax.training.records import PromptBatch
from pacs_jax.training.rollout import RolloutCollector
from pacs_jax.training.step_programs import StepPrograms
from pacs_jax.training.learner.update_step import make_update_step
from pacs_jax.training.spec import RunSpec

CFG = models.QwenConfig(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=False,
                        bos_token_id=None, eos_token_id=1, max_position_embeddings=128)
SEED = 3
N = 4                   # responses per prompt
PROMPTS = 4             # prompts per training step
MINI_BATCHES = 2        # optimizer steps per training step, each over 2 whole groups (8 rows)
MICRO_BATCHES = 2       # 4 rows per micro-batch: one per data x fsdp shard
MAX_NEW_TOKENS = 8
# rewards per group, both labels in every group (balanced and unbalanced) so every PACS weight is used
REWARDS = np.array([1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 0, 1], np.float32)
LR = 1e-4  # a small step, as in RL; with far larger steps Adam turns float noise in near-zero gradients into
# visible parameter differences (sign flips of g / sqrt(g^2)), which is not what this test is about
OPTIONS = dict(beta=1.0, use_weight=True, weight_mode="question", reward_method="1", adv_estimator="rloo")


def _host(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(2, 2, 2)


@pytest.fixture(scope="module")
def single_model():
    return models.init_random(CFG, seed=SEED)


@pytest.fixture(scope="module")
def mesh_model(mesh):
    with jax.set_mesh(mesh):
        return models.init_random(CFG, seed=SEED)


@pytest.fixture(scope="module")
def rollout_batch(single_model):
    """The update batch of one step from the trainer's RolloutCollector on one device, as numpy.

    The tiny random policy never answers correctly, so the sampled responses get the fixed rewards
    REWARDS (both labels in each group) in place of the all-zero ones.
    """
    graphdef, params = nnx.split(single_model)
    rs = np.random.RandomState(0)
    prompt_ids = [list(rs.randint(2, CFG.vocab_size, size=length)) for length in (5, 9, 3, 12)]
    config = load_config("default.py")
    config.rollout.update(n=N, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, sampler="static")
    config.data.max_prompt_length, config.data.prompt_buckets = 16, (8, 16)
    config.train.prompts_per_step, config.train.logprob_micro_batches = PROMPTS, 1
    config.train.packing = False  # this test cuts the batch into mini-batches by rows; packed on the mesh: test_rl_packing
    programs = StepPrograms(RunSpec.unplaced(config), graphdef, params, (1,))
    with RewardPool(1) as pool:
        collector = RolloutCollector.from_spec(RunSpec.unplaced(config), programs, decode=lambda ids: " ".join(map(str, ids)),
                                                 reward_pool=pool)
        rollout = collector(params, lambda: PromptBatch(prompt_ids, ["7"] * PROMPTS, ["test"] * PROMPTS),
                            jax.random.key(0))
    batch = jax.tree.map(np.asarray, rollout.batch)
    assert batch.input_ids.shape == (PROMPTS * N, 16 + MAX_NEW_TOKENS)
    assert batch.response_mask.sum() > PROMPTS * N  # real responses, several tokens each
    return batch.replace(rewards=REWARDS.copy())


def test_same_seed_gives_the_same_weights_on_the_mesh_and_they_are_sharded(single_model, mesh_model, mesh):
    single, on_mesh = _host(nnx.state(single_model)), _host(nnx.state(mesh_model))
    assert single.keys() == on_mesh.keys()
    for name in single:
        np.testing.assert_array_equal(on_mesh[name], single[name], err_msg=name)
    specs = {name: x.sharding.spec for name, x in
             zip(single, jax.tree.leaves(nnx.state(mesh_model)))}
    used_axes = {a for spec in specs.values() for dim in spec if dim for a in ((dim,) if isinstance(dim, str) else dim)}
    assert {"fsdp", "tensor"} <= used_axes, specs
    mlp = [x for name, x in zip(single, jax.tree.leaves(nnx.state(mesh_model))) if "up" in name][0]
    assert mlp.addressable_shards[0].data.size * 4 == mlp.size  # split over fsdp x tensor


def _train_step(model, batch, put):
    """The loop's step on a fixed rollout (on the mesh in context): pi_old, then MINI_BATCHES AdamW
    updates. Returns (old_logp, [loss per mini-batch], [metrics per mini-batch], updated params)."""
    graphdef, params = nnx.split(model)
    params = jax.tree.map(lambda x: x.copy(), params)  # the update donates its inputs
    old_logp = jax.jit(lambda p, ids, mask: rl.logprobs_of_pass(  # one pass of every row
        nnx.merge(graphdef, p), ids, mask, MAX_NEW_TOKENS, jnp.zeros((ids.shape[0], MAX_NEW_TOKENS)), 0))(
        params, put(batch.input_ids), put(batch.attention_mask))
    optimizer, _ = make_optimizer(LR, weight_decay=0.01, total_steps=MINI_BATCHES)
    opt_state = jax.jit(optimizer.init)(params)
    update = make_update_step(graphdef, optimizer, "pacs", group_size=N, objective_options=OPTIONS,
                              num_micro_batches=MICRO_BATCHES)
    full = batch.replace(old_logp=np.asarray(old_logp))
    rows = PROMPTS * N // MINI_BATCHES
    metrics = []
    for k in range(MINI_BATCHES):
        params, opt_state, (m,) = update(params, opt_state, jax.tree.map(lambda v: put(v[k * rows:(k + 1) * rows]),
                                                                         full))
        metrics.append(jax.device_get(m))
    return np.asarray(old_logp), metrics, params


def test_training_step_on_the_2x2x2_mesh_equals_one_device(single_model, mesh_model, mesh, rollout_batch):
    one_logp, one_metrics, one_params = _train_step(single_model, rollout_batch, np.asarray)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        mesh_logp, mesh_metrics, mesh_params = _train_step(mesh_model, rollout_batch, lambda x: jax.device_put(x, rows))

    # the batch from the rollout: pi_old recomputed on the mesh matches the collector's own
    np.testing.assert_allclose(one_logp, rollout_batch.old_logp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mesh_logp, one_logp, rtol=1e-5, atol=1e-6)
    for one, on_mesh in zip(one_metrics, mesh_metrics):
        assert one["skipped"] == on_mesh["skipped"] == 0.0
        np.testing.assert_allclose(on_mesh["loss"], one["loss"], rtol=1e-5)
        np.testing.assert_allclose(on_mesh["grad_norm"], one["grad_norm"], rtol=1e-5)
    assert one_metrics[0]["loss"] != one_metrics[1]["loss"]

    before = _host(nnx.state(single_model))
    one, on_mesh = _host(one_params), _host(mesh_params)
    for name in before:
        step = one[name] - before[name]
        assert np.abs(step).max() > 0.5 * LR, f"{name}: the update did not move it"
        rel = np.linalg.norm(on_mesh[name] - one[name]) / np.linalg.norm(one[name])
        assert rel <= 1e-5, f"{name}: parameters differ by {rel:.2e} (relative)"
        # the update itself (what AdamW added), not only the parameters it was added to
        rel_step = np.linalg.norm((on_mesh[name] - before[name]) - step) / np.linalg.norm(step)
        assert rel_step <= 1e-3, f"{name}: updates differ by {rel_step:.2e} (relative)"

    # the updated parameters stay sharded on the mesh (in place: donated buffers)
    for name, x in zip(on_mesh, jax.tree.leaves(mesh_params)):
        assert x.sharding.mesh.shape == mesh.shape, name
    up = [x for name, x in zip(on_mesh, jax.tree.leaves(mesh_params)) if "up" in name][0]
    assert up.addressable_shards[0].data.size * 4 == up.size


def test_a_mixture_of_experts_step_with_its_experts_split_over_fsdp_equals_one_device(mesh, rollout_batch):
    """The same step on a Qwen3-MoE model (4 experts, 2 a token) with ``expert_parallel``: on the 2x2x2 mesh its
    experts are split over fsdp (2 a device), the fsdp pair exchanging tokens (models/moe.py ``local_dispatch``), and
    pi_old, the losses, the grad norms and the updated parameters equal one device's."""
    cfg = dataclasses.replace(CFG, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, expert_parallel=True)
    one_logp, one_metrics, one_params = _train_step(models.init_random(cfg, seed=SEED), rollout_batch, np.asarray)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        model = models.init_random(cfg, seed=SEED)
        assert model.layers.mlp.gate_kernel.get_value().sharding.spec[:2] == (None, "fsdp")  # [L, E, D, I]
        mesh_logp, mesh_metrics, mesh_params = _train_step(model, rollout_batch, lambda x: jax.device_put(x, rows))
    np.testing.assert_allclose(mesh_logp, one_logp, rtol=1e-5, atol=1e-6)
    for one, on_mesh in zip(one_metrics, mesh_metrics):
        assert one["skipped"] == on_mesh["skipped"] == 0.0
        np.testing.assert_allclose(on_mesh["loss"], one["loss"], rtol=1e-5)
        np.testing.assert_allclose(on_mesh["grad_norm"], one["grad_norm"], rtol=1e-5)
    one, on_mesh = _host(one_params), _host(mesh_params)
    assert any("gate_kernel" in name for name in one)
    for name in one:
        rel = np.linalg.norm(on_mesh[name] - one[name]) / np.linalg.norm(one[name])
        assert rel <= 1e-5, f"{name}: parameters differ by {rel:.2e} (relative)"
