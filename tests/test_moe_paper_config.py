"""Issue 66 item 5: the paper setup of Qwen3-30B-A3B (configs/paper.py ``qwen3_30b_a3b``), checked without
compiling it (its plan on a v5p-64: tools/plan_memory.py and tools/plan_step.py, docs/measurements.md 8c).

``qwen3_30b_a3b,ALGO`` is the mixture-of-experts preset on a mesh whose tensor axis divides the experts'
width, and passes the trainer's check for the v5p-64's 32 chips as launch/tpu_pod.sh runs it (the data files
left to the workers); its ``,cpu`` scale is a tiny random model of the same family, experts included, that
passes the trainer's check on one device.
"""

from __future__ import annotations

import pytest

from pacs_jax.models.config import preset
from pacs_jax.sharding import mesh_shape
from pacs_jax.training.config_check import check_for_slice, validate_config
from pacs_jax.training.model_spec import model_config
from pacs_jax.training.spec import RunSpec
from train_helpers import load_config

V5P_64_CHIPS = 32


@pytest.mark.parametrize("algo", ["pacs_beta1", "grpo"])
def test_the_30b_setup_is_the_moe_preset_and_passes_the_check_for_a_v5p_64(algo):
    config = load_config("paper.py", f"qwen3_30b_a3b,{algo}")
    config.model.random_init = True  # no released weights here: the plan's model
    spec, unchecked = check_for_slice(RunSpec.unplaced(config), V5P_64_CHIPS)
    assert unchecked == ["data.train_files[0]=data/deepscaler/train.jsonl"]  # on the workers' disks
    cfg = model_config(spec)
    released = preset("Qwen3-30B-A3B")
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size) == ("qwen3_moe", 48, 128, 8, 768) == (
        released.model_type, released.num_hidden_layers, released.num_experts, released.num_experts_per_tok,
        released.moe_intermediate_size)
    _, _, tensor = mesh_shape(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, V5P_64_CHIPS)
    assert cfg.moe_intermediate_size % tensor == 0 and cfg.num_attention_heads % tensor == 0
    # a sampler call's rows fill its decode slots (slots are capped at them)
    rows = config.train.prompts_per_step // config.rollout.micro_batches * config.rollout.n
    assert config.rollout.slots <= rows


def test_the_30b_cpu_scale_is_a_tiny_moe_that_passes_the_check_on_one_device():
    small = load_config("paper.py", "qwen3_30b_a3b,pacs_beta1,cpu")
    validate_config(small, device_count=1)
    cfg = model_config(RunSpec.from_config(small, device_count=1))
    assert cfg.model_type == "qwen3_moe"
    assert 2 <= cfg.num_experts_per_tok < cfg.num_experts <= 8 and cfg.num_hidden_layers <= 2  # tiny, top-k >= 2
    assert small.rollout.max_new_tokens == 64 and small.model.preset == ""
    dense = load_config("paper.py", "qwen3_8b,pacs_beta1,cpu")  # the dense family's scale has no experts
    assert (dense.model.model_type, dense.model.num_experts) == ("qwen3", 0)
