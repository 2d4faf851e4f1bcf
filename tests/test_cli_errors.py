"""A user's mistakes give one line naming what to fix (issue 28, item 11): a misspelled config override
names the likely field and exits with status 78 (it used to be a 50-line traceback and status 1,
raised while the flags were defined, before the CLI's error handler); a malformed training row says
that ``data.allow_skips`` would skip it; a workdir that is a file or cannot be written is one line
naming the path."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import REPO
from pacs_jax.data import DataError, training_problems
from pacs_jax.errors import PERMANENT_ERROR_STATUS, unknown_config_field
from train_helpers import load_config


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "JAX_PLATFORMS": "cpu"}


def _run(module: str, *args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=_env())


def _error_line(run: subprocess.CompletedProcess, program: str) -> str:
    """The one line of a permanent error: status 78, no traceback, nothing else on stderr."""
    assert run.returncode == PERMANENT_ERROR_STATUS, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}: error: "), run.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("config", ["", "--config=configs/paper.py:qwen3_4b,grpo"])
def test_a_misspelled_override_is_one_line_naming_the_likely_field(tmp_path, config):
    """With the default config the overrides are applied while the flag is defined (at import), with
    --config while the flags are parsed: both are one line, status 78, and no workdir."""
    workdir = tmp_path / "workdir"
    before = [config] if config else []
    line = _error_line(_run("pacs_jax.train", *before, "--config.train.stepz=3", f"--workdir={workdir}"),
                       "pacs_jax.train")
    assert line == ("pacs_jax.train: error: --config.train.stepz: config.train has no field 'stepz'; "
                    "did you mean --config.train.steps?")
    line = _error_line(_run("pacs_jax.train", *before, "--config.modle.path=/m", f"--workdir={workdir}"),
                       "pacs_jax.train")
    assert line == ("pacs_jax.train: error: --config.modle.path: config has no field 'modle'; "
                    "did you mean --config.model.path?")
    line = _error_line(_run("pacs_jax.train", *before, "--config.train.qqqqqq=1", f"--workdir={workdir}"),
                       "pacs_jax.train")
    assert line == "pacs_jax.train: error: --config.train.qqqqqq: config.train has no field 'qqqqqq'"
    assert not workdir.exists()


def test_evaluate_reports_a_misspelled_override_alike(tmp_path):
    line = _error_line(_run("pacs_jax.evaluate", "--config=configs/eval.py", f"--checkpoint={tmp_path}",
                            "--config.eval.max_new_tokenz=8"), "pacs_jax.evaluate")
    assert line == ("pacs_jax.evaluate: error: --config.eval.max_new_tokenz: config.eval has no field "
                    "'max_new_tokenz'; did you mean --config.eval.max_new_tokens?")


def test_unknown_config_field_leaves_other_errors_alone():
    assert unknown_config_field(KeyError("other"), ["--config.train.steps=1"]) is None  # not an override's key
    assert unknown_config_field(ValueError("'stepz'"), ["--config.train.stepz=1"]) is None
    wrapped = AttributeError(KeyError("'stepz'\nDid you mean \"steps\" instead of \"stepz\"?"))
    assert unknown_config_field(wrapped, ["prog", "--config.train.stepz=1"]) == (
        "--config.train.stepz: config.train has no field 'stepz'; did you mean --config.train.steps?")


def _data_config(train_file: pathlib.Path, allow_skips: bool):
    config = load_config("default.py")
    config.data.source, config.data.train_files = "files", (str(train_file),)
    config.data.warmstart_problems, config.data.held_out_problems = 0, 0
    config.data.allow_skips = allow_skips
    return config.data


def test_a_malformed_training_row_names_data_allow_skips(tmp_path):
    rows = tmp_path / "rows.jsonl"
    good = {"data_source": "math", "problem": "1 + 1", "ground_truth": "2"}
    rows.write_text("\n".join(json.dumps(r) for r in (good, {"data_source": "math", "ground_truth": "3"}, good)) + "\n")
    with pytest.raises(DataError) as error:
        training_problems(_data_config(rows, allow_skips=False), seed=0)
    message = str(error.value)
    assert message.startswith(f"{rows}:2: missing field 'problem'") and "--config.data.allow_skips=True" in message
    train, _, _, counts = training_problems(_data_config(rows, allow_skips=True), seed=0)
    assert len(train) == 2 and counts["skipped"] == 1
    # a file whose format cannot be told is no row's fault: allow_skips would not help, so it is not named
    unknown = tmp_path / "other.jsonl"
    unknown.write_text(json.dumps({"question": "1 + 1", "answer": "2"}) + "\n")
    with pytest.raises(DataError) as error:
        training_problems(_data_config(unknown, allow_skips=False), seed=0)
    assert "allow_skips" not in str(error.value)


def _unwritable_folder(tmp_path) -> pathlib.Path:
    """A folder this process cannot create files in (root writes anywhere chmod allows: /sys then)."""
    if os.geteuid() != 0:
        folder = tmp_path / "read_only"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    folder = pathlib.Path("/sys/kernel")
    assert folder.is_dir(), "running as root, the test needs /sys/kernel: a folder root cannot write in"
    return folder


def test_a_workdir_that_is_a_file_or_cannot_be_written_is_one_line(tmp_path):
    flags = ("--config.train.steps=1", "--config.warmstart.steps=0", "--config.data.warmstart_problems=0")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder\n")
    line = _error_line(_run("pacs_jax.train", f"--workdir={a_file}", *flags), "pacs_jax.train")
    assert line == f"pacs_jax.train: error: --workdir={a_file}: is a file, not a folder"
    line = _error_line(_run("pacs_jax.train", f"--workdir={a_file / 'run'}", *flags), "pacs_jax.train")
    assert line.startswith(f"pacs_jax.train: error: --workdir={a_file / 'run'}: cannot create the folder (")
    folder = _unwritable_folder(tmp_path)
    line = _error_line(_run("pacs_jax.train", f"--workdir={folder}", *flags), "pacs_jax.train")
    assert line.startswith(f"pacs_jax.train: error: --workdir={folder}: cannot write in it (")


def test_the_readme_config_paths_work_from_any_folder_and_a_missing_one_is_one_line(tmp_path):
    """``--config=configs/...`` (the README's commands) from a folder other than the repository's: the file
    is read from the repository (it was a traceback from ml_collections); a config file that exists
    nowhere is one line naming the flag and where it was looked for, for both CLIs."""
    found = _error_line(_run("pacs_jax.train", "--config=configs/paper.py:qwen25_3b,pacs_beta1",
                             "--config.data.train_files=('missing.jsonl',)", f"--workdir={tmp_path / 'w'}",
                             cwd=tmp_path), "pacs_jax.train")
    assert found.startswith("pacs_jax.train: error: config.data.train_files[0]: missing.jsonl does not exist")
    for module, args in (("pacs_jax.train", ("--config=configs/papr.py:qwen25_3b,grpo",)),
                         ("pacs_jax.evaluate", ("--config=configs/evl.py", "--checkpoint=x"))):
        line = _error_line(_run(module, *args, cwd=tmp_path), module)
        assert line == (f"{module}: error: {args[0]}: {args[0].split('=')[1].split(':')[0]} does not exist (a "
                        f"relative path: looked for in the working directory {tmp_path}, then in the repository "
                        f"root {REPO})")
