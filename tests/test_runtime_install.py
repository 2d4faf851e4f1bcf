"""The README's runtime install (requirements.txt + `pip install -e .`) has what a real model's run needs.

The test requirements pull in torch, and torch pulls in jinja2, which transformers' apply_chat_template
needs: the suite alone would never notice a runtime requirement missing. So requirements.txt and
pyproject.toml are checked here, and CI (.ci/run) installs requirements.txt alone in a second, fresh
virtual environment and, with it, renders a real chat prompt, runs a short real-tokenizer training with the
trainer CLI and evaluates it with the evaluation CLI (.ci/runtime_check.py). The suite does not install
that environment: it checks the wiring (CI's commands, the check's CLI commands and that their overrides
make valid configs).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import shlex
import subprocess
import sys
import tomllib

from conftest import REPO
from pacs_jax.training.config_check import validate_config
from train_helpers import load_config


def _runtime_check():
    """.ci/runtime_check.py as a module (it imports pacs_jax only when it runs)."""
    spec = importlib.util.spec_from_file_location("_ci_runtime_check", REPO / ".ci" / "runtime_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _apply(config, overrides: dict):
    """``--config.FIELD=VALUE`` as config_flags applies it: every FIELD must exist already."""
    for field, value in overrides.items():
        *parents, leaf = field.split(".")
        node = config
        for name in parents:
            node = node[name]
        assert leaf in node, f"{field}: no such config field"
        node[leaf] = value
    return config


def _pinned(requirements: str) -> dict[str, str]:
    """{normalised name: version} of the ``name==version`` lines of a requirements file."""
    pins = {}
    for line in requirements.splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s#;]+)", line)
        if match:
            pins[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return pins


def test_runtime_requirements_pin_the_chat_template_engine():
    pins = _pinned((REPO / "requirements.txt").read_text())
    assert "transformers" in pins and "jinja2" in pins, "requirements.txt: jinja2 (apply_chat_template) is not pinned"
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"jinja2\b", d, re.IGNORECASE) for d in dependencies), "pyproject.toml lacks jinja2"


def test_both_readme_installs_pin_tensorboard_to_read_the_run_s_events():
    """Issue 53 item 7: the trainer writes TensorBoard events, and neither README command installed
    TensorBoard itself; requirements-test.txt includes requirements.txt."""
    assert "tensorboard" in _pinned((REPO / "requirements.txt").read_text())
    assert "-r requirements.txt" in (REPO / "requirements-test.txt").read_text().splitlines()
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"tensorboard\b(?!X)", d) for d in dependencies), "pyproject.toml lacks tensorboard"


def test_ci_runs_the_readme_tests_then_the_runtime_install_alone_in_a_fresh_venv():
    readme = (REPO / "README.md").read_text()
    test_command = "sh tools/make_venv.sh .venv && . .venv/bin/activate && pip install -r requirements-test.txt -e . && pytest -q"
    assert test_command in readme
    ci = (REPO / ".ci" / "run").read_text()
    lines = [line.split("  #")[0] for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    # the README's test command (pip quiet; each phase's seconds printed), stopping CI on any failure
    tests = next(i for i, line in enumerate(lines) if "requirements-test.txt" in line)
    assert "ci_phase suite" in lines[tests] and "ci_phase() {" in ci
    command = re.sub(r' && ci_phase (\w+|"[^"]*")', "", lines[tests]).replace("pip install -q ", "pip install ")
    assert command.startswith(test_command)
    assert lines[tests].rstrip().endswith("|| exit")
    # then a second venv, in another folder, with requirements.txt alone, and the check that needs jinja2
    runtime = lines[tests + 1:]
    venvs = [shlex.split(line)[-1] for line in runtime if line.startswith("sh tools/make_venv.sh ")]
    assert venvs and venvs[0] != ".venv"
    installs = [line for line in runtime if line.startswith("pip install")]
    assert installs == ["pip install -q -r requirements.txt -e ."]
    assert runtime[-1] == "python .ci/runtime_check.py"


def test_the_runtime_check_refuses_an_environment_with_the_test_extras():
    # here torch is installed (requirements-test.txt), which would hide a missing jinja2
    check = subprocess.run([sys.executable, str(REPO / ".ci" / "runtime_check.py")], capture_output=True, text=True,
                           timeout=120, cwd=REPO)
    assert check.returncode == 1 and "torch is installed here" in check.stderr


def test_the_runtime_check_trains_and_then_evaluates_with_the_real_tokenizer(tmp_path):
    """The check runs the trainer CLI on the demo config with the shipped Qwen tokenizer, then the
    evaluation CLI on that workdir, and checks their outputs; its overrides name real fields and make
    a config that validate_config accepts (a typo there would show only in CI)."""
    check = _runtime_check()
    workdir = tmp_path / "workdir"
    train = check.train_command(workdir)
    assert train[:3] == [sys.executable, "-m", "pacs_jax.train"]
    assert f"--config={REPO / 'configs' / 'default.py'}" in train and f"--workdir={workdir}" in train
    assert f"--config.data.tokenizer={REPO / 'data' / 'tokenizers' / 'qwen3'}" in train
    assert "--config.data.prompt_buckets=(64,)" in train  # a tuple, as config_flags parses it
    evaluate = check.eval_command(workdir)
    assert evaluate[:3] == [sys.executable, "-m", "pacs_jax.evaluate"]
    assert f"--config={REPO / 'configs' / 'eval.py'}" in evaluate and f"--checkpoint={workdir}" in evaluate

    config = _apply(load_config("default.py"), check.TRAIN_OVERRIDES)
    assert config.data.source == "arithmetic" and config.model.vocab_size == 0  # the tokenizer's vocabulary
    assert config.train.steps == check.TRAIN_STEPS and config.warmstart.steps >= 1 and "held_out" in config.eval.sets
    validate_config(config)
    eval_config = _apply(load_config("eval.py"), check.EVAL_OVERRIDES)
    assert eval_config.eval.sets.split(",") == list(check.EVAL_SETS) and not eval_config.eval.final.greedy

    # in that order: the prompt, the trainer and its outputs, the evaluator and its outputs
    body = inspect.getsource(check.check)
    steps = ["check_prompt(", "train_command(", "check_training(", "eval_command(", "check_evaluation("]
    positions = [body.index(step) for step in steps]
    assert positions == sorted(positions), body
    training_checks = inspect.getsource(check.check_training)
    for output in ("summary.json", "accuracy_before_rl", "accuracy_after_rl", "hf_export", "TOKENIZER_FILES"):
        assert output in training_checks, output
    assert "eval_metrics.json" in inspect.getsource(check.check_evaluation)
