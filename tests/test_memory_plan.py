"""The analytic memory plan (pacs_jax/training/memory_plan.py), its use in validate_config, and the
ahead-of-time memory tool (tools/plan_memory.py) on the local CPU mesh."""

import importlib.util
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import models, sampling
from pacs_jax.sampling.engine import lower_sample, sample
from pacs_jax.sharding import MeshRules, make_mesh
from pacs_jax.training import config_check, memory_plan
from pacs_jax.training.config_check import ConfigError, validate_config
from pacs_jax.training.memory_plan import GiB, estimate_memory
from train_helpers import REPO, train_env


def load_config(file: str, arg: str | None = None):
    spec = importlib.util.spec_from_file_location(f"_memory_test_config_{file}", REPO / "configs" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config() if arg is None else module.get_config(arg)


def load_tool():
    spec = importlib.util.spec_from_file_location("plan_memory", REPO / "tools" / "plan_memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_memory"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def tiny_config():
    """The demo config (qwen3 architecture: D 128, F 256, L 2, H 4, K 2, Dh 32, tied) with a 64-token
    vocabulary on a (2, 2, 2) mesh: 8 prompts x 8 responses, prompts 56, responses 12 tokens."""
    c = load_config("default.py")
    c.model.vocab_size = 64
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
    c.train.prompts_per_step, c.train.mini_batches, c.train.micro_batches = 8, 2, 1
    c.rollout.micro_batches = 2
    return c


# ------------------------------------------------------------------------------------------ by hand
def test_params_optimizer_and_gradients_by_hand():
    plan = estimate_memory(tiny_config(), 8)
    assert plan.mesh == {"data": 2, "fsdp": 2, "tensor": 2}
    L, D, F, H, K, Dh, V = 2, 128, 256, 4, 2, 32, 64
    per_device = (
        V * D // 4  # embedding [V, D]: vocab over tensor, embed over fsdp
        + 2 * L * D  # input and post-attention norms [L, D], replicated
        + L * D * H * Dh // 4 + 2 * (L * D * K * Dh // 4) + L * H * Dh * D // 4  # q, k, v (K divides tensor), o
        + 2 * L * Dh  # q and k norms, replicated
        + 3 * (L * D * F // 4)  # gate, up, down
        + D)  # final norm
    assert per_device == 76544
    assert plan.params == per_device * 4  # float32
    assert plan.optimizer == 2 * per_device * 4  # AdamW mu + nu
    assert plan.gradients == 2 * per_device * 4  # float32 accumulator + one micro-batch's
    assert plan.resident == plan.params + plan.optimizer


def test_params_of_published_shapes_by_hand():
    """Qwen2.5-7B on (1, 8, 4): K/V heads (4) split over tensor; Qwen2.5-3B on (1, 4, 8): its 2 K/V heads
    do not divide tensor=8 and are replicated (as the model does), its 16 query heads are split."""
    c = load_config("paper.py", "qwen25_7b,pacs_beta1")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 8, 4
    L, D, F, H, K, Dh, V = 28, 3584, 18944, 28, 4, 128, 152064
    elems = (2 * V * D // 32  # embedding and lm_head (untied): vocab over tensor, embed over fsdp
             + L * D * (H + 2 * K) * Dh // 32 + L * H * Dh * D // 32  # q, k, v, o kernels
             + L * (H + 2 * K) * Dh // 4  # q, k, v biases: heads over tensor
             + 2 * L * D + D  # norms
             + 3 * L * D * F // 32)
    assert estimate_memory(c, 32).params == elems * 4

    c = load_config("paper.py", "qwen25_3b,pacs_beta1")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 4, 8
    L, D, F, H, K, Dh, V = 36, 2048, 11008, 16, 2, 128, 151936
    elems = (V * D // 32  # tied embedding
             + L * D * H * Dh // 32 + 2 * (L * D * K * Dh // 4) + L * H * Dh * D // 32  # k, v over fsdp only
             + L * H * Dh // 8 + 2 * L * K * Dh  # q bias over tensor, k / v biases replicated
             + 2 * L * D + D
             + 3 * L * D * F // 32)
    assert estimate_memory(c, 32).params == elems * 4


def test_params_match_the_real_models_shardings():
    """The plan's parameter bytes are those of the model's own sharded abstract state on a real mesh."""
    config = tiny_config()
    cfg = memory_plan.model_config(config)
    _, state = models.abstract_model(cfg, make_mesh(2, 2, 2))
    real = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert estimate_memory(config, 8).params == real


def test_kv_cache_by_hand():
    plan = estimate_memory(tiny_config(), 8)
    # 8 prompts / 2 sampler calls x n 8 = 32 rows over data x fsdp = 4; the demo's 128 slots capped at the
    # call's 32 rows; 56 + 12 cache slots per decode slot, and the prefill's 56 per prompt (1 per device);
    # K 2 over tensor 2
    L, rows, S, K, Dh = 2, 8, 56 + 12, 1, 32
    assert plan.rows_per_sampler_call == rows
    assert plan.kv_cache == L * (rows * S + 1 * 56) * K * Dh * 2 * 4  # k and v, float32 compute

    c = load_config("paper.py", "qwen25_7b,pacs_beta1")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 8, 4
    c.rollout.micro_batches, c.rollout.sampler = 2, "static"
    # 512 prompts x 8 = 4096 rows over fsdp 8, each its own slot of 512 + 4096; 4 K/V heads over tensor 4;
    # bfloat16; the prefill's 512 slots per prompt
    assert estimate_memory(c, 32).kv_cache == 28 * (512 * 4608 + 64 * 512) * 1 * 128 * 2 * 2
    c.rollout.micro_batches, c.rollout.sampler, c.rollout.slots = 1, "continuous", 4096
    # all 1024 prompts in one call, but 4096 decode slots (512 per device): a quarter of the static cache
    # of 8192 rows, whatever the call's row count
    assert estimate_memory(c, 32).kv_cache == 28 * (512 * 4608 + 128 * 512) * 1 * 128 * 2 * 2


@pytest.mark.parametrize("field, part", [("train.micro_batches", "update_activations"),
                                         ("rollout.micro_batches", "kv_cache"),
                                         ("train.logprob_micro_batches", "pi_old_activations")])
def test_more_micro_batches_never_need_more_memory(field, part):
    section, name = field.split(".")
    sizes, peaks = [], []
    for k in (1, 2, 4, 8):
        c = load_config("paper.py", "qwen25_7b,pacs_beta1")
        c.train.micro_batches = c.train.logprob_micro_batches = c.rollout.micro_batches = 1
        c.rollout.sampler = "static"  # one slot per row: the call's rows set the KV cache
        c[section][name] = k
        plan = estimate_memory(c, 32)
        sizes.append(getattr(plan, part))
        peaks.append(plan.peak)
    assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes
    assert all(a >= b for a, b in zip(peaks, peaks[1:])), peaks


def test_full_remat_saves_less_than_dots_than_none():
    sizes = {}
    for remat in ("none", "dots_with_no_batch_dims_saveable", "full"):
        c = load_config("paper.py", "qwen25_7b,pacs_beta1")
        c.model.remat = remat
        sizes[remat] = estimate_memory(c, 32).update_activations
    assert sizes["none"] > sizes["dots_with_no_batch_dims_saveable"] > sizes["full"]


@pytest.mark.parametrize("model, devices, hbm", [("qwen25_3b", 32, 95), ("qwen25_7b", 32, 95), ("qwen3_4b", 32, 95),
                                                 ("qwen3_8b", 32, 95), ("qwen25_7b_v6e", 64, 32)])
def test_paper_configs_fit_their_slices(model, devices, hbm):
    """The paper's models on the slices they are sized for (v5p-64, v6e-64), with room to spare; the
    compiled programs' numbers are checked by tools/plan_memory.py (needs libtpu)."""
    plan = estimate_memory(load_config("paper.py", f"{model},pacs_beta1"), devices)
    assert plan.peak < 0.8 * hbm * GiB, plan.table()


def test_ppo_adds_the_critics_parameters_and_adamw_state():
    """PPO's critic (a Qwen-2.5-7B backbone and a scalar head, float32, AdamW) on 32 devices of the
    (1, 8, 4) mesh, counted by hand; nothing else of the plan changes."""
    pacs = estimate_memory(load_config("paper.py", "qwen25_7b,pacs_beta1"), 32)
    ppo = estimate_memory(load_config("paper.py", "qwen25_7b,ppo"), 32)
    L, D, F, V, H, K, Dh = 28, 3584, 18944, 152064, 28, 4, 128
    layer = (D * H * Dh // 32 + H * Dh // 4  # q kernel (embed over fsdp 8, heads over tensor 4), q bias
             + 2 * (D * K * Dh // 32 + K * Dh // 4)  # k, v kernels and biases (4 KV heads over tensor 4)
             + H * Dh * D // 32 + 3 * D * F // 32 + 2 * D)  # o, gate / up / down, two norms (replicated)
    elems = V * D // 32 + L * layer + D + D // 8 + 1  # embedding, final norm, value head (w over fsdp, b); no lm_head
    assert ppo.critic == 3 * 4 * elems, (ppo.critic, 3 * 4 * elems)
    assert pacs.critic == 0 and "critic_update" not in pacs.phases
    # the actor's update (the peak phase) reads the advantages too: 8192 rows / (data x fsdp = 8) x 4096 f32
    assert ppo.update_batch - pacs.update_batch == 1024 * 4096 * 4
    assert ppo.peak - pacs.peak == ppo.critic + 1024 * 4096 * 4
    assert ppo.critic_gradients == 2 * 4 * elems  # float32 accumulator + one micro-batch's


# Published architectures (model cards' config.json): V, D, L, H, K, Dh, F, q/k/v biases, q/k norms, tied
# embeddings; and the models' published parameter counts, which the count below reproduces.
ARCHITECTURES = {
    "qwen25_7b": ((152064, 3584, 28, 28, 4, 128, 18944, True, False, False), 7.61e9),
    "qwen25_3b": ((151936, 2048, 36, 16, 2, 128, 11008, True, False, True), 3.09e9),
    "qwen3_8b": ((151936, 4096, 36, 32, 8, 128, 12288, False, True, False), 8.19e9),
    "qwen3_4b": ((151936, 2560, 36, 32, 8, 128, 9728, False, True, True), 4.02e9),
    "qwen25_7b_v6e": ((152064, 3584, 28, 28, 4, 128, 18944, True, False, False), 7.61e9),
}


def _parameter_count(V, D, L, H, K, Dh, F, bias, qk_norm, tied, *, critic=False) -> int:
    """Parameters of the actor (or of PPO's critic: no lm_head, a value head of D + 1), by the formula."""
    layer = (D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F + 2 * D
             + ((H + 2 * K) * Dh if bias else 0) + (2 * Dh if qk_norm else 0))
    backbone = V * D + L * layer + D
    if critic:
        return backbone + D + 1
    return backbone + (0 if tied else V * D)


@pytest.mark.parametrize("model, devices", [("qwen25_7b", 32), ("qwen25_3b", 32), ("qwen3_8b", 32), ("qwen3_4b", 32),
                                            ("qwen25_7b_v6e", 64)])
def test_ppo_estimate_exceeds_pacs_by_about_the_critics_parameters_and_adamw_state(model, devices):
    """PPO's peak minus PACS's, per device, is about the critic's float32 parameters, mu and nu (12 bytes
    a parameter, from the parameter count) over the mesh's fsdp x tensor shards; the critic's own two
    programs need less than the actor's update, so the peak phase stays the same."""
    arch, published = ARCHITECTURES[model]
    assert abs(_parameter_count(*arch) - published) < 0.005 * published  # the count is the models'
    pacs_config = load_config("paper.py", f"{model},pacs_beta1")
    ppo_config = load_config("paper.py", f"{model},ppo")
    pacs, ppo = estimate_memory(pacs_config, devices), estimate_memory(ppo_config, devices)
    shards = ppo.mesh["fsdp"] * ppo.mesh["tensor"]
    expected = 12 * _parameter_count(*arch, critic=True) / shards
    assert abs(ppo.critic - expected) < 0.01 * expected, (ppo.critic, expected)
    extra = ppo.peak - pacs.peak
    assert expected * 0.99 < extra < expected * 1.02, (extra / GiB, expected / GiB)
    assert set(ppo.phases) == {"sampler", "pi_old", "critic_values", "critic_update", "update"}
    assert 0 < ppo.phases["critic_values"] < ppo.phases["pi_old"]  # the same forward, without logits
    assert 0 < ppo.phases["critic_update"] < ppo.phases["update"]
    assert max(ppo.phases, key=ppo.phases.get) == max(pacs.phases, key=pacs.phases.get)
    assert "critic params + AdamW (PPO)" in ppo.table() and "phase critic_update" in ppo.table()


def test_advice_names_the_fields_of_the_largest_parts():
    c = load_config("paper.py", "qwen25_7b,pacs_beta1")
    c.train.micro_batches, c.rollout.micro_batches = 1, 1
    plan = estimate_memory(c, 32)
    advice = plan.advice()
    assert advice.startswith("train.micro_batches / model.remat (update activations ")
    assert advice.index("rollout.micro_batches (KV cache") < advice.index("mesh.fsdp / mesh.tensor (params")


# ------------------------------------------------------------------------------------------ validate_config
def test_validate_config_refuses_what_the_devices_cannot_hold(monkeypatch):
    config = tiny_config()
    monkeypatch.setattr(memory_plan, "device_memory_limit", lambda: None)  # CPU: no limit reported
    validate_config(config)
    monkeypatch.setattr(memory_plan, "device_memory_limit", lambda: 64 * GiB)
    validate_config(config)

    peak = estimate_memory(config, 8).peak
    monkeypatch.setattr(memory_plan, "device_memory_limit", lambda: peak - 1)
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    message = str(error.value)
    assert re.match(r"^config\.(train|rollout)\.[a-z_]+: a training step needs about ", message), message
    for field in ("train.micro_batches", "rollout.micro_batches", "train.logprob_micro_batches", "mesh.fsdp"):
        assert field in message, message


def test_validate_config_refuses_a_ppo_config_whose_critic_does_not_fit(monkeypatch):
    """A device that holds the PACS step exactly refuses the same config with PPO's critic, naming the
    fields to change, the critic's parts among them."""
    pacs = tiny_config()
    ppo = tiny_config()
    ppo.algorithm.objective = "ppo"
    pacs_plan, ppo_plan = estimate_memory(pacs, 8), estimate_memory(ppo, 8)
    assert ppo_plan.peak > pacs_plan.peak + ppo_plan.critic // 2 > pacs_plan.peak
    monkeypatch.setattr(memory_plan, "device_memory_limit", lambda: pacs_plan.peak)
    validate_config(pacs)
    with pytest.raises(ConfigError) as error:
        validate_config(ppo)
    message = str(error.value)
    assert re.match(rf"^config\.(train|rollout)\.[a-z_]+: a training step needs about {ppo_plan.peak / GiB:.1f} GiB ",
                    message), message
    for part in ("mesh.fsdp / mesh.tensor (critic params + optimizer ", "(critic update activations ",
                 "(critic gradients ", "train.logprob_micro_batches (critic values pass ", "train.micro_batches"):
        assert part in message, (part, message)
    monkeypatch.setattr(memory_plan, "device_memory_limit", lambda: ppo_plan.peak)
    validate_config(ppo)


def test_validate_config_names_the_tensor_axis_when_heads_do_not_divide(monkeypatch):
    config = tiny_config()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 8  # 4 query heads on tensor 8
    monkeypatch.setattr(memory_plan, "device_memory_limit", lambda: 64 * GiB)
    with pytest.raises(ConfigError, match=r"^config\.mesh\.tensor: num_attention_heads"):
        config_check.validate_config(config)


def test_device_memory_limit_is_none_on_cpu():
    assert memory_plan.device_memory_limit() is None


# ------------------------------------------------------------------------------------------ the tool
def test_tool_compiles_the_three_programs_on_the_cpu_mesh():
    tool = load_tool()
    config = tiny_config()
    config.model.num_hidden_layers = 1
    log = []
    programs = tool.build_programs(config, jax.devices(), platform="cpu", log=log.append)
    assert [p.name for p in programs] == ["sampler", "pi_old", "update"]
    opt_state = estimate_memory(config, 8).optimizer
    for p in programs:
        assert p.argument > 0 and p.peak >= p.argument and p.estimate > 0 and not p.error, p
        # the AdamW state (mu, nu and step counts) is an argument of the update only
        assert p.outside == 0 if p.name == "update" else 0 <= p.outside - opt_state <= 16, p
    update = programs[-1]
    assert update.alias > 0  # params and optimizer state donated
    assert update.argument >= estimate_memory(config, 8).resident
    assert any("compiling update" in line for line in log)
    assert programs[0].loop_gathers == "no parameter all-gather inside its loops"  # the decode layout
    text, fits = tool.report(programs, 16 * GiB, "cpu")
    assert fits and "sampler: no parameter all-gather inside its loops" in text
    assert re.fullmatch(r"peak per device: \d+\.\d\d GiB of 16\.00 GiB \(fits\)", text.splitlines()[-1])
    _, fits = tool.report(programs, 1024, "cpu")
    assert not fits


def test_tool_compiles_the_critics_programs_for_ppo_on_the_cpu_mesh():
    """PPO: the critic's values and update programs between pi_old and the actor's update (which reads
    the advantages); the critic's state counted outside the actor's programs and the actor's outside
    the critic's."""
    tool = load_tool()
    config = tiny_config()
    config.model.num_hidden_layers = 1
    config.algorithm.objective = "ppo"
    plan = estimate_memory(config, 8)
    programs = {p.name: p for p in tool.build_programs(config, jax.devices(), platform="cpu", log=lambda s: None)}
    assert list(programs) == ["sampler", "pi_old", "critic_values", "critic_update", "update"]
    for p in programs.values():
        assert p.argument > 0 and p.peak >= p.argument and p.estimate > 0 and not p.error, p
    scalars = 16  # AdamW's step counts
    assert 0 <= programs["update"].outside - plan.critic <= scalars
    assert 0 <= programs["sampler"].outside - plan.critic - plan.optimizer <= 2 * scalars
    assert 0 <= programs["critic_update"].outside - plan.resident + plan.critic <= scalars  # the actor's state
    critic_update = programs["critic_update"]
    assert critic_update.alias > 0 and critic_update.argument >= plan.critic  # its params and AdamW donated
    assert programs["critic_values"].estimate == plan.phase_total("critic_values")


def test_tool_without_libtpu_says_how_to_install_it():
    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is installed here")
    result = subprocess.run([sys.executable, "tools/plan_memory.py", "--topology=v5p-8"], cwd=REPO,
                            env=train_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert 'pip install "jax[tpu]==' in result.stderr


def test_sampler_lowered_on_abstract_arguments_is_the_program_a_call_runs():
    """lower_sample makes nothing concrete (key, temperature, top_p, stop ids are abstract), and
    the real call afterwards compiles nothing."""
    cfg = models.QwenConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    mesh = make_mesh(4, 1, 2)
    graphdef, state = nnx.split(models.init_random(cfg, mesh))
    settings = sampling.SamplingSettings(max_new_tokens=4, n=2, temperature=1.0, stop_token_ids=(3,))
    sharding = MeshRules(mesh).sharding(("batch", "length"), (8, 16))
    prompts = jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=sharding)
    abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    lowered = lower_sample(graphdef, abstract_state, prompts, prompts, settings)
    lowered.compile()
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    tokens = jax.device_put(np.ones((8, 16), np.int32), sharding)
    jax.block_until_ready(sample(graphdef, state, tokens, tokens, settings, jax.random.fold_in(jax.random.key(0), 1)))
    assert events == []
