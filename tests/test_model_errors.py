"""Bad input to the model loaders, configs, meshes and tools: a clear error naming the file, tensor or field."""

from __future__ import annotations

import json
import re
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pacs_jax import checkpoints, models
from pacs_jax.models import QwenConfig, preset
from pacs_jax.sharding import make_mesh
from qwen_reference import ARCHS, load_tool, save_random_hf_model

import_hf, export_hf = load_tool("import_hf"), load_tool("export_hf")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A valid single-file HF directory (Qwen2, untied, biases); tests copy it before breaking it."""
    path = tmp_path_factory.mktemp("errors") / "qwen2"
    save_random_hf_model("qwen2_untied_bias", path, seed=30)
    return path


@pytest.fixture
def broken(hf_dir, tmp_path):
    """A copy of hf_dir to break."""
    return shutil.copytree(hf_dir, tmp_path / "broken")


def _edit_config(directory, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_unsupported_model_type(broken):
    _edit_config(broken, model_type="llama")
    with pytest.raises(ValueError, match=r"config\.json: model_type='llama' is not supported") as err:
        checkpoints.from_pretrained(broken)
    assert str(broken) in str(err.value)


def test_unsupported_rope_scaling(broken):
    _edit_config(broken, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"config\.json: rope type 'yarn' is not supported"):
        checkpoints.from_pretrained(broken)


def test_missing_config_field(broken):
    config = json.loads((broken / "config.json").read_text())
    del config["num_attention_heads"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: missing field\(s\) \['num_attention_heads'\]"):
        checkpoints.from_pretrained(broken)


def test_missing_shard_file(tmp_path):
    directory = tmp_path / "sharded"
    save_random_hf_model("qwen2_untied_bias", directory, seed=31, max_shard_size="40KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (directory / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{directory / shards[1]}: shard file listed in "
                                                          "model.safetensors.index.json is missing")):
        checkpoints.from_pretrained(directory)


def test_tensor_of_the_wrong_shape(broken):
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    assert tensors[name].shape == (128, 64)
    tensors[name] = np.zeros((120, 64), tensors[name].dtype)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    expected = f"{broken / 'model.safetensors'}: tensor '{name}' has shape (120, 64)"
    with pytest.raises(ValueError, match=re.escape(expected)) as err:
        checkpoints.from_pretrained(broken)
    assert "layers[1].mlp.up_kernel" in str(err.value) and "(64, 128)" in str(err.value)


def test_missing_tensor(broken):
    tensors = load_file(broken / "model.safetensors")
    del tensors["lm_head.weight"]  # an untied config needs it
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"tensor 'lm_head\.weight' not found"):
        checkpoints.from_pretrained(broken)


def test_no_weights_file(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        checkpoints.from_pretrained(broken)


def test_mesh_must_divide_query_heads():
    """Qwen2.5-7B has 28 query heads: a tensor axis of 8 cannot split them."""
    with jax.set_mesh(make_mesh(1, 1, 8)), \
            pytest.raises(ValueError, match=r"num_attention_heads=28 is not divisible by mesh\.tensor=8"):
        models.abstract_model(preset("Qwen2.5-7B"))


def test_mesh_must_divide_mlp_width(tmp_path):
    directory = tmp_path / "mlp100"
    save_random_hf_model("qwen2_untied_bias", directory, seed=32, intermediate_size=100)
    with jax.set_mesh(make_mesh(1, 1, 8)), \
            pytest.raises(ValueError, match=r"intermediate_size=100 is not divisible by mesh\.tensor=8"):
        checkpoints.from_pretrained(directory)
    with jax.set_mesh(make_mesh(2, 1, 4)):
        assert checkpoints.from_pretrained(directory).cfg.intermediate_size == 100  # 4 divides it


def test_mesh_sizes_must_fit_devices():
    with pytest.raises(ValueError, match=r"mesh \(data, fsdp, tensor\)=\(2, 2, 4\) needs 16 devices, 8 are available"):
        make_mesh(2, 2, 4)


@pytest.mark.parametrize("changes,message", [
    (dict(num_key_value_heads=3), r"num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    (dict(remat="everything"), r"remat='everything'"),
    (dict(param_dtype="int8"), r"param_dtype='int8'"),
])
def test_bad_config_values(changes, message):
    arch = {k: v for k, v in ARCHS["qwen2_untied_bias"].items() if k != "model_type"}
    with pytest.raises(ValueError, match=message):
        QwenConfig(**{**arch, **changes})


def test_checkpoint_config_does_not_match_params(hf_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    import_hf.main(["--hf_dir", str(hf_dir), "--out", str(ckpt)])
    config = json.loads((ckpt / "model_config.json").read_text())
    config["intermediate_size"] = 96
    (ckpt / "model_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"parameter layers\.mlp\.\w+_kernel has shape \(2, (64, 128|128, 64)\)"):
        checkpoints.from_pretrained(ckpt)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no params/"):
        checkpoints.from_pretrained(tmp_path)


def test_tools_refuse_to_overwrite(hf_dir, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    import_hf.main(["--hf_dir", str(hf_dir), "--out", str(ckpt)])
    with pytest.raises(SystemExit):
        import_hf.main(["--hf_dir", str(hf_dir), "--out", str(ckpt)])
    assert f"--out {ckpt}: already holds a checkpoint" in capsys.readouterr().err
    out = tmp_path / "export"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit):
        export_hf.main(["--checkpoint", str(ckpt), "--out", str(out)])
    assert f"--out {out}: exists and is not empty (pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(SystemExit):
        import_hf.main(["--hf_dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c2")])
    assert "no config.json there" in capsys.readouterr().err
