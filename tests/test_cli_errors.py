"""A user's mistakes give one line naming what to fix (issue 28, item 11): a misspelled config override
names the likely field and exits with status 78 (it used to be a 50-line traceback and status 1,
raised while the flags were defined, before the CLI's error handler); a malformed training row says
that ``data.allow_skips`` would skip it; a workdir that is a file or cannot be written is one line
naming the path.

Issue 35: bad input is caught before anything runs. The check the trainer runs before it creates its
workdir (config_check.check_inputs) reads every input: a model folder without weights, with a copy cut
short or of another model (item 1), lengths beyond the model's context (item 2), training data that is
empty, of one's own format or not read by the chosen source (item 3), the samplers' slots (item 6);
the evaluation CLI checks its checkpoint alike (item 1), export_hf takes a workdir and replaces only
an export of its own (item 5), a misspelled setup name is one line (item 6). Most cases call the check
in-process; a few run the CLIs as a user does: status 78, one line naming the field or file, nothing
written, and launch/supervise.sh does not restart it.

Issue 53: export_hf --overwrite, and the trainer's own export into workdir/hf_export (refused before it trains),
name the evaluation results in an export instead of deleting them (item 2); a damaged training file and rows
without the format's answer are one line naming the file and line even with data.allow_skips, and each row
data.allow_skips skips is named in the log and in the workdir (items 4, 5); --help exits 0 naming
configs/base.py (item 7)."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import REPO
from pacs_jax.data import DataError, training_problems
from pacs_jax.errors import CONFIG_HELP, CONFIG_SECTIONS, PERMANENT_ERROR_STATUS, PermanentError, unknown_config_field
from pacs_jax.models import QwenConfig
from pacs_jax.models.hf_weights import check_export_target
from pacs_jax.models.loading import hf_shapes
from pacs_jax.training.config_check import check_inputs, validate_config
from train_helpers import load_config


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "JAX_PLATFORMS": "cpu"}


def _run(module: str, *args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=_env())


@functools.cache
def _help(module: str) -> subprocess.CompletedProcess:
    """``python -m module --help``, run once for the tests that read it."""
    return _run(module, "--help")


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


@pytest.mark.parametrize("module, flag", [("pacs_jax.train", "--workdir"), ("pacs_jax.evaluate", "--checkpoint"),
                                          ("pacs_jax.check_config", "--accelerator")])
def test_help_exits_0_and_points_to_the_config_fields(module, flag):
    """Issue 53 item 7: --help exited with status 1 (absl's); it exits 0 with the program's flags and where the
    config's fields are: configs/base.py, naming its sections."""
    import ml_collections

    from configs import base

    run = _help(module)
    assert run.returncode == 0 and not run.stderr, run.stderr[-3000:]
    assert f"  {flag}: " in run.stdout and CONFIG_HELP in run.stdout, run.stdout
    sections = [name for name, value in base.get_config().items() if isinstance(value, ml_collections.ConfigDict)]
    assert sorted(CONFIG_SECTIONS) == sorted(sections) and "configs/base.py lists every field" in CONFIG_HELP


def test_help_lists_the_config_files_the_trainer_runs_and_their_arguments():
    """Issue 67 item 7: the trainer's --help listed no configs; it names each file with its arguments, as the
    files define them."""
    from configs import algorithms, default, demo_objectives, paper

    run = _help("pacs_jax.train")
    assert run.returncode == 0 and not run.stderr, run.stderr[-3000:]
    for usage in ("configs/default.py[:SETUP]", "configs/demo_objectives.py:OBJECTIVE",
                  "configs/paper.py:MODEL,ALGO[,cpu]"):
        assert f"\n  {usage} " in run.stdout, run.stdout
    words = set(re.findall(r"\w+", run.stdout))
    for names in (algorithms.setups(default.MAX_NEW_TOKENS), demo_objectives.SETUPS, paper.MODELS, paper.ALGORITHMS):
        assert set(names) <= words, set(names) - words


@pytest.mark.parametrize("field, value, line", [
    ("algorithm.rollout_correction.preset", "tis_token", "config.algorithm.rollout_correction.preset: 'tis_token' is "
     "not one of ['geo_rs', 'icepop', 'k3_rs', 'seq_mis', 'seq_tis', 'token_tis']; did you mean 'token_tis'?"),
    ("algorithm.objective", "gpso", "config.algorithm.objective: 'gpso' is not one of ['cispo', 'drgrpo', 'grpo', "
     "'gspo', 'pacs', 'ppo', 'rloo']; did you mean 'gspo'?"),
    ("algorithm.pacs.weight_mode", "questoin", "config.algorithm.pacs.weight_mode: objective 'pacs': "
     "weight_mode='questoin': expected one of ('question', 'only_positive', 'only_negative'); did you mean "
     "'question'?"),
    ("algorithm.rollout_correction.rollout_rs", "seq_mean_k4", "did you mean 'seq_mean_k3'?"),
    ("rollout.sampler", "Paged", "did you mean 'paged'?"),
    ("algorithm.objective", "zzz", "config.algorithm.objective: 'zzz' is not one of ['cispo', 'drgrpo', 'grpo', "
     "'gspo', 'pacs', 'ppo', 'rloo']"),  # nothing close: no guess
])
def test_a_misspelled_value_names_the_likely_choice(field, value, line):
    """Issue 67 item 7: a misspelled field got a "did you mean", a misspelled value only the choices."""
    config = load_config("default.py")
    *sections, name = field.split(".")
    section = config
    for part in sections:
        section = section[part]
    section[name] = value
    with pytest.raises(PermanentError) as refused:
        validate_config(config)
    assert str(refused.value).endswith(line), str(refused.value)
    assert str(refused.value).count("did you mean") == ("did you mean" in line)


def test_a_field_a_user_reaches_for_under_another_name_points_to_the_one_that_does_it():
    """Issue 67 item 7: --config.algorithm.name=gspo said only that config.algorithm has no field 'name'."""
    for field in ("name", "algo"):
        refusal = AttributeError(KeyError(f"'{field}'"))
        assert unknown_config_field(refusal, ["prog", f"--config.algorithm.{field}=gspo"]) == (
            f"--config.algorithm.{field}: config.algorithm has no field '{field}'; did you mean "
            "--config.algorithm.objective=gspo?")


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
    unknown.write_text(json.dumps({"q": "1 + 1", "a": "2"}) + "\n")
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


# ------------------------------------------------------------------------------------------ issue 35
TINY = QwenConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=False,
                  max_position_embeddings=256, bos_token_id=0, eos_token_id=1)


def _model_folder(path: pathlib.Path, *, weights: bool = True, cfg: QwenConfig = TINY) -> pathlib.Path:
    """An HF model folder of ``cfg`` (config.json, zero weights in model.safetensors, the repository's Qwen3
    tokenizer files), written without JAX: nothing compiles."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    if weights:
        save_file({name: np.zeros(shape, np.float32) for name, shape in hf_shapes(cfg).items()},
                  str(path / "model.safetensors"))
    for name in ("tokenizer_config.json", "vocab.json", "merges.txt"):
        (path / name).write_bytes((REPO / "data" / "tokenizers" / "qwen3" / name).read_bytes())
    return path


def _refusal(config, check=validate_config) -> str:
    with pytest.raises(PermanentError) as error:
        check(config)
    return str(error.value)


def _model_config(model_path) -> "ml_collections.ConfigDict":
    config = load_config("default.py")
    config.model.path, config.data.tokenizer = str(model_path), ""
    return config


def test_a_model_folder_is_read_before_anything_runs(tmp_path):
    """Item 1: config.json, the safetensors headers (every tensor the config needs, at its shape; a copy cut
    short) and the folder's kind are read by the check, before the tokenizer is looked for in it."""
    good = _model_folder(tmp_path / "good")
    validate_config(_model_config(good))
    no_weights = _model_folder(tmp_path / "no_weights", weights=False)
    assert _refusal(_model_config(no_weights)) == (
        f"config.model.path: {no_weights}: holds config.json but no weights: neither model.safetensors nor "
        "model.safetensors.index.json: copy the model's *.safetensors files (and model.safetensors.index.json) into it")
    cut = _model_folder(tmp_path / "cut")
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    assert _refusal(_model_config(cut)).startswith(
        f"config.model.path: {cut}: model.safetensors: holds {len(weights) // 2} bytes of the {len(weights)} its "
        "header describes (a copy cut short?)")
    other = _model_folder(tmp_path / "other", cfg=TINY.replace(num_hidden_layers=3))
    (other / "model.safetensors").write_bytes(weights)  # a 2-layer model's weights under a 3-layer config.json
    assert _refusal(_model_config(other)).startswith(
        f"config.model.path: {other}: the weights lack 11 of the 35 tensors config.json's model needs "
        "(model.layers.2.self_attn.q_proj.weight, ")
    wide = _model_folder(tmp_path / "wide", cfg=TINY.replace(hidden_size=48))
    (wide / "model.safetensors").write_bytes(weights)
    assert "tensor model.embed_tokens.weight has shape (64, 32), config.json's model needs (64, 48)" in _refusal(
        _model_config(wide))
    sharded = _model_folder(tmp_path / "sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    assert _refusal(_model_config(sharded)) == (
        f"config.model.path: {sharded}: holds config.json but model-00002-of-00002.safetensors (a shard "
        "model.safetensors.index.json lists) is missing: copy the model's *.safetensors files (and "
        "model.safetensors.index.json) into it")
    empty = tmp_path / "empty"
    empty.mkdir()  # it used to be refused for data.tokenizer first
    assert _refusal(_model_config(empty)) == (
        f"config.model.path: {empty}: not a model: no config.json (an HF model folder), no params/ (a pacs_jax "
        "checkpoint) and no <step>/params/ (a trainer's checkpoints/)")
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps({"model": {}, "data": {}, "train": {}}))
    assert _refusal(_model_config(workdir)).startswith(f"config.model.path: {workdir}: a training workdir, not a model")


def test_lengths_beyond_the_context_and_slots_that_cannot_work_name_their_field(tmp_path):
    """Item 2: every length against the model's context (the demo's own model: 32768 positions, model.path's
    config.json); item 6: slots and tail_slots against each other and the sampler."""
    def refusal(**changes) -> str:
        config = load_config("default.py")
        for dotted, value in changes.items():
            section, field = dotted.split("__")
            config[section][field] = value
        return _refusal(config)

    assert refusal(rollout__max_new_tokens=100000) == (
        "config.rollout.max_new_tokens: 100000 with data.max_prompt_length=56 is 100056 tokens, beyond the model's "
        "context of 32768 (max_position_embeddings): set it to at most 32712")
    assert refusal(eval__max_new_tokens=32760).startswith("config.eval.max_new_tokens: 32760 with data.max_prompt_length")
    assert refusal(warmstart__max_response_tokens=40000).startswith("config.warmstart.max_response_tokens: 40000")
    config = _model_config(_model_folder(tmp_path / "model"))
    config.rollout.max_new_tokens = 256
    assert _refusal(config).startswith("config.rollout.max_new_tokens: 256 with data.max_prompt_length=56 is 312 "
                                       "tokens, beyond the model's context of 256")
    assert refusal(rollout__slots=0) == (
        "config.rollout.slots: must be an integer >= 1 (decode slots per sampler call), got 0")
    assert refusal(rollout__tail_slots=200) == (
        "config.rollout.tail_slots: 200 is more than rollout.slots=128: the decode batch narrows from slots down to "
        "tail_slots; set it to at most 128 (0: no narrowing)")
    assert refusal(rollout__sampler="static", rollout__tail_slots=8) == (
        "config.rollout.tail_slots: 8, but rollout.sampler is 'static', which gives every response its own slot and "
        "never narrows: set rollout.tail_slots=0, or rollout.sampler=continuous (or paged)")
    assert refusal(eval__sampler="static", eval__tail_slots=8).startswith("config.eval.tail_slots: 8, but eval.sampler")


def _files_config(*files: str, prompts: int = 8):
    config = load_config("default.py")
    config.data.update(source="files", train_files=files, warmstart_problems=0, held_out_problems=4)
    config.warmstart.steps, config.train.prompts_per_step = 0, prompts
    return config


def test_training_data_is_read_before_anything_runs(tmp_path):
    """Item 3: rows of one's own format train whatever the file's name ({problem, answer}, {question,
    answer}, {prompt, ground_truth}); other fields need a format (data.format or FILE:FORMAT); an empty file,
    too few problems for a step, and a data field the source does not read are refused naming the field."""
    rows = lambda fields: "".join(json.dumps(dict(zip(fields, (f"{i} + 1?", str(i + 1))))) + "\n"  # noqa: E731
                                  for i in range(20))
    for fields in (("problem", "answer"), ("question", "answer"), ("prompt", "ground_truth")):
        mine = tmp_path / f"my_{'_'.join(fields)}.jsonl"
        mine.write_text(rows(fields))
        check_inputs(_files_config(str(mine)))
    odd = tmp_path / "odd.jsonl"
    odd.write_text(rows(("q", "a")))
    assert _refusal(_files_config(str(odd)), check_inputs).startswith(
        f"config.data.train_files: {odd}:1: cannot tell the dataset format from its name or fields (its first row "
        "has the fields ['a', 'q']); name it, as PATH:FORMAT (or the trainer's data.format)")
    named = tmp_path / "named.jsonl"
    named.write_text(rows(("question", "answer")).replace('"answer": "', '"answer": "#### '))
    check_inputs(_files_config(f"{named}:gsm8k"))  # the file's own format
    config = _files_config(str(named))
    config.data.format = "gsm8k"
    check_inputs(config)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _refusal(_files_config(str(empty)), check_inputs) == (
        f"config.data.train_files: {empty}: holds no rows (an empty file?)")
    assert _refusal(_files_config(str(named), prompts=32), check_inputs) == (
        "config.train.prompts_per_step: 32 is more than the 16 problems RL samples from (20 read, 4 held out, 0 for "
        "the warm-start only): a step takes 32 distinct prompts; lower it or the splits, or add problems")
    config = _files_config(str(named))
    config.warmstart.steps = 5  # on RL's 16 problems (data.warmstart_problems 0), 32 a batch
    assert _refusal(config, check_inputs) == (
        "config.warmstart.batch_size: 32 is more than the 16 problems the warm-start trains on (RL's, "
        "data.warmstart_problems being 0): a warm-start step takes that many distinct prompts; lower it, or set more "
        "problems aside")
    demo = load_config("default.py")
    demo.data.train_files = (str(named),)
    assert _refusal(demo) == (
        f"config.data.train_files: ('{named}',) is set, but data.source is 'arithmetic', which does not read it (it "
        "generates its problems): set data.source=files to train on files, or leave it unset")


def _supervised(*args: str, cwd) -> subprocess.CompletedProcess:
    """The trainer under launch/supervise.sh, as the launch scripts run it (no delay before a restart)."""
    return subprocess.run(["bash", str(REPO / "launch" / "supervise.sh"), "--delay", "0", "--", sys.executable, "-m",
                           "pacs_jax.train", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=_env())


def test_the_trainer_refuses_bad_input_in_one_line_before_its_workdir_exists(tmp_path):
    """Items 1, 2 and 3 through the CLI: status 78, one line naming the field or file, no workdir, and
    supervise.sh stops at once instead of restarting."""
    workdir = tmp_path / "workdir"
    model = _model_folder(tmp_path / "model", weights=False)
    run = _supervised(f"--config.model.path={model}", "--config.data.tokenizer=", f"--workdir={workdir}", cwd=tmp_path)
    assert run.returncode == PERMANENT_ERROR_STATUS and run.stderr.count("pacs_jax.train: error:") == 1, run.stderr
    assert f"pacs_jax.train: error: config.model.path: {model}: holds config.json but no weights" in run.stderr
    assert run.stdout.count("attempt") == 1 and "not restarting" in run.stderr, run.stdout + run.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for flags, line in (
            (("--config.rollout.max_new_tokens=100000",), "config.rollout.max_new_tokens: 100000 with "
                                                          "data.max_prompt_length=56 is 100056 tokens, beyond"),
            ((f"--config.data.train_files=('{empty}',)", "--config.data.source=files"),
             f"config.data.train_files: {empty}: holds no rows (an empty file?)"),
            (("--config.train.packed_rows=1",), "config.train.packed_rows: 1 rows a pass on each of 1 batch shards "
                                                "cannot hold a prompt group's 8 sequences"),  # issue 42: was found at step 1
    ):  # the other cases of items 3 and 6 in-process above; a misspelled setup name: tests/test_launch_safety.py
        error = _error_line(_run("pacs_jax.train", *flags, f"--workdir={workdir}", cwd=tmp_path), "pacs_jax.train")
        assert error.startswith(f"pacs_jax.train: error: {line}"), error
    assert not workdir.exists()


def test_the_trainer_refuses_a_damaged_file_and_rows_without_the_answer_even_with_allow_skips(tmp_path):
    """Issue 53 items 4 and 5 through the CLI, with data.allow_skips (as the paper configs set it): a jsonl line
    of invalid JSON trained (status 0, its only trace "1 malformed rows skipped"); a FILE:problem_answer file
    whose rows have no "answer" was "config.data.held_out_problems: 4 leaves no training problems of the 0
    read". Each is one line naming the file and the line (and the missing field), status 78, no workdir."""
    rows = [json.dumps({"problem": f"{i} + 1 = ?", "answer": str(i + 1)}) for i in range(40)]
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("\n".join([*rows[:6], '{"problem": "7 + 1 = ?", "answer": ', *rows[6:]]) + "\n")
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text("".join(json.dumps({"problem": f"{i} + 1 = ?", "solution": str(i + 1)}) + "\n"
                                 for i in range(40)))
    workdir = tmp_path / "workdir"
    for spec, line in (
            (damaged, f"{damaged}:7: invalid JSON (Expecting value, column 36)"),
            (f"{no_answer}:problem_answer", f"{no_answer}:1: missing field 'answer'; no row of the 40 read is a "
                                            "problem (all malformed): format 'problem_answer' reads the problem from "
                                            "'problem' and the answer from 'answer'")):
        run = _run("pacs_jax.train", "--config.data.source=files", f"--config.data.train_files=('{spec}',)",
                   "--config.data.allow_skips=True", "--config.warmstart.steps=0", "--config.data.warmstart_problems=0",
                   "--config.data.held_out_problems=4", "--config.train.prompts_per_step=8", f"--workdir={workdir}",
                   cwd=tmp_path)
        assert _error_line(run, "pacs_jax.train") == f"pacs_jax.train: error: config.data.train_files: {line}"
    assert not workdir.exists()


def test_each_row_data_allow_skips_skips_is_named_once_in_the_log_and_in_the_workdir(tmp_path):
    """Issue 53 item 4, when the user asked to skip malformed rows (data.allow_skips): the only trace was "2
    malformed rows skipped" in the count line. Each skipped row is named once, file and line and why, in the
    log and in workdir/skipped_rows.txt; a later session that skips none removes that record."""
    from pacs_jax.training.run import SKIPPED_ROWS_FILE, _record_skipped_rows
    from train_helpers import RL_ONLY_FLAGS, compile_cache_dir, train_env

    rows = [json.dumps({"problem": f"{i}+1=", "answer": str(i + 1)}) for i in range(40)]
    rows[4], rows[9] = json.dumps({"problem": "4+1="}), json.dumps({"problem": "9+1=", "answer": None})
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(rows) + "\n")
    workdir = tmp_path / "workdir"
    run = subprocess.run([sys.executable, "-m", "pacs_jax.train", *RL_ONLY_FLAGS, "--config.data.source=files",
                          f"--config.data.train_files=('{train}',)", "--config.data.allow_skips=True",
                          "--config.train.steps=1", f"--workdir={workdir}"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env=train_env(compile_cache_dir()))
    assert run.returncode == 0, run.stderr[-3000:]
    named = [f"{train}:5: missing field 'answer'", f"{train}:10: field 'answer' must be a string or a number, got null"]
    lines = run.stdout.splitlines()
    assert "30 of 38 problems read (0 for the warm-start only, 8 held out, 2 malformed rows skipped" in run.stdout
    for message in named:
        assert lines.count(f"skipped (data.allow_skips): {message}") == 1, run.stdout
    assert sum(f"{train}:" in line for line in lines) == 2, run.stdout  # each named once
    assert f"the 2 skipped rows are listed in {workdir / SKIPPED_ROWS_FILE}" in lines
    assert (workdir / SKIPPED_ROWS_FILE).read_text().splitlines() == named
    _record_skipped_rows([], workdir, print)  # a session whose data has no malformed row: no stale record
    assert not (workdir / SKIPPED_ROWS_FILE).exists()


def test_the_evaluation_cli_reads_its_checkpoint_before_the_sets_or_the_tokenizer(tmp_path):
    """Item 1 for the evaluation CLI: a folder with config.json and tokenizer files but no weights, and a
    folder with no model, are one line naming --checkpoint and what the folder lacks; no eval/ is written."""
    model = _model_folder(tmp_path / "model", weights=False)
    line = _error_line(_run("pacs_jax.evaluate", "--config=configs/eval.py", f"--checkpoint={model}", cwd=tmp_path),
                       "pacs_jax.evaluate")
    assert line == (f"pacs_jax.evaluate: error: --checkpoint: {model}: holds config.json but no weights: neither "
                    "model.safetensors nor model.safetensors.index.json: copy the model's *.safetensors files (and "
                    "model.safetensors.index.json) into it")
    assert not (model / "eval").exists()


def _export_overwrite(checkpoint, out, cwd) -> subprocess.CompletedProcess:
    """tools/export_hf.py --checkpoint CHECKPOINT --out OUT --overwrite, as a user runs it from ``cwd``."""
    return subprocess.run([sys.executable, str(REPO / "tools" / "export_hf.py"), "--checkpoint", str(checkpoint),
                           "--out", str(out), "--overwrite"], capture_output=True, text=True, timeout=300, env=_env(),
                          cwd=cwd)


def test_export_hf_refuses_to_replace_a_downloaded_model(tmp_path):
    """Item 5: --overwrite onto a folder holding a downloaded HF model (no pacs_jax_export.json) is one line
    naming what it holds, status 78, every file kept."""
    downloaded = _model_folder(tmp_path / "Qwen3-tiny")
    (downloaded / "README.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in downloaded.iterdir()}
    run = _export_overwrite(tmp_path / "ckpt", downloaded, cwd=tmp_path)
    assert _error_line(run, "export_hf") == (
        f"export_hf: error: --out {downloaded}: not an export pacs_jax wrote (no pacs_jax_export.json; it holds "
        "README.md, config.json, merges.txt, model.safetensors, tokenizer_config.json, ... (6 in all)); not "
        "replacing it: choose another output folder, or empty it first")
    assert {p.name: p.read_bytes() for p in downloaded.iterdir()} == before


def _checkpointed_workdir(tmp_path, data_config: dict | None = None) -> pathlib.Path:
    """A training workdir with the TINY model's step 3 (zeros: nothing compiles); its config.json's data
    section ``data_config`` (default: empty, no tokenizer recorded)."""
    import orbax.checkpoint as ocp

    from pacs_jax import checkpoints
    from pacs_jax.models.loading import param_shapes

    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps({"model": {}, "data": data_config or {}, "train": {}}))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(workdir / "checkpoints" / "3" / "params",
                          {name: np.zeros(shape, np.float32) for name, shape in param_shapes(TINY).items()})
    checkpoints.write_model_config(workdir / "checkpoints", TINY)
    return workdir


def test_export_hf_takes_a_training_workdir(tmp_path, capsys):
    """Item 5: --checkpoint WORKDIR (it was a traceback) exports the workdir's newest checkpoint, as the
    evaluation CLI evaluates it; the export lists its files in pacs_jax_export.json, so --overwrite may
    replace it."""
    from pacs_jax import checkpoints
    from qwen_reference import load_tool

    workdir = _checkpointed_workdir(tmp_path)
    out = tmp_path / "export"
    load_tool("export_hf").main(["--checkpoint", str(workdir), "--out", str(out)])
    assert f"export_hf: {workdir} is a training workdir: exporting {workdir / 'checkpoints' / '3'}" in capsys.readouterr().out
    assert json.loads((out / "pacs_jax_export.json").read_text())["files"] == [
        "README.md", "config.json", "generation_config.json", "model.safetensors"]  # README.md: no tokenizer
    assert checkpoints.check_model_dir(out) == TINY
    check_export_target(out, overwrite=True)  # an export of its own: --overwrite may replace it


def test_export_hf_of_a_char_tokenizer_run_says_it_has_no_hugging_face_tokenizer(tmp_path, capsys):
    """Issue 53 item 6: the export of a run with the demo's character tokenizer holds no Hugging Face
    tokenizer, and transformers' AutoTokenizer loaded an empty one from it without a word; one line at
    export time and the export's own README.md say so, naming what to use instead."""
    from qwen_reference import load_tool

    workdir = _checkpointed_workdir(tmp_path, {"tokenizer": "char"})
    out = tmp_path / "export"
    load_tool("export_hf").main(["--checkpoint", str(workdir), "--out", str(out)])
    why = ("the run's tokenizer is the character tokenizer (data.tokenizer=\"char\"), which has no Hugging Face files: "
           "encode and decode with pacs_jax.data.CharTokenizer() instead")
    assert (f"export_hf: the HF export {out} has no Hugging Face tokenizer ({why}); its README.md says so"
            in capsys.readouterr().out.splitlines())
    assert f"no Hugging Face tokenizer: {why}." in (out / "README.md").read_text()
    assert "README.md" in json.loads((out / "pacs_jax_export.json").read_text())["files"]
    check_export_target(out, overwrite=True)  # the README is the export's own: --overwrite may replace it


def test_export_hf_overwrite_refuses_to_delete_the_evaluation_results_naming_them(tmp_path):
    """Issue 53 item 2: --overwrite onto an export holding the eval/ results that `python -m pacs_jax.evaluate
    --checkpoint=EXPORT` wrote there deleted them without a word (status 0); it is one line naming them,
    status 78, every file kept."""
    from qwen_reference import load_tool

    workdir = _checkpointed_workdir(tmp_path)
    out = tmp_path / "export"
    load_tool("export_hf").main(["--checkpoint", str(workdir), "--out", str(out)])
    (out / "eval").mkdir()
    (out / "eval" / "eval_metrics.json").write_text('{"pass@1": 0.5}')
    before = sorted((str(p.relative_to(out)), p.read_bytes() if p.is_file() else None) for p in out.rglob("*"))
    run = _export_overwrite(workdir, out, cwd=tmp_path)
    assert _error_line(run, "export_hf") == (
        f"export_hf: error: --out {out}: holds eval/, which pacs_jax's export did not write (pacs_jax_export.json "
        "lists the files it wrote); not replacing the folder, which would delete them: move them out, or choose "
        "another output folder")
    assert sorted((str(p.relative_to(out)), p.read_bytes() if p.is_file() else None) for p in out.rglob("*")) == before


def test_the_trainer_refuses_an_hf_export_holding_the_evaluation_results_before_it_trains(tmp_path):
    """Issue 53: the trainer's own export at the end of a run (workdir/hf_export) onto an export holding the
    eval/ results that `python -m pacs_jax.evaluate --checkpoint=WORKDIR/hf_export` wrote there trained every
    step, then ended in a FileExistsError traceback (status 1). It is one line naming the folder and the files,
    status 78, before anything is written (no config.json, nothing trained), every file kept."""
    from qwen_reference import load_tool
    from train_helpers import RL_ONLY_FLAGS

    workdir = tmp_path / "workdir"
    out = workdir / "hf_export"
    load_tool("export_hf").main(["--checkpoint", str(_checkpointed_workdir(tmp_path)), "--out", str(out)])
    (out / "eval").mkdir()
    (out / "eval" / "eval_metrics.json").write_text('{"pass@1": 0.5}')
    before = sorted((str(p.relative_to(workdir)), p.read_bytes() if p.is_file() else None) for p in workdir.rglob("*"))
    run = _run("pacs_jax.train", *RL_ONLY_FLAGS, "--config.train.steps=1", f"--workdir={workdir}", cwd=tmp_path)
    assert _error_line(run, "pacs_jax.train") == (
        f"pacs_jax.train: error: {out}: holds eval/, which pacs_jax's export did not write (pacs_jax_export.json "
        f"lists the files it wrote); not replacing the folder, which would delete them: move them out, or move it "
        f"out of {workdir} (the run replaces hf_export with its HF export when it ends)")
    assert sorted((str(p.relative_to(workdir)), p.read_bytes() if p.is_file() else None)
                  for p in workdir.rglob("*")) == before


def test_progress_bars_write_plain_lines_into_a_log_file():
    """Item 6: nested tqdm bars in a file (a pod's log) left ESC[A cursor moves and carriage returns; through
    console.PlainLines each refresh is a line of its own, a bar cleared leaves no blank line, and a line
    written between refreshes starts on its own line."""
    import io

    from tqdm import tqdm

    from pacs_jax.console import PlainLines

    log = io.StringIO()
    stream = PlainLines(log)
    for _ in tqdm(range(2), desc="outer", file=stream, mininterval=0):
        stream.write("a log line\n")
        for _ in tqdm(range(3), desc="inner", file=stream, mininterval=0, leave=False, position=1):
            pass
    lines = log.getvalue().splitlines()
    assert "\x1b" not in log.getvalue() and "\r" not in log.getvalue() and all(line.strip() for line in lines)
    assert lines[:3] == ["outer:   0%|          | 0/2 [00:00<?, ?it/s]", "a log line",
                         "inner:   0%|          | 0/3 [00:00<?, ?it/s]"], lines
    assert lines[-1].startswith("outer: 100%|##########| 2/2") and lines.count("a log line") == 2
