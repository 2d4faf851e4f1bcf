"""Resume: a demo run killed with SIGKILL after its second checkpoint and restarted reaches the same
per-step loss, rewards, sampled tokens and final parameters as an uninterrupted run with the same
seed; tools/export_hf.py turns the trainer's checkpoints into a directory transformers loads."""

import json
import signal
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from transformers import AutoModelForCausalLM

from pacs_jax.checkpoints import load_model
from train_helpers import (FAST_DEMO_FLAGS, REPO, checkpoint_steps, compile_cache_dir, finish, logs, metrics_rows,
                           start_train, train_env, wait_for)

pytestmark = pytest.mark.slow(seconds=10)  # the fixture's three runs, ~40 s: the demo's programs from the run's cache

STEPS = 4
FLAGS = (*FAST_DEMO_FLAGS, f"--config.train.steps={STEPS}", "--config.train.checkpoint_every=1",
         "--config.train.keep_checkpoints=5")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"a": workdir of the uninterrupted run, "b": workdir of the killed-and-restarted run,
    "killed_after": checkpoint steps on disk at the kill, "rows_before_restart": metrics rows then,
    "warmstart_rewritten": whether the restart redid the warm-start (it rewrites warmstart.json),
    "restart_log": the restarted run's output}."""
    root = tmp_path_factory.mktemp("resume")
    env = train_env(compile_cache_dir())
    a, b = root / "a", root / "b"
    assert finish(start_train(a, *FLAGS, env=env, log_name="a")) == 0, logs(a, "a")

    first = start_train(b, *FLAGS, env=env, log_name="b1")
    wait_for(lambda: 2 in checkpoint_steps(b), first, "the checkpoint of step 2")
    first.send_signal(signal.SIGKILL)
    assert finish(first) == -signal.SIGKILL
    killed_after = checkpoint_steps(b)
    rows_before_restart = len(metrics_rows(b))
    warmstart_written = (b / "warmstart.json").stat().st_mtime_ns
    assert finish(start_train(b, *FLAGS, env=env, log_name="b2")) == 0, logs(b, "b2")
    return {"a": a, "b": b, "killed_after": killed_after, "rows_before_restart": rows_before_restart,
            "warmstart_rewritten": (b / "warmstart.json").stat().st_mtime_ns != warmstart_written,
            "restart_log": logs(b, "b2")}


def _last_row_per_step(rows: list[dict]) -> dict[int, dict]:
    return {row["step"]: row for row in rows}  # a restarted step's row replaces the killed run's


def test_killed_run_was_interrupted_and_the_restart_resumed_from_its_checkpoint(runs):
    killed_after = runs["killed_after"]
    assert 2 in killed_after and max(killed_after) < STEPS, killed_after
    assert runs["rows_before_restart"] >= max(killed_after)
    assert f"resumed from step {max(killed_after)} " in runs["restart_log"]
    # the restart kept the rows up to its checkpoint and logged the steps it ran again once each
    assert [row["step"] for row in metrics_rows(runs["b"])] == list(range(1, STEPS + 1))
    assert not runs["warmstart_rewritten"]  # the warm-start result was kept, not redone
    assert checkpoint_steps(runs["b"])[-1] == STEPS


def test_restarted_run_matches_the_uninterrupted_one_step_by_step(runs):
    a = _last_row_per_step(metrics_rows(runs["a"]))
    b = _last_row_per_step(metrics_rows(runs["b"]))
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert b[step]["sampled_tokens_checksum"] == a[step]["sampled_tokens_checksum"], step
        assert b[step]["reward_mean"] == a[step]["reward_mean"], step
        assert b[step]["response_length_mean"] == a[step]["response_length_mean"], step
        np.testing.assert_allclose(b[step]["loss"], a[step]["loss"], rtol=1e-6, err_msg=f"step {step}")
        np.testing.assert_allclose(b[step]["grad_norm"], a[step]["grad_norm"], rtol=1e-5, err_msg=f"step {step}")
        np.testing.assert_allclose(b[step]["lr"], a[step]["lr"], rtol=1e-7, err_msg=f"step {step}")
    # the steps differ from each other: equal rows are not equal by construction
    assert len({a[s]["sampled_tokens_checksum"] for s in a}) == STEPS


def _stored_params(workdir, step: int) -> dict[str, np.ndarray]:
    return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "params")


def test_restarted_run_ends_with_the_same_parameters_and_accuracy(runs):
    a, b = _stored_params(runs["a"], STEPS), _stored_params(runs["b"], STEPS)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(np.asarray(b[name]), np.asarray(a[name]), rtol=1e-6, atol=1e-9, err_msg=name)
    first = _stored_params(runs["a"], 1)
    assert any(not np.array_equal(np.asarray(first[k]), np.asarray(a[k])) for k in a)  # RL moved them
    summary_a = json.loads((runs["a"] / "summary.json").read_text())
    summary_b = json.loads((runs["b"] / "summary.json").read_text())
    for key in ("accuracy_before_rl", "accuracy_after_rl", "greedy_accuracy_after_rl", "final_step"):
        assert summary_b[key] == summary_a[key], key


def test_export_hf_tool_on_trainer_checkpoints_loads_in_transformers(runs, tmp_path):
    out = tmp_path / "hf"
    env = train_env()
    done = subprocess.run([sys.executable, "tools/export_hf.py", "--checkpoint", str(runs["a"] / "checkpoints"),
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert hf.config.model_type == "qwen3"

    # the latest trainer checkpoint, read by our loader, and the exported model give the same logits
    ours = load_model(runs["a"] / "checkpoints")
    rs = np.random.RandomState(0)
    tokens = rs.randint(2, hf.config.vocab_size, size=(2, 11)).astype(np.int32)
    want = np.asarray(ours(jnp.asarray(tokens), attention_mask=jnp.ones_like(jnp.asarray(tokens))))
    with torch.no_grad():
        got = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)

    # ... and that is the final model: the demo's own export of its in-memory result has the same weights
    final = AutoModelForCausalLM.from_pretrained(runs["a"] / "hf_export", torch_dtype=torch.float32).state_dict()
    exported = hf.state_dict()
    assert exported.keys() == final.keys()
    for name, value in final.items():
        assert torch.equal(exported[name], value), name
