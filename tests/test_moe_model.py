"""A Qwen3-MoE model in and out of Hugging Face's format: our logits against transformers'
``Qwen3MoeForCausalLM`` (float32, random weights, the real vocabulary), greedy decoding against its
``generate``, the HF files written back bit for bit, and a config it does not serve refused naming the field."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from pacs_jax import checkpoints, sampling
from pacs_jax.models.config import PRESETS, QwenConfig
from pacs_jax.models.moe import MoE
from pacs_jax.models.qwen import MLP
from pacs_jax.sharding import make_mesh
from qwen_reference import MOE_ARCHS, hf_logits, load_tool, max_rel_err, padded_batch, save_random_hf_model
from test_hf_roundtrip import assert_bit_identical, read_safetensors
from test_sampling import hf_greedy
from train_helpers import (FAST_DEMO_FLAGS, RL_ONLY_FLAGS, compile_cache_dir, finish, logs, metrics_rows, start_train,
                           train_env)

import_hf, export_hf = load_tool("import_hf"), load_tool("export_hf")


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """(HF directory, transformers model) of a random Qwen3-MoE saved with save_pretrained: 3 layers, the middle
    one dense (``mlp_only_layers``) between two sparse ones of 8 experts, 2 a token."""
    path = tmp_path_factory.mktemp("moe") / "hf"
    return path, save_random_hf_model("qwen3_moe", path, seed=5, num_hidden_layers=3, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def ours(hf_moe):
    return checkpoints.from_pretrained(hf_moe[0], dtype="float32")


def test_the_config_reads_the_experts_as_transformers_writes_them(hf_moe):
    written = json.loads((hf_moe[0] / "config.json").read_text())
    cfg = QwenConfig.from_hf_file(hf_moe[0])
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) \
        == ("qwen3_moe", written.get("num_experts", written.get("num_local_experts")), 2, 32, True)
    assert cfg.layer_runs() == ((True, 0, 1), (False, 1, 1), (True, 2, 1))  # sparse, dense, sparse


@pytest.mark.parametrize("side", ["left", "right"])
def test_logits_match_transformers(hf_moe, ours, side):
    tokens, mask = padded_batch(ours.cfg.vocab_size, [9, 4, 7], 9, side, seed=1)
    logits = np.asarray(ours(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)))
    assert max_rel_err(logits, hf_logits(hf_moe[1], tokens, mask), mask) < 1e-4


def test_greedy_decoding_equals_transformers_generate(hf_moe, ours):
    prompts = [[5, 17, 900, 33, 151000], [42, 7], [1000, 2000, 3000, 4000, 5, 6, 7]]
    want, _ = hf_greedy(hf_moe[1], prompts, 12)
    got = sampling.generate(ours, prompts, max_new_tokens=12, stop_token_ids=())
    assert [list(t) for t in got.tokens] == want.tolist()


def test_import_then_export_writes_the_hf_tensors_bit_for_bit(hf_moe, tmp_path):
    import_hf.main(["--hf_dir", str(hf_moe[0]), "--out", str(tmp_path / "ckpt")])
    export_hf.main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "export")])
    ref = read_safetensors(hf_moe[0])
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in ref and "model.layers.0.mlp.gate.weight" in ref
    assert "model.layers.1.mlp.down_proj.weight" in ref  # the dense layer's MLP
    assert_bit_identical(read_safetensors(tmp_path / "export"), ref)


def test_the_presets_activate_what_their_model_cards_say():
    """3.3 B parameters a token of Qwen3-30B-A3B, 22 B of Qwen3-235B-A22B (the totals against the cards:
    tests/test_model_config.py): attention, k experts and the router of every layer, the embedding and head."""
    def active(cfg):
        attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
        moe = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        router = cfg.hidden_size * cfg.num_experts
        return cfg.num_hidden_layers * (attn + moe + router) + 2 * cfg.vocab_size * cfg.hidden_size
    assert 3.3e9 <= active(PRESETS["Qwen3-30B-A3B"]) < 3.4e9  # the cards' figures, to their last digit
    assert 22e9 <= active(PRESETS["Qwen3-235B-A22B"]) < 23e9


def test_every_other_layer_sparse_computes_transformers_logits_and_routes_only_there(tmp_path):
    """``decoder_sparse_step`` 2 (layers 1 and 3 sparse, 0 and 2 dense): a scan a stack, the logits as transformers',
    the routing record of the two sparse layers."""
    hf = save_random_hf_model("qwen3_moe", tmp_path / "hf", seed=6, num_hidden_layers=4, decoder_sparse_step=2)
    ours = checkpoints.from_pretrained(tmp_path / "hf", dtype="float32")
    tokens, mask = padded_batch(ours.cfg.vocab_size, [7, 4], 7, "left", seed=3)
    logits, routing = ours(jnp.asarray(tokens), attention_mask=jnp.asarray(mask), with_routing=True)
    assert max_rel_err(np.asarray(logits), hf_logits(hf, tokens, mask), mask) < 1e-4
    assert routing.shape == (2, 7, 2, 2) and isinstance(ours.layers_1.mlp, MoE) and isinstance(ours.layers.mlp, MLP)


@pytest.mark.parametrize("changes, field", [(dict(mlp_only_layers=[7]), "mlp_only_layers"),
                                            (dict(decoder_sparse_step=0), "decoder_sparse_step"),
                                            (dict(num_experts_per_tok=None), "num_experts_per_tok")])
def test_a_config_json_it_does_not_serve_is_refused_naming_the_field(hf_moe, changes, field):
    written = json.loads((hf_moe[0] / "config.json").read_text()) | changes
    with pytest.raises(ValueError, match=field):
        QwenConfig.from_hf_dict({k: v for k, v in written.items() if v is not None}, source="config.json")


def test_a_dense_mlps_adapter_names_on_a_mixture_of_experts_are_refused_naming_the_field():
    """up_proj names a dense MLP's Linear, which a model of experts does not have (its experts' weights are
    target_parameters: tests/test_moe_lora.py)."""
    with pytest.raises(ValueError, match="lora_targets"):
        PRESETS["Qwen3-30B-A3B"].replace(lora_rank=8, lora_alpha=16.0, lora_targets=("q_proj", "up_proj"))
    assert PRESETS["Qwen3-30B-A3B"].replace(lora_rank=8, lora_alpha=16.0, lora_targets=("q_proj",)).lora_rank == 8


def test_the_demo_trains_a_mixture_of_experts_model_and_transformers_loads_its_export(tmp_path):
    """The shrunk demo (warm-start, RL steps replaying the sampler's routing (R3) on packed passes, checkpoint,
    evaluation, HF export) with every layer sparse (4 experts, 2 a token): each step reports how many tokens the
    learner's routers would have sent elsewhere (none: the same float32 weights); transformers'
    Qwen3MoeForCausalLM reads the export and computes our logits."""
    workdir = tmp_path / "run"
    flags = (*FAST_DEMO_FLAGS, "--config.train.steps=2", "--config.model.model_type=qwen3_moe",
             "--config.model.num_experts=4", "--config.model.num_experts_per_tok=2",
             "--config.model.moe_intermediate_size=64", "--config.train.router_replay=R3")
    process = start_train(workdir, *flags, env=train_env(compile_cache_dir()), log_name="moe")
    assert finish(process) == 0, logs(tmp_path / "run", "moe")[-3000:]
    rows = metrics_rows(workdir)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["routing_mismatch_tokens"] == row["routing_mismatch_decisions"] == 0 for row in rows)
    export = workdir / "hf_export"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    model = checkpoints.from_pretrained(export, dtype="float32")
    tokens, mask = padded_batch(model.cfg.vocab_size, [6, 3], 6, "left", seed=2)
    logits = np.asarray(model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)))
    assert max_rel_err(logits, hf_logits(hf, tokens, mask), mask) < 1e-4


def test_without_replay_the_routing_difference_is_still_measured_each_step(tmp_path):
    """train.router_replay disabled (the default) on a mixture-of-experts model: nothing is replayed, and the
    sampler still records its experts, so each step reports and prints how far the learner's routers differ
    (RunSpec.measures_routing): none here (one set of float32 weights in both roles). One RL step, no warm-start,
    with a load-balancing loss (train.router_aux_loss_coef): its metric (E sum_e f_e P_e: above 0, at most E k = 8)
    and its line."""
    workdir = tmp_path / "run"
    flags = (*RL_ONLY_FLAGS, "--config.train.steps=1", "--config.model.model_type=qwen3_moe",
             "--config.model.num_experts=4", "--config.model.num_experts_per_tok=2",
             "--config.model.moe_intermediate_size=64", "--config.train.router_aux_loss_coef=0.01")
    process = start_train(workdir, *flags, env=train_env(compile_cache_dir()), log_name="off")
    assert finish(process) == 0, logs(tmp_path / "run", "off")[-3000:]
    (row,) = metrics_rows(workdir)
    assert row["routing_mismatch_tokens"] == row["routing_mismatch_decisions"] == 0
    assert 0 < row["actor/router_aux_loss"] <= 8, row
    assert "load balance: the routers' load-balancing loss " in logs(workdir, "off")
    assert ("step 1: routing: the learner's routers sent 0% of the tokens (0% of their layers' decisions) to other "
            "experts than the sampler's (train.router_replay disabled: nothing replayed)") in logs(workdir, "off")


def _loss_and_grads(model, tokens, mask):
    """The mean next-token log-likelihood of the real tokens and its gradient, jitted on the mesh in context."""
    def loss(m):
        logp = jax.nn.log_softmax(m(tokens, attention_mask=mask)[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(picked * mask[:, 1:]) / jnp.sum(mask[:, 1:])
    return nnx.jit(nnx.value_and_grad(loss))(model)


def test_on_a_2x2x2_mesh_the_experts_are_split_and_logits_and_gradients_equal_one_device(hf_moe):
    """With ``expert_parallel``, the experts split over fsdp (``moe.local_dispatch``: the fsdp pair's tokens gathered
    to each half of the experts; loaded from HF weights straight into that layout), their width over the tensor axis, each batch shard dispatching its own tokens:
    logits and every parameter's gradient as on one device."""
    tokens, mask = (jnp.asarray(a) for a in padded_batch(MOE_ARCHS["qwen3_moe"]["vocab_size"], [8, 5, 3, 7], 8,
                                                          "left", seed=4))
    results = {}
    for shape in ((1, 1, 1), (2, 2, 2)):
        with jax.set_mesh(make_mesh(*shape, devices=jax.devices()[:math.prod(shape)])):
            model = checkpoints.from_pretrained(hf_moe[0], dtype="float32", expert_parallel=True)
            if shape == (2, 2, 2):
                layers = nnx.state(model, nnx.Param)["layers"]["mlp"]
                assert tuple(layers["gate_kernel"].get_value().sharding.spec) == (None, "fsdp", None, "tensor")
                assert tuple(layers["down_kernel"].get_value().sharding.spec) == (None, "fsdp", "tensor", None)
            loss, grads = _loss_and_grads(model, tokens, mask)
            if shape == (2, 2, 2):  # each device sorts its fsdp pair's 16 tokens' 32 slots, not all 32 tokens' 64
                hlo = nnx.jit(lambda m: m(tokens, attention_mask=mask).sum()).lower(model).compile().as_text()
                sorted_slots = set(re.findall(r"\(s32\[(\d+)\]\{0\}, s32\[\d+\]\{0\}\) sort\(", hlo))
                assert sorted_slots == {str(tokens.size * 2 // 2)}, sorted_slots
            results[shape] = (float(loss), {".".join(map(str, p)): np.asarray(v.get_value())
                                            for p, v in nnx.to_flat_state(grads)})
    (loss1, grads1), (loss8, grads8) = results[(1, 1, 1)], results[(2, 2, 2)]
    np.testing.assert_allclose(loss8, loss1, rtol=1e-6)
    assert sorted(grads8) == sorted(grads1) and "layers.mlp.router_kernel" in grads1
    for name, grad in grads1.items():
        assert np.abs(grad).max() > 0, name  # every parameter, the router included, is trained
        # float32 sums in another order on 8 shards: within 1e-4 relative, or 1e-5 of the tensor's largest entry
        np.testing.assert_allclose(grads8[name], grad, rtol=1e-4, atol=1e-5 * np.abs(grad).max(), err_msg=name)


def test_rl_on_adapters_of_the_attention_and_the_experts_through_the_cli(tmp_path):
    """LoRA on a mixture-of-experts model as verl's config asks for it: target_modules all-linear (PEFT's: the
    attention's four Linear) and target_parameters the experts' two, the KL to the base (the adapters off) on,
    routing replayed (R3). The KL starts at 0; the checkpoint holds the adapters alone; the experts' adapters train;
    the PEFT folder names the experts' parameters; transformers reads the merged export."""
    workdir = tmp_path / "run"
    flags = (*RL_ONLY_FLAGS, "--config.train.steps=2", "--config.model.model_type=qwen3_moe",
             "--config.model.num_experts=4", "--config.model.num_experts_per_tok=2",
             "--config.model.moe_intermediate_size=64", "--config.train.router_replay=R3",
             "--config.model.lora_rank=4", "--config.model.lora_alpha=8", "--config.optim.lr=3e-3",
             "--config.model.target_parameters=gate_up_proj,down_proj", "--config.algorithm.use_kl_loss=True",
             "--config.algorithm.kl_loss_coef=0.01", "--config.train.mini_batches=1")
    process = start_train(workdir, *flags, env=train_env(compile_cache_dir()), log_name="lora")
    assert finish(process) == 0, logs(tmp_path / "run", "lora")[-3000:]
    rows = metrics_rows(workdir)
    assert [row["step"] for row in rows] == [1, 2] and abs(rows[0]["actor/kl_loss"]) < 1e-6
    assert all(row["routing_mismatch_tokens"] == 0 for row in rows)
    # step 2 samples with the adapters step 1 trained (down's B moved off 0): a sampler left on the first ones, or
    # on the base, would differ from pi_old's log-probs by about the KL it reports
    assert rows[1]["actor/kl_loss"] > 1e-8 and rows[1]["rollout_logprob_diff_max"] < 1e-5, rows[1]
    names = list(getattr(ocp.StandardCheckpointer().metadata(workdir / "checkpoints" / "2" / "params"),
                         "item_metadata"))
    assert sorted(names) == sorted(f"layers.{sub}.{m}_lora.{f}" for sub, ms in
                                   (("attn", "qkvo"), ("mlp", ("gate_up", "down"))) for m in ms for f in "ab")
    config = json.loads((workdir / "peft_adapter" / "adapter_config.json").read_text())
    assert (config["target_modules"], config["target_parameters"]) == (
        ["q_proj", "k_proj", "v_proj", "o_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    tensors = load_file(workdir / "peft_adapter" / "adapter_model.safetensors")
    # down_proj's B [D, r E] (from 0) and gate_up_proj's A [E r, D], PEFT's layouts for 4 experts at rank 4
    trained = tensors["base_model.model.model.layers.0.mlp.experts.lora_B.weight"]
    assert trained.shape[1] == 16 and np.abs(trained).max() > 0
    assert tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape[0] == 16
    hf = transformers.AutoModelForCausalLM.from_pretrained(workdir / "hf_export", dtype=torch.float32)
    assert hf.config.num_experts == 4
    # the line a PEFT user knows from print_trainable_parameters, counted against the checkpoint's arrays
    meta = ocp.StandardCheckpointer().metadata(workdir / "checkpoints" / "2" / "params")
    stored = sum(math.prod(x.shape) for x in jax.tree.leaves(meta.item_metadata, is_leaf=lambda x: hasattr(x, "shape")))
    assert (f"LoRA rank 4 (alpha 8) on q_proj, k_proj, v_proj, o_proj, mlp.experts.gate_up_proj, "
            f"mlp.experts.down_proj: trainable params {stored:,} of all params ") in logs(workdir, "lora")
