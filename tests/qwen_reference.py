"""Reference Qwen models for the model tests: `transformers` (PyTorch CPU) with random weights.

The tiny architectures cover what the parity tests must exercise: Qwen2 untied with q/k/v biases,
Qwen3 tied with a head_dim that is not hidden / heads, fewer KV heads than query heads, and
8 query heads with 2 KV heads so that a tensor axis of 8 must replicate the K/V projections.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import numpy as np
import torch
import transformers

REPO = pathlib.Path(__file__).resolve().parents[1]

ARCHS: dict[str, dict] = {
    "qwen2_untied_bias": dict(model_type="qwen2", vocab_size=160, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                              tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6,
                              max_position_embeddings=256),
    "qwen3_tied_head_dim24": dict(model_type="qwen3", vocab_size=160, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                  head_dim=24, tie_word_embeddings=True, rope_theta=1_000_000.0,
                                  rms_norm_eps=1e-6, max_position_embeddings=256),
}

# Qwen3-MoE (issue 66): every layer sparse, 8 experts, 2 a token, the real vocabulary; not in ARCHS (the dense
# model tests), tests/test_moe_model.py reads it
MOE_ARCHS: dict[str, dict] = {
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                      max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0),
}


def random_hf_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    **overrides) -> transformers.PreTrainedModel:
    """A transformers Qwen2/Qwen3ForCausalLM with every parameter random (biases and norms too).

    HF initialises biases to 0 and norm scales to 1, which would hide a mis-mapped bias or norm.
    ``overrides`` change fields of the ARCHS entry.
    """
    config = transformers.AutoConfig.for_model(**{**(ARCHS | MOE_ARCHS)[arch], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model.to(dtype).eval()


def save_random_hf_model(arch: str, directory: pathlib.Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                         max_shard_size: str | None = None, **overrides) -> transformers.PreTrainedModel:
    """``random_hf_model`` written with ``save_pretrained`` to ``directory``; returns the model."""
    model = random_hf_model(arch, seed, dtype, **overrides)
    model.save_pretrained(directory, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    return model


def padded_batch(vocab_size: int, lengths: list[int], total: int, side: str,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, total] int32, mask [B, total] int32): rows of the given lengths, padded on ``side``.

    Pad slots hold random token ids too, so a model that leaks pads into real positions is caught.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, size=(len(lengths), total)).astype(np.int32)
    mask = np.zeros((len(lengths), total), np.int32)
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, total - n:] = 1
        elif side == "right":
            mask[row, :n] = 1
        else:
            raise ValueError(f"side={side!r}")
    return tokens, mask


def hf_logits(model: transformers.PreTrainedModel, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Reference logits [B, T, V] (float64) from transformers.

    Position ids as transformers' generate() builds them for padded batches: cumsum(mask) - 1.
    """
    input_ids = torch.from_numpy(np.asarray(tokens, np.int64))
    attention_mask = torch.from_numpy(np.asarray(mask, np.int64))
    position_ids = attention_mask.cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 1)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return out.logits.double().numpy()


def max_rel_err(ours: np.ndarray, ref: np.ndarray, mask: np.ndarray) -> float:
    """max |ours - ref| / max |ref|, over the real (mask == 1) positions of [B, T, V] logits."""
    real = np.asarray(mask, bool)
    diff = np.abs(np.asarray(ours, np.float64)[real] - ref[real])
    return float(diff.max() / np.abs(ref[real]).max())


def load_tool(name: str) -> ModuleType:
    """Import tools/<name>.py as a module (tools/ is scripts, not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
