"""``python -m pacs_jax.evaluate`` end to end: a random tiny Qwen2 (transformers) on 20 MATH-500 problems."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from math_verify import parse, verify

from pacs_jax.rewards import STATUSES
from train_helpers import SMALL_TOKENIZER_SIZE, train_env

REPO = pathlib.Path(__file__).resolve().parents[1]
N, PROBLEMS, NEW_TOKENS = 4, 20, 8


@pytest.fixture(scope="module")
def tiny_qwen_dir(tmp_path_factory, small_tokenizer_dir) -> pathlib.Path:
    """A random-weight Qwen2 whose vocabulary is the Qwen tokenizer cut to 4,096 entries (conftest.py's
    small_tokenizer_dir; the evaluation is not about the vocabulary), with the tokenizer files beside it."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(small_tokenizer_dir)
    end, text_end = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=SMALL_TOKENIZER_SIZE, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True, max_position_embeddings=1024, eos_token_id=end,
                                      bos_token_id=text_end)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    for name in os.listdir(small_tokenizer_dir):
        shutil.copy(small_tokenizer_dir / name, path / name)
    return path


def test_evaluate_cli_writes_both_files(tiny_qwen_dir, shared_data, tmp_path):
    out = tmp_path / "eval"
    env = train_env()  # one CPU device: fast on 2 cores
    result = subprocess.run(
        [sys.executable, "-m", "pacs_jax.evaluate", f"--config={REPO / 'configs' / 'eval.py'}",
         f"--checkpoint={tiny_qwen_dir}", "--config.eval.sets=math_500", f"--config.eval.max_problems={PROBLEMS}",
         f"--config.eval.final.n={N}", f"--config.eval.max_new_tokens={NEW_TOKENS}", "--config.eval.final.temperature=1.0",
         "--config.eval.final.top_p=1.0",  # top_p < 1 sorts the vocabulary per step
         "--config.model.dtype=float32", f"--config.eval.data_dir={shared_data}",
         f"--config.evaluate.output_dir={out}", "--config.eval.batch_size=20", "--config.reward.workers=1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{PROBLEMS}/{PROBLEMS}" in result.stderr  # the progress bar reached the end

    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    truth = [json.loads(line) for line in (shared_data / "math_500" / "test.jsonl").read_text().splitlines()]
    assert len(rows) == PROBLEMS
    for row, original in zip(rows, truth):
        assert row["data_source"] == "math_500"
        assert (row["problem"], row["ground_truth"]) == (original["problem"], original["answer"])
        assert row["extra"]["unique_id"] == original["unique_id"]
        assert len(row["samples"]) == N
        for sample in row["samples"]:
            assert set(sample) == {"response", "score", "status", "finish_reason", "num_tokens"}
            assert isinstance(sample["response"], str) and sample["status"] in STATUSES
            assert sample["finish_reason"] in ("stop", "length") and 1 <= sample["num_tokens"] <= NEW_TOKENS
            reference = float(verify(parse("\\boxed{" + row["ground_truth"] + "}"), parse(sample["response"])))
            assert sample["score"] == reference
        assert row["num_correct"] == sum(s["score"] for s in row["samples"])
    assert len({s["response"] for row in rows for s in row["samples"]}) > PROBLEMS  # sampled, not one repeated text

    metrics = json.loads((out / "eval_metrics.json").read_text())
    assert list(metrics) == ["math_500"]
    assert set(metrics["math_500"]) == {"pass@1", "pass@2", "pass@4", f"mean@{N}"}
    for k in (1, 2, 4):
        expected = sum(1 - math.comb(N - r["num_correct"], k) / math.comb(N, k) for r in rows) / PROBLEMS
        assert metrics["math_500"][f"pass@{k}"] == pytest.approx(expected, abs=1e-12)
    assert metrics["math_500"][f"mean@{N}"] == pytest.approx(sum(r["num_correct"] for r in rows) / (N * PROBLEMS))
    assert (out / "pass_at_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left behind


@pytest.fixture(scope="module")
def answers_seven_dir(tmp_path_factory, small_tokenizer_dir) -> pathlib.Path:
    """A Qwen2 whose every response is "7": attention and MLP outputs are zero (o_proj, down_proj = 0),
    so the last hidden state is the last token's embedding, and the LM head maps the embedding of the
    prompt's last token (the assistant header's newline) to the token "7" and that of "7" to <|im_end|>
    (the Qwen tokenizer cut to 4,096 entries, conftest.py's small_tokenizer_dir, as its vocabulary)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(small_tokenizer_dir)
    newline, seven = tokenizer.encode("\n")[0], tokenizer.encode("7")[0]
    end, text_end = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = transformers.Qwen2Config(vocab_size=SMALL_TOKENIZER_SIZE, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False, max_position_embeddings=4096, eos_token_id=end,
                                      bos_token_id=text_end)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, 2] = 1.0          # every other token: direction 2 (maps to no particular token)
        embed[newline] = 0.0
        embed[newline, 0] = 1.0    # "\n" -> direction 0
        embed[seven] = 0.0
        embed[seven, 1] = 1.0      # "7" -> direction 1
        head = model.lm_head.weight
        head.zero_()
        head[seven, 0] = 20.0      # after "\n": "7" by a logit margin of 20 * sqrt(32) ~ 113
        head[end, 1] = 20.0        # after "7": <|im_end|>
    path = tmp_path_factory.mktemp("answers_seven")
    model.save_pretrained(path)
    for name in os.listdir(small_tokenizer_dir):
        shutil.copy(small_tokenizer_dir / name, path / name)
    return path


def test_evaluate_cli_pass_at_k_on_known_scores(answers_seven_dir, tmp_path):
    """Every response is "7", so a problem's samples are all right or all wrong and pass@k is, for every
    k, the fraction of problems whose answer equals 7 (in any form the verifier accepts)."""
    data_dir, out = tmp_path / "sets", tmp_path / "eval"
    math_answers = ["7", "\\frac{14}{2}", "7.0", "5", "-7"]   # right, right (= 7), right, wrong, wrong
    amc_answers = [7.0, 3.0, 49.0, 7]                         # right, wrong, wrong, right
    for name, answers, key in (("math_500", math_answers, "problem"), ("amc23", amc_answers, "question")):
        (data_dir / name).mkdir(parents=True)
        rows = [{key: f"Problem {i}: what is the answer?", "answer": a} for i, a in enumerate(answers)]
        (data_dir / name / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = train_env()
    result = subprocess.run(
        [sys.executable, "-m", "pacs_jax.evaluate", f"--config={REPO / 'configs' / 'eval.py'}",
         f"--checkpoint={answers_seven_dir}", "--config.eval.sets=math_500,amc23", f"--config.eval.final.n={N}",
         "--config.eval.max_new_tokens=4", "--config.eval.final.temperature=1.0", "--config.eval.final.top_p=1.0",
         "--config.model.dtype=float32", f"--config.eval.data_dir={data_dir}", f"--config.evaluate.output_dir={out}",
         "--config.reward.workers=1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert {s["response"] for row in rows for s in row["samples"]} == {"7"}
    assert [row["num_correct"] for row in rows] == [N, N, N, 0, 0] + [N, 0, 0, N]
    metrics = json.loads((out / "eval_metrics.json").read_text())
    assert metrics == {"math_500": {"pass@1": 0.6, "pass@2": 0.6, "pass@4": 0.6, "mean@4": 0.6},
                       "amc23": {"pass@1": 0.5, "pass@2": 0.5, "pass@4": 0.5, "mean@4": 0.5}}


def test_bad_config_names_the_field(tiny_qwen_dir, shared_data, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pacs_jax.evaluate", f"--config={REPO / 'configs' / 'eval.py'}",
         f"--checkpoint={tiny_qwen_dir}", "--config.eval.sets=math_501", f"--config.eval.data_dir={shared_data}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 78 and "Traceback" not in result.stderr, result.stderr[-3000:]  # one line (issue 41)
    assert result.stderr.strip().splitlines()[-1].startswith(
        "pacs_jax.evaluate: error: config.eval.sets: evaluation set 'math_501' has no entry in config.eval.set_files")


def test_checkpoint_without_tokenizer_files(tiny_qwen_dir, tmp_path, shared_data):
    import importlib.util

    from pacs_jax import evaluate

    spec = importlib.util.spec_from_file_location("eval_config", REPO / "configs" / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.eval.data_dir = str(shared_data)
    config.eval.sets = "amc23"
    for name in ("config.json", "model.safetensors"):  # the model without its tokenizer files
        shutil.copy(tiny_qwen_dir / name, tmp_path / name)
    with pytest.raises(ValueError, match="no tokenizer files .* pass --config.data.tokenizer=DIR"):
        evaluate.run(config, tmp_path)
