"""CI: the README's runtime install (requirements.txt alone, no test extras) trains and evaluates a real-tokenizer run.

    python .ci/runtime_check.py [KEEP_DIR]   # in a virtual environment made with `pip install -r requirements.txt -e .`

The test requirements pull in torch, and torch pulls in jinja2 and others that the trainer needs at run
time: the test suite alone would never notice a runtime requirement missing from requirements.txt. So,
in an environment without torch (it refuses to run where torch is installed), this check

1. renders and tokenizes one chat prompt with the shipped Qwen tokenizer (data/tokenizers/qwen3)
   through the trainer's own code (pacs_jax/data/prompts.py: apply_chat_template, jinja2);
2. runs the trainer CLI, ``python -m pacs_jax.train --config=configs/default.py``, shrunk to seconds
   (TRAIN_OVERRIDES) with the Qwen tokenizer in place of the demo's character tokenizer: a warm-start
   of 2 steps, an evaluation before RL, 2 PACS steps, the final evaluation, the HF export; and checks
   summary.json (its accuracies), the checkpoint and hf_export/ (weights, config and the tokenizer's
   files, which load and render the chat prompt again);
3. runs the evaluation CLI, ``python -m pacs_jax.evaluate --config=configs/eval.py --checkpoint=WORKDIR``
   (EVAL_OVERRIDES: the run's held-out problems and 2 AMC23 problems, 2 samples each), and checks its
   eval_metrics.json and eval_samples.jsonl.

Everything runs on the CPU (JAX_PLATFORMS=cpu), in a temporary folder (or KEEP_DIR, kept). 54-75 s measured
on a 2-core machine shared with a benchmark (the trainer 42-55 s, the evaluator 10-17 s); the install
before it took 73 s. Prints one line per stage; exits 0 on success, 1 (with the failing
command's output) on any failure.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizers" / "qwen3"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")  # what data/tokenizers/qwen3 ships

TRAIN_CONFIG = "configs/default.py"
TRAIN_STEPS = 2
# The CPU demo (configs/default.py) with the real Qwen tokenizer (its vocabulary: model.vocab_size 0), a
# one-layer model, 2 warm-start steps, 2 RL steps of 2 prompts x 8 responses, and 4 held-out problems.
TRAIN_OVERRIDES = {
    "data.tokenizer": str(TOKENIZER),
    "data.max_prompt_length": 64,     # the demo's 56 counts characters; Qwen-templated prompts are ~30 tokens
    "data.prompt_buckets": (64,),
    "data.arithmetic.problems": 40,
    "data.warmstart_problems": 16,
    "data.held_out_problems": 4,
    "model.hidden_size": 64,
    "model.intermediate_size": 128,
    "model.num_hidden_layers": 1,
    "model.head_dim": 16,
    "warmstart.steps": 2,
    "warmstart.batch_size": 8,
    "warmstart.probe_problems": 4,
    "train.steps": TRAIN_STEPS,
    "train.prompts_per_step": 2,
    "train.mini_batches": 2,
    "reward.workers": 1,
    "eval.final.n": 2,
}

EVAL_CONFIG = "configs/eval.py"
EVAL_SETS = ("held_out", "amc23")
EVAL_SAMPLES = 2
EVAL_PROBLEMS = 2
# configs/eval.py on the run's held-out problems and the first AMC23 problems, a few samples each.
EVAL_OVERRIDES = {
    "eval.sets": ",".join(EVAL_SETS),
    "eval.max_problems": EVAL_PROBLEMS,
    "eval.final.n": EVAL_SAMPLES,
    "eval.final.temperature": 1.0,
    "eval.max_new_tokens": 12,
    "model.dtype": "float32",
    "reward.workers": 1,
    "evaluate.progress": False,
}

TIMEOUT_S = 600  # per CLI run; the whole check takes a fraction of it


class CheckFailed(Exception):
    pass


def flags(overrides: dict) -> list[str]:
    """``--config.FIELD=VALUE`` flags (tuples as Python literals, as config_flags parses them)."""
    return [f"--config.{field}={value!r}" if isinstance(value, tuple) else f"--config.{field}={value}"
            for field, value in overrides.items()]


def train_command(workdir: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "pacs_jax.train", f"--config={REPO / TRAIN_CONFIG}", f"--workdir={workdir}",
            *flags(TRAIN_OVERRIDES)]


def eval_command(workdir: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "pacs_jax.evaluate", f"--config={REPO / EVAL_CONFIG}", f"--checkpoint={workdir}",
            *flags(EVAL_OVERRIDES)]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def _run(command: list[str], name: str) -> float:
    """Run a CLI on the CPU; its output is shown only when it fails. Returns its wall seconds."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"{name} did not finish in {TIMEOUT_S} s: {' '.join(command)}\n"
                          f"{(e.stderr or b'')[-4000:]!r}") from None
    if done.returncode != 0:
        raise CheckFailed(f"{name} exited with status {done.returncode}: {' '.join(command)}\n"
                          f"--- stdout (tail)\n{done.stdout[-3000:]}\n--- stderr (tail)\n{done.stderr[-6000:]}")
    return time.monotonic() - start


def check_prompt(tokenizer_dir: pathlib.Path) -> int:
    """A Qwen chat prompt rendered and tokenized by the trainer's code with ``tokenizer_dir``: its length."""
    from pacs_jax.data.prompts import build_prompts, load_tokenizer
    from pacs_jax.data.records import Problem

    tokenizer = load_tokenizer(tokenizer_dir)
    problem = Problem(data_source="ci", problem="What is 2 + 3?", ground_truth="5", index=0)
    examples, dropped = build_prompts([problem], tokenizer, max_prompt_length=256)
    text = tokenizer.decode(list(examples[0].prompt_ids)) if examples else ""
    _require(not dropped and "<|im_start|>assistant" in text and "What is 2 + 3?" in text,
             f"unexpected prompt from {tokenizer_dir}: {text!r}")
    return len(examples[0].prompt_ids)


def _fraction(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= 1


def check_training(workdir: pathlib.Path) -> str:
    summary_file = workdir / "summary.json"
    _require(summary_file.is_file(), f"the trainer wrote no {summary_file}")
    summary = json.loads(summary_file.read_text())
    _require(summary.get("final_step") == TRAIN_STEPS, f"summary.json: final_step {summary.get('final_step')!r}, "
                                                       f"expected {TRAIN_STEPS}")
    for key in ("accuracy_before_rl", "accuracy_after_rl", "greedy_accuracy_before_rl", "greedy_accuracy_after_rl"):
        _require(_fraction(summary.get(key)), f"summary.json: {key} is {summary.get(key)!r}, not an accuracy in [0, 1]")
    _require(bool(summary.get("warmstart")) and summary["warmstart"].get("steps", 0) >= 1,
             f"summary.json: no warm-start recorded: {summary.get('warmstart')!r}")
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    _require([m["step"] for m in metrics] == list(range(1, TRAIN_STEPS + 1)),
             f"metrics.jsonl: steps {[m['step'] for m in metrics]}")
    _require(all(math.isfinite(m["loss"]) and m["generated_tokens"] > 0 for m in metrics),
             f"metrics.jsonl: a non-finite loss or no generated tokens: {metrics}")
    _require((workdir / "checkpoints" / str(TRAIN_STEPS)).is_dir(),
             f"no checkpoint {workdir}/checkpoints/{TRAIN_STEPS}")
    export = workdir / "hf_export"
    _require((export / "config.json").is_file() and any(export.glob("*.safetensors")),
             f"{export}: no config.json and safetensors weights: {sorted(p.name for p in export.iterdir())}")
    for name in TOKENIZER_FILES:
        _require((export / name).is_file() and (export / name).read_bytes() == (TOKENIZER / name).read_bytes(),
                 f"{export}/{name}: missing, or not the run's tokenizer file {TOKENIZER / name}")
    vocab = json.loads((workdir / "config.json").read_text())["model"]["vocab_size"]
    _require(vocab > 151_000, f"the run's model.vocab_size is {vocab}, not the Qwen tokenizer's")
    check_prompt(export)  # the exported tokenizer renders the chat prompt too
    return (f"accuracy before / after RL {summary['accuracy_before_rl']:.3f} / {summary['accuracy_after_rl']:.3f}, "
            f"vocabulary {vocab}")


def check_evaluation(workdir: pathlib.Path) -> str:
    out = workdir / "eval" / f"evaluate_step_{TRAIN_STEPS}"  # the evaluator's default for a workdir's newest checkpoint
    metrics_file = out / "eval_metrics.json"
    _require(metrics_file.is_file(), f"the evaluator wrote no {metrics_file}")
    metrics = json.loads(metrics_file.read_text())
    _require(sorted(metrics) == sorted(EVAL_SETS), f"eval_metrics.json: sets {sorted(metrics)}, expected {EVAL_SETS}")
    for name, values in metrics.items():
        for key in ("pass@1", f"pass@{EVAL_SAMPLES}", f"mean@{EVAL_SAMPLES}"):
            _require(_fraction(values.get(key)), f"eval_metrics.json: {name} {key} is {values.get(key)!r}")
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    _require(len(rows) == EVAL_PROBLEMS * len(EVAL_SETS) and all(len(r["samples"]) == EVAL_SAMPLES for r in rows),
             f"eval_samples.jsonl: {len(rows)} problems, samples per problem {[len(r['samples']) for r in rows]}")
    return ", ".join(f"{name} pass@1 {values['pass@1']:.3f}" for name, values in sorted(metrics.items()))


def check(folder: pathlib.Path) -> None:
    start = time.monotonic()
    tokens = check_prompt(TOKENIZER)
    print(f"runtime_check.py: requirements.txt alone renders a Qwen chat prompt ({tokens} tokens)", flush=True)
    workdir = folder / "workdir"
    seconds = _run(train_command(workdir), "the trainer")
    print(f"runtime_check.py: the trainer ({TRAIN_CONFIG}, Qwen tokenizer) ran {TRAIN_STEPS} steps in {seconds:.0f} s: "
          f"{check_training(workdir)}", flush=True)
    seconds = _run(eval_command(workdir), "the evaluator")
    print(f"runtime_check.py: the evaluator ({EVAL_CONFIG}) evaluated {workdir} in {seconds:.0f} s: "
          f"{check_evaluation(workdir)}", flush=True)
    print(f"runtime_check.py: all done in {time.monotonic() - start:.0f} s", flush=True)


def main(argv: list[str]) -> int:
    if importlib.util.find_spec("torch") is not None:
        print("runtime_check.py: torch is installed here: run it in a venv made from requirements.txt alone",
              file=sys.stderr)
        return 1
    if len(argv) > 2:
        print(f"usage: python {argv[0]} [KEEP_DIR]", file=sys.stderr)
        return 2
    try:
        if len(argv) == 2:
            folder = pathlib.Path(argv[1]).resolve()
            folder.mkdir(parents=True, exist_ok=True)
            check(folder)
        else:
            with tempfile.TemporaryDirectory(prefix="pacs_jax_runtime_check.") as tmp:
                check(pathlib.Path(tmp))
    except CheckFailed as e:
        print(f"runtime_check.py: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
