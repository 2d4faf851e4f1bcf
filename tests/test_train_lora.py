"""RL on adapters through the trainer CLI (the demo shrunk, LoRA rank 4 on every linear layer, every norm trained
whole beside them (PEFT's modules_to_save), the KL loss on):
the warm-start trains the base at full rank, as a run without LoRA does, and the run keeps it for its
resume and export; the learner trains and checkpoints the adapters alone, a run stopped and resumed equals an uninterrupted
one, the KL to the reference (the adapters off) starts at 0, the sampler samples the newest adapter, and
the run exports a PEFT folder beside the merged model. One step off's weight move: the adapters alone."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors.numpy import load_file

from pacs_jax import models, sharding
from pacs_jax.models import lora
from pacs_jax.training.engine.weight_sync import WeightSync
from qwen_reference import load_tool
from train_helpers import FAST_DEMO_FLAGS, compile_cache_dir, finish, logs, metrics_rows, start_train, train_env

pytestmark = pytest.mark.slow(seconds=60)  # two short runs and a resume of the demo's tiny model

# the shrunk demo with a 2-step warm-start (of the model without adapters: decision 0014), then LoRA's RL
WARM_START_FLAGS = (*FAST_DEMO_FLAGS, "--config.warmstart.steps=2", "--config.warmstart.target_accuracy=0",
                    "--config.eval.sets=")
FLAGS = (*WARM_START_FLAGS, "--config.model.lora_rank=4", "--config.model.lora_alpha=8", "--config.optim.lr=3e-3",
         "--config.model.modules_to_save=norm",  # the final norm and each layer's four (qwen3: q and k norms)
         "--config.algorithm.use_kl_loss=True", "--config.algorithm.kl_loss_coef=0.01",
         "--config.train.mini_batches=1", "--config.train.checkpoint_every=1", "--config.eval.sets=")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"a": an uninterrupted 3-step run, "b": the same run stopped after step 2 and resumed to step 3}."""
    root = tmp_path_factory.mktemp("lora")
    env = train_env(compile_cache_dir())
    a, b = root / "a", root / "b"
    assert finish(start_train(a, *FLAGS, "--config.train.steps=3", env=env, log_name="a")) == 0, logs(a, "a")
    assert finish(start_train(b, *FLAGS, "--config.train.steps=2", env=env, log_name="b1")) == 0, logs(b, "b1")
    assert finish(start_train(b, *FLAGS, "--config.train.steps=3", env=env, log_name="b2")) == 0, logs(b, "b2")
    return {"a": a, "b": b, "resume_log": logs(b, "b2")}


def _stored_arrays(step_dir, item: str) -> list:
    """The metadata (shape, dtype) of each array a checkpoint's item holds (Orbax's)."""
    meta = ocp.StandardCheckpointer().metadata(step_dir / item)
    tree = getattr(meta, "item_metadata", meta)
    return jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape"))


def _stored_shapes(step_dir, item: str) -> list[tuple[int, ...]]:
    """The shapes of the arrays a checkpoint's item holds."""
    return [tuple(x.shape) for x in _stored_arrays(step_dir, item)]


NORMS = ["final_norm.scale", "layers.attn.k_norm.scale", "layers.attn.q_norm.scale", "layers.input_norm.scale",
         "layers.post_attn_norm.scale"]


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_alone(runs):
    """The adapters and the modules trained whole (the norms), with their AdamW state: no other weight."""
    step = runs["a"] / "checkpoints" / "3"
    names = list(getattr(ocp.StandardCheckpointer().metadata(step / "params"), "item_metadata"))
    assert sorted(n for n in names if "_lora." not in n) == NORMS, sorted(names)
    assert len(names) == 2 * 7 + len(NORMS)  # A and B of q, k, v, o, gate, up, down
    params = _stored_shapes(step, "params")
    moments = [shape for shape in _stored_shapes(step, "opt_state") if shape]  # AdamW's mu and nu, not its count
    assert sorted(moments) == sorted(params * 2)  # over the adapters alone
    # the bytes of the arrays it stores, not of its files: Orbax's metadata and the number of its data files
    # vary from save to save (116-149 KB for the same adapters), which once crossed this bound
    stored = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for item in ("params", "opt_state")
                 for x in _stored_arrays(step, item))
    export = sum(f.stat().st_size for f in (runs["a"] / "hf_export").glob("*.safetensors"))
    assert stored < export / 4, (stored, export)  # no base weight in it


def test_a_run_stopped_and_resumed_equals_the_uninterrupted_one(runs):
    """The resume puts the checkpoint's adapters on the warm-started base the run wrote (<workdir>/lora_base,
    named in the checkpoints' model_config.json); on another base its steps would differ."""
    assert "resumed from step 2" in runs["resume_log"]
    for run in ("a", "b"):
        named = json.loads((runs[run] / "checkpoints" / "model_config.json").read_text())["pacs_jax"]["lora"]
        assert named["model_path"] == str((runs[run] / "lora_base").absolute()), named
    a = {row["step"]: row for row in metrics_rows(runs["a"])}
    b = {row["step"]: row for row in metrics_rows(runs["b"])}
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in (1, 2, 3):
        assert b[step]["sampled_tokens_checksum"] == a[step]["sampled_tokens_checksum"], step
        np.testing.assert_allclose(b[step]["loss"], a[step]["loss"], rtol=1e-6, err_msg=f"step {step}")
        np.testing.assert_allclose(b[step]["actor/kl_loss"], a[step]["actor/kl_loss"], rtol=1e-5, atol=1e-9)
    adapters_a = load_file(runs["a"] / "peft_adapter" / "adapter_model.safetensors")
    adapters_b = load_file(runs["b"] / "peft_adapter" / "adapter_model.safetensors")
    assert sorted(adapters_a) == sorted(adapters_b)
    for name in adapters_a:
        np.testing.assert_array_equal(adapters_b[name], adapters_a[name], err_msg=name)


def test_the_kl_starts_at_zero_and_the_sampler_samples_the_newest_adapter(runs):
    rows = {row["step"]: row for row in metrics_rows(runs["a"])}
    assert abs(rows[1]["actor/kl_loss"]) < 1e-6  # B = 0: the policy is the reference (the adapters off)
    moved = rows[3]["actor/kl_loss"]
    assert moved > 1e-5, moved  # the adapters have moved the policy away from the base
    for step in (2, 3):  # sampled with the adapters pi_old has: the newest, not the first (then the gap ~ the KL)
        gap = rows[step]["rollout_logprob_diff_max"]
        assert gap < 1e-3 and gap < 0.1 * np.sqrt(moved), (step, gap, moved)
    config = json.loads((runs["a"] / "peft_adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["modules_to_save"]) == ("LORA", 4, 8.0,
                                                                                                   ["norm"])
    # the KL reference's one copy: the norms as RL started them, the warm-started base's, bit for bit
    reference = ocp.StandardCheckpointer().restore(runs["a"] / "kl_reference")
    base = ocp.StandardCheckpointer().restore(runs["a"] / "lora_base" / "params")
    assert sorted(reference) == NORMS
    for name in NORMS:
        np.testing.assert_array_equal(reference[name], base[name], err_msg=name)
    trained = ocp.StandardCheckpointer().restore(runs["a"] / "checkpoints" / "3" / "params")
    assert not np.array_equal(trained["final_norm.scale"], base["final_norm.scale"])  # trained, apart from it
    assert (runs["a"] / "hf_export" / "model.safetensors").is_file()  # the merged model


def test_export_hf_writes_the_checkpoints_adapters_as_peft_or_merged_as_the_run_did(runs, tmp_path):
    """A LoRA checkpoint holds the adapters alone; export_hf loads it onto its base (the warm-started one the run
    wrote to <workdir>/lora_base) and writes what the run's own end wrote, bit for bit: the PEFT folder, and with --merged the model."""
    export_hf = load_tool("export_hf")
    export_hf.main(["--checkpoint", str(runs["a"]), "--out", str(tmp_path / "peft")])
    export_hf.main(["--checkpoint", str(runs["a"]), "--out", str(tmp_path / "merged"), "--merged"])
    for ours, run in ((tmp_path / "peft" / "adapter_model.safetensors", runs["a"] / "peft_adapter" / "adapter_model.safetensors"),
                      (tmp_path / "merged" / "model.safetensors", runs["a"] / "hf_export" / "model.safetensors")):
        got, want = load_file(ours), load_file(run)
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_without_lora_the_kl_reference_is_a_frozen_copy_kept_for_the_resume(runs, tmp_path):
    """Full fine-tuning with the KL loss: the reference is the weights RL starts from, a copy written once to
    <workdir>/kl_reference; the KL is 0 at step 1; a resume reads the copy back, and its step's KL is above 0.
    Those weights are the LoRA run's base: the same warm-start, at full rank, whatever RL then trains."""
    flags = (*WARM_START_FLAGS, "--config.algorithm.use_kl_loss=True", "--config.optim.lr=1e-3",
             "--config.train.mini_batches=1")
    env = train_env(compile_cache_dir())
    workdir = tmp_path / "full"
    assert finish(start_train(workdir, *flags, "--config.train.steps=1", env=env, log_name="f1")) == 0, logs(workdir, "f1")
    assert (workdir / "kl_reference").is_dir() and not (workdir / "peft_adapter").exists()
    reference = ocp.StandardCheckpointer().restore(workdir / "kl_reference")
    base = ocp.StandardCheckpointer().restore(runs["a"] / "lora_base" / "params")
    assert sorted(base) == sorted(reference)
    for name in reference:  # one warm-start program, the model without adapters: the same weights, bit for bit
        np.testing.assert_array_equal(base[name], reference[name], err_msg=name)
    assert finish(start_train(workdir, *flags, "--config.train.steps=2", env=env, log_name="f2")) == 0, logs(workdir, "f2")
    rows = {row["step"]: row for row in metrics_rows(workdir)}
    assert abs(rows[1]["actor/kl_loss"]) < 1e-6 < rows[2]["actor/kl_loss"], rows  # step 2 against the copy read back
    assert "resumed from step 1" in logs(workdir, "f2")


def test_one_step_offs_weight_move_takes_the_adapters_alone_after_the_first(tmp_path):
    cfg = models.QwenConfig(model_type="qwen3", vocab_size=160, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            tie_word_embeddings=True, attention_bias=False)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    engine_mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])  # the engine's own
    with jax.set_mesh(mesh):
        model = lora.attach(models.init_random(cfg), rank=2, alpha=4.0, targets=("q_proj", "down_proj"),
                            modules_to_save=("model.norm",), seed=0)  # the final norm trained whole
    _, params = nnx.split(model)
    sync = WeightSync(params, engine_mesh, "bfloat16", adapters_only=True)
    first = sync(params)
    full = sum(x.size * 2 for x in jax.tree.leaves(params))  # bf16 copies of every parameter
    assert sync.moved_bytes == full
    adapters, base = lora.split(params)
    assert [path for path, _ in nnx.to_flat_state(lora.saved(adapters))] == [("final_norm", "scale")]
    trained = jax.tree.map(lambda x: x + 1.0, adapters)  # an update: the adapters (and the final norm) alone move
    second = sync(nnx.merge_state(trained, base), previous=first)
    assert sync.moved_bytes == sum(x.size * 2 for x in jax.tree.leaves(adapters))
    engine_adapters, engine_base = lora.split(second)
    for got, want in zip(jax.tree.leaves(engine_adapters), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32))
    for got, want in zip(jax.tree.leaves(engine_base), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32))
