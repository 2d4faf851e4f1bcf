"""The supervised warm-start (training/warmstart.py): its batches, its loss against transformers'
logits in float64, its stopping rule."""

from __future__ import annotations

import re

import jax
import ml_collections
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from pacs_jax import checkpoints, data, models
from pacs_jax.data.arithmetic import make_problems
from pacs_jax.rewards import RewardPool
from pacs_jax.sharding import config_mesh, make_mesh
from pacs_jax.training import run
from pacs_jax.training.learner import warmstart
from pacs_jax.training.compilations import compilations, start_counting
from pacs_jax.training.spec import RunSpec
from qwen_reference import save_random_hf_model
from train_helpers import load_config


@pytest.fixture(scope="module")
def task():
    """(char tokenizer, 16 arithmetic prompts, their target responses: \\boxed{answer} + eos)."""
    tokenizer = data.load_tokenizer("char")
    examples, _ = data.build_prompts(make_problems(16, seed=2), tokenizer, 64, instruction="")
    responses = [tokenizer.encode(f"\\boxed{{{e.problem.ground_truth}}}") + [tokenizer.eos_token_id] for e in examples]
    return tokenizer, examples, responses


def sft_program(model, wc):
    """The warm-start step of ``wc`` for ``model``'s parameters (as the run's StepPrograms makes it)."""
    graphdef, params = nnx.split(model)
    return warmstart.sft_step(graphdef, wc, params)


def test_batches_have_the_rollout_layout(task):
    tokenizer, examples, responses = task
    batch = warmstart.sft_batch(examples[:3], responses[:3], prompt_length=64, response_length=12)
    assert batch.input_ids.shape == (3, 76) and batch.response_mask.shape == (3, 12)
    for row, (example, response) in enumerate(zip(examples[:3], responses[:3])):
        prompt = np.asarray(example.prompt_ids)
        assert (batch.input_ids[row, 64 - len(prompt):64] == prompt).all()  # left-padded prompt
        assert (batch.attention_mask[row, :64] == (np.arange(64) >= 64 - len(prompt))).all()
        assert (batch.input_ids[row, 64:64 + len(response)] == response).all()  # right-padded response
        assert batch.response_mask[row].sum() == len(response) and batch.response_mask[row, 0] == 1
    with pytest.raises(ValueError, match="warmstart.max_response_tokens=4: a target response has"):
        warmstart.sft_batch(examples[:1], responses[:1], prompt_length=64, response_length=4)


def test_loss_is_the_token_mean_cross_entropy_of_transformers_logits(task, tmp_path):
    """The step's loss on a padded, sharded batch equals the float64 cross-entropy of the response
    tokens computed from transformers' logits of each unpadded sequence."""
    tokenizer, examples, responses = task
    hf_model = save_random_hf_model("qwen3_tied_head_dim24", tmp_path / "hf", seed=5, vocab_size=len(tokenizer))
    with jax.set_mesh(make_mesh(data=4, fsdp=2)):
        model = checkpoints.from_pretrained(tmp_path / "hf")
        batch = warmstart.sft_batch(examples[:8], responses[:8], prompt_length=64, response_length=12)
        graphdef, params = nnx.split(model)
        step = warmstart.make_sft_step(graphdef, optax.sgd(0.0), 12)
        _, _, loss = step(params, optax.sgd(0.0).init(params), batch)

    total, count = 0.0, 0
    for example, response in zip(examples[:8], responses[:8]):
        sequence = torch.tensor([list(example.prompt_ids) + response])
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(input_ids=sequence).logits.double(), dim=-1)[0]
        start = len(example.prompt_ids)
        total -= sum(logp[start - 1 + i, token].item() for i, token in enumerate(response))
        count += len(response)
    np.testing.assert_allclose(float(loss), total / count, rtol=2e-5)


def test_stops_once_the_probe_reaches_the_target(task, monkeypatch):
    """Probed every check_every steps, it stops at the first probe at or above target_accuracy."""
    tokenizer, examples, _ = task
    wc = ml_collections.ConfigDict(load_config("default.py").warmstart.to_dict())
    wc.update(steps=12, batch_size=4, target_accuracy=0.25, check_every=2)
    probe, _ = data.build_prompts(make_problems(5, seed=3), tokenizer, 64, instruction="")  # prompts it never trains on
    probes = iter([0.1, 0.2, 0.3, 0.9])
    probed: list[int] = []

    def fake_probe(model, probe, *args, **kwargs):
        probed.append([e.problem.problem for e in probe])
        return next(probes)

    monkeypatch.setattr(warmstart, "probe_accuracy", fake_probe)
    model = models.init_random(models.QwenConfig(
        model_type="qwen3", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True), seed=0)
    program = sft_program(model, wc)  # both runs' step (its lr, weight decay and response length), compiled once
    with RewardPool(1, 5.0) as pool:
        model, result = warmstart.warm_start(model, examples, tokenizer, wc, program=program, probe=probe,
                                             prompt_length=64, seed=0,
                                             pool=pool, reward_name="math", probe_max_new_tokens=12,
                                             stop_token_ids=(1,))
    assert (result.steps, result.probe_accuracy) == (6, 0.3)
    assert probed == [[e.problem.problem for e in probe]] * 3
    wc.target_accuracy = 0.0  # no target: every step, never probed
    seen: list[tuple] = []  # the prompts of each step's batch
    real_batch = warmstart.sft_batch
    monkeypatch.setattr(warmstart, "sft_batch", lambda ex, *a: seen.append(tuple(e.prompt_ids for e in ex))
                        or real_batch(ex, *a))
    with RewardPool(1, 5.0) as pool:
        _, result = warmstart.warm_start(model, examples, tokenizer, wc, program=program, probe=probe,
                                         prompt_length=64, seed=0,
                                         pool=pool, reward_name="math", probe_max_new_tokens=12, stop_token_ids=(1,))
    assert (result.steps, result.probe_accuracy, len(probed)) == (12, None, 3)
    epochs = [sorted(sum(seen[i:i + 4], ())) for i in (0, 4, 8)]  # 16 prompts in batches of 4: 4 steps an epoch
    assert epochs[0] == epochs[1] == epochs[2] == sorted(e.prompt_ids for e in examples)  # each once an epoch
    assert seen[:4] != seen[4:8]  # in a fresh order


def test_the_step_compiles_once_on_the_demo_mesh(task, monkeypatch):
    """Steps 2.. run the program step 1 compiled: the step's outputs keep its inputs' shardings."""
    tokenizer, examples, _ = task
    config = load_config("default.py")
    wc = ml_collections.ConfigDict(config.warmstart.to_dict())
    wc.update(steps=3, batch_size=8, target_accuracy=0.0)
    compiled_per_call: list[int] = []
    real_step = warmstart.make_sft_step

    def counted_step(*args, **kwargs):
        step = real_step(*args, **kwargs)

        def call(*step_args):
            before = compilations()
            out = jax.block_until_ready(step(*step_args))
            compiled_per_call.append(compilations() - before)
            return out

        return call

    monkeypatch.setattr(warmstart, "make_sft_step", counted_step)
    with jax.set_mesh(config_mesh(config.mesh)), RewardPool(1, 5.0) as pool:
        model = models.init_random(models.QwenConfig(
            model_type="qwen3", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True), seed=0)
        start_counting()
        warmstart.warm_start(model, examples, tokenizer, wc, program=sft_program(model, wc), probe=examples[:2],
                             prompt_length=64, seed=0, pool=pool,
                             reward_name="math", probe_max_new_tokens=12, stop_token_ids=(1,))
    assert len(compiled_per_call) == 3 and compiled_per_call[0] >= 1
    assert compiled_per_call[1:] == [0, 0]


class _AfterWarmStart(Exception):
    """Raised in place of RL: the test needs the run only up to the warm-start."""


def test_the_run_probes_rl_prompts_the_warm_start_never_trains_on(monkeypatch, tmp_path, capsys):
    """The demo's probe is the first probe_problems of RL's prompts, none of them a warm-start prompt; the
    run says where the warm-start stopped against its target."""
    config = load_config("default.py")
    config.data.update(arithmetic=dict(problems=96, max_operand=40), warmstart_problems=64, held_out_problems=8)
    config.warmstart.update(steps=4, target_accuracy=0.5, check_every=2, probe_problems=16)
    config.model.num_hidden_layers = 1
    config.eval.before_rl = False
    probed: list[list[str]] = []
    trained: set[str] = set()

    def fake_probe(model, probe, *args, **kwargs):
        probed.append([e.problem.problem for e in probe])
        return 0.0

    real_batch = warmstart.sft_batch
    monkeypatch.setattr(warmstart, "probe_accuracy", fake_probe)
    monkeypatch.setattr(warmstart, "sft_batch", lambda ex, *a: trained.update(e.problem.problem for e in ex)
                        or real_batch(ex, *a))
    monkeypatch.setattr(run, "rl_train", lambda *a, **k: (_ for _ in ()).throw(_AfterWarmStart()))
    with pytest.raises(_AfterWarmStart):
        with jax.set_mesh(config_mesh(config.mesh)):
            run.run_training(config, tmp_path)
    rl, warm, _, _ = run.prompt_source(RunSpec.unplaced(config), data.load_tokenizer("char"))
    assert probed == [[e.problem.problem for e in rl.examples[:16]]] * 2  # probed at steps 2 and 4
    assert trained and trained <= {e.problem.problem for e in warm} and trained.isdisjoint(probed[0])
    assert re.search(r"^warm-start: 4 steps in \d+ s, greedy accuracy 0\.000 on the probe "
                     r"\(target 0\.5 not reached within warmstart\.steps\)$", capsys.readouterr().out, re.M)
    reached = run._warm_start_line(warmstart.WarmStartResult(steps=40, probe_accuracy=0.5, seconds=3.2), 0.45)
    assert reached == "warm-start: 40 steps in 3 s, greedy accuracy 0.500 on the probe (reached the target 0.45)"
