"""The paper's configs, shrunk (issue: real scale): a tiny random Qwen with the real vocabulary, the
real tokenizer and the DeepScaleR subset prompts, under the config's own remat, dtype and mesh on the
8-device CPU mesh. Trains under every remat policy in bf16 and fp32; compiles nothing after the
first step on ragged prompts; and the compiled pi_old and update programs hold no [B, H, T, T] or
[B, T, V] buffer and do not grow with depth."""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from pacs_jax import models, sampling
from pacs_jax.models.config import REMAT_POLICIES
from pacs_jax.sharding import MeshRules, config_mesh
from pacs_jax.training.config_check import validate_config
from pacs_jax.training.optim import make_optimizer
from pacs_jax.training.real_run import run_training
from pacs_jax.training.rollout import RolloutCollector
from pacs_jax.training.update_step import make_update_step
from test_train_config import load_config

TINY = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=0)  # vocab 0: the real tokenizer's


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
    model of its family, 4 prompts x 8 responses of at most 16 tokens, 2 mini-batches of 2
    micro-batches (8 rows: one per batch shard)."""
    c = load_config("paper.py", arg)
    family = "qwen3" if c.model.preset.startswith("Qwen3") else "qwen2"
    c.model.preset = ""
    for k, v in TINY.items():
        c.model[k] = v
    c.model.model_type = family
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


def _train(config, workdir) -> list[dict]:
    validate_config(config)
    mesh = config_mesh(config.mesh)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}  # the paper's (-1, 8, 1) on 8 devices
    summary = run_training(config, workdir, mesh)
    assert summary["final_step"] == config.train.steps
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("remat", REMAT_POLICIES)
def test_paper_config_trains_under_every_remat_policy_and_dtype(deepscaler_rows, qwen_tokenizer_dir, tmp_path, dtype,
                                                               remat):
    config = shrunk_paper_config(deepscaler_rows, qwen_tokenizer_dir, steps=2, dtype=dtype, remat=remat)
    config.data.prompt_buckets = (512,)  # one bucket per program: 8 configurations to compile
    config.rollout.response_buckets = (16,)
    rows = _train(config, tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # (a random policy scores 0 everywhere: all-equal groups, whose PACS gradient is 0)
        assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) and r["skipped"] == 0.0
        assert r["generated_tokens"] > 0 and r["prompt_bucket"] == 512 and r["response_bucket"] == 16
    assert rows[1]["compilations"] == rows[0]["compilations"]


def test_no_compilation_after_the_first_step_on_ragged_prompts(deepscaler_rows, qwen_tokenizer_dir, tmp_path):
    """5 steps of 2 real prompts each: the prompt bucket (256 or 512) changes between steps and so
    does the response bucket (8 or 16), yet every program was compiled before step 1."""
    config = shrunk_paper_config(deepscaler_rows, qwen_tokenizer_dir, steps=5, dtype="float32", remat="full")
    config.train.prompts_per_step, config.train.mini_batches, config.train.micro_batches = 2, 1, 2
    config.rollout.response_buckets = (8, 16)
    config.data.shuffle_seed = 3
    rows = _train(config, tmp_path)
    assert len({r["prompt_bucket"] for r in rows}) == 2, [r["prompt_bucket"] for r in rows]  # ragged indeed
    assert [r["compilations"] for r in rows] == [rows[0]["compilations"]] * 5


@pytest.mark.parametrize("arg", ["qwen25_7b,pacs_beta1", "qwen3_4b,pacs_beta2_noweight", "qwen3_8b,pacs_beta1",
                                 "qwen25_7b_v6e,pacs_beta1", "qwen25_3b,grpo"])
def test_every_paper_setup_takes_a_step_at_its_own_remat_dtype_and_tensor_axis(deepscaler_rows, qwen_tokenizer_dir,
                                                                                 tmp_path, arg):
    """Each MODEL of configs/paper.py (and the GRPO baseline), shrunk: its remat, bf16 and its tensor
    axis (4 for the 7B / 8B meshes) kept, fsdp reduced to fill the 8 test devices."""
    config = shrunk_paper_config(deepscaler_rows, qwen_tokenizer_dir, steps=1, arg=arg)
    reference = load_config("paper.py", arg)
    assert (config.model.remat, config.model.dtype) == (reference.model.remat, reference.model.dtype) == \
        ("dots_with_no_batch_dims_saveable", "bfloat16")
    tensor = reference.mesh.tensor
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 8 // tensor, tensor
    config.data.prompt_buckets, config.rollout.response_buckets = (512,), (16,)
    validate_config(config)
    mesh = config_mesh(config.mesh)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8 // tensor, "tensor": tensor}
    summary = run_training(config, tmp_path, mesh)
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["final_step"] == 1 and row["skipped"] == 0.0
    assert np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]) and row["generated_tokens"] > 0


# ------------------------------------------------------------------------------------ compiled programs
P_LEN, R_LEN, BLOCK, N, PROMPTS = 128, 64, 32, 4, 4  # T = 192 = 6 attention blocks


def _programs(num_layers: int, remat: str = "dots_with_no_batch_dims_saveable"):
    """(pi_old HLO, update HLO, model config) of the trainer's own programs for a tiny real-vocabulary
    model on the (1, 8, 1) mesh: 4 prompts x 4 responses, prompt 128 + response 64 tokens."""
    cfg = models.QwenConfig(model_type="qwen2", vocab_size=151936, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            dtype="bfloat16", remat=remat, attention="xla", attention_block_size=BLOCK)
    mesh = jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    graphdef, state = models.abstract_model(cfg, mesh)
    params = jax.tree.map(lambda v: v, nnx.state(state))
    rules = MeshRules(mesh)
    collector = RolloutCollector(graphdef, rules, sampling.SamplingSettings(max_new_tokens=R_LEN, n=N, temperature=1.0),
                                 decode=str, reward_pool=None, reward_name="math", prompt_buckets=(P_LEN,),
                                 logprob_micro_batches=2)
    abstract = jax.tree.map(lambda v: v.get_value() if hasattr(v, "get_value") else v, params,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))
    prompts = collector._abstract((PROMPTS, P_LEN), jnp.int32)
    responses = collector._abstract((PROMPTS * N, R_LEN), jnp.int32)
    old = collector._prepare.lower(abstract, prompts, prompts, responses, responses).compile().as_text()
    optimizer, _ = make_optimizer(1e-6)
    opt_state = jax.eval_shape(optimizer.init, abstract)
    update = make_update_step(graphdef, optimizer, "pacs", group_size=N, num_mini_batches=2, num_micro_batches=2,
                              rules=rules)
    batch = collector.abstract_batches(PROMPTS)[0]
    new = update.lower(abstract, opt_state, batch).compile().as_text()
    return old, new, cfg


def _shapes(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\b(?:f32|bf16|s32|pred)\[([\d,]*)\]", hlo)]


def _instructions(hlo: str) -> int:
    return sum(1 for line in hlo.splitlines() if re.match(r"\s*(ROOT )?%\S+ = ", line))


@pytest.fixture(scope="module")
def compiled_programs():
    return {layers: _programs(layers) for layers in (2, 8)}


def test_pi_old_and_update_hold_no_attention_matrix_nor_full_logits(compiled_programs):
    old, new, cfg = compiled_programs[2]
    T, B, H, V = P_LEN + R_LEN, PROMPTS * N, cfg.num_attention_heads, cfg.vocab_size
    for name, hlo in (("pi_old", old), ("update", new)):
        shapes = _shapes(hlo)
        assert shapes, name
        no_vocab = [s for s in shapes if V not in s]
        square = [s for s in no_vocab if sum(d >= T for d in s) >= 2]
        assert not square, f"{name}: buffers with two sequence-length axes {square[:3]}"
        assert not [s for s in no_vocab if math.prod(s) >= B * H * T * T // 8], name  # not an eighth of [B, H, T, T]
        assert not [s for s in shapes if math.prod(s) >= B * R_LEN * V], f"{name}: a [B, T, V] buffer"
        assert [s for s in shapes if V in s], f"{name}: the checker sees vocabulary-sized buffers"


def test_program_size_does_not_grow_with_depth(compiled_programs):
    for index, name in ((0, "pi_old"), (1, "update")):
        two, eight = _instructions(compiled_programs[2][index]), _instructions(compiled_programs[8][index])
        assert abs(eight - two) <= 0.1 * two, f"{name}: {two} HLO instructions for 2 layers, {eight} for 8"
