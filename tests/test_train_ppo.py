"""PPO in the trainer (training/critic_step.py) on the 8-device mesh: the critic's step (values, GAE,
its update) against the float64 statements of the authors' verl (GAE and critic loss, with its mask
shifted by one slot) of test_rl_ppo on the critic's own values computed in one pass; and the paper's
PPO setup, shrunk, trains with the critic sharded like the actor, compiling nothing after the first
step."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax import data, distributed, evaluation, models, sharding
from pacs_jax.checkpoints import flat_params
from pacs_jax.models.value import response_values, value_model_from_actor
from pacs_jax.rewards import RewardPool
from pacs_jax.rl.update_batch import UpdateBatch
from pacs_jax.sharding import config_mesh
from pacs_jax.training.config_check import validate_config
from pacs_jax.training.learner.critic_step import PPOCritic, critic_programs
from pacs_jax.training.loop import rl_train
from pacs_jax.training.learner.optim import make_optimizer
from pacs_jax.training.run import build_model, prompt_source
from pacs_jax.sharding import batch_sharding
from pacs_jax.training.spec import RunSpec
from test_rl_ppo import T, ref_gae_verl, verl_critic_mini_batch_loss
from test_train_real_config import deepscaler_rows, one_prompt_bucket, shrunk_paper_config  # noqa: F401 (a fixture)

CFG = models.QwenConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=4)
PROMPT, ROWS, GAMMA, LAM = 4, 16, 0.9, 0.8


def update_batch(seed=0):
    """A host update batch of ROWS rows (left-padded prompts of PROMPT tokens, right-padded responses of
    1 .. T tokens, 0/1 rewards) and its global arrays, rows sharded as the trainer shards them."""
    rs = np.random.RandomState(seed)
    lengths = rs.randint(1, T + 1, ROWS)
    lengths[:2] = 1, T
    ids = rs.randint(0, CFG.vocab_size, (ROWS, PROMPT + T)).astype(np.int32)
    mask = np.zeros(ids.shape, np.int32)
    for i in range(ROWS):
        mask[i, PROMPT - rs.randint(1, PROMPT + 1):PROMPT + lengths[i]] = 1
    host = UpdateBatch(input_ids=ids, attention_mask=mask, response_mask=mask[:, PROMPT:].astype(np.float32),
                       old_logp=np.zeros((ROWS, T), np.float32), rewards=rs.randint(0, 2, ROWS).astype(np.float32))
    host.rewards[:2] = 1.0, 0.0
    return host, lengths, jax.tree.map(lambda v: distributed.put_rows(v, batch_sharding(v.shape)), host)


@pytest.mark.slow
def test_critic_step_matches_the_float64_gae_and_value_loss_on_the_mesh():
    with jax.set_mesh(sharding.make_mesh(2, 2, 2)):
        actor = models.init_random(CFG, seed=0)
        critic_model = value_model_from_actor(actor, seed=1)
        host, lengths, batch = update_batch()
        # the reference: the critic's values in one plain forward pass (no micro-batches) times verl's critic
        # mask (attention_mask[:, -T - 1:-1]), GAE in float64 as verl computes it
        critic_mask = host.attention_mask[:, -T - 1:-1].astype(np.float64)
        values = np.asarray(jax.jit(response_values, static_argnums=3)(critic_model, batch.input_ids,
                                                                       batch.attention_mask, T), np.float64)
        values = values * critic_mask
        token_rewards = np.zeros((ROWS, T))
        token_rewards[np.arange(ROWS), lengths - 1] = host.rewards
        want_adv, want_ret = ref_gae_verl(token_rewards, values, host.response_mask, critic_mask, GAMMA, LAM)
        before = {k: np.asarray(v) for k, v in flat_params(nnx.state(critic_model, nnx.Param)).items()}
        shardings = {k: v.sharding for k, v in flat_params(nnx.state(critic_model, nnx.Param)).items()}

        optimizer, _ = make_optimizer(1e-3, grad_clip=1.0)
        critic = PPOCritic(critic_model, optimizer)
        programs = critic_programs(critic.graphdef, optimizer, critic.shardings, gamma=GAMMA, lam=LAM,
                                   clip_range_value=0.5, loss_agg_mode="token-mean", loss_scale="mean",
                                   verl_micro_batch_size=0, num_mini_batches=1, num_micro_batches=2, values_micro_batches=4)
        actor_batch, (metrics,) = critic.step(programs, batch)

        assert jax.tree.structure(actor_batch) == jax.tree.structure(batch.replace(advantages=batch.old_logp))
        advantages = actor_batch.advantages
        assert advantages.sharding == batch_sharding((ROWS, T)) and advantages.sharding.spec[0] == ("data", "fsdp")
        live = host.response_mask > 0
        np.testing.assert_allclose(np.asarray(advantages)[live], want_adv[live], rtol=1e-4, atol=1e-4)
        # one mini-batch: the loss is read before the update, where the values are the rollout's (no clip):
        # verl's critic loss (no 1/2; token-mean over its mask, "mean" scale: one verl micro-batch of all rows);
        # the explained variance is the mean of the 2 micro-batches' (rows 0, 2, ... and 1, 3, ...)
        assert (critic_mask > host.response_mask).any()  # slots after responses shorter than T count
        want_loss = verl_critic_mini_batch_loss(values, values, want_ret, host.attention_mask, "token-mean", ROWS, 1)
        np.testing.assert_allclose(float(metrics["value_loss"]), want_loss, rtol=1e-4)
        residual, on = want_ret - values, critic_mask > 0
        explained = [1 - residual[k::2][on[k::2]].var() / want_ret[k::2][on[k::2]].var() for k in range(2)]
        np.testing.assert_allclose(float(metrics["explained_variance"]), np.mean(explained), rtol=1e-4)
        assert float(metrics["value_clip_fraction"]) == 0.0 and float(metrics["critic_skipped"]) == 0.0
        assert set(metrics) == {"value_loss", "explained_variance", "value_clip_fraction", "critic_grad_norm",
                                "critic_skipped"}

        after = flat_params(critic.params)
        assert {k: v.sharding for k, v in after.items()} == shardings  # updated in place, in its shardings
        for name in ("value_kernel", "backbone.layers.mlp.down_kernel"):  # the head and the backbone learn
            assert not np.array_equal(np.asarray(after[name]), before[name]), name


@pytest.mark.slow(seconds=50)
def test_paper_ppo_setup_trains_with_the_critic_sharded_like_the_actor(deepscaler_rows, small_tokenizer_dir,
                                                                      tmp_path):
    config = shrunk_paper_config(deepscaler_rows, small_tokenizer_dir, steps=2, arg="qwen25_3b,ppo")
    # prompts of the 128-token bucket (the update's time goes with the rows' length) and responses of 8
    # tokens in one bucket: a random model never stops early, so a second bucket would never run
    config.rollout.max_new_tokens = 8
    one_prompt_bucket(config, 128).rollout.response_buckets = (8,)
    assert (config.critic.loss_agg_mode, config.critic.loss_scale, config.critic.verl_micro_batch_size,
            config.optim.grad_clip) == ("actor", "verl", 8, 1.0)
    validate_config(config)
    mesh = config_mesh(config.mesh)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    tokenizer = data.load_tokenizer(config.data.tokenizer)
    with jax.set_mesh(mesh), RewardPool(config.reward.workers, config.reward.item_timeout) as pool:
        model = build_model(RunSpec.unplaced(config), tokenizer)
        prompts, _, _, _ = prompt_source(RunSpec.unplaced(config), tokenizer)
        actor = {k: v.sharding for k, v in flat_params(nnx.state(model, nnx.Param)).items()}
        result = rl_train(RunSpec.unplaced(config), tmp_path, model, prompts, stop_token_ids=evaluation.default_stop_ids(model, tokenizer),
                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), reward_pool=pool)

    critic = {k: v.sharding for k, v in flat_params(result.critic.params).items()}
    assert {f"backbone.{k}" for k in actor if k != "lm_head"} | {"value_kernel", "value_bias"} == set(critic)
    for name, spec in actor.items():
        if name != "lm_head":
            assert critic[f"backbone.{name}"] == spec, name
    assert any(spec.spec and "fsdp" in jax.tree.leaves(tuple(spec.spec)) for spec in critic.values())

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("value_loss", "explained_variance", "value_clip_fraction", "critic_grad_norm", "loss",
                    "grad_norm", "ppo/clipfrac"):
            assert np.isfinite(r[key]), key
        assert r["skipped"] == r["critic_skipped"] == 0.0 and r["value_loss"] > 0
    assert rows[1]["compilations"] == rows[0]["compilations"]
    assert (tmp_path / "checkpoints" / "2" / "critic_params").is_dir()
