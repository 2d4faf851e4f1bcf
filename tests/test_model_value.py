"""The PPO critic (models/value.py): a copy of the actor's backbone with a scalar head, sharded like
the actor; its values against a float64 NumPy head on the actor's own hidden states; its gradients
reach only its own parameters, and updating it (donated) leaves the actor untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import models, rl, sharding
from pacs_jax.models.loading import dotted
from pacs_jax.models.value import response_values, value_model_from_actor

CFG = models.QwenConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=4, tie_word_embeddings=False)
PROMPT, RESPONSE = 4, 5


def batch(seed=0, rows=8):
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, CFG.vocab_size, (rows, PROMPT + RESPONSE)).astype(np.int32)
    mask = np.zeros(ids.shape, np.int32)
    for i in range(rows):
        mask[i, PROMPT - rs.randint(1, PROMPT + 1):PROMPT + rs.randint(1, RESPONSE + 1)] = 1
    return jnp.asarray(ids), jnp.asarray(mask)


def flat(module) -> dict[str, jax.Array]:
    return {dotted(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))}


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(2, 2, 2)


@pytest.fixture(scope="module")
def actor_and_critic(mesh):
    """The actor and its critic on the 2 x 2 x 2 mesh: call them inside ``jax.set_mesh(mesh)``."""
    with jax.set_mesh(mesh):
        actor = models.init_random(CFG, seed=0)
        return actor, value_model_from_actor(actor, seed=1)


def test_critic_is_the_actors_backbone_sharded_like_it(mesh, actor_and_critic):
    actor, critic = actor_and_critic
    actor_params, critic_params = flat(actor), flat(critic)
    assert set(critic_params) == {f"backbone.{k}" for k in actor_params if k != "lm_head"} | {"value_kernel",
                                                                                              "value_bias"}
    for name, value in actor_params.items():
        if name == "lm_head":
            continue
        copy = critic_params[f"backbone.{name}"]
        assert copy.sharding == value.sharding, name
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(value))
    assert critic_params["value_kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp")

    ids, mask = batch()
    with jax.set_mesh(mesh):
        hidden = np.asarray(jax.jit(lambda m, i, k: m(i, k, return_hidden=True))(actor, ids, mask), np.float64)
        head = np.asarray(critic_params["value_kernel"], np.float64)
        want = hidden @ head + float(critic_params["value_bias"])
        values = np.asarray(jax.jit(lambda c, i, k: c(i, k))(critic, ids, mask))
        real = np.asarray(mask, bool)
        np.testing.assert_allclose(values[real], want[real], rtol=1e-5, atol=1e-6)
        got = np.asarray(jax.jit(response_values, static_argnums=3)(critic, ids, mask, RESPONSE))
        np.testing.assert_array_equal(got, values[:, PROMPT - 1:-1])  # value t: the state choosing token t


def test_critic_gradients_touch_only_the_critic(mesh, actor_and_critic):
    actor = actor_and_critic[0]
    with jax.set_mesh(mesh):
        critic = value_model_from_actor(actor, seed=1)  # its own: this test donates its parameters
        actor_def, actor_params = nnx.split(actor)
        critic_def, critic_params = nnx.split(critic)
        ids, mask = batch(seed=1)
        response_mask = mask[:, PROMPT:].astype(jnp.float32)
        rs = np.random.RandomState(2)
        old_values = jnp.asarray(rs.randn(*response_mask.shape), jnp.float32)
        returns = jnp.asarray(rs.randn(*response_mask.shape), jnp.float32)

        def critic_loss(actor_params, critic_params):  # the actor is an argument too: its gradient must be 0
            del actor_params
            values = response_values(nnx.merge(critic_def, critic_params), ids, mask, RESPONSE)
            return rl.value_loss(values, old_values, returns, response_mask, clip_range_value=10.0)[0]

        actor_grads, critic_grads = jax.jit(jax.grad(critic_loss, argnums=(0, 1)))(actor_params, critic_params)
        assert all(not np.asarray(g).any() for g in jax.tree.leaves(actor_grads))
        for path, g in nnx.to_flat_state(critic_grads):
            assert np.abs(np.asarray(g.get_value())).max() > 0, dotted(path)  # every critic parameter learns

        before = {k: np.asarray(v) for k, v in flat(actor).items()}
        sgd = jax.jit(lambda p, g: jax.tree.map(lambda x, d: x - 0.1 * d, p, g), donate_argnums=0)
        new_critic = sgd(critic_params, critic_grads)
        for name, value in flat(actor).items():  # alive (not donated with the critic) and unchanged
            assert not value.is_deleted(), name
            np.testing.assert_array_equal(np.asarray(value), before[name])
        moved = nnx.to_flat_state(new_critic)
        assert any(np.abs(np.asarray(v.get_value()) - before[dotted(p)[len("backbone."):]]).max() > 0
                   for p, v in moved if dotted(p).startswith("backbone."))
