"""Model configs against the published Qwen config.json files; the real Qwen tokenizer's chat format."""

from __future__ import annotations

import math

import pytest
import transformers
from flax import nnx

from pacs_jax import models
from pacs_jax.models import QwenConfig, preset

# config.json of Qwen/Qwen2.5-0.5B, Qwen/Qwen3-0.6B and Qwen/Qwen3-30B-A3B as published on the Hugging Face hub.
PUBLISHED = {
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
        "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
}
# Parameter counts from the model cards: (total, non-embedding), in billions, as printed there.
MODEL_CARD_PARAMS = {"Qwen2.5-0.5B": ("0.49", "0.36"), "Qwen3-0.6B": ("0.6", "0.44"),
                     "Qwen3-30B-A3B": ("30.5", "29.9"), "Qwen3-235B-A22B": ("235", "234")}
HF_CONFIG_CLASSES = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                     "qwen3_moe": transformers.Qwen3MoeConfig}
ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings",
               "max_position_embeddings", "bos_token_id", "eos_token_id", "hidden_act", "rope_parameters")


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_equals_published_config(name):
    published = PUBLISHED[name]
    assert QwenConfig.from_hf_dict(published) == preset(name)
    cfg = preset(name)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        published["hidden_size"], published["num_attention_heads"], published["num_key_value_heads"])
    assert cfg.head_dim == published.get("head_dim", published["hidden_size"] // published["num_attention_heads"])
    assert cfg.attention_bias == (published["model_type"] == "qwen2")  # Qwen2 q/k/v biases, Qwen3 none


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_transformers_reads_our_config_as_the_published_one(name):
    """transformers' config class on the published dict agrees with our to_hf_dict() field by field."""
    published = PUBLISHED[name]
    ours = preset(name).to_hf_dict()
    config_class = HF_CONFIG_CLASSES[published["model_type"]]
    from_published, from_ours = config_class(**published), config_class(**ours)
    for field in ARCH_FIELDS:
        assert getattr(from_published, field) == ours[field], field
        assert getattr(from_ours, field) == getattr(from_published, field), field
    default_head_dim = from_published.hidden_size // from_published.num_attention_heads
    assert ours["head_dim"] == (getattr(from_published, "head_dim", None) or default_head_dim)
    assert from_ours.use_sliding_window is False
    assert getattr(from_ours, "attention_bias", False) == getattr(from_published, "attention_bias", False)


@pytest.mark.parametrize("name", list(MODEL_CARD_PARAMS))
def test_parameter_count_matches_model_card(name):
    _, state = models.abstract_model(preset(name))
    sizes = {".".join(map(str, path)): math.prod(v.get_value().shape) for path, v in nnx.to_flat_state(state)}
    total = sum(sizes.values())
    embeddings = sizes["embedding"] + sizes.get("lm_head", 0)  # the cards' non-embedding count leaves out both
    for count, printed in zip((total, total - embeddings), MODEL_CARD_PARAMS[name]):
        decimals = len(printed.split(".")[1]) if "." in printed else 0
        assert f"{count / 1e9:.{decimals}f}" == printed


@pytest.mark.parametrize("name", sorted(models.PRESETS))
def test_every_preset_survives_hf_dict_round_trip(name):
    cfg = preset(name, dtype="bfloat16", remat="full")
    back = QwenConfig.from_hf_dict(cfg.to_hf_dict(), dtype="bfloat16", remat="full")
    assert back == cfg
    assert HF_CONFIG_CLASSES[cfg.model_type](**cfg.to_hf_dict()).num_key_value_heads == cfg.num_key_value_heads


def test_qwen_tokenizer_renders_and_encodes_a_chat_prompt(qwen_tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    messages = [{"role": "system", "content": "Please reason step by step."},
                {"role": "user", "content": "What is 2+3?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nPlease reason step by step.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")  # ChatML
    ids = tokenizer.encode(text)
    im_start, im_end = 151644, 151645
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2  # special tokens kept whole
    assert ids[0] == im_start and ids[-3] == im_start
    assert tokenizer.convert_ids_to_tokens([im_start, im_end]) == ["<|im_start|>", "<|im_end|>"]
    assert tokenizer.decode(ids) == text
    assert (tokenizer.decode(ids, skip_special_tokens=True)
            == "system\nPlease reason step by step.\nuser\nWhat is 2+3?\nassistant\n")
    assert max(ids) < preset("Qwen2.5-0.5B").vocab_size  # fits the model's embedding
