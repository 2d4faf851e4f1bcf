"""Issue 41 items 3 and 4: what a new user's tryout found, each through the command line as the user ran it.

- ``tools/export_hf.py --checkpoint=WORKDIR`` writes the training run's tokenizer files (it wrote none,
  and transformers then loaded an empty tokenizer without a word).
- A tokenizer folder that does not load, a tuple override given twice: one line, status 78, no workdir.
- Data files that start with a UTF-8 byte order mark are read, every row.
- summary.json's accuracy_metric states each evaluated set's own samples and temperature.
(The evaluation CLI's unknown set: tests/test_evaluate.py; a resume with another prompts_per_step and
a resume's "compiling ... before step N": tests/test_train_stop.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

from transformers import AutoTokenizer

from conftest import REPO
from pacs_jax import checkpoints, models
from pacs_jax.data import load_problems
from pacs_jax.errors import PERMANENT_ERROR_STATUS
from pacs_jax.evaluation import EvalSet
from pacs_jax.training import run
from pacs_jax.training.spec import EvalSpec
from train_helpers import load_config, train_env

TINY = models.QwenConfig(model_type="qwen2", vocab_size=151936, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4)


def _env() -> dict[str, str]:
    return train_env()


def test_export_of_a_workdir_s_checkpoint_writes_the_run_s_tokenizer(tmp_path, qwen_tokenizer_dir):
    """A training workdir (its config.json: data.tokenizer the repository's Qwen tokenizer; a
    checkpoint at step 1 with the real vocabulary) exported with no --tokenizer: the export holds that
    tokenizer's files, and transformers' tokenizer loaded from the export encodes as the original."""
    workdir = tmp_path / "workdir"
    checkpoints.save_model(models.init_random(TINY), workdir / "checkpoints" / "1")
    workdir.joinpath("config.json").write_text(json.dumps({
        "seed": 0, "model": {"path": ""}, "train": {"steps": 1},
        "data": {"tokenizer": str(qwen_tokenizer_dir), "tokenizer_force": False}}))
    out = tmp_path / "export"
    run = subprocess.run([sys.executable, str(REPO / "tools" / "export_hf.py"), f"--checkpoint={workdir}",
                          f"--out={out}"], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"export_hf: tokenizer files from {qwen_tokenizer_dir} (the training run's data.tokenizer)" in run.stdout
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (qwen_tokenizer_dir / name).read_bytes()
    text = "Find 3 + 4. Put the answer in \\boxed{}."
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(qwen_tokenizer_dir)(text)["input_ids"]


def _cli(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=_env())


def _one_line(run: subprocess.CompletedProcess, program: str) -> str:
    """The one error line of a refused command (status 78, no traceback)."""
    assert run.returncode == PERMANENT_ERROR_STATUS and "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith(f"{program}: error: ")]
    assert len(errors) == 1, run.stderr[-3000:]
    return errors[0]


def test_a_model_folder_without_merges_txt_is_one_line_and_no_workdir(tmp_path, qwen_tokenizer_dir):
    """An HF model folder whose tokenizer has vocab.json but no merges.txt (a 40-line traceback, status 1
    and an empty workdir before), as its own tokenizer and as data.tokenizer with tokenizer_force."""
    model = tmp_path / "model"
    models.export_hf(models.init_random(TINY), model, tokenizer_dir=qwen_tokenizer_dir)
    (model / "merges.txt").unlink()
    for field, flags in (("model.path", ()),
                         ("data.tokenizer", (f"--config.data.tokenizer={model}", "--config.data.tokenizer_force=True"))):
        workdir = tmp_path / f"workdir_{field}"
        run = _cli("pacs_jax.train", f"--config.model.path={model}", "--config.data.tokenizer=", *flags,
                   f"--workdir={workdir}", cwd=tmp_path)
        assert _one_line(run, "pacs_jax.train") == (f"pacs_jax.train: error: config.{field}: the tokenizer in {model} "
                                                    "does not load: it has vocab.json but no merges.txt (nor "
                                                    "tokenizer.json)")
        assert not workdir.exists()


def test_a_tuple_override_given_twice_is_refused_naming_the_field(tmp_path, shared_data):
    """--config.data.train_files twice (ml_collections joined them: 7769 problems trained instead of 299)."""
    workdir = tmp_path / "workdir"
    run = _cli("pacs_jax.train", "--config.data.source=files", f"--config.data.train_files={shared_data / 'amc23'}",
               f"--config.data.train_files={shared_data / 'gsm8k'}", f"--workdir={workdir}", cwd=tmp_path)
    assert _one_line(run, "pacs_jax.train") == (
        "pacs_jax.train: error: --config.data.train_files is given 2 times; give the tuple once, e.g. "
        "--config.data.train_files=\"('a.jsonl', 'b.jsonl')\"")
    assert not workdir.exists()


def test_data_files_with_a_utf8_byte_order_mark_read_every_row(tmp_path, shared_data):
    """Two jsonl files of 10 rows, each starting with a BOM: one whose format is found from its fields,
    one named with allow_skips (its first row was dropped as malformed). The trainer's check (through
    check_config, which stops at train.prompts_per_step) counts all 20 rows."""
    rows = (shared_data / "math_500" / "test.jsonl").read_text().splitlines()
    files = []
    for i, name in enumerate(("by_fields.jsonl", "named.jsonl")):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + "\n".join(rows[10 * i:10 * i + 10]).encode() + b"\n")
        files.append(str(tmp_path / name) + (":math_500" if i else ""))
    run = _cli("pacs_jax.check_config", f"--config={REPO / 'configs' / 'default.py'}", "--accelerator=v5p-2",
               "--config.data.source=files", f"--config.data.train_files={tuple(files)}",
               f"--config.data.tokenizer={REPO / 'data' / 'tokenizers' / 'qwen3'}", "--config.data.allow_skips=True",
               "--config.data.held_out_problems=0", "--config.data.warmstart_problems=0", "--config.warmstart.steps=0",
               "--config.eval.sets=", cwd=tmp_path)
    assert _one_line(run, "pacs_jax.check_config") == (
        "pacs_jax.check_config: error: config.train.prompts_per_step: 32 is more than the 20 problems RL samples from "
        "(20 read, 0 held out, 0 for the warm-start only): a step takes 32 distinct prompts; lower it or the splits, "
        "or add problems")


def test_summary_accuracy_metric_states_each_evaluated_set_s_own_settings(shared_data):
    """summary.json's accuracy_metric said "32 samples ... at temperature 0.6" when a per_set override
    ran n=2, and listed per_set sets never evaluated (aime_2024 here)."""
    config = load_config("default.py")
    config.eval.final.update(n=4, temperature=0.6)
    config.eval.final.per_set = {name: {"n": 2, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16}
                                 for name in ("amc23", "aime_2024")}
    amc23, _ = load_problems(shared_data / "amc23" / "test.jsonl")
    sets = [EvalSet("amc23", amc23, "math"), EvalSet("held_out", amc23[:8], "math")]
    assert run._accuracy_metric(EvalSpec.from_config(config.eval), sets) == (
        "mean reward of the samples per problem, averaged over the eval sets (amc23: 40 problems, 2 samples at "
        "temperature 1.0, eval.final.per_set; held_out: 8 problems, 4 samples at temperature 0.6)")
