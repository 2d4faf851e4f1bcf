"""gs:// paths wherever a path is read (issue 28 item 9): model.path, data.tokenizer, the data files, the
evaluation CLI's --checkpoint, and the workdir.

There is no network here, so ``gs://`` is served by ``FakeGCS``: an fsspec file system registered for the
"gs" / "gcs" protocols (the ones etils.epath asks fsspec for) whose objects are files under a local folder.
Everything above fsspec is the real code: the config check, data/remote.py's cache copy, the readers, the
tokenizer and model loaders, the trainer and the evaluation CLI's copy of a workdir. A workdir on
``gs://`` is written by Orbax through tensorstore too, which fsspec cannot serve: its test runs against a
local GCS emulator (tests/gcs_emulator.py) that both clients talk to, gcsfs and tensorstore.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys

import fsspec
import jax
import pytest
from etils import epath
from etils.epath import backend as epath_backend
from fsspec.registry import _registry as fsspec_implementations
from fsspec.implementations.local import LocalFileSystem
from tensorboardX.record_writer import GCSRecordWriter

from gcs_emulator import gcs_emulator, point_clients_at
from pacs_jax import checkpoints, data, evaluate, models
from pacs_jax.data import remote
from pacs_jax.evaluation.target import resolve as resolve_target
from pacs_jax.sharding import make_mesh
from pacs_jax.training.config_check import ConfigError, validate_config
from pacs_jax.training.metrics import read_rows
from pacs_jax.training.model_spec import model_config, run_options
from pacs_jax.training.run import run_training
from pacs_jax.training.workdir import checkpoint_steps
from pacs_jax.training.workdir_lock import LOCK_FILE, WorkdirLockedError
from test_train_real_config import TINY, deepscaler_rows, shrunk_paper_config  # noqa: F401 (a fixture)
from train_helpers import load_config, train_env


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
def hf_model_dir(tmp_path_factory, small_tokenizer_dir):
    """A tiny random Qwen2 as an HF folder (config.json, safetensors) with the files of the Qwen tokenizer cut
    to 4,096 entries (conftest.py's small_tokenizer_dir), its vocabulary."""
    tokenizer = data.load_tokenizer(small_tokenizer_dir)
    cfg = models.QwenConfig(**{**TINY, "vocab_size": len(tokenizer)}, attention_bias=True, bos_token_id=None,
                            eos_token_id=tokenizer.eos_token_id)
    out = tmp_path_factory.mktemp("hf") / "tiny_qwen2"
    return models.export_hf(models.init_random(cfg, seed=3), out, tokenizer_dir=small_tokenizer_dir)


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


@pytest.mark.slow(seconds=30)
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


def test_the_model_config_of_a_gs_model_path_is_read_from_the_store(store, hf_model_dir):
    """training/model_spec.model_config (what the resume check compares a checkpoint's shapes with) reads a
    gs:// model.path as a local one: an HF folder's config.json and generation_config.json, a pacs_jax
    checkpoint's model_config.json."""
    shutil.copytree(hf_model_dir, store / "bucket" / "hf")
    config = _config("gs://bucket/data.json", "gs://bucket/hf", steps=1)
    local = models.QwenConfig.from_hf_file(hf_model_dir, **run_options(config))
    assert model_config(config) == local
    checkpoints.write_model_config(store / "bucket" / "checkpoint", local)
    config.model.path = "gs://bucket/checkpoint"
    assert model_config(config) == local
    config.model.path = "gs://bucket/nothing"
    assert model_config(config) is None


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    """A GCS emulator (tests/gcs_emulator.py) holding the empty bucket "bucket", every client of gs:// sent to
    it, etils' and fsspec's file systems made afresh; stopped after the test. The cache of local copies is
    tmp_path / "cache"."""
    monkeypatch.setenv(remote.CACHE_ENV, str(tmp_path / "cache"))
    with gcs_emulator("bucket") as url:
        point_clients_at(url, monkeypatch)
        _forget_listings()
        yield url
        # tensorboardX keeps its writers (an atexit hook) until the interpreter exits, when each uploads its
        # events once more: to this store, gone by then, for 2 minutes of retries. Their uploads are done.
        for writer in gc.get_objects():
            if type(writer) is GCSRecordWriter:
                writer.flush = lambda: None
    _forget_listings()


def _forget_listings() -> None:
    """New etils and gcsfs file systems for gs://, without the listings the old ones cached (gcsfs keeps a
    folder's listing until it writes there itself: another process's objects would not show)."""
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    fsspec.get_filesystem_class("gs").clear_instance_cache()


# The demo's task shrunk for the gs:// workdir run: a 1-layer model of the character tokenizer, 8 prompts a
# step, no warm-start, the final evaluation on 8 held-out problems (sampled once each).
GS_RUN = {"model.num_hidden_layers": 1, "warmstart.steps": 0, "data.warmstart_problems": 0,
          "data.arithmetic.problems": 64, "data.held_out_problems": 8, "eval.batch_size": 8, "eval.slots": 8,
          "eval.final.n": 1, "eval.final.greedy": False, "train.steps": 2, "train.checkpoint_every": 1,
          "train.prompts_per_step": 8, "train.mini_batches": 2, "reward.workers": 1}


@pytest.mark.slow(seconds=100)
def test_a_run_in_a_gs_workdir_resumes_from_it_and_evaluate_reads_it(gcs, tmp_path):
    """GS_RUN trains 2 steps in gs://bucket/run, then the trainer CLI, in a process of its own, resumes
    there to step 3: the lock, config.json, metrics, Orbax checkpoints, TensorBoard, the evaluation outputs, the
    HF export and the summary are all in the store; then the evaluation CLI reads the workdir from it."""
    config = load_config("default.py")
    config.update_from_flattened_dict(GS_RUN)
    validate_config(config)  # on the 8 test devices; the run on one
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
    workdir = epath.Path("gs://bucket/run")
    (workdir / LOCK_FILE).write_text(json.dumps({"host": "node-7", "pid": 4242}))  # another host's, fresh
    with pytest.raises(WorkdirLockedError, match="pid 4242 on host node-7"):
        run_training(config, workdir)
    (workdir / LOCK_FILE).unlink()
    with jax.set_mesh(make_mesh(1, 1, 1, devices=jax.devices()[:1])):
        assert run_training(config, workdir)["final_step"] == 2
    assert checkpoint_steps(workdir) == [1, 2]
    # the resume: the trainer CLI in a process of its own, reading the store over HTTP as on another host
    flags = [f"--config.{key}={value}" for key, value in GS_RUN.items()]
    resume = subprocess.run([sys.executable, "-m", "pacs_jax.train", "--workdir=gs://bucket/run", *flags,
                             "--config.train.steps=3"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=train_env())  # one device; the store's and the cache's variables (gcs, tmp_path)
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert "resumed from step 2" in resume.stdout
    _forget_listings()
    summary = json.loads((workdir / "summary.json").read_text())
    assert (summary["final_step"], summary["sessions"], summary["hf_export"]) == (3, 2, "gs://bucket/run/hf_export")
    assert checkpoint_steps(workdir) == [1, 2, 3]
    assert [row["step"] for row in read_rows(workdir / "metrics.jsonl")] == [1, 2, 3]
    assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 3
    assert json.loads((workdir / "summary.json").read_text())["final_step"] == 3
    assert len(json.loads((workdir / "sessions.json").read_text())["sessions"]) == 2
    assert not (workdir / LOCK_FILE).exists()
    assert {"config.json", "model.safetensors"} <= {p.name for p in (workdir / "hf_export").iterdir()}
    assert (workdir / "eval" / "final" / "eval_metrics.json").is_file()
    events = [p.name for p in (workdir / "tensorboard").iterdir()]  # a session's training events file, and its
    assert (len(events), sum(name.endswith(".eval") for name in events)) == (4, 2), events  # evaluations' file

    metrics = evaluate.run(_eval_config(), "gs://bucket/run")
    assert set(metrics) == {"held_out"}
    copied = tmp_path / "cache" / "remote" / "gs" / "bucket" / "run"
    assert sorted(p.name for p in (copied / "checkpoints").iterdir()) == ["3", "model_config.json"]
    assert json.loads((workdir / "eval" / "evaluate_step_3" / "eval_metrics.json").read_text()) == metrics
    assert not (copied / "eval" / "evaluate_step_3").exists()  # the outputs are the workdir's, not the copy's


def _eval_config():
    """configs/eval.py on the run's held-out problems: greedy, 12 new tokens, one device."""
    config = load_config("eval.py")
    config.update(dict(model=dict(dtype="float32"), eval=dict(sets="held_out", max_new_tokens=12,
                                                              final=dict(n=1, temperature=0.0)),
                       evaluate=dict(use_mesh=False, progress=False), reward=dict(workers=1, item_timeout=5.0)))
    return config
