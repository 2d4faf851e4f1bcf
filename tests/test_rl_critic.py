"""The critic's value-loss gradient over micro-batches (rl/critic.py) against the float64 statement of
the authors' verl critic loss (test_rl_ppo: no 1/2, its mask shifted by one slot) on the critic's own
values, at verl's micro-batch scale and at the whole-batch mean."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import models, rl
from pacs_jax.rl.update_batch import CriticBatch
from test_rl_ppo import verl_critic_mini_batch_loss

CFG = models.QwenConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=4)
PROMPT, RESPONSE, ROWS = 4, 5, 8


@pytest.fixture(scope="module")
def critic_and_batch():
    critic = models.value_model_from_actor(models.init_random(CFG, seed=0), seed=1)
    rs = np.random.RandomState(0)
    ids = rs.randint(0, CFG.vocab_size, (ROWS, PROMPT + RESPONSE)).astype(np.int32)
    mask = np.zeros(ids.shape, np.int32)
    for i in range(ROWS):
        mask[i, PROMPT - rs.randint(1, PROMPT + 1):PROMPT + rs.randint(1, RESPONSE + 1)] = 1
    values = np.asarray(models.response_values(critic, jnp.asarray(ids), jnp.asarray(mask), RESPONSE))
    batch = CriticBatch(input_ids=ids, attention_mask=mask, response_mask=mask[:, PROMPT:].astype(np.float32),
                        old_values=(values + 0.6 * rs.randn(*values.shape)).astype(np.float32),  # some beyond the clip
                        returns=rs.randint(0, 2, values.shape).astype(np.float32))
    return critic, batch, values


def test_critic_loss_over_micro_batches_matches_numpy(critic_and_batch):
    critic, batch, values = critic_and_batch
    graphdef, params = nnx.split(critic)
    critic_mask = batch.attention_mask[:, -RESPONSE - 1:-1]  # verl's critic mask (dp_critic.py)
    assert (critic_mask > batch.response_mask).any()  # the slots after responses shorter than RESPONSE
    assert (np.abs(values - batch.old_values)[critic_mask > 0] > 0.5).any()  # the value clip is exercised

    def verl(mode, micro_batch_size, rows=slice(None)):  # the authors' verl critic loss (test_rl_ppo), float64
        return verl_critic_mini_batch_loss(values[rows], batch.old_values[rows], batch.returns[rows],
                                           batch.attention_mask[rows], mode, micro_batch_size, ranks=1)

    whole = jax.jit(rl.critic_loss_and_grad_fn(graphdef))(params, batch)
    split = jax.jit(rl.critic_loss_and_grad_fn(graphdef, num_micro_batches=2))(params, batch)
    np.testing.assert_allclose(float(whole[0]), verl("token-mean", ROWS), rtol=1e-5)  # no 1/2, the critic mask
    np.testing.assert_allclose(float(split[0]), float(whole[0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(split[2]), jax.tree.leaves(whole[2])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    assert 0 < float(whole[1]["critic/value_clipfrac"]) < 1

    # verl's scale: the loss per micro-batch of 2 responses, averaged; our micro-batch k of 2 holds rows
    # k, k + 2, ... and verl's micro-batches are consecutive pairs of them. token-mean, and the paper's
    # seq-mean-token-sum-norm (the actor's; here over the width RESPONSE)
    order = np.concatenate([np.arange(k, ROWS, 2) for k in range(2)])
    for mode in ("token-mean", "seq-mean-token-sum-norm"):
        got = jax.jit(rl.critic_loss_and_grad_fn(graphdef, num_micro_batches=2, loss_agg_mode=mode,
                                                 norm_length=RESPONSE, loss_scale="verl",
                                                 verl_micro_batch_size=2))(params, batch)
        np.testing.assert_allclose(float(got[0]), verl(mode, 2, order), rtol=1e-5, err_msg=mode)
        if mode == "token-mean":
            assert abs(float(got[0]) - float(whole[0])) > 1e-4  # the scale differs from the whole-batch mean here


def test_critic_batch_is_checked(critic_and_batch):
    critic, batch, _ = critic_and_batch
    graphdef, params = nnx.split(critic)
    with pytest.raises(TypeError, match="returns"):  # the typed batch names a missing array
        CriticBatch(batch.input_ids, batch.attention_mask, batch.response_mask, batch.old_values)
    with pytest.raises(ValueError, match="num_micro_batches=3"):
        rl.critic_loss_and_grad_fn(graphdef, num_micro_batches=3)(params, batch)
