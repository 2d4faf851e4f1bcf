"""Issue 66 item 5: the paper setup of Qwen3-30B-A3B (configs/paper.py ``qwen3_30b_a3b``), checked without
compiling it (its plan on a v5p-64: tools/plan_memory.py and tools/plan_step.py, docs/measurements.md 8c).

``qwen3_30b_a3b,ALGO`` is the mixture-of-experts preset on a mesh whose tensor axis divides the experts'
width (the 8B's setup otherwise, with fewer decode slots), and passes the trainer's check for the
v5p-64's 32 chips as launch/tpu_pod.sh runs it (the data files left to the workers); its ``,cpu`` scale is a
tiny random model of the same family, experts included, that passes the trainer's check on one device.
tools/plan_step.py's decode step must read only the experts its tokens route to: their expected share against
a simulation of uniform routing.
"""

from __future__ import annotations

import numpy as np
import pytest

from pacs_jax.models.config import preset
from pacs_jax.sharding import mesh_shape
from pacs_jax.training.config_check import check_for_slice, validate_config
from pacs_jax.training.model_spec import model_config
from pacs_jax.training.spec import RunSpec
from qwen_reference import load_tool
from train_helpers import load_config

V5P_64_CHIPS = 32


@pytest.mark.parametrize("algo", ["pacs_beta1", "grpo"])
def test_the_30b_setup_is_the_moe_preset_and_passes_the_check_for_a_v5p_64(algo):
    config = load_config("paper.py", f"qwen3_30b_a3b,{algo}")
    config.model.random_init = True  # no released weights here: the plan's model
    spec, unchecked = check_for_slice(RunSpec.unplaced(config), V5P_64_CHIPS)
    assert set(unchecked) <= {"data.train_files[0]=data/deepscaler/train.jsonl"}  # left to the workers' disks
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


def _fields(config) -> dict:
    """{dotted field: value} of a config."""
    def walk(tree, prefix):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value
    return dict(walk(config.to_dict(), ""))


def test_the_30b_setup_is_the_8b_setup_but_for_the_model_and_the_sampler_slots():
    """The paper's setup at Qwen3-8B (its mesh, micro-batches, remat, one sampler call a step) with the MoE
    preset; only the decode slots are fewer (the 8B's 4096 slots' page pool does not fit beside the 30B's weights)."""
    moe, dense = (_fields(load_config("paper.py", f"{m},pacs_beta1")) for m in ("qwen3_30b_a3b", "qwen3_8b"))
    differ = {k: (moe[k], dense[k]) for k in moe if moe[k] != dense[k]}
    assert set(moe) == set(dense)
    assert differ.pop("model.preset") == ("Qwen3-30B-A3B", "Qwen3-8B")
    assert differ.pop("workdir") == ("workdir/qwen3_30b_a3b_pacs_beta1", "workdir/qwen3_8b_pacs_beta1")
    slots = differ.pop("rollout.slots")
    assert slots[0] < slots[1] and differ == {}


@pytest.mark.parametrize("model", ["qwen3_30b_a3b", "qwen3_30b_a3b_lora"])
def test_the_30b_cpu_scale_is_a_tiny_moe_that_passes_the_check_on_one_device(model):
    small = load_config("paper.py", f"{model},pacs_beta1,cpu")
    validate_config(small, device_count=1)
    cfg = model_config(RunSpec.from_config(small, device_count=1))
    assert cfg.model_type == "qwen3_moe"
    if model.endswith("_lora"):  # the attention (PEFT's all-linear on a model of experts) and both experts' weights
        assert (cfg.lora_rank, cfg.lora_targets) == (32, ("q_proj", "k_proj", "v_proj", "o_proj",
                                                          "mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    assert 2 <= cfg.num_experts_per_tok < cfg.num_experts <= 8 and cfg.num_hidden_layers <= 2  # tiny, top-k >= 2
    assert small.rollout.max_new_tokens == 64 and small.model.preset == ""
    dense = load_config("paper.py", "qwen3_8b,pacs_beta1,cpu")  # the dense family's scale has no experts
    assert (dense.model.model_type, dense.model.num_experts) == ("qwen3", 0)


@pytest.mark.parametrize("tokens, experts, per_token", [(1, 128, 8), (4, 16, 2), (32, 128, 8)])
def test_a_decode_step_must_read_the_experts_its_tokens_route_to(tokens, experts, per_token):
    share = load_tool("plan_step").experts_touched(tokens, experts, per_token)
    rng = np.random.default_rng(0)
    trials = 1000  # each token's k distinct experts drawn uniformly, as top-k of random scores
    picks = np.argsort(rng.random((trials, tokens, experts)), axis=-1)[..., :per_token]
    touched = np.zeros((trials, experts), bool)
    np.put_along_axis(touched, picks.reshape(trials, -1), True, axis=-1)
    simulated = touched.mean()
    assert share == pytest.approx(simulated, abs=4 * touched.mean(axis=-1).std() / np.sqrt(trials) + 1e-6)
    if tokens == 1:
        assert share == pytest.approx(per_token / experts)
