"""The paper's setups, shrunk as in test_train_real_config.py (a tiny random Qwen of each model's
family with the Qwen tokenizer cut to 4,096 entries, conftest.py's small_tokenizer_dir, and DeepScaleR rows):
each MODEL of configs/paper.py takes a step at its own remat, dtype and tensor axis on the 8-device CPU mesh (the
qwen25_7b run evaluated before and after RL as the paper's tables are); and the compiled pi_old and
update programs hold no [B, H, T, T] or [B, T, V] buffer and do not grow with depth."""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from pacs_jax import models
from pacs_jax.rewards import RewardPool
from pacs_jax.rl import get_objective, options_for
from pacs_jax.sharding import config_mesh
from pacs_jax.training.config_check import validate_config
from pacs_jax.training.run import run_training
from pacs_jax.training.step_programs import StepPrograms
from pacs_jax.training.spec import RunSpec
from test_paper_ablations import authors_pacs_loss  # the float64 statement of the authors' compute_pacs_loss
from test_train_config import load_config
from test_train_real_config import deepscaler_rows, one_prompt_bucket, shrunk_paper_config  # noqa: F401 (a fixture)


def setup_config(data_file, tokenizer_dir, arg: str):
    """The shrunk 1-step config of paper setup ``arg``: its remat, bf16 and its tensor axis (4 for the
    7B / 8B meshes) kept, fsdp reduced to fill the 8 test devices; prompts of the 128-token bucket and
    responses of 8 tokens (the step's time goes with the rows' length)."""
    config = shrunk_paper_config(data_file, tokenizer_dir, steps=1, arg=arg)
    tensor = load_config("paper.py", arg).mesh.tensor
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 8 // tensor, tensor
    config.rollout.max_new_tokens = 8
    one_prompt_bucket(config, 128).rollout.response_buckets = (8,)
    return config


def test_the_v6e_setup_shrunk_is_the_7b_setup_shrunk(tmp_path):
    """qwen25_7b_v6e differs from qwen25_7b only in its mesh's fsdp (16, for 64 chips) and in the
    micro-batch counts that the shrinking replaces: shrunk to 8 devices the two are one config (but
    for the workdir's name), so the qwen25_7b run below trains it too."""
    v5p, v6e = (load_config("paper.py", f"{m},pacs_beta1") for m in ("qwen25_7b", "qwen25_7b_v6e"))
    assert (v5p.mesh.fsdp, v6e.mesh.fsdp, v5p.mesh.tensor, v6e.mesh.tensor) == (8, 16, 4, 4)
    a, b = (setup_config(tmp_path / "math.json", tmp_path, f"{m},pacs_beta1").to_dict()
            for m in ("qwen25_7b", "qwen25_7b_v6e"))
    assert (a.pop("workdir"), b.pop("workdir")) == ("workdir/qwen25_7b_pacs_beta1", "workdir/qwen25_7b_v6e_pacs_beta1")
    assert a == b


# The setup whose run is also evaluated as the paper's tables are (configs/paper_evaluation.py), below
EVALUATED = "qwen25_7b,pacs_beta1"
# The Qwen3-4B setup's run: the most distinct PACS ablation (reward_method '2'), which the ablation test below
# reads to show that the option reached the trainer's loss
REWARD2 = "qwen3_4b,pacs_beta1_reward2"


@pytest.fixture(scope="module")
def setup_runs(deepscaler_rows, small_tokenizer_dir, tmp_path_factory):
    """run(arg): (summary, the metrics rows, the workdir, the reward calls) of setup_config's 1-step run
    of ``arg``, trained once a module. EVALUATED's run evaluates 2 problems of AMC23 and GSM8K before RL
    and after, at the paper's per-set settings (1 token a sample); the reward calls are the (number of
    texts, reward names) of its every RewardPool.score."""
    done: dict[str, tuple] = {}

    def run(arg: str) -> tuple:
        if arg not in done:
            config = setup_config(deepscaler_rows, small_tokenizer_dir, arg)
            reference = load_config("paper.py", arg)
            assert (config.model.remat, config.model.dtype) == (reference.model.remat, reference.model.dtype) == \
                ("dots_with_no_batch_dims_saveable", "bfloat16")
            if arg == EVALUATED:
                _evaluate_as_the_paper(config)
            validate_config(config)
            mesh = config_mesh(config.mesh)
            tensor = reference.mesh.tensor
            assert dict(mesh.shape) == {"data": 1, "fsdp": 8 // tensor, "tensor": tensor}
            workdir = tmp_path_factory.mktemp(arg.replace(",", "_"))
            scored = []
            real_score = RewardPool.score

            def recording_score(self, texts, golds, reward, *args, **kwargs):
                scored.append((len(texts), tuple(sorted(set([reward] if isinstance(reward, str) else reward)))))
                return real_score(self, texts, golds, reward, *args, **kwargs)

            with pytest.MonkeyPatch.context() as patch, jax.set_mesh(mesh):
                patch.setattr(RewardPool, "score", recording_score)
                summary = run_training(config, workdir)
            rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
            done[arg] = summary, rows, workdir, scored
        return done[arg]

    return run


def _evaluate_as_the_paper(config) -> None:
    """EVALUATED's evaluation: AMC23 with its 256 samples per problem and GSM8K with the final default
    32, 2 problems a set (the 2 batch shards of its (1, 2, 4) mesh: both queues busy), one token a
    sample (the samples and their scoring, not their decoding, are what is checked). That token is
    each row's prefill token, so the decode batch's narrowing in the tail is left off (eval.tail_slots
    0): the config's 7 widths, 256 down to 32 slots, would add 7 decode loops to compile (18 of this
    run's 81 CPU seconds) for rows that decode nothing; test_sampling_continuous.py checks narrowing."""
    assert config.eval.before_rl and config.eval.final.per_set.amc23.n == 256 and config.reward.mode == "paper"
    config.eval.sets, config.eval.max_problems, config.eval.max_new_tokens = "amc23,gsm8k", 2, 1
    config.eval.final.per_set.amc23.max_new_tokens = 1
    assert config.eval.tail_slots == 32
    config.eval.tail_slots = 0
    config.reward.item_timeout = 2.0
    config.eval.periodic.every = 0


@pytest.mark.slow(seconds=50)
@pytest.mark.parametrize("arg", [EVALUATED, REWARD2, "qwen3_8b,pacs_beta1", "qwen25_3b,grpo", "qwen25_7b_lora,pacs_beta1",
                                 "qwen3_30b_a3b,pacs_beta1", "qwen3_30b_a3b_lora,pacs_beta1"])
def test_every_paper_setup_takes_a_step_at_its_own_remat_dtype_and_tensor_axis(setup_runs, arg):
    """Each MODEL of configs/paper.py (and the GRPO baseline), shrunk: its remat, bf16 and its tensor
    axis (4 for the 7B / 8B meshes) kept, fsdp reduced to fill the 8 test devices (qwen25_7b_v6e is
    qwen25_7b then: see above; qwen25_3b with PACS trains in test_train_real_config.py, with PPO in
    test_train_ppo.py); qwen25_7b_lora trains its rank-32 adapters alone (the checkpoint holds them); the 30B's
    two setups (issue 66) with configs/paper.py's CPU-scale experts, its LoRA twin's adapters on the experts too."""
    summary, rows, workdir, _ = setup_runs(arg)
    (row,) = rows
    assert summary["final_step"] == 1 and row["skipped"] == 0.0
    assert np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]) and row["generated_tokens"] > 0
    assert 0 <= row["rollout_logprob_diff_mean"] <= row["rollout_logprob_diff_max"] < 1  # bfloat16: round-off
    moe = arg.startswith("qwen3_30b_a3b")
    if moe:  # the model that ran has the experts of configs/paper.py's CPU scale, its routing measured
        model = json.loads((workdir / "config.json").read_text())["model"]
        assert (model["model_type"], model["num_experts"], model["num_experts_per_tok"]) == ("qwen3_moe", 4, 2)
        assert 0 <= row["routing_mismatch_tokens"] <= 1, row
    if "lora" in arg:
        reference = load_config("paper.py", arg).model
        named = json.loads((workdir / "checkpoints" / "model_config.json").read_text())["pacs_jax"]["lora"]
        assert (named["rank"], named["alpha"]) == (reference.lora_rank, reference.lora_alpha) == (32, 64.0)
        stored = ocp.StandardCheckpointer().metadata(workdir / "checkpoints" / "1" / "params").item_metadata
        # the 7B: every linear layer (7); the 30B: its attention's four and each expert's gate_up and down
        adapted = ("q", "k", "v", "o", "gate_up", "down") if moe else ("q", "k", "v", "o", "gate", "up", "down")
        assert sorted(stored) == sorted(f"layers.{'mlp' if m in ('gate', 'up', 'down', 'gate_up') else 'attn'}."
                                        f"{m}_lora.{f}" for m in adapted for f in "ab"), sorted(stored)


@pytest.mark.slow(seconds=40)  # the evaluation of the qwen25_7b run
def test_paper_evaluation_draws_each_sets_own_samples_before_and_after_rl(setup_runs):
    """The shrunk qwen25_7b setup's run (above, at its own remat, bf16 and mesh), evaluated as the
    paper's tables are (configs/paper_evaluation.py): AMC23 with its 256 samples per problem (pass@256 in
    eval_metrics.json) and GSM8K with the final default 32, before RL (the "Base" row, on by default) and
    after; every sample of every set scored by the authors' math-verify call ("paper"), GSM8K included."""
    _, _, workdir, scored = setup_runs(EVALUATED)
    for name in ("before_rl", "final"):
        metrics = json.loads((workdir / "eval" / name / "eval_metrics.json").read_text())
        assert "pass@256" in metrics["amc23"] and "mean@256" in metrics["amc23"], metrics["amc23"]
        assert "pass@32" in metrics["gsm8k"] and "pass@64" not in metrics["gsm8k"], metrics["gsm8k"]
        rows = [json.loads(line) for line in (workdir / "eval" / name / "eval_samples.jsonl").read_text().splitlines()]
        assert sorted(len(r["samples"]) for r in rows) == [32] * 2 + [256] * 2
    evaluation_calls = [names for count, names in scored if count in (2 * 32, 2 * 256)]
    assert len(evaluation_calls) == 4 and all(names == ("paper",) for names in evaluation_calls), scored


# ------------------------------------------------------------------------------------ PACS ablations
# The ablations of configs/paper.py, written out here rather than read from it: pacs_beta1 (the authors'
# scripts/pacs/pacs_beta_1.0.sh) with one option of their src/pacs/pacs_core_algos.py changed.
ABLATIONS = {
    "pacs_beta1_only_positive": dict(weight_mode="only_positive"),
    "pacs_beta1_only_negative": dict(weight_mode="only_negative"),
    "pacs_beta1_reward2": dict(reward_method="2"),
    "pacs_beta1_grpo_adv": dict(adv_estimator="grpo"),
    "pacs_beta1_naive_adv": dict(adv_estimator="naive"),
}
PACS_BETA1 = dict(beta=1.0, use_weight=True, weight_mode="question", reward_method="1", adv_estimator="rloo")


def test_every_pacs_ablation_is_a_named_setup_whose_options_reach_the_objective(deepscaler_rows, small_tokenizer_dir,
                                                                                  tmp_path):
    """Each ablation is its own ALGO of configs/paper.py: pacs_beta1 with its one option changed and
    nothing else (workdir named after it), valid, and what the trainer hands the objective registry
    (``options_for``, as training/step_programs.py does) gives the authors' loss for that option: on a batch
    where every option changes the loss, so that a dropped or misspelt option fails."""
    import configs.paper

    assert set(ABLATIONS) < set(configs.paper.ALGORITHMS)
    base = load_config("paper.py", "qwen25_7b,pacs_beta1").to_dict()
    assert dict(base["algorithm"]["pacs"]) == PACS_BETA1
    rng = np.random.default_rng(0)
    n, B, T = 4, 12, 6
    logp = rng.normal(-1.5, 0.6, (B, T))
    old_logp = logp + rng.normal(0.0, 0.5, (B, T))
    mask = (np.arange(T)[None, :] < rng.integers(2, T + 1, B)[:, None]).astype(np.float32)
    labels = np.array([1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0], np.float32)  # groups of 1/4, 3/4 and 0/4 right
    losses = {}
    for name in ["pacs_beta1", *ABLATIONS]:
        config = load_config("paper.py", f"qwen25_7b,{name}")
        flat = config.to_dict()
        assert flat.pop("workdir") == f"workdir/qwen25_7b_{name}"
        expected = {k: v for k, v in base.items() if k != "workdir"}
        options = dict(PACS_BETA1, **ABLATIONS.get(name, {}))
        expected["algorithm"] = dict(base["algorithm"], pacs=options)
        assert flat == expected, name
        validate_config(setup_config(deepscaler_rows, small_tokenizer_dir, f"qwen25_7b,{name}"))  # as the runs above
        bound = options_for(config.algorithm)
        assert bound == options
        loss, _ = get_objective("pacs", **bound)(jnp.asarray(logp, jnp.float32), jnp.asarray(old_logp, jnp.float32),
                                                  jnp.asarray(mask), jnp.asarray(labels), n)
        losses[name] = float(loss)
        np.testing.assert_allclose(losses[name], authors_pacs_loss(logp, old_logp, mask, labels, n, **options),
                                   rtol=2e-5, err_msg=name)
    values = sorted(losses.values())
    assert all(b - a > 1e-3 for a, b in zip(values, values[1:])), losses  # each option changes the loss


def test_the_reward_method_2_ablation_trains_shrunk(setup_runs):
    """The most distinct ablation, the shrunk qwen3_4b setup's run above: reward_method '2' is the only PACS
    proxy that reads no pi_old (beta times the mean log-prob of the response), so its proxy is far below 0
    from the first mini-batch on a random model (method '1' starts at exactly 0), which shows the option
    reached the trainer's loss; the other ablations change only the loss's arithmetic, checked against the
    authors' formula above."""
    summary, rows, workdir, _ = setup_runs(REWARD2)
    assert json.loads((workdir / "config.json").read_text())["algorithm"]["options"]["reward_method"] == "2"
    (row,) = rows
    assert summary["final_step"] == 1 and row["skipped"] == 0.0
    assert np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    assert row["pacs/reward_proxy_mean"] < -1.0, row  # beta * mean log pi over a 4,096-token vocabulary (~ -8.3)


# ------------------------------------------------------------------------------------ compiled programs
P_LEN, R_LEN, BLOCK, N, PROMPTS = 128, 64, 32, 4, 4  # T = 192 = 6 attention blocks


def _programs(num_layers: int, remat: str = "dots_with_no_batch_dims_saveable"):
    """(pi_old HLO, update HLO, model config) of the trainer's own programs for a tiny real-vocabulary
    model on the (1, 8, 1) mesh: 4 prompts x 4 responses, prompt 128 + response 64 tokens."""
    cfg = models.QwenConfig(model_type="qwen2", vocab_size=151936, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            dtype="bfloat16", remat=remat, attention="xla", attention_block_size=BLOCK)
    mesh = jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    with jax.set_mesh(mesh):
        return _compiled_programs(cfg)


def _compiled_programs(cfg):
    graphdef, params = models.abstract_model(cfg)
    config = load_config("default.py")
    config.rollout.update(n=N, max_new_tokens=R_LEN, temperature=1.0)
    config.data.max_prompt_length, config.data.prompt_buckets = P_LEN, (P_LEN,)
    config.train.update(prompts_per_step=PROMPTS, mini_batches=2, micro_batches=2, logprob_micro_batches=2)
    config.optim.update(lr=1e-6, grad_clip=0.0)
    programs = {p.name: p for p in StepPrograms(RunSpec.unplaced(config), graphdef, params, ()).programs()}
    old = programs["pi_old"].lower().compile().as_text()
    new = programs["update"].lower().compile().as_text()
    return old, new, cfg


def _shapes(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\b(?:f32|bf16|s32|pred)\[([\d,]*)\]", hlo)]


def _instructions(hlo: str) -> int:
    return sum(1 for line in hlo.splitlines() if re.match(r"\s*(ROOT )?%\S+ = ", line))


@pytest.fixture(scope="module")
def compiled_programs():
    return {layers: _programs(layers) for layers in (2, 8)}


@pytest.mark.slow(seconds=70)  # the fixture's compilations (2 and 8 layers)
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
