"""Running ``python -m pacs_jax.train`` as a subprocess in the trainer tests (resume, signals, config),
and loading the configs/ files as the CLI does.

The subprocess runs on one CPU device: the 8-device XLA flag of conftest.py is removed from its
environment. Runs of one pytest session, on either xdist worker, share the session's JAX compilation
cache (tests/conftest.py), so only the first run pays for compiling the demo's programs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import ml_collections

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_config(file: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """configs/<file>'s get_config(arg), as config_flags loads it, unlocked for editing."""
    spec = importlib.util.spec_from_file_location(f"_test_config_{file}", REPO / "configs" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config() if arg is None else module.get_config(arg)


# The demo shrunk to seconds: one layer, a few warm-start steps, 8 prompts x 8 responses per step in
# 2 mini-batches.
FAST_DEMO_FLAGS = (
    "--config.model.num_hidden_layers=1",
    "--config.warmstart.steps=5",
    "--config.data.arithmetic.problems=64",
    "--config.data.warmstart_problems=32",
    "--config.data.held_out_problems=8",
    "--config.eval.final.n=1",
    "--config.train.prompts_per_step=8",
    "--config.train.mini_batches=2",
    "--config.reward.workers=1",
)
# The shrunk demo straight into RL: no warm-start and no evaluation (for tests that need only RL steps).
RL_ONLY_FLAGS = (*FAST_DEMO_FLAGS, "--config.warmstart.steps=0", "--config.data.warmstart_problems=0",
                 "--config.eval.sets=")
# No warm-start (add to FAST_DEMO_FLAGS): for tests of what RL and the evaluations leave, not of the warm-start.
NO_WARMSTART_FLAGS = ("--config.warmstart.steps=0", "--config.data.warmstart_problems=0")


# The small Qwen tokenizer of the in-process trainings (``write_small_tokenizer``): a tiny model with the real
# 151,669-token vocabulary spends most of a step on its [T, V] logits and its embedding (at hidden size 64,
# ~9.7M parameters in the head against ~0.1M in the layers). 4,096 entries: the 256 byte tokens, Qwen's first
# 3,814 merges (in its own order, so its BPE on the same text, with longer token sequences) and its 26 added
# tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...: the chat template, the stop and pad ids) after them.
SMALL_TOKENIZER_SIZE = 4096


def write_small_tokenizer(source: pathlib.Path, folder: pathlib.Path, size: int = SMALL_TOKENIZER_SIZE) -> pathlib.Path:
    """Qwen's tokenizer in ``source`` cut to ``size`` entries, written to ``folder`` (vocab.json, merges.txt,
    tokenizer_config.json): its byte tokens and first merges keep their ids (Qwen's vocab.json numbers a merge's
    token 256 + its rank), and its added tokens, special or not, follow in their order with the same flags and
    the same chat template, eos (<|im_end|>) and pad (<|endoftext|>)."""
    vocab = json.loads((source / "vocab.json").read_text(encoding="utf-8"))
    header, *merges = (source / "merges.txt").read_text(encoding="utf-8").splitlines()
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = sorted(config["added_tokens_decoder"].items(), key=lambda item: int(item[0]))
    base = size - len(added)
    kept = {token: i for token, i in vocab.items() if i < base}
    assert len(kept) == base and all(kept.get("".join(m.split(" "))) == 256 + rank
                                     for rank, m in enumerate(merges[:base - 256]))
    config["added_tokens_decoder"] = {str(base + j): token for j, (_, token) in enumerate(added)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(kept, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("\n".join([header, *merges[:base - 256]]) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    return folder


# tests/no_torch/sitecustomize.py: on a subprocess's PYTHONPATH, PyTorch is not importable there, as in a user's runtime
NO_TORCH = REPO / "tests" / "no_torch"


def without_torch(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a subprocess without PyTorch (NO_TORCH first on its PYTHONPATH), as a user's runtime: what
    it prints is what a user's would (pacs_jax.data.prompts drops transformers' advice that PyTorch is missing)."""
    path = os.pathsep.join(filter(None, [str(NO_TORCH), env.get("PYTHONPATH", "")]))
    return {**env, "PYTHONPATH": path}


def train_env(cache_dir: pathlib.Path | None = None, torch: bool = False) -> dict[str, str]:
    """The environment of a trainer (or tool) subprocess: CPU, one device, LLVM's optimisation level 0 as
    conftest.py gives the test processes, optionally a shared compilation cache, and without PyTorch unless
    ``torch`` (``without_torch``; a tool that compares against transformers' models needs it). The tests' short runs of
    tiny models compile more than they run, so level 0 saves CPU time (one process each, CPU seconds with
    the default level -> level 0: test_multihost.py 168 -> 145, test_train_stop.py + test_train_stop_phases.py
    + test_run_outputs.py 107 -> 97, accelerator_check's tiny run 158 -> 130; the paper-table files 169 ->
    168); the programs are the same HLO, so every compiled figure they print is too (not their times)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()  # conftest.py's device count (the subprocess has one)
             if not f.startswith(("--xla_force_host_platform_device_count", "--xla_backend_optimization_level"))]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_backend_optimization_level=0"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    if not torch:
        env = without_torch(env)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return env


def compile_cache_dir() -> pathlib.Path:
    """The compilation cache of this pytest session (tests/conftest.py's), shared by both xdist workers and
    every trainer subprocess."""
    return pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


def start_train(workdir: pathlib.Path, *flags: str, env: dict[str, str], log_name: str,
                new_session: bool = False) -> subprocess.Popen:
    """Start ``python -m pacs_jax.train --workdir=workdir *flags``; its stdout and stderr go to
    ``workdir.parent / f"{log_name}.out"`` and ``.err``.

    new_session: run it in a process group of its own (with its reward workers), for group signals.
    """
    workdir.parent.mkdir(parents=True, exist_ok=True)
    with open(workdir.parent / f"{log_name}.out", "w") as out, open(workdir.parent / f"{log_name}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "pacs_jax.train", f"--workdir={workdir}", *flags], cwd=REPO,
                                env=env, stdout=out, stderr=err, start_new_session=new_session)


def finish(process: subprocess.Popen, timeout: float = 600) -> int:
    """Wait for ``process`` (killing it after ``timeout`` seconds) and return its exit code."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


def logs(workdir: pathlib.Path, log_name: str) -> str:
    """stdout then stderr of the run started with ``log_name``."""
    return "".join((workdir.parent / f"{log_name}.{s}").read_text() for s in ("out", "err"))


def wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 600, poll: float = 0.02) -> None:
    """Poll ``condition()`` until true; fail if ``process`` exits first or ``timeout`` passes."""
    end = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the trainer exited with {process.returncode} before {what}")
        if time.monotonic() > end:
            process.kill()
            process.wait()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def metrics_rows(workdir: pathlib.Path) -> list[dict]:
    """The complete rows of ``workdir/metrics.jsonl`` in file order (a partly written last line is left out)."""
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n"):
            rows.append(json.loads(line))
    return rows


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    """Steps of the finished checkpoints under ``workdir/checkpoints`` (Orbax renames a step's
    temporary directory to ``<step>`` once it is complete)."""
    root = workdir / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


class ListPromptSource:
    """A list of ``PromptBatch``es as a trainer's prompt source (training/loop.py ``PromptSource``): a
    cursor saved with every checkpoint."""

    def __init__(self, batches):
        self.batches, self.next_index = batches, 0

    def next_batch(self):
        self.next_index += 1
        return self.batches[self.next_index - 1]

    def get_state(self) -> dict:
        return {"next_index": self.next_index}

    def set_state(self, state: dict) -> None:
        self.next_index = state["next_index"]


def with_adapters(mesh, model, config):
    """(``model`` with fresh LoRA adapters of rank 2 on every linear layer, on ``mesh``; a copy of ``config``
    that trains them at a learning rate that moves the sampler within a step): the LoRA cases of the schedule
    tests (the sampler samples the newest adapters)."""
    import jax

    from pacs_jax.models import lora
    from pacs_jax.models.config import LORA_MODULES

    config = config.copy_and_resolve_references()
    config.model.update(lora_rank=2, lora_alpha=16.0)
    config.optim.lr = 3e-2
    with jax.set_mesh(mesh):
        return lora.attach(model, rank=2, alpha=16.0, targets=LORA_MODULES, seed=0), config


def tiny_model_on_mesh(seed: int = 5, **overrides):
    """(the (2, 2, 2) mesh of the 8 simulated devices, a 1-layer random Qwen3 of a 96-token vocabulary on it,
    eos 1; ``overrides``: QwenConfig fields, a Qwen3-MoE's): the model the step-level tests of dynamic sampling and
    carry-over train."""
    import jax

    from pacs_jax import models, sharding

    fields = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=False, bos_token_id=None,
                  eos_token_id=1, max_position_embeddings=128)
    cfg = models.QwenConfig(**{**fields, **overrides})
    mesh = sharding.make_mesh(2, 2, 2)
    with jax.set_mesh(mesh):
        return mesh, models.init_random(cfg, seed=seed)
