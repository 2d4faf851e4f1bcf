"""HF -> Orbax (tools/import_hf.py) -> HF (tools/export_hf.py): bit-identical, and transformers loads it."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from pacs_jax import checkpoints
from pacs_jax.sharding import make_mesh
from qwen_reference import ARCHS, load_tool, padded_batch, save_random_hf_model

CASES = [("qwen2_untied_bias", torch.float32), ("qwen3_tied_head_dim24", torch.float32),
         ("qwen2_untied_bias", torch.bfloat16), ("qwen3_tied_head_dim24", torch.bfloat16)]
CASE_IDS = [f"{arch}-{str(dtype).removeprefix('torch.')}" for arch, dtype in CASES]
import_hf, export_hf = load_tool("import_hf"), load_tool("export_hf")


def read_safetensors(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors file(s), by name."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def assert_bit_identical(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def hf_output(model: transformers.PreTrainedModel, tokens: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits


@pytest.fixture(scope="module")
def roundtrips(tmp_path_factory):
    """{case id: (HF dir, transformers model, our checkpoint, exported HF dir)} for every case."""
    root = tmp_path_factory.mktemp("roundtrip")
    out = {}
    for i, ((arch, dtype), case) in enumerate(zip(CASES, CASE_IDS)):
        hf_dir, ckpt, exported = root / f"{case}-hf", root / f"{case}-ckpt", root / f"{case}-export"
        hf_model = save_random_hf_model(arch, hf_dir, seed=20 + i, dtype=dtype)
        import_hf.main(["--hf_dir", str(hf_dir), "--out", str(ckpt)])
        export_hf.main(["--checkpoint", str(ckpt), "--out", str(exported)])
        out[case] = (hf_dir, hf_model, ckpt, exported)
    return out


@pytest.mark.parametrize("case", CASE_IDS)
def test_roundtrip_is_bit_identical(roundtrips, case):
    hf_dir, hf_model, ckpt, exported = roundtrips[case]
    dtype = str(hf_model.dtype).removeprefix("torch.")
    assert json.loads((ckpt / "model_config.json").read_text())["pacs_jax"]["param_dtype"] == dtype  # kept
    assert sorted(p.name for p in exported.iterdir()) == ["README.md", "config.json", "generation_config.json",
                                                          "model.safetensors", "pacs_jax_export.json"]
    assert_bit_identical(read_safetensors(exported), read_safetensors(hf_dir))

    original, ours = (transformers.AutoConfig.from_pretrained(d).to_dict() for d in (hf_dir, exported))
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_parameters",
                  "tie_word_embeddings", "hidden_act", "dtype", "attention_bias"):
        assert ours.get(field) == original.get(field), field
    for config in (original, ours):  # Qwen2 configs may leave head_dim out (then hidden / heads)
        config["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert ours["head_dim"] == original["head_dim"]

    # Loaded the same way, the exported and the original directory give the same logits.
    loaded, original_loaded = (transformers.AutoModelForCausalLM.from_pretrained(d).eval() for d in (exported, hf_dir))
    assert loaded.dtype == hf_model.dtype
    tokens, _ = padded_batch(hf_model.config.vocab_size, [9, 9], 9, "left", seed=21)
    assert torch.equal(hf_output(loaded, tokens), hf_output(original_loaded, tokens))


def test_from_pretrained_loads_our_checkpoint(roundtrips):
    """checkpoints.from_pretrained takes the Orbax checkpoint as well as the HF dir, on a mesh too."""
    hf_dir, _, ckpt, _ = roundtrips["qwen2_untied_bias-float32"]
    tokens, mask = (jnp.asarray(a) for a in padded_batch(160, [8, 5, 8, 2, 7, 8, 1, 3], 8, "left", seed=22))
    forward = nnx.jit(lambda model, tokens, mask: model(tokens, attention_mask=mask))
    from_hf = np.asarray(forward(checkpoints.from_pretrained(hf_dir), tokens, mask))
    from_ckpt = checkpoints.from_pretrained(ckpt)
    assert from_ckpt.embedding[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(forward(from_ckpt, tokens, mask)), from_hf)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        sharded = checkpoints.from_pretrained(ckpt)
        assert sharded.layers.attn.q_kernel[...].sharding.spec == P(None, "fsdp", "tensor", None)
        np.testing.assert_allclose(np.asarray(forward(sharded, tokens, mask)), from_hf, rtol=1e-5, atol=1e-5)


def _hf_state(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("case,fmt", [("qwen2_untied_bias-float32", "safetensors"),
                                      ("qwen3_tied_head_dim24-bfloat16", "bin"),
                                      ("qwen2_untied_bias-float32", "bin")])
def test_sharded_and_bin_exports_load_in_transformers(roundtrips, tmp_path, case, fmt):
    hf_dir, hf_model, ckpt, _ = roundtrips[case]
    out = tmp_path / "export"
    max_shard = "30KB" if case.startswith("qwen2") else "20KiB"
    export_hf.main(["--checkpoint", str(ckpt), "--out", str(out), "--format", fmt, "--max_shard_size", max_shard])
    ext = "safetensors" if fmt == "safetensors" else "bin"
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    shards = sorted(out.glob(f"*.{ext}"))
    assert len(shards) > 1
    assert not list(out.glob("*.bin" if fmt == "safetensors" else "*.safetensors"))
    index = json.loads((out / f"{stem}.{ext}.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    assert all(p.name == f"{stem}-{k + 1:05d}-of-{len(shards):05d}.{ext}" for k, p in enumerate(shards))
    if fmt == "safetensors":
        assert_bit_identical(read_safetensors(out), read_safetensors(hf_dir))
        limit = 30 * 10**3
        for path in shards:  # a shard exceeds the limit only when it is a single tensor
            with safe_open(path, framework="pt") as f:
                sizes = [f.get_tensor(k).nbytes for k in f.keys()]
            assert sum(sizes) <= limit or len(sizes) == 1

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref = _hf_state(hf_model)
    got = _hf_state(loaded)
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_export_casts_param_dtype(roundtrips, tmp_path):
    """--param_dtype bfloat16 from fp32 master weights rounds exactly as torch's .to(bfloat16) does."""
    hf_dir, hf_model, ckpt, _ = roundtrips["qwen3_tied_head_dim24-float32"]
    out = tmp_path / "bf16"
    export_hf.main(["--checkpoint", str(ckpt), "--out", str(out), "--param_dtype", "bfloat16"])
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert_bit_identical(read_safetensors(out), {k: v.to(torch.bfloat16) for k, v in read_safetensors(hf_dir).items()})


def test_export_copies_tokenizer(roundtrips, tmp_path, qwen_tokenizer_dir):
    _, _, ckpt, _ = roundtrips["qwen3_tied_head_dim24-bfloat16"]
    out = tmp_path / "with_tokenizer"
    export_hf.main(["--checkpoint", str(ckpt), "--out", str(out), "--tokenizer", str(qwen_tokenizer_dir)])
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (qwen_tokenizer_dir / name).read_bytes()
    text = "Solve: 12 * 7 = ?"
    assert (transformers.AutoTokenizer.from_pretrained(out).encode(text)
            == transformers.AutoTokenizer.from_pretrained(qwen_tokenizer_dir).encode(text))


def test_failed_export_leaves_nothing(roundtrips, tmp_path):
    """The export fails after the weights are written (no tokenizer files): nothing at --out, no temp dir."""
    _, _, ckpt, _ = roundtrips["qwen2_untied_bias-float32"]
    parent = tmp_path / "exports"
    parent.mkdir()
    empty_tokenizer = tmp_path / "no_tokenizer_here"
    empty_tokenizer.mkdir()
    with pytest.raises(FileNotFoundError, match="no_tokenizer_here: no tokenizer files"):
        export_hf.main(["--checkpoint", str(ckpt), "--out", str(parent / "model"), "--tokenizer", str(empty_tokenizer)])
    assert list(parent.iterdir()) == []


def test_failed_overwrite_keeps_the_old_export(roundtrips, tmp_path):
    """With --overwrite, a failing export leaves the previous directory as it was."""
    _, _, ckpt, exported = roundtrips["qwen2_untied_bias-float32"]
    out = tmp_path / "model"
    export_hf.main(["--checkpoint", str(ckpt), "--out", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    empty_tokenizer = tmp_path / "empty"
    empty_tokenizer.mkdir()
    with pytest.raises(FileNotFoundError):
        export_hf.main(["--checkpoint", str(ckpt), "--out", str(out), "--tokenizer", str(empty_tokenizer),
                        "--overwrite"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "model"]
