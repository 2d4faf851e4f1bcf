"""An export never replaces a training workdir, and written files get the modes a plain open() gives.

Issue 28: `tools/export_hf.py --overwrite` with --out at the workdir or its checkpoints replaced them
without a word; atomic writes (mkstemp / mkdtemp) left summary.json, curves.png and hf_export/ 0600 /
0700, unreadable to colleagues on a shared cluster. Issue 53: --overwrite onto an export deleted the eval/
results the evaluation CLI had written into it; files an export did not write are named and kept.
"""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from pacs_jax.errors import PERMANENT_ERROR_STATUS
from pacs_jax.files import atomic_write, atomic_write_text, current_umask
from pacs_jax.models.config import QwenConfig
from pacs_jax.models.hf_weights import NotAnExportError, check_export_target, write_hf_dir
from qwen_reference import load_tool

CFG = QwenConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)


def _tensors():
    yield "model.embed_tokens.weight", np.arange(16 * 8, dtype=np.float32).reshape(16, 8)


def _workdir(root):
    """A training workdir as the trainer leaves it (config.json, metrics, checkpoints/<step>/)."""
    workdir = root / "run"
    (workdir / "checkpoints" / "3" / "params").mkdir(parents=True)
    (workdir / "checkpoints" / "3" / "params" / "data").write_bytes(b"weights")
    (workdir / "config.json").write_text("{}")
    (workdir / "metrics.jsonl").write_text('{"step": 1}\n')
    return workdir


def _contents(folder):
    return sorted((str(p.relative_to(folder)), p.read_bytes() if p.is_file() else None) for p in folder.rglob("*"))


@pytest.mark.parametrize("target", ["workdir", "checkpoints", "step"])
def test_overwrite_refuses_a_workdir_and_its_checkpoints(tmp_path, target):
    workdir = _workdir(tmp_path)
    out = {"workdir": workdir, "checkpoints": workdir / "checkpoints", "step": workdir / "checkpoints" / "3"}[target]
    before = _contents(workdir)
    with pytest.raises(NotAnExportError, match=rf"^{out}: not a previous HF export .*not replacing it"):
        write_hf_dir(out, CFG, _tensors(), overwrite=True)  # the trainer's and export_hf's writer
    assert _contents(workdir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary folder left either


def test_overwrite_refuses_a_folder_without_an_export_and_replaces_a_previous_export(tmp_path):
    downloaded = tmp_path / "Qwen2.5-0.5B"  # issue 35: a downloaded HF model is no export of ours
    downloaded.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        (downloaded / name).write_text("{}")
    with pytest.raises(NotAnExportError, match=rf"^{downloaded}: not an export pacs_jax wrote \(no pacs_jax_export\.json; "
                                               r"it holds README\.md, config\.json, model\.safetensors, tokenizer\.json\)"):
        check_export_target(downloaded, overwrite=True)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(NotAnExportError, match="not a folder"):
        check_export_target(a_file, overwrite=True)
    out = tmp_path / "export"
    write_hf_dir(out, CFG, _tensors())
    (out / "model.safetensors").write_bytes(b"old")
    write_hf_dir(out, CFG, _tensors(), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "generation_config.json",
                                                     "model.safetensors", "pacs_jax_export.json"]  # no tokenizer
    assert (out / "model.safetensors").read_bytes() != b"old"
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        write_hf_dir(out, CFG, _tensors())
    (out / "notes.txt").write_text("mine")  # a file of someone's own in an export: named, the folder kept
    (out / "eval").mkdir()  # issue 53: python -m pacs_jax.evaluate --checkpoint=export writes its results there
    (out / "eval" / "eval_metrics.json").write_text("{}")
    with pytest.raises(NotAnExportError, match=rf"^{out}: holds eval/, notes\.txt, which pacs_jax's export did not "
                                               "write"):
        write_hf_dir(out, CFG, _tensors(), overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "eval" / "eval_metrics.json").read_text() == "{}"


def test_export_tool_refuses_the_workdir_before_loading_anything(tmp_path, capsys):
    export_hf = load_tool("export_hf")
    workdir = _workdir(tmp_path)
    before = _contents(workdir)
    for out in (workdir, workdir / "checkpoints"):
        with pytest.raises(SystemExit) as exit_info:  # the checkpoint is never read: it does not exist
            export_hf.main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(out), "--overwrite"])
        assert exit_info.value.code == PERMANENT_ERROR_STATUS
        assert capsys.readouterr().err.strip() == (
            f"export_hf: error: --out {out}: not a previous HF export (it holds "
            + ("checkpoints, metrics.jsonl" if out == workdir else "3")
            + ": a training workdir or checkpoint?); not replacing it: choose another output folder")
    assert _contents(workdir) == before


@pytest.fixture
def umask():
    """Set the process umask for one test, then restore it."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield lambda mask: os.umask(mask)
    os.umask(saved)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_written_files_and_exports_honour_the_umask(tmp_path, umask, mask):
    umask(mask)
    assert current_umask() == mask
    atomic_write_text(tmp_path / "summary.json", json.dumps({"a": 1}))
    atomic_write(tmp_path / "curves.png", lambda f: f.write(b"\x89PNG"), binary=True)
    for name in ("summary.json", "curves.png"):
        assert _mode(tmp_path / name) == 0o666 & ~mask, name
    out = write_hf_dir(tmp_path / "hf_export", CFG, _tensors())
    assert _mode(out) == 0o777 & ~mask
    for path in out.iterdir():
        assert _mode(path) == 0o666 & ~mask, path.name
    # a plain open() and mkdir() as the reference
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain.txt").write_text("x")
    assert (_mode(tmp_path / "plain"), _mode(tmp_path / "plain.txt")) == (_mode(out), _mode(tmp_path / "summary.json"))
