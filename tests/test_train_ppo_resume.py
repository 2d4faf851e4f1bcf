"""PPO's critic is checkpointed with the actor and restored on resume: the demo with
``--config.algorithm.objective=ppo`` runs end to end, and that run cut back to its checkpoint of step 2
(as a run stopped there leaves its workdir) and resumed to step 3 reports the same value losses, actor
losses and sampled tokens as the uninterrupted run and ends with the same critic (and its optimizer
state, which step 3's update read restored)."""

import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from train_helpers import FAST_DEMO_FLAGS, compile_cache_dir, finish, logs, metrics_rows, start_train, train_env

pytestmark = pytest.mark.slow(seconds=15)  # the fixture's two runs

FLAGS = (*FAST_DEMO_FLAGS, "--config.algorithm.objective=ppo", "--config.train.checkpoint_every=1",
         "--config.train.keep_checkpoints=5")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"a": workdir of a 3-step run, "b": a copy of it cut back to step 2, then resumed to 3}. The copy
    keeps what a run stopped after step 2 leaves (checkpoints 1 and 2, metrics rows 1 and 2, the
    warm-start and the evaluation before RL): step 3, its row and checkpoint, and the run's end (final
    evaluation, export, summary) are the resume's own."""
    root = tmp_path_factory.mktemp("ppo_resume")
    env = train_env(compile_cache_dir())
    a, b = root / "a", root / "b"
    assert finish(start_train(a, *FLAGS, "--config.train.steps=3", env=env, log_name="a")) == 0, logs(a, "a")
    shutil.copytree(a, b)
    for folder in ("checkpoints/3", "eval/final", "eval/final_greedy", "hf_export"):
        shutil.rmtree(b / folder)
    (b / "summary.json").unlink()
    (b / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics_rows(a) if row["step"] <= 2))
    assert finish(start_train(b, *FLAGS, "--config.train.steps=3", env=env, log_name="b")) == 0, logs(b, "b")
    assert "resumed from step 2 " in logs(b, "b")
    return {"a": a, "b": b}


def _stored(workdir, step: int, item: str) -> dict:
    return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / item)


def test_the_ppo_demo_runs_end_to_end(runs):
    summary = json.loads((runs["a"] / "summary.json").read_text())
    assert summary["final_step"] == 3 and 0.0 <= summary["accuracy_after_rl"] <= 1.0
    rows = metrics_rows(runs["a"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert np.isfinite([r["value_loss"], r["explained_variance"], r["value_clip_fraction"], r["loss"]]).all()
        assert r["skipped"] == r["critic_skipped"] == 0.0
        assert 0 <= r["rollout_kl"] and r["rollout_logprob_diff_max"] < 1e-4  # the demo's float32
    assert len({r["compilations"] for r in rows}) == 1
    critic = _stored(runs["a"], 3, "critic_params")
    assert {"value_kernel", "value_bias", "backbone.embedding"} <= set(critic)
    first = _stored(runs["a"], 1, "critic_params")
    assert not np.array_equal(np.asarray(first["value_kernel"]), np.asarray(critic["value_kernel"]))  # it learns


def test_resume_restores_the_critic(runs):
    rows_b = metrics_rows(runs["b"])
    assert [r["step"] for r in rows_b] == [1, 2, 3]  # step 3 comes from the resumed run
    a = {r["step"]: r for r in metrics_rows(runs["a"])}
    b = {r["step"]: r for r in rows_b}
    # the critic of the resumed run is the one saved: same values, same losses
    assert b[3]["sampled_tokens_checksum"] == a[3]["sampled_tokens_checksum"]
    for key in ("value_loss", "explained_variance", "critic_grad_norm", "loss", "grad_norm"):
        np.testing.assert_allclose(b[3][key], a[3][key], rtol=1e-5, err_msg=f"{key} at step 3")
    for item in ("critic_params", "critic_opt_state", "params"):
        want, got = _stored(runs["a"], 3, item), _stored(runs["b"], 3, item)
        for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-8, err_msg=item)
