"""A step's responses the reward deadline leaves unscored: reported in the step's metrics (count and
fraction, after one more round), and above ``reward.max_unscored_fraction`` the step stops with an
error naming the field instead of training on zeros."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from pacs_jax import models, rewards
from pacs_jax.training.rollout import RolloutCollector
from pacs_jax.training.step_programs import StepPrograms
from pacs_jax.training.metrics import KEY_METRICS
from pacs_jax.training.records import PromptBatch
from pacs_jax.training.spec import RunSpec
from train_helpers import load_config

CFG = models.QwenConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=4, eos_token_id=1)
PROMPTS = PromptBatch(prompt_ids=[[5, 6, 7], [8, 9]], ground_truths=["3", "4"], data_sources=["a", "b"])


def test_unscored_responses_are_counted_then_refused():
    model = models.init_random(CFG, seed=0)
    graphdef, params = nnx.split(model)
    config = load_config("default.py")
    config.rollout.n, config.rollout.max_new_tokens = 2, 4
    config.data.max_prompt_length, config.data.prompt_buckets = 8, (8,)
    config.train.prompts_per_step, config.train.mini_batches = 2, 1
    config.reward.deadline = 0.0  # nothing can be scored in time, in either round
    with rewards.RewardPool(num_workers=1) as pool:
        config.reward.max_unscored_fraction = 1.0
        collect = RolloutCollector.from_spec(RunSpec.unplaced(config), StepPrograms(RunSpec.unplaced(config), graphdef, params, (1,)),
                                               decode=lambda ids: " ".join(map(str, ids)), reward_pool=pool)
        rollout = collect(params, lambda: PROMPTS, jax.random.key(0))
        assert (rollout.metrics["reward_unscored"], rollout.metrics["reward_unscored_fraction"]) == (4.0, 1.0)
        assert rollout.metrics["reward_deadline_retried"] == 4.0
        assert "reward_unscored" in KEY_METRICS  # on the progress bar

        config.reward.max_unscored_fraction = 0.5
        collect = RolloutCollector.from_spec(RunSpec.unplaced(config), StepPrograms(RunSpec.unplaced(config), graphdef, params, (1,)),
                                               decode=lambda ids: " ".join(map(str, ids)), reward_pool=pool)
        with pytest.raises(rewards.UnscoredError, match="4 of 4 responses.*reward.max_unscored_fraction"):
            collect(params, lambda: PROMPTS, jax.random.key(0))
