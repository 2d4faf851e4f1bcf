"""LoRA adapters in our Qwen (pacs_jax/models/lora.py), against transformers + peft (PyTorch CPU) on the same
random weights: a fresh adapter changes nothing, merged equals unmerged, the PEFT export loads onto the HF base
and gives our logits, and target_modules names what it adapts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx

from pacs_jax import checkpoints, sharding
from pacs_jax.models import lora
from pacs_jax.models.config import LORA_MODULES
from pacs_jax.models.lora_targets import resolve_targets
from pacs_jax.models.peft_export import export_peft
from qwen_reference import hf_logits, max_rel_err, padded_batch, save_random_hf_model

ARCH = "qwen2_untied_bias"  # q/k/v biases, untied head, 8 query heads over 2 KV heads
LENGTHS, T = [12, 7, 3, 10], 12


@nnx.jit
def logits(model, tokens, mask):
    return model(tokens, attention_mask=mask)


def with_random_b(model: nnx.Module, seed: int) -> nnx.Module:
    """``model`` with every adapter's B drawn at random (a trained adapter; a fresh one has B = 0)."""
    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)

    def draw(path, var):
        if getattr(var, "lora_factor", None) != "b":
            return var
        x = var.get_value()
        noise = 0.05 * jax.random.normal(jax.random.fold_in(key, hash(path) % 2**31), x.shape, jnp.float32)
        return var.replace(value=jax.device_put(noise.astype(x.dtype), x.sharding))

    state = nnx.from_flat_state([(p, draw(p, v)) for p, v in nnx.to_flat_state(state)])
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora") / ARCH
    return folder, save_random_hf_model(ARCH, folder, seed=3)


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(data=2, fsdp=2, tensor=2)


def test_a_fresh_adapter_gives_the_base_models_logits_exactly_sharded_on_the_mesh(hf_base, mesh):
    folder, _ = hf_base
    tokens, mask = padded_batch(160, LENGTHS, T, "left")
    with jax.set_mesh(mesh):
        base = checkpoints.from_pretrained(folder, dtype="float32")
        want = np.asarray(logits(base, tokens, mask))
        model = lora.attach(base, rank=4, alpha=8.0, targets=LORA_MODULES, seed=1)
        adapters, _ = lora.split(nnx.state(model))
        got = np.asarray(logits(model, tokens, mask))
    np.testing.assert_array_equal(got, want)  # B = 0: x W + scale (x A) 0 is x W, bit for bit
    shardings = {".".join(map(str, p)): _axes(v.get_value()) for p, v in nnx.to_flat_state(adapters)}
    assert len(shardings) == 2 * len(LORA_MODULES)
    # A takes its kernel's input axes, B its output axes: q's A [L, D, r] over fsdp, B [L, r, H, Dh] over tensor
    assert shardings["layers.attn.q_lora.a"] == (None, "fsdp", None)
    assert shardings["layers.attn.q_lora.b"] == (None, None, "tensor", None)
    assert shardings["layers.mlp.down_lora.a"] == (None, "tensor", None)


def _axes(x: jax.Array) -> tuple:
    """The mesh axis of each dim of ``x`` (None: not sharded)."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def test_merged_and_unmerged_logits_agree_within_bf16_round_off(hf_base):
    folder, _ = hf_base
    tokens, mask = padded_batch(160, LENGTHS, T, "right")
    base = checkpoints.from_pretrained(folder, dtype="bfloat16", param_dtype="float32")
    model = with_random_b(lora.attach(base, rank=4, alpha=8.0, targets=LORA_MODULES, seed=2), seed=5)
    unmerged = np.asarray(logits(model, tokens, mask), np.float64)
    merged = np.asarray(logits(lora.merge(model), tokens, mask), np.float64)
    plain = np.asarray(logits(base, tokens, mask), np.float64)
    real = mask.astype(bool)
    gap = np.abs(unmerged - merged)[real].max()
    moved = np.abs(unmerged - plain)[real].max()
    assert moved > 0.5  # the adapters change the logits
    assert gap < 0.1 * moved and gap < 0.15, (gap, moved)  # bf16 activations: round-off, not the adapters' change


# peft 0.21.2 reads transformers' deprecated is_gradient_checkpointing (theirs, not ours)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_export_loaded_by_peft_onto_the_hf_base_gives_our_logits(hf_base, tmp_path):
    folder, _ = hf_base
    tokens, mask = padded_batch(160, LENGTHS, T, "left")
    base = checkpoints.from_pretrained(folder, dtype="float32")
    targets = resolve_targets("all-linear")
    model = with_random_b(lora.attach(base, rank=4, alpha=16.0, targets=targets, seed=4), seed=6)
    ours = np.asarray(logits(model, tokens, mask), np.float64)
    out = export_peft(model, tmp_path / "adapter", base_model=str(folder))
    hf = save_random_hf_model(ARCH, tmp_path / "unused", seed=3)  # the same base weights (seed 3)
    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    theirs = hf_logits(peft_model, tokens, mask)
    assert max_rel_err(ours, theirs, mask) < 1e-4
    assert max_rel_err(np.asarray(logits(base, tokens, mask), np.float64), theirs, mask) > 1e-2  # the adapters count
    config = peft_model.peft_config["default"]
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 16.0, sorted(targets))


def with_random_saved(model: nnx.Module, seed: int) -> nnx.Module:
    """``model`` with every module trained whole (``lora.saved``) moved by noise (a trained one)."""
    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)
    moved = [(path, var.replace(value=var.get_value() + 0.2 * jax.random.normal(
        jax.random.fold_in(key, i), var.get_value().shape, var.get_value().dtype)))
             for i, (path, var) in enumerate(nnx.to_flat_state(lora.saved(state)))]
    return nnx.merge(graphdef, nnx.merge_state(state, nnx.from_flat_state(moved)))


# peft 0.21.2 reads transformers' deprecated is_gradient_checkpointing (theirs, not ours)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("arch, names, whole", [
    # PEFT's rule: "norm" ends the final norm's name and every layer's four (input, post-attention, q, k)
    ("qwen3_tied_head_dim24", ["embed_tokens", "norm"],
     {"embedding", "final_norm.scale", "layers.input_norm.scale", "layers.post_attn_norm.scale",
      "layers.attn.q_norm.scale", "layers.attn.k_norm.scale"}),
    ("qwen2_untied_bias", ["lm_head", "input_layernorm"], {"lm_head", "layers.input_norm.scale"}),
])
def test_modules_to_save_train_whole_beside_the_adapters_and_peft_loads_them(arch, names, whole, tmp_path):
    """PEFT's modules_to_save: the modules named train whole (their leaves among the trained ones), start at the
    base's values (its logits exactly), the KL reference puts their original values back (the base's logits
    exactly, however they trained), merging keeps them, and the PEFT export loaded by peft onto the HF base
    gives our logits, a tied embedding's LM head tied to it."""
    folder = tmp_path / arch
    save_random_hf_model(arch, folder, seed=3)
    tokens, mask = padded_batch(160, LENGTHS, T, "left")
    base = checkpoints.from_pretrained(folder, dtype="float32")
    plain = np.asarray(logits(base, tokens, mask), np.float64)
    fresh = lora.attach(base, rank=4, alpha=16.0, targets=LORA_MODULES, modules_to_save=names, seed=4)
    trained, _ = lora.split(nnx.state(fresh))
    saved = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(lora.saved(trained))}
    assert {p.removesuffix(".value") for p in saved} == whole
    np.testing.assert_array_equal(np.asarray(logits(fresh, tokens, mask), np.float64), plain)
    model = with_random_saved(with_random_b(fresh, seed=6), seed=7)
    ours = np.asarray(logits(model, tokens, mask), np.float64)
    graphdef, state = nnx.split(model)
    reference = nnx.merge(graphdef, lora.switched_off(state, lora.saved(nnx.state(fresh))))
    np.testing.assert_array_equal(np.asarray(logits(reference, tokens, mask), np.float64), plain)
    with pytest.raises(ValueError, match="originals are missing"):
        lora.switched_off(state)
    adapters_alone = with_random_b(fresh, seed=6)  # the same adapters, the saved modules at the base's values
    assert max_rel_err(np.asarray(logits(adapters_alone, tokens, mask), np.float64), ours, mask) > 1e-2
    assert max_rel_err(np.asarray(logits(lora.merge(model), tokens, mask), np.float64), ours, mask) < 1e-4
    out = export_peft(model, tmp_path / "adapter", base_model=str(folder))
    hf = save_random_hf_model(arch, tmp_path / "unused", seed=3)  # the same base weights (seed 3)
    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    assert max_rel_err(ours, hf_logits(peft_model, tokens, mask), mask) < 1e-4


@pytest.mark.parametrize("arch, names, words", [
    ("qwen3_tied_head_dim24", ("lm_head",), "ties its LM head to the embedding: 'embed_tokens' trains both"),
    ("qwen2_untied_bias", ("q_norm",), "matches no module of this model; there are model.embed_tokens, lm_head"),
    ("qwen2_untied_bias", ("up_proj",), "names a linear layer"),
])
def test_modules_to_save_that_name_no_module_or_a_linear_layer_are_refused(arch, names, words):
    from qwen_reference import ARCHS

    from pacs_jax.models.config import QwenConfig

    hf = dict(ARCHS[arch], lora_rank=4, lora_alpha=8.0, lora_targets=LORA_MODULES, lora_saved=names)
    hf.pop("max_position_embeddings")
    with pytest.raises(ValueError, match="modules_to_save") as error:
        QwenConfig(**hf)
    assert words in str(error.value)


@pytest.mark.parametrize("given, expected", [
    ("all-linear", LORA_MODULES),
    (("v_proj", "q_proj"), ("q_proj", "v_proj")),
    ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    (r"mlp\.(gate|up)_proj", ("gate_proj", "up_proj")),
])
def test_target_modules_all_linear_a_list_or_a_regular_expression(given, expected):
    assert resolve_targets(given) == expected


@pytest.mark.parametrize("given, words", [
    ("lm_head", "matches no module; the modules are self_attn.q_proj"),
    (("q_proj", "qkv_proj"), "names no module ('qkv_proj')"),
    ((), "is empty"),
    ("mlp.(gate", "neither 'all-linear', a module name nor a regular expression"),
])
def test_target_modules_that_match_nothing_list_the_modules_there_are(given, words):
    with pytest.raises(ValueError) as error:
        resolve_targets(given)
    assert words in str(error.value) and "mlp.down_proj" in str(error.value)
