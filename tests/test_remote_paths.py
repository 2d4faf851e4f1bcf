"""gs:// paths wherever a path is read (issue 28 item 9): model.path, data.tokenizer, the data files, and the
evaluation CLI's --checkpoint.

There is no network here, so ``gs://`` is served by ``FakeGCS``: an fsspec file system registered for the
"gs" / "gcs" protocols (the ones etils.epath asks fsspec for) whose objects are files under a local folder.
Everything above fsspec is the real code: the config check, data/remote.py's cache copy, the readers, the
tokenizer and model loaders, the trainer and the evaluation CLI's copy of a workdir.
"""

from __future__ import annotations

import json
import shutil

import jax
import pytest
from etils.epath import backend as epath_backend
from fsspec.registry import _registry as fsspec_implementations
from fsspec.implementations.local import LocalFileSystem

from pacs_jax import checkpoints, data, evaluate, models
from pacs_jax.data import remote
from pacs_jax.evaluation.target import resolve as resolve_target
from pacs_jax.sharding import make_mesh
from pacs_jax.training.config_check import ConfigError, validate_config
from pacs_jax.training.run import run_training
from test_train_real_config import TINY, deepscaler_rows, shrunk_paper_config  # noqa: F401 (a fixture)


class FakeGCS(LocalFileSystem):
    """``gs://BUCKET/KEY`` is the file ``ROOT/BUCKET/KEY``; set ``ROOT`` before use."""

    protocol = ("gs", "gcs")
    root_marker = ""
    ROOT = ""

    def __init__(self, *args, finalize_on_close: bool = False, **kwargs):  # gcsfs's option, which etils passes
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                return f"{cls.ROOT}/{path[len(prefix):]}".rstrip("/")
        return path.rstrip("/")

    def unstrip_protocol(self, name: str) -> str:
        return "gs://" + name[len(self.ROOT) + 1:]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The fake store's root folder (gs://bucket/x is store / "bucket" / "x"); the cache of local copies is
    tmp_path / "cache"."""
    root = tmp_path / "store"
    root.mkdir()
    monkeypatch.setattr(FakeGCS, "ROOT", str(root))
    monkeypatch.setenv(remote.CACHE_ENV, str(tmp_path / "cache"))
    for name in FakeGCS.protocol:  # fsspec's registry of implementations, restored after the test
        monkeypatch.setitem(fsspec_implementations, name, FakeGCS)
    epath_backend.fsspec_backend._get_filesystem.cache_clear()  # etils keeps one file system per protocol
    FakeGCS.clear_instance_cache()
    yield root
    epath_backend.fsspec_backend._get_filesystem.cache_clear()


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory, qwen_tokenizer_dir):
    """A tiny random Qwen2 as an HF folder (config.json, safetensors) with the real Qwen tokenizer files."""
    tokenizer = data.load_tokenizer(qwen_tokenizer_dir)
    cfg = models.QwenConfig(**{**TINY, "vocab_size": len(tokenizer)}, attention_bias=True, bos_token_id=None,
                            eos_token_id=tokenizer.eos_token_id)
    out = tmp_path_factory.mktemp("hf") / "tiny_qwen2"
    return models.export_hf(models.init_random(cfg, seed=3), out, tokenizer_dir=qwen_tokenizer_dir)


def _config(data_file: str, model_path: str, steps: int):
    """The shrunk paper config of test_train_real_config, its model and data at the given paths."""
    config = shrunk_paper_config(data_file, "", steps=steps)  # data.tokenizer "": the model's own
    config.model.path = model_path
    config.rollout.response_buckets = (config.rollout.max_new_tokens,)
    return config


def test_the_config_check_reads_gs_paths_and_names_a_missing_one(store, hf_model_dir, deepscaler_rows):
    shutil.copytree(hf_model_dir, store / "bucket" / "model")
    (store / "bucket" / "data").mkdir()
    shutil.copy(deepscaler_rows, store / "bucket" / "data" / "deepscaler.json")
    config = _config("gs://bucket/data/deepscaler.json", "gs://bucket/model", steps=1)
    validate_config(config)  # every path found in the store
    config.data.tokenizer = "gs://bucket/model"
    validate_config(config)

    for field, value, message in (
            ("model.path", "gs://bucket/missing_model", "config.model.path: gs://bucket/missing_model does not exist"),
            ("data.train_files", ("gs://bucket/data/none.jsonl",),
             "config.data.train_files[0]: gs://bucket/data/none.jsonl does not exist"),
            ("data.tokenizer", "gs://bucket/no_tokenizer", "config.data.tokenizer: tokenizer directory "
                                                            "'gs://bucket/no_tokenizer' does not exist")):
        broken = config.copy_and_resolve_references()
        section, name = field.split(".")
        broken[section][name] = value
        with pytest.raises(ConfigError) as error:
            validate_config(broken)
        assert str(error.value).startswith(message) and "\n" not in str(error.value)


def _short_rows(deepscaler_rows, path):
    """The rows of deepscaler_rows whose prompts fit one 256-token bucket (its 24 shortest), written to path."""
    rows = json.loads(deepscaler_rows.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sorted(rows, key=lambda r: len(r["problem"]))[:24]))


@pytest.mark.slow(seconds=20)
def test_a_run_reads_its_model_tokenizer_and_data_from_gs_and_evaluate_reads_its_workdir(
        store, hf_model_dir, deepscaler_rows, tmp_path, capsys):
    """The trainer as a run calls it (the config check's lookups, then run_training: model.path's cached
    copy, the tokenizer and data read through it, config.json, the export's tokenizer), on the cheapest run
    that writes two checkpoints: one device, 2 steps of 2 prompts x 8 responses of 4 tokens, one prompt
    bucket, no evaluation."""
    shutil.copytree(hf_model_dir, store / "bucket" / "models" / "tiny")
    _short_rows(deepscaler_rows, store / "bucket" / "data" / "deepscaler.json")
    config = _config("gs://bucket/data/deepscaler.json", "gs://bucket/models/tiny", steps=2)
    config.train.checkpoint_every = 1
    config.train.prompts_per_step, config.train.mini_batches, config.train.micro_batches = 2, 1, 1
    config.rollout.max_new_tokens, config.rollout.response_buckets = 4, (4,)
    config.data.max_prompt_length, config.data.prompt_buckets = 256, (256,)
    config.eval.before_rl = False
    validate_config(config)  # with the paper's mesh over the 8 test devices; the run on one device
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
    workdir = tmp_path / "run"
    with jax.set_mesh(make_mesh(1, 1, 1, devices=jax.devices()[:1])):
        summary = run_training(config, workdir)
    assert summary["final_step"] == 2
    copy = tmp_path / "cache" / "remote" / "gs" / "bucket" / "models" / "tiny"
    assert f"model.path gs://bucket/models/tiny: read from its copy in {copy}" in capsys.readouterr().out
    assert sorted(p.name for p in hf_model_dir.iterdir()) == sorted(p.name for p in copy.iterdir()
                                                                     if not p.name.startswith("."))
    assert json.loads((workdir / "config.json").read_text())["model"]["path"] == "gs://bucket/models/tiny"
    assert (workdir / "hf_export" / "tokenizer_config.json").is_file()  # the run's tokenizer, from the copy

    # a second reader reuses the copy; a changed file in the store is copied again
    before = (copy / "config.json").stat().st_mtime_ns
    assert remote.local_folder("gs://bucket/models/tiny") == str(copy)
    assert (copy / "config.json").stat().st_mtime_ns == before
    (store / "bucket" / "models" / "tiny" / "extra.txt").write_text("new")
    remote.local_folder("gs://bucket/models/tiny")
    assert (copy / "extra.txt").read_text() == "new"

    # the workdir on gs://: evaluate copies the config files and the newest step's parameters only
    shutil.copytree(workdir, store / "bucket" / "runs" / "one")
    local = evaluate._local_checkpoint("gs://bucket/runs/one")
    target = resolve_target(local)
    assert target.label == "step_2" and target.training_config["model"]["path"] == "gs://bucket/models/tiny"
    copied = tmp_path / "cache" / "remote" / "gs" / "bucket" / "runs" / "one"
    assert sorted(p.name for p in (copied / "checkpoints").iterdir()) == ["2", "model_config.json"]
    step_items = {p.name for p in (copied / "checkpoints" / "2").iterdir()}
    assert {"meta", "params"} <= step_items and not step_items & {"opt_state", "critic_params", "critic_opt_state"}
    assert not (copied / "hf_export").exists() and not (copied / "eval").exists()
    loaded = checkpoints.from_pretrained(target.model_dir)
    assert loaded.cfg.vocab_size == json.loads((hf_model_dir / "config.json").read_text())["vocab_size"]
    # a step folder of it, and the model folder itself
    assert resolve_target(evaluate._local_checkpoint("gs://bucket/runs/one/checkpoints/1")).label == "step_1"
    assert checkpoints.from_pretrained("gs://bucket/models/tiny").cfg.hidden_size == TINY["hidden_size"]
    with pytest.raises(Exception, match="--checkpoint=gs://bucket/runs/two: gs://bucket/runs/two does not exist"):
        evaluate._local_checkpoint("gs://bucket/runs/two")
