"""``python -m pacs_jax.evaluate`` on what the trainer leaves behind (issue 28, item 10): a training
workdir (its newest checkpoint, or its HF export, with a line saying which), the demo's models (the
character tokenizer, which writes no tokenizer files: the workdir's config.json records it), the
run's held-out problems, and relative data paths from outside the repository."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from pacs_jax import evaluate
from pacs_jax.data import paths
from pacs_jax.errors import PERMANENT_ERROR_STATUS, UsageError
from pacs_jax.evaluation import load_eval_sets
from pacs_jax.evaluation.target import resolve
from train_helpers import FAST_DEMO_FLAGS, compile_cache_dir, finish, load_config, logs, start_train, train_env

STEPS = 3


@pytest.fixture(scope="module")
def demo_workdir(tmp_path_factory) -> pathlib.Path:
    """The demo shrunk to seconds, 3 RL steps, checkpoints at steps 2 and 3, and its HF export."""
    workdir = tmp_path_factory.mktemp("demo") / "workdir"
    process = start_train(workdir, *FAST_DEMO_FLAGS, f"--config.train.steps={STEPS}", "--config.train.checkpoint_every=2",
                          env=train_env(compile_cache_dir()), log_name="train")
    assert finish(process) == 0, logs(workdir, "train")[-3000:]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]
    return workdir


def _samples(path: pathlib.Path) -> list[tuple[str, str, float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(row["problem"], s["response"], s["score"]) for row in rows for s in row["samples"]]


def test_evaluate_a_demo_workdir_from_outside_the_repository(demo_workdir, tmp_path):
    """--checkpoint=WORKDIR (it failed with "model_type=None is not supported": the workdir's config.json
    is the run's, not an HF model's) evaluates the newest checkpoint and says so; the demo's character
    tokenizer and instruction come from the run's config; greedy on the held-out problems it gives the
    trainer's own final greedy evaluation. Run from tmp_path: the config path is absolute, the data
    paths of the recorded config relative."""
    env = train_env()
    run = subprocess.run(
        [sys.executable, "-m", "pacs_jax.evaluate", f"--config={REPO / 'configs' / 'eval.py'}",
         f"--checkpoint={demo_workdir}", "--config.eval.sets=held_out", "--config.eval.final.n=1",
         "--config.eval.final.temperature=0", "--config.eval.max_new_tokens=12", "--config.model.dtype=float32",
         "--config.reward.workers=1", "--config.evaluate.progress=False"], cwd=tmp_path, env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    newest = demo_workdir / "checkpoints" / str(STEPS)
    assert (f"pacs_jax.evaluate: {demo_workdir} is a training workdir: evaluating its newest checkpoint, {newest} "
            f"(step {STEPS};") in run.stdout
    assert 'pacs_jax.evaluate: tokenizer "char" (the training run\'s data.tokenizer)' in run.stdout
    out = demo_workdir / "eval" / f"evaluate_step_{STEPS}"
    trained = _samples(demo_workdir / "eval" / "final_greedy" / "eval_samples.jsonl")
    assert len(trained) == 8 and _samples(out / "eval_samples.jsonl") == trained
    assert json.loads((out / "eval_metrics.json").read_text()) == \
        json.loads((demo_workdir / "eval" / "final_greedy" / "eval_metrics.json").read_text())


def _eval_config(tokenizer: str = "", **fields):
    config = load_config("eval.py")
    config.update(dict(model=dict(dtype="float32"), data=dict(tokenizer=tokenizer),
                       eval=dict(final=dict(n=1, temperature=0.0), max_new_tokens=12, **fields),
                       evaluate=dict(use_mesh=False, progress=False), reward=dict(workers=1, item_timeout=5.0)))
    return config


def test_the_demo_s_export_says_it_has_no_hugging_face_tokenizer(demo_workdir):
    """Issue 53 item 6: the trainer's export of a character-tokenizer run holds no Hugging Face tokenizer
    (transformers' AutoTokenizer loaded an empty one from it without a word): its log line and the export's
    own README.md say so, naming pacs_jax.data.CharTokenizer."""
    export = demo_workdir / "hf_export"
    assert f"hf_export: the HF export {export} has no Hugging Face tokenizer (" in logs(demo_workdir, "train")
    assert "pacs_jax.data.CharTokenizer()" in (export / "README.md").read_text()


def test_evaluate_the_export_and_a_checkpoint_of_a_demo_workdir(demo_workdir, tmp_path, capsys):
    """WORKDIR/hf_export and WORKDIR/checkpoints/<step> of a char-tokenizer run: the run's config.json
    beside them gives the tokenizer; the outputs go to WORKDIR/eval/evaluate_<which>, not into the
    export (which the trainer replaces) nor the Orbax step (which it rotates)."""
    trained = _samples(demo_workdir / "eval" / "final_greedy" / "eval_samples.jsonl")
    evaluate.run(_eval_config(sets="held_out"), demo_workdir / "hf_export")
    assert _samples(demo_workdir / "eval" / "evaluate_hf_export" / "eval_samples.jsonl") == trained
    evaluate.run(_eval_config(sets="held_out", max_problems=3), demo_workdir / "checkpoints" / "2")
    assert len(_samples(demo_workdir / "eval" / "evaluate_step_2" / "eval_samples.jsonl")) == 3
    assert not (demo_workdir / "hf_export" / "eval").exists() and not (demo_workdir / "checkpoints" / "2" / "eval").exists()

    # without checkpoints, a workdir's export; with neither, an error naming both
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(demo_workdir / "config.json", bare / "config.json")
    with pytest.raises(UsageError, match=r"a training workdir \(config\.json\) with no checkpoint \(checkpoints/<step>/\) "
                                         r"and no hf_export/ yet"):
        resolve(bare)
    shutil.copytree(demo_workdir / "hf_export", bare / "hf_export")
    target = resolve(bare)
    assert target.model_dir == bare / "hf_export" and "evaluating its HF export" in target.note


def test_a_demo_model_on_math_sets_is_refused_naming_the_held_out_set(demo_workdir):
    """MATH-500's LaTeX is outside the character tokenizer's alphabet: one error before the model loads."""
    with pytest.raises(UsageError, match=r"^evaluation set 'math_500': problem \d+ has characters \[.*\] that the "
                                         r"character tokenizer .* cannot encode; .*--config\.eval\.sets=held_out$"):
        evaluate.run(_eval_config(sets="math_500"), demo_workdir)


def test_the_held_out_set_needs_a_training_run(demo_workdir, tmp_path):
    model = shutil.copytree(demo_workdir / "hf_export", tmp_path / "model")  # an HF model folder in no workdir
    with pytest.raises(UsageError, match=r"^config\.eval\.sets: 'held_out' is the held-out split of a training run"):
        evaluate.run(_eval_config(sets="held_out", tokenizer="char"), model)


def test_relative_data_paths_are_read_from_the_repository_root_or_named_with_the_cwd(tmp_path, monkeypatch):
    """configs/eval.py's data_dir "data" is the repository's: from another folder it is found there; a
    path found in neither place is one error naming it, the working directory and the repository."""
    monkeypatch.chdir(tmp_path)
    files = dict(load_config("eval.py").eval.set_files)
    (amc,) = load_eval_sets("amc23", files, "data")
    assert len(amc.problems) == 40
    with pytest.raises(UsageError) as error:
        load_eval_sets("amc23", files, "nowhere")
    assert str(error.value) == (f"evaluation set 'amc23': nowhere/amc23/test.jsonl does not exist (a relative path: "
                                f"looked for in the working directory {tmp_path}, then in the repository root "
                                f"{paths.REPO_ROOT}); set the folder of the sets with data_dir (now 'nowhere')")
    local = tmp_path / "data" / "amc23"  # the working directory's copy comes first
    local.mkdir(parents=True)
    (local / "test.jsonl").write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    (mine,) = load_eval_sets("amc23", files, "data")
    assert [p.problem for p in mine.problems] == ["1 + 1?"]


def test_evaluate_cli_names_a_missing_checkpoint(tmp_path):
    env = train_env()
    run = subprocess.run([sys.executable, "-m", "pacs_jax.evaluate", f"--config={REPO / 'configs' / 'eval.py'}",
                          f"--checkpoint={tmp_path / 'nothing'}"], cwd=tmp_path, env={**env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == PERMANENT_ERROR_STATUS, run.stderr[-3000:]
    assert run.stderr.strip() == f"pacs_jax.evaluate: error: --checkpoint={tmp_path / 'nothing'}: does not exist"
