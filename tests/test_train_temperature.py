"""Log-probs at the rollout temperature: the trainer's pi_old program and its update's log pi_theta
divide the logits by ``rollout.temperature`` (as verl does), against transformers logits / T with a
float64 log-softmax."""

from __future__ import annotations

import types

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from pacs_jax import checkpoints
from pacs_jax.training.rollout import RolloutCollector
from pacs_jax.training.step_programs import StepPrograms
from pacs_jax.training.spec import RunSpec
from qwen_reference import ARCHS, hf_logits, save_random_hf_model
from train_helpers import load_config

ARCH = "qwen3_tied_head_dim24"
PROMPTS, N, PROMPT_LEN, RESPONSE_LEN = 2, 4, 5, 6
TEMPERATURE = 0.6


@pytest.fixture(scope="module")
def models_and_batch(tmp_path_factory):
    """(transformers model, our model on its weights, host rollout arrays: left-padded prompts
    [P, Tp], right-padded responses [P n, R] of ragged lengths)."""
    directory = tmp_path_factory.mktemp("temperature") / ARCH
    hf_model = save_random_hf_model(ARCH, directory, seed=3)
    model = checkpoints.from_pretrained(directory, dtype="float32")
    rs = np.random.RandomState(0)
    vocab = ARCHS[ARCH]["vocab_size"]
    prompt_tokens = rs.randint(0, vocab, (PROMPTS, PROMPT_LEN)).astype(np.int32)
    prompt_mask = np.zeros((PROMPTS, PROMPT_LEN), np.int32)
    prompt_mask[0, 1:] = 1
    prompt_mask[1, 3:] = 1
    tokens = rs.randint(0, vocab, (PROMPTS * N, RESPONSE_LEN)).astype(np.int32)
    lengths = np.array([6, 1, 4, 2, 5, 6, 3, 2])
    response_mask = (np.arange(RESPONSE_LEN)[None] < lengths[:, None]).astype(np.int32)
    sampled = types.SimpleNamespace(  # the fields of rollout.SampledRows that pi_old reads
        prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens, response_mask=response_mask,
        lengths=lengths, prompt_lengths=np.repeat(prompt_mask.sum(axis=1), N), routing=None)  # no experts: no record
    return hf_model, model, sampled


def reference_logprobs(hf_model, sampled, temperature):
    """log softmax(transformers logits / T) of each response token, float64, [P n, R]."""
    ids = np.concatenate([np.repeat(sampled.prompt_tokens, N, axis=0), sampled.tokens], axis=1)
    mask = np.concatenate([np.repeat(sampled.prompt_mask, N, axis=0), sampled.response_mask], axis=1)
    z = hf_logits(hf_model, ids, mask)[:, PROMPT_LEN - 1:-1] / temperature  # position P - 1 + t predicts token t
    z = z - z.max(axis=-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return np.take_along_axis(logp_all, sampled.tokens[..., None].astype(np.int64), axis=-1)[..., 0]


def trainer_config(temperature: float) -> ml_collections.ConfigDict:
    config = load_config("default.py")
    config.rollout.n = N
    config.rollout.temperature = temperature
    config.rollout.max_new_tokens = RESPONSE_LEN
    config.data.max_prompt_length = PROMPT_LEN
    config.data.prompt_buckets = (PROMPT_LEN,)
    config.train.prompts_per_step = PROMPTS
    config.train.mini_batches = 1
    config.train.logprob_micro_batches = 2
    config.algorithm.objective = "grpo"
    config.algorithm.grpo.loss_agg_mode = "token-mean"
    return config


def test_pi_old_and_the_update_use_the_rollout_temperature(models_and_batch):
    hf_model, model, sampled = models_and_batch
    graphdef, params = nnx.split(model)
    live = sampled.response_mask.astype(bool)
    want = reference_logprobs(hf_model, sampled, TEMPERATURE)
    at_one = reference_logprobs(hf_model, sampled, 1.0)
    assert np.abs(want - at_one)[live].max() > 0.1  # the temperature matters on these logits

    config = trainer_config(TEMPERATURE)
    programs = StepPrograms(RunSpec.unplaced(config), graphdef, params, ())
    batch, *_ = RolloutCollector.from_spec(RunSpec.unplaced(config), programs, decode=lambda ids: "", reward_pool=None).old_policy(
        params, sampled)  # the config's passes run packed (train.packing)
    np.testing.assert_allclose(np.asarray(batch.old_logp)[live], want[live], atol=2e-5)

    # The update's log pi_theta at T: with pi_old = the reference at T, the ratio is 1 on every token.
    optimizer, update = programs.learner.optimizer, programs.learner.update
    batch = batch.replace(old_logp=jax.numpy.asarray(want, np.float32),
                          rewards=jax.numpy.asarray([1, 0, 0, 1, 0, 1, 1, 1], np.float32))
    fresh = jax.tree.map(np.array, params)  # the update donates its inputs
    _, _, (metrics,) = update(fresh, jax.jit(optimizer.init)(fresh), batch)
    assert abs(float(metrics["pg/approx_kl_old"])) < 1e-5
    assert float(metrics["pg/clipfrac"]) == 0.0
    # At T = 1 the same old log-probs are far from pi_theta: the check above can fail.
    config_one = trainer_config(1.0)
    update_one = StepPrograms(RunSpec.unplaced(config_one), graphdef, params, ()).learner.update
    fresh = jax.tree.map(np.array, params)
    _, _, (metrics_one,) = update_one(fresh, jax.jit(optimizer.init)(fresh), batch)
    assert abs(float(metrics_one["pg/approx_kl_old"])) > 1e-2
