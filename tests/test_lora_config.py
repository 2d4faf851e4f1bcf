"""LoRA's and the KL loss's config (issue 65 item 7): a bad rank, alpha or target_modules, or LoRA with an option it
cannot serve, is one line naming the field (status 78 through the CLI, nothing written); with them off every
field of the run is as before."""

from __future__ import annotations

import pytest

from pacs_jax.errors import PermanentError
from pacs_jax.training.config_check import validate_config
from pacs_jax.training.model_spec import lora_options, model_config
from pacs_jax.training.spec import RunSpec
from test_cli_errors import _error_line, _run
from train_helpers import load_config


def _refusal(**fields) -> str:
    config = load_config("default.py")
    for dotted, value in fields.items():
        section, name = dotted.split("__")
        config[section][name] = value
    with pytest.raises(PermanentError) as refused:
        validate_config(config)
    return str(refused.value)


@pytest.mark.parametrize("fields, line", [
    ({"model__lora_rank": -2}, "config.model.lora_rank: must be an integer >= 0 (0: full fine-tuning), got -2"),
    ({"model__lora_rank": 8, "model__lora_alpha": 0.0}, "config.model.lora_alpha: must be > 0 (the adapters' scale "
                                                         "is lora_alpha / lora_rank), got 0.0"),
    ({"model__lora_rank": 8, "model__target_modules": "lm_head"},
     "config.model.target_modules: 'lm_head' matches no module; the modules are self_attn.q_proj, self_attn.k_proj, "
     "self_attn.v_proj, self_attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj"),
    ({"model__lora_rank": 8, "algorithm__objective": "ppo"}, "config.model.lora_rank: 8 with algorithm.objective 'ppo'"),
    ({"model__modules_to_save": "embed_tokens"}, "config.model.modules_to_save: ['embed_tokens'] trains modules whole "
                                                 "beside LoRA's adapters, and model.lora_rank is 0"),
    ({"model__lora_rank": 8, "model__modules_to_save": ["embed_tokens", "up_proj"]},
     "config.model.modules_to_save: 'up_proj' names a linear layer; LoRA's adapters train those"),
    ({"model__lora_rank": 8, "model__modules_to_save": "embed_tokens,embeddings"},
     "config.model.modules_to_save: 'embeddings' matches no module of this model; there are model.embed_tokens, "
     "lm_head, model.norm, model.layers.{i}.input_layernorm"),
    # the demo's model ties its head to its embedding (its own architecture, known before anything runs)
    ({"model__lora_rank": 8, "model__modules_to_save": "lm_head"},
     "modules_to_save: 'lm_head' matches no module of this model (this model ties its LM head to the embedding: "
     "'embed_tokens' trains both)"),
    ({"algorithm__kl_loss_type": "full"}, "config.algorithm.kl_loss_type: 'full' is not one of"),
    ({"algorithm__kl_loss_type": "low_var"}, "did you mean 'low_var_kl'?"),
    ({"algorithm__kl_loss_coef": -0.1}, "config.algorithm.kl_loss_coef: must be >= 0, got -0.1"),
])
def test_bad_lora_or_kl_fields_are_one_line_naming_the_field(fields, line):
    assert line in _refusal(**fields)


def test_full_says_verl_does_not_build_it_either():
    assert "raises NotImplementedError in verl 0.9.1's kl_penalty" in _refusal(algorithm__kl_loss_type="full")


def test_a_non_integer_rank_is_refused_by_the_cli_before_its_workdir_exists(tmp_path):
    workdir = tmp_path / "w"
    error = _error_line(_run("pacs_jax.train", "--config.model.lora_rank=2.5", f"--workdir={workdir}", cwd=tmp_path),
                        "pacs_jax.train")
    assert "config.model.lora_rank" in error, error
    error = _error_line(_run("pacs_jax.train", "--config.model.lora_rank=4", "--config.model.target_modules=lm_head",
                             f"--workdir={workdir}", cwd=tmp_path), "pacs_jax.train")
    assert error == ("pacs_jax.train: error: config.model.target_modules: 'lm_head' matches no module; the modules are "
                     "self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj, mlp.gate_proj, "
                     "mlp.up_proj, mlp.down_proj"), error
    assert not workdir.exists()


def test_lora_off_by_default_leaves_the_model_as_it_was():
    spec = RunSpec.unplaced(load_config("default.py"))
    cfg = model_config(spec, vocab_size=100)
    assert spec.model.lora_rank == 0 and lora_options(spec, cfg) == {} and not spec.algorithm.use_kl_loss
    assert (cfg.lora_rank, cfg.lora_targets) == (0, ())
