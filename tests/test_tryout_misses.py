"""Issue 41 items 3 and 4: what a new user's tryout found, each through the command line as the user ran it.

- ``tools/export_hf.py --checkpoint=WORKDIR`` writes the training run's tokenizer files (it wrote none,
  and transformers then loaded an empty tokenizer without a word).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from transformers import AutoTokenizer

from conftest import REPO
from pacs_jax import checkpoints, models

TINY = models.QwenConfig(model_type="qwen2", vocab_size=151936, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "JAX_PLATFORMS": "cpu"}


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
