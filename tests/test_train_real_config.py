"""The paper's configs, shrunk (issue: real scale): a tiny random Qwen with the Qwen tokenizer cut to 4,096
entries (conftest.py's small_tokenizer_dir: its BPE, chat template and special tokens; the real vocabulary's
[T, V] logits were half a step) and the DeepScaleR subset prompts, under the config's own remat, dtype and mesh on the
8-device CPU mesh. Trains under every remat policy (in fp32 or bf16, each dtype under two policies)
and compiles nothing after the first step on ragged prompts. test_train_paper_setups.py runs each
model of the paper config (the qwen25_7b run evaluated as the paper's tables are) and checks the
compiled pi_old and update programs; test_train_ppo.py its PPO setup."""

from __future__ import annotations

import json

import jax
import ml_collections
import numpy as np
import pytest

from configs.paper import CPU_TINY_EXPERTS
from pacs_jax.models.config import REMAT_POLICIES, preset
from pacs_jax.rl import options_for
from pacs_jax.sharding import config_mesh
from pacs_jax.training.learner import rollout_consistency
from pacs_jax.training.config_check import validate_config
from pacs_jax.training.run import run_training
from test_train_config import load_config

TINY = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
            vocab_size=0)  # vocab 0: the tokenizer's


@pytest.fixture(scope="module")
def deepscaler_rows(shared_data, tmp_path_factory):
    """Real DeepScaleR subset rows, in its own file format: the 24 shortest problems of math.json and
    24 of 700 to 1,200 characters (prompts of both buckets, 256 and 512 tokens; tokenising all 7,474
    rows in every run would cost more than the training)."""
    rows = json.loads((shared_data / "deepscaler_subset" / "math.json").read_text())
    rows = sorted(rows, key=lambda r: len(r["problem"]))
    rows = rows[:24] + [r for r in rows if 700 <= len(r["problem"]) <= 1200][:24]
    path = tmp_path_factory.mktemp("data") / "deepscaler_subset" / "math.json"
    path.parent.mkdir()
    path.write_text(json.dumps(rows))
    return path


def shrunk_paper_config(data_file, tokenizer_dir, *, steps: int, arg: str = "qwen25_3b,pacs_beta1",
                        dtype: str | None = None, remat: str | None = None) -> ml_collections.ConfigDict:
    """configs/paper.py's setup ``arg`` with its remat and dtype (unless given) and its mesh kept, a tiny
    model of its family (a mixture of experts' with configs/paper.py's CPU_TINY_EXPERTS), 4 prompts x 8 responses of at most 16 tokens, 2 mini-batches of 2
    micro-batches (8 rows: one per batch shard)."""
    c = load_config("paper.py", arg)
    family = preset(c.model.preset).model_type  # qwen2, qwen3 or qwen3_moe
    c.model.preset = ""
    for k, v in TINY.items():
        c.model[k] = v
    c.model.model_type = family
    if family == "qwen3_moe":  # a mixture of experts' setup: its CPU scale's sparse block (4 experts, 2 a token)
        c.model.update(CPU_TINY_EXPERTS)
    c.model.dtype, c.model.remat = dtype or c.model.dtype, remat or c.model.remat
    c.data.tokenizer = str(tokenizer_dir)
    c.data.train_files = (str(data_file),)
    c.train.steps, c.train.prompts_per_step, c.train.mini_batches, c.train.micro_batches = steps, 4, 2, 2
    c.train.checkpoint_every = 0
    c.train.logprob_micro_batches = 0  # the paper's counts are for its 8,192 responses a step
    c.rollout.micro_batches = 1
    c.rollout.max_new_tokens = 16
    c.reward.workers = 1
    c.eval.sets = ""
    return c


def _train(config, workdir, mesh_shape=(1, 8, 1)) -> list[dict]:
    validate_config(config)
    mesh = config_mesh(config.mesh)
    assert tuple(mesh.shape.values()) == mesh_shape  # the paper's (-1, 8, 1) on 8 devices unless shrunk otherwise
    with jax.set_mesh(mesh):
        summary = run_training(config, workdir)
    assert summary["final_step"] == config.train.steps
    recorded = json.loads((workdir / "config.json").read_text())  # the options that ran, the model built
    assert recorded["algorithm"] == {"objective": config.algorithm.objective, "options": options_for(config.algorithm)}
    assert recorded["model"]["vocab_size"] > 0 and \
        {k: recorded["model"][k] for k in TINY if k != "vocab_size"} == {k: config.model[k] for k in TINY if k != "vocab_size"}
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def one_prompt_bucket(config: ml_collections.ConfigDict, tokens: int = 256) -> ml_collections.ConfigDict:
    """Prompts of one ``tokens`` bucket (the longer rows of deepscaler_rows dropped as too long): a step
    costs half its time at 512 tokens (the [T, V] logits of the real vocabulary), and a test that is not
    about the buckets compiles each program once. The ragged run below trains the paper's two buckets."""
    config.data.max_prompt_length, config.data.prompt_buckets = tokens, (tokens,)
    return config


# One run per remat policy, the dtypes alternating (each under two policies): 1 step in one prompt
# bucket; COMPARED_REMAT's run 2 (the sampler comparison's, whose second step shows that no program
# compiles after step 1) and none's run the ragged run (2 steps over the paper's two prompt buckets);
# dots_with_no_batch_dims_saveable in bfloat16 is the qwen25_3b PACS setup of configs/paper.py as it
# is. Not run: none and dots_saveable in bfloat16, full and dots_with_no_batch_dims_saveable in
# float32. A policy missing here fails the test (KeyError).
MATRIX_DTYPE = {"none": "float32", "full": "bfloat16", "dots_saveable": "float32",
                "dots_with_no_batch_dims_saveable": "bfloat16"}
RAGGED_REMAT = "none"
# The sampler comparison's policy: its continuous run is the matrix's (8 decode slots, one per batch
# shard), its static run the one extra run (float32, where both samplers' tokens agree exactly)
COMPARED_REMAT = "dots_saveable"


def matrix_config(data_file, tokenizer_dir, remat: str, sampler: str = "continuous") -> ml_collections.ConfigDict:
    """The matrix's run of ``remat`` at its MATRIX_DTYPE: 1 step in one prompt bucket (128 tokens) and one
    response bucket (8 tokens) (one configuration per program to compile), COMPARED_REMAT's 2 steps with 8
    decode slots; RAGGED_REMAT's is 2 steps of 2 prompts over the paper's prompt buckets (256, 512), shuffled so
    that the small bucket comes first (shuffle_seed 3: 256 then 512), in one response bucket of 16 tokens (a step's
    longest of 16 random responses runs to 16 tokens: a bucket of 8 was compiled, never used)."""
    dtype = MATRIX_DTYPE[remat]
    ragged = remat == RAGGED_REMAT
    compared = remat == COMPARED_REMAT or sampler != "continuous"
    config = shrunk_paper_config(data_file, tokenizer_dir, steps=2 if ragged or compared else 1, dtype=dtype,
                                 remat=remat)
    assert (config.model.remat, config.model.dtype) == (remat, dtype)
    if ragged:
        assert config.data.prompt_buckets == (256, 512)  # the paper's
        config.train.prompts_per_step, config.train.mini_batches, config.train.micro_batches = 2, 1, 2
        config.rollout.response_buckets = (16,)
        config.data.shuffle_seed = 3
        return config
    one_prompt_bucket(config, 128)
    config.rollout.max_new_tokens, config.rollout.response_buckets = 8, (8,)
    if compared:
        # 8 slots, 1 a batch shard: nothing to narrow (the paper's tail_slots is for its 4096)
        config.rollout.sampler, config.rollout.slots, config.rollout.tail_slots = sampler, 8, 0
    return config


@pytest.fixture(scope="module")
def matrix_runs(deepscaler_rows, small_tokenizer_dir, tmp_path_factory):
    """run(remat, sampler="continuous"): the metrics rows of matrix_config's run, trained once a module
    (the matrix's COMPARED_REMAT run is the sampler comparison's continuous run too)."""
    done: dict[tuple[str, str], list[dict]] = {}

    def run(remat: str, sampler: str = "continuous") -> list[dict]:
        if (remat, sampler) not in done:
            config = matrix_config(deepscaler_rows, small_tokenizer_dir, remat, sampler)
            done[remat, sampler] = _train(config, tmp_path_factory.mktemp(f"{remat}_{sampler}"))
        return done[remat, sampler]

    return run


@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("remat", REMAT_POLICIES)
def test_paper_config_trains_under_every_remat_policy_and_both_dtypes(matrix_runs, remat):
    assert set(MATRIX_DTYPE.values()) == {"float32", "bfloat16"}
    rows = matrix_runs(remat)
    assert [r["step"] for r in rows] == ([1, 2] if remat in (RAGGED_REMAT, COMPARED_REMAT) else [1])
    for r in rows:  # (a random policy scores 0 everywhere: all-equal groups, whose PACS gradient is 0)
        assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) and r["skipped"] == 0.0
        assert r["generated_tokens"] > 0
        if remat != RAGGED_REMAT:
            assert r["prompt_bucket"] == 128 and r["response_bucket"] == 8
    assert all(r["compilations"] == rows[0]["compilations"] for r in rows)  # none after step 1 (the 2-step runs)


@pytest.mark.slow(seconds=10)  # the matrix's RAGGED_REMAT run
def test_no_compilation_after_the_first_step_on_ragged_prompts(matrix_runs):
    """The matrix's RAGGED_REMAT run, 2 steps of 2 real prompts each: the prompt bucket changes from the
    small one (256) at step 1 to the large one (512) at step 2, where a program compiled on first use
    would show, yet every program was compiled before step 1."""
    rows = matrix_runs(RAGGED_REMAT)
    buckets = [r["prompt_bucket"] for r in rows]
    assert buckets == [256, 512], buckets  # ragged indeed, small first
    assert {r["response_bucket"] for r in rows} == {16}
    assert [r["compilations"] for r in rows] == [rows[0]["compilations"]] * 2


@pytest.mark.slow(seconds=30)
def test_the_continuous_and_the_static_sampler_train_alike(matrix_runs):
    """The shrunk qwen25_3b PACS setup (the matrix's float32 COMPARED_REMAT run), 2 steps, with 8 decode
    slots (one per batch shard: each takes its prompt's 8 responses one after another) and with one
    slot per response: the same sampled tokens and the same per-step metrics; only the decode steps and
    the slot utilisation differ."""
    assert MATRIX_DTYPE[COMPARED_REMAT] == "float32"
    rows = {sampler: matrix_runs(COMPARED_REMAT, sampler) for sampler in ("continuous", "static")}
    for continuous, static in zip(rows["continuous"], rows["static"], strict=True):
        for key in ("sampled_tokens_checksum", "generated_tokens", "response_length_mean", "truncated_fraction", "loss",
                    "grad_norm", "entropy", "reward_mean"):
            assert continuous[key] == pytest.approx(static[key], rel=1e-5, abs=1e-6), key
        assert continuous["decode_steps"] > static["decode_steps"]  # 8 responses a slot in turn
        assert 0 < continuous["slot_utilisation"] <= 1 and 0 < static["slot_utilisation"] <= 1
    assert rows["continuous"][1]["compilations"] == rows["continuous"][0]["compilations"]  # none after step 1


@pytest.mark.slow(seconds=60)
def test_the_demo_trains_alike_with_every_sampler(tmp_path):
    """The demo (configs/default.py) shrunk to 2 RL steps of 8 prompts x 8 responses (no warm-start: its
    few steps would leave the model as random as it starts), with 16 decode slots (2 per batch shard of
    its 8-way data mesh) narrowing to 8 (1 a shard) in each call's tail, the same over a page pool per
    shard (the paged sampler, 16-token pages), and with one slot per response: the same per-step metrics but the sampler's own (decode steps, slot utilisation, times),
    and the sampler's log-probs within 1e-4 of pi_old's (float32)."""
    rows = {}
    for sampler in ("continuous", "paged", "static"):
        config = load_config("default.py")
        config.model.num_hidden_layers, config.warmstart.steps = 1, 0
        config.data.arithmetic.problems, config.data.warmstart_problems, config.data.held_out_problems = 64, 0, 8
        config.train.steps, config.train.prompts_per_step, config.train.mini_batches = 2, 8, 2
        config.train.checkpoint_every, config.reward.workers, config.eval.sets = 0, 1, ""
        config.rollout.sampler, config.rollout.slots = sampler, 16
        config.rollout.tail_slots = 0 if sampler == "static" else 8  # the static sampler never narrows
        validate_config(config)
        with jax.set_mesh(config_mesh(config.mesh)):
            run_training(config, tmp_path / sampler)
        rows[sampler] = [json.loads(line) for line in (tmp_path / sampler / "metrics.jsonl").read_text().splitlines()]
    sampler_own = {"decode_steps", "slot_utilisation", "compilations", "tokens_per_second",
                   *rollout_consistency.METRICS}  # round-off, which the sampler's batch widths shape
    for row in rows["continuous"] + rows["paged"] + rows["static"]:  # float32: the sampler's log-probs are pi_old's
        assert 0 <= row["rollout_kl"] <= row["rollout_logprob_diff_mean"] <= row["rollout_logprob_diff_max"] < 1e-4
    for continuous, paged, static in zip(rows["continuous"], rows["paged"], rows["static"]):
        assert continuous.keys() == paged.keys() == static.keys()
        for key in continuous.keys() - sampler_own:
            if not key.startswith("time_") and not key.startswith("reward_seconds"):
                assert continuous[key] == pytest.approx(static[key], rel=1e-5, abs=1e-6), key
                assert paged[key] == pytest.approx(static[key], rel=1e-5, abs=1e-6), key
    assert [r["step"] for r in rows["continuous"]] == [1, 2]
