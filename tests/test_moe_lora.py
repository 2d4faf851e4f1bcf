"""LoRA on a Qwen3-MoE model's experts (models/moe.py ``ExpertAdapter``; PEFT's ``target_parameters``), against
transformers + peft (PyTorch CPU) on the same random weights: a fresh adapter changes nothing; the PEFT export,
loaded by peft onto the HF base, gives our logits and, under PyTorch's autograd, our gradients; merged equals
unmerged; on a 2x2x2 mesh with the experts split over fsdp the adapters split with them and their gradients equal
one device's; the config's refusals and PEFT's "all-linear"."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx

from pacs_jax import checkpoints
from pacs_jax.errors import PermanentError
from pacs_jax.models import lora
from pacs_jax.models.config import LORA_EXPERT_PARAMETERS, PRESETS
from pacs_jax.models.loading import abstract_model
from pacs_jax.models.lora_targets import resolve_parameters
from pacs_jax.models.peft_export import export_peft
from pacs_jax.sharding import make_mesh
from pacs_jax.training.config_check import validate_config
from pacs_jax.training.model_spec import model_config
from pacs_jax.training.spec import RunSpec
from qwen_reference import MOE_ARCHS, hf_logits, max_rel_err, padded_batch, save_random_hf_model
from test_lora_model import with_random_b
from train_helpers import load_config

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
BOTH = ATTENTION + LORA_EXPERT_PARAMETERS
VOCAB = MOE_ARCHS["qwen3_moe"]["vocab_size"]


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """The HF directory of a random Qwen3-MoE (2 sparse layers of 8 experts, 2 a token, I 32, D 64)."""
    path = tmp_path_factory.mktemp("moe_lora") / "hf"
    save_random_hf_model("qwen3_moe", path, seed=5)
    return path


def _peft_model(folder, adapter, trainable: bool = False):
    """transformers' Qwen3MoeForCausalLM of the random weights in ``folder`` with our PEFT ``adapter`` folder."""
    hf = save_random_hf_model("qwen3_moe", folder.parent / "unused", seed=5)  # the same base weights (seed 5)
    return peft.PeftModel.from_pretrained(hf, str(adapter), is_trainable=trainable).eval()


# peft 0.21.2 reads transformers' deprecated is_gradient_checkpointing (theirs, not ours)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("targets", [BOTH, ("mlp.experts.gate_up_proj",), ("mlp.experts.down_proj",)],
                         ids=["attention_and_experts", "gate_up", "down"])
def test_the_peft_export_loaded_by_peft_gives_our_logits_and_a_fresh_adapter_changes_nothing(hf_moe, tmp_path,
                                                                                             targets):
    """PEFT nests one ParamWrapper a targeted parameter (gate_up_proj's tensors under ``experts.base_layer`` when
    down_proj is targeted too) and lays each expert's A and B out in its own order: a layout or name of ours that
    differs fails to load or gives other logits. Merged (the HF export's model) equals unmerged in float32."""
    tokens, mask = padded_batch(VOCAB, [9, 4, 7], 9, "left", seed=1)
    base = checkpoints.from_pretrained(hf_moe, dtype="float32")
    plain = np.asarray(base(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)), np.float64)
    fresh = lora.attach(base, rank=4, alpha=8.0, targets=targets, seed=1)
    np.testing.assert_array_equal(np.asarray(fresh(jnp.asarray(tokens), attention_mask=jnp.asarray(mask))), plain)
    model = with_random_b(fresh, seed=3)
    ours = np.asarray(model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)), np.float64)
    merged = np.asarray(lora.merge(model)(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)), np.float64)
    assert max_rel_err(ours, plain, mask) > 1e-2  # the adapters count
    assert max_rel_err(merged, ours, mask) < 1e-5
    out = export_peft(model, tmp_path / "adapter", base_model=str(hf_moe))
    peft_model = _peft_model(hf_moe, out)
    assert max_rel_err(ours, hf_logits(peft_model, tokens, mask), mask) < 1e-4
    config = peft_model.peft_config["default"]
    assert sorted(config.target_parameters) == sorted(t for t in targets if t in LORA_EXPERT_PARAMETERS)


# peft 0.21.2 reads transformers' deprecated is_gradient_checkpointing (theirs, not ours)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_adapters_gradients_equal_pytorchs_autograd_of_the_peft_model(hf_moe, tmp_path):
    """The mean next-token loss's gradient with respect to every adapter, A and B of the attention's and of the
    experts' (through the grouped matmuls' backward), against PyTorch's autograd of the PEFT model, tensor by
    tensor in PEFT's names and layouts."""
    tokens, mask = padded_batch(VOCAB, [9, 6, 8], 9, "right", seed=2)
    base = checkpoints.from_pretrained(hf_moe, dtype="float32")
    model = with_random_b(lora.attach(base, rank=4, alpha=8.0, targets=BOTH, seed=1), seed=4)
    grads = _adapter_grads(model, jnp.asarray(tokens), jnp.asarray(mask))
    graphdef, state = nnx.split(model)
    ours = dict(lora.peft_tensors(nnx.merge(graphdef, nnx.merge_state(state, grads))))  # gradients as adapters

    peft_model = _peft_model(hf_moe, export_peft(model, tmp_path / "adapter", base_model=str(hf_moe)), trainable=True)
    input_ids, attention = (torch.from_numpy(np.asarray(a, np.int64)) for a in (tokens, mask))
    logits = peft_model(input_ids=input_ids, attention_mask=attention).logits
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    loss = -(logp * attention[:, 1:]).sum() / attention[:, 1:].sum()
    loss.backward()
    theirs = {name.replace(".default", ""): p.grad.numpy() for name, p in peft_model.named_parameters()
              if p.requires_grad}
    assert sorted(ours) == sorted(theirs) and any(".mlp.experts.base_layer.lora_A" in n for n in ours)
    for name, grad in theirs.items():
        assert np.abs(grad).max() > 0, name
        np.testing.assert_allclose(ours[name], grad, rtol=1e-3, atol=1e-4 * np.abs(grad).max(), err_msg=name)


def _adapter_grads(model, tokens, mask) -> nnx.State:
    """The gradient of the mean next-token loss of the real tokens with respect to the adapters (``LoRAParam``)."""
    def loss(m):
        logp = jax.nn.log_softmax(m(tokens, attention_mask=mask)[:, :-1].astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(picked * mask[:, 1:]) / jnp.sum(mask[:, 1:])
    return nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))(model)


def test_on_a_2x2x2_mesh_the_adapters_split_with_their_experts_and_their_gradients_equal_one_device(hf_moe):
    """With ``expert_parallel`` each device holds its experts' A and B beside their weights (the experts' dim over
    fsdp, B's width over tensor as the weights'), and the adapters' gradients on the mesh equal one device's."""
    tokens, mask = (jnp.asarray(a) for a in padded_batch(VOCAB, [8, 5, 3, 7], 8, "left", seed=4))
    results = {}
    for shape in ((1, 1, 1), (2, 2, 2)):
        with jax.set_mesh(make_mesh(*shape, devices=jax.devices()[:math.prod(shape)])):
            base = checkpoints.from_pretrained(hf_moe, dtype="float32", expert_parallel=True)
            model = with_random_b(lora.attach(base, rank=4, alpha=8.0, targets=LORA_EXPERT_PARAMETERS, seed=1), 6)
            if shape == (2, 2, 2):
                mlp = nnx.state(model, nnx.LoRAParam)["layers"]["mlp"]
                specs = {name: tuple(mlp[name][f].get_value().sharding.spec) for name in ("gate_up_lora", "down_lora")
                         for f in ("a", "b")}
                assert tuple(mlp["gate_up_lora"]["b"].get_value().sharding.spec) == (None, "fsdp", None, "tensor",
                                                                                      None), specs
                assert tuple(mlp["down_lora"]["a"].get_value().sharding.spec) == (None, "fsdp", "tensor", None), specs
                # the merge (the HF export's) adds each expert's A B where that expert is: nothing gathered
                a, b = mlp["gate_up_lora"]["a"].get_value(), mlp["gate_up_lora"]["b"].get_value()
                hlo = jax.jit(lora.delta, static_argnums=(2, 3)).lower(a, b, 2.0, True).compile().as_text()
                assert "all-gather" not in hlo, hlo
            grads = _adapter_grads(model, tokens, mask)
            results[shape] = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    one, eight = results[(1, 1, 1)], results[(2, 2, 2)]
    assert sorted(eight) == sorted(one) == sorted(f"layers.mlp.{m}_lora.{f}" for m in ("gate_up", "down")
                                                  for f in ("a", "b"))
    for name, grad in one.items():
        assert np.abs(grad).max() > 0, name
        np.testing.assert_allclose(eight[name], grad, rtol=1e-4, atol=1e-5 * np.abs(grad).max(), err_msg=name)


@pytest.mark.parametrize("given, expected", [
    (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], LORA_EXPERT_PARAMETERS),
    ("down_proj", ("mlp.experts.down_proj",)),                     # PEFT's rule: the end of a parameter's path
    (["experts.gate_up_proj"], ("mlp.experts.gate_up_proj",)),
    ("gate_up_proj,down_proj", LORA_EXPERT_PARAMETERS),            # names with commas, as a command line gives them
    ((), ()),
])
def test_target_parameters_by_peft_rule(given, expected):
    assert resolve_parameters(given) == expected


def _spec(**model_fields) -> RunSpec:
    config = load_config("default.py")
    for name, value in model_fields.items():
        config.model[name] = value
    return RunSpec.unplaced(config)


def test_all_linear_on_a_model_of_experts_is_pefts_its_attention_and_the_experts_take_target_parameters():
    """PEFT's "all-linear" adapts every nn.Linear of the decoder; transformers' Qwen3-MoE experts are parameters,
    not Linear modules: the attention's four (the default target_modules no longer refused), and the experts with
    ``target_parameters``."""
    moe = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, lora_rank=8)
    assert model_config(_spec(**moe), vocab_size=100).lora_targets == ATTENTION
    cfg = model_config(_spec(**moe, target_parameters=["gate_up_proj", "down_proj"]), vocab_size=100)
    assert cfg.lora_targets == BOTH
    assert model_config(_spec(lora_rank=8), vocab_size=100).lora_targets[4:] == ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("fields, line", [
    ({"lora_rank": 8, "target_parameters": ["gate_proj"]},
     "config.model.target_parameters: 'gate_proj' matches no parameter; the experts' are mlp.experts.gate_up_proj, "
     "mlp.experts.down_proj"),
    ({"lora_rank": 8, "target_parameters": ["down_proj"]},  # the demo's model is dense
     "target_parameters ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'] name a mixture-of-experts model's "
     "experts, and this model has none (num_experts 0)"),
    ({"target_parameters": ["down_proj"]},  # without LoRA: refused, not silently full fine-tuning
     "config.model.target_parameters: ['down_proj'] names the experts' weights LoRA's adapters train, and "
     "model.lora_rank is 0"),
    ({"lora_rank": 8, "target_modules": ["q_proj", "up_proj"], "model_type": "qwen3_moe", "num_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 64},
     "a mixture-of-experts model has no gate_proj, up_proj or down_proj Linear"),
])
def test_target_parameters_it_cannot_serve_are_one_line_naming_the_field(fields, line):
    config = load_config("default.py")
    for name, value in fields.items():
        config.model[name] = value
    with pytest.raises(PermanentError) as refused:
        validate_config(config)
    assert line in str(refused.value) and "\n" not in str(refused.value)


def test_the_presets_experts_take_an_adapter_each_in_transformers_layout():
    """Qwen3-30B-A3B at rank 32 (abstract: no array made): each of the 48 layers' 128 experts its own A and B, the
    gate and up projections' B side by side on I (768), and the counts PEFT would print for it."""
    cfg = PRESETS["Qwen3-30B-A3B"].replace(lora_rank=32, lora_alpha=64.0, lora_targets=BOTH)
    _, state = abstract_model(cfg)
    mlp = state["layers"]["mlp"]
    shapes = {f"{m}.{f}": tuple(mlp[f"{m}_lora"][f].get_value().shape) for m in ("gate_up", "down") for f in "ab"}
    assert shapes == {"gate_up.a": (48, 128, 2048, 32), "gate_up.b": (48, 128, 32, 768, 2),
                      "down.a": (48, 128, 768, 32), "down.b": (48, 128, 32, 2048)}
    # per layer and expert: r (D + 2I) + r (I + D), PEFT's lora_A / lora_B sizes of gate_up_proj and down_proj
    experts = sum(math.prod(v) for v in shapes.values())
    assert experts == 48 * 128 * 32 * (2048 + 2 * 768 + 768 + 2048)


def test_the_experts_adapters_on_a_dense_model_path_are_refused_before_anything_runs(tmp_path):
    """model.path a dense HF folder: its config is read, and target_parameters names weights it has none of."""
    save_random_hf_model("qwen2_untied_bias", tmp_path / "hf", seed=3)
    config = load_config("default.py")
    config.model.update(path=str(tmp_path / "hf"), lora_rank=8, target_parameters="down_proj")
    with pytest.raises(PermanentError) as refused:
        validate_config(config)
    assert str(refused.value).startswith("config.model: lora_targets=") and "num_experts 0" in str(refused.value)


def test_a_resume_compares_the_experts_adapted_not_the_spelling():
    """The resume check reads the recorded and the configured target_parameters as the weights they name."""
    from pacs_jax.training.workdir import _experts_adapted

    assert _experts_adapted("gate_up_proj,down_proj") == _experts_adapted(["mlp.experts.down_proj",
                                                                          "experts.gate_up_proj"])
    assert _experts_adapted(()) == [] != _experts_adapted("down_proj")  # a run before the field adapted none
