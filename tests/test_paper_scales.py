"""Issue 41 item 3: a paper setup at a CPU's size, and a warning for a step far beyond the machine.

``configs/paper.py:MODEL,ALGO,cpu`` shrinks every length that depends on the responses' (the buckets,
the algorithm's L_max, the evaluation lengths, each eval.final.per_set entry's), keeps the setup's
algorithm, reward mode and family, and passes the trainer's check on one device and, through
``python -m pacs_jax.check_config``, with every input read. A paper step planned on a CPU prints a
warning naming the smoke test; the smoke test's does not.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from pacs_jax.rl import options_for
from pacs_jax.training.config_check import validate_config
from pacs_jax.training.progress import planned_step_warning
from pacs_jax.training.spec import ConfigError, RunSpec
from train_helpers import load_config

MODELS = ("qwen25_3b", "qwen25_7b", "qwen3_4b", "qwen3_8b", "qwen25_7b_v6e", "qwen25_7b_lora")


@pytest.mark.parametrize("model, algo", [(m, a) for m in MODELS for a in ("pacs_beta1", "grpo", "ppo")
                                         if (m, a) != ("qwen25_7b_lora", "ppo")])  # refused: see below
def test_the_cpu_scale_shrinks_every_dependent_length_together(model, algo):
    paper, small = load_config("paper.py", f"{model},{algo}"), load_config("paper.py", f"{model},{algo},cpu")
    validate_config(small, device_count=1)
    new = small.rollout.max_new_tokens
    assert new == 64 < paper.rollout.max_new_tokens
    assert small.rollout.response_buckets[-1] == small.eval.max_new_tokens == new
    assert [s.max_new_tokens for s in small.eval.final.per_set.values()] == [new] * len(paper.eval.final.per_set)
    options, paper_options = options_for(small.algorithm), options_for(paper.algorithm)
    assert {k: v for k, v in options.items() if k != "norm_length"} == \
        {k: v for k, v in paper_options.items() if k != "norm_length"}
    if "norm_length" in paper_options:  # L_max of the losses that normalise by it
        assert (paper_options["norm_length"], options["norm_length"]) == (paper.rollout.max_new_tokens, new)
    assert small.algorithm.objective == paper.algorithm.objective and small.reward.mode == paper.reward.mode
    assert small.model.model_type == ("qwen3" if paper.model.preset.startswith("Qwen3") else "qwen2")
    assert (small.rollout.n, small.train.mini_batches, small.data.prompt_buckets) == \
        (paper.rollout.n, paper.train.mini_batches, paper.data.prompt_buckets)


def test_the_lora_setup_is_the_7b_setup_with_adapters_and_ten_times_the_learning_rate():
    full, adapters = (load_config("paper.py", f"{model},pacs_beta1") for model in ("qwen25_7b", "qwen25_7b_lora"))
    assert (adapters.model.lora_rank, adapters.model.lora_alpha, adapters.model.target_modules) == (32, 64.0, "all-linear")
    assert full.model.lora_rank == 0 and adapters.optim.lr == pytest.approx(10 * full.optim.lr)
    assert adapters.model.preset == full.model.preset and adapters.algorithm == full.algorithm
    RunSpec.from_config(adapters, device_count=8)  # its mesh on the v5p-16's 8 chips
    with pytest.raises(ConfigError, match="config.model.lora_rank: 32 with algorithm.objective 'ppo'"):
        RunSpec.unplaced(load_config("paper.py", "qwen25_7b_lora,ppo"))  # the critic is full rank


def test_an_unknown_scale_is_refused():
    with pytest.raises(ValueError, match="config arg scale 'tiny'"):
        load_config("paper.py", "qwen25_7b,pacs_beta1,tiny")


def test_a_paper_step_on_a_cpu_is_warned_and_its_smoke_test_is_not():
    paper, small = (RunSpec.unplaced(load_config("paper.py", f"qwen25_7b,pacs_beta1{scale}")) for scale in ("", ",cpu"))
    assert planned_step_warning(paper, "cpu") == (
        "warning: a step of 1024 prompts x 8 responses of up to 4096 tokens (37.7 M prompt and response tokens) is "
        "planned on a CPU: expect hours a step. A paper setup's CPU smoke test is configs/paper.py:MODEL,ALGO,cpu; "
        "else lower train.prompts_per_step, rollout.n or rollout.max_new_tokens")
    assert planned_step_warning(paper, "gpu") is None  # the memory check compiles against an accelerator's memory
    assert planned_step_warning(small, "cpu") is None
    assert planned_step_warning(RunSpec.unplaced(load_config("default.py")), "cpu") is None  # the demo


def test_check_config_reads_the_cpu_scale_s_inputs(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pacs_jax.check_config",
                          f"--config={REPO / 'configs' / 'paper.py'}:qwen3_8b,grpo,cpu", "--accelerator=v5p-8"],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the config and its inputs pass the trainer's check for v5p-8 (4 devices)" in run.stdout
