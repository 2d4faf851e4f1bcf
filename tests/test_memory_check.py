"""Memory of a training step from XLA's compiled programs (training/memory_check.py): the trainer's
check before step 1, and the ahead-of-time tool (tools/plan_memory.py) on the local CPU mesh."""

import importlib.util
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax.models import lora
from pacs_jax import models, sampling
from pacs_jax.sampling.engine import lower_sample, sample
from pacs_jax.sharding import make_mesh, placement
from pacs_jax.training import compilations, memory_check
from pacs_jax.training.config_check import ConfigError, validate_config
from pacs_jax.training.memory_check import GiB
from pacs_jax.training.step_programs import StepPrograms
from pacs_jax.training.spec import RunSpec
from train_helpers import REPO, train_env


def load_config(file: str, arg: str | None = None):
    spec = importlib.util.spec_from_file_location(f"_memory_test_config_{file}", REPO / "configs" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config() if arg is None else module.get_config(arg)


def load_tool():
    spec = importlib.util.spec_from_file_location("plan_memory", REPO / "tools" / "plan_memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_memory"] = module
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


def state_bytes(tree) -> int:
    """Bytes per device of a tree of sharded arrays, counted shard by shard (not by memory_check)."""
    return max(sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
                   if s.device == d) for d in jax.devices())


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_kl_losss_frozen_reference_is_counted_resident_and_lora_has_none(lora_rank):
    """The KL loss without LoRA holds a frozen copy of the parameters through every program (the memory plan
    counts it outside each, and in the learner's resident state); with LoRA the reference is the adapters off:
    nothing more, and AdamW's state covers the adapters alone. Programs listed, not compiled."""
    config = tiny_config()
    config.algorithm.use_kl_loss = True
    config.model.lora_rank = lora_rank
    cfg = models.QwenConfig(model_type="qwen3", vocab_size=64, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            tie_word_embeddings=True)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        model = models.init_random(cfg)
        if lora_rank:
            model = lora.attach(model, rank=lora_rank, alpha=8.0, targets=("q_proj", "up_proj"))
        graphdef, params = nnx.split(model)
        spec = RunSpec.unplaced(config)
        with_kl = StepPrograms(spec, graphdef, params, (1,)).learner
        without = StepPrograms(RunSpec.unplaced(_without_kl(config)), graphdef, params, (1,)).learner
    params_bytes = memory_check.per_device_bytes(params)
    copy = 0 if lora_rank else params_bytes
    assert with_kl.reference_bytes() == copy and with_kl.resident_bytes() == without.resident_bytes() + copy
    outside = {p.name: p.outside for p in with_kl.programs((56,), (12,))}
    assert outside == {p.name: p.outside + copy for p in without.programs((56,), (12,))}
    opt_params = sum(1 for x in jax.tree.leaves(with_kl.state[1]) if x.shape)  # AdamW's mu and nu (not its counts)
    assert opt_params == 2 * (4 if lora_rank else len(jax.tree.leaves(params))), opt_params


def _without_kl(config):
    config = config.copy_and_resolve_references()
    config.algorithm.use_kl_loss = False
    return config


@pytest.mark.slow(seconds=45)
@pytest.mark.parametrize("packing", [False, True])
def test_the_step_programs_memory_is_xlas_and_counts_the_state_outside_each(packing):
    """Every program of every bucket compiled (the warm-up's list: padded, one pi_old and update per
    response bucket; packed, one per pass on the largest buckets' rows, its passes a loop); each
    program's outside bytes are the resident state it does not take: the AdamW
    state during the sampler and pi_old, nothing during the update (it takes params and AdamW state,
    donated)."""
    config = tiny_config()
    config.rollout.response_buckets = (6, 12)
    config.train.packing = packing
    with jax.set_mesh(make_mesh(2, 2, 2)):
        model = models.init_random(models.QwenConfig(
            model_type="qwen3", vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True))
        graphdef, params = nnx.split(model)
        programs = StepPrograms(RunSpec.unplaced(config), graphdef, params, (1,))
        opt_state = programs.learner.init_optimizer(params)
        compiled = programs.compile(progress=False)
    names = [p.name for p in compiled]
    if packing:  # 64 rows in 2 micro-batches of pi_old (2 mini-batches of the update) on 4 batch shards: 8 rows
        # a micro-batch and shard; passes of a quarter of those, 2 rows a shard, at most 4 (the update: 4 x 8 rows
        # in a mini-batch of 32 rows) or 8 (pi_old: 64 rows) passes
        assert {k: (v.rows, v.passes) for k, v in programs.learner.layouts().items()} == {"logprob": (2, 8),
                                                                                          "update": (2, 4)}
        assert names == ["sampler", "assemble", "pi_old", "update", "rollout_consistency"], names
    else:
        assert names == (["sampler", "assemble", "assemble"] + ["pi_old", "update"] * 2
                         + ["rollout_consistency"] * 2), names
    opt_bytes = state_bytes(opt_state)
    for p in compiled:
        assert p.argument > 0 and p.peak >= p.argument and not p.error, p
        if p.name in ("sampler", "pi_old"):
            assert p.outside == opt_bytes, p
        if p.name == "update":
            assert p.outside == 0 and p.alias >= state_bytes((params, opt_state)), p  # donated in place
    memory_check.check_fits(compiled, 64 * GiB)  # fits: no error
    update = max((p for p in compiled if p.name == "update"), key=lambda p: p.total)
    fullest = max(compiled, key=lambda p: p.total)
    with pytest.raises(ConfigError) as error:
        memory_check.check_fits(compiled, fullest.total - 1)
    field = memory_check.FIELDS[fullest.name].split(" / ")[0]
    assert str(error.value).startswith(f"config.{field}: the step's {fullest.name} program"), error.value
    assert f"{fullest.total / GiB:.2f} GiB per device" in str(error.value)
    assert update.total <= fullest.total


@pytest.mark.slow(seconds=45)
def test_the_trainer_refuses_a_step_that_does_not_fit_before_step_1(monkeypatch, tmp_path):
    """A device that reports less memory than the step's fullest program: the run stops at the
    warm-up with one ConfigError naming the fields, and trains nothing."""
    from pacs_jax.training.run import run_training

    config = load_config("default.py")
    config.warmstart.steps, config.eval.before_rl, config.eval.sets = 0, False, ""
    config.train.steps, config.train.prompts_per_step = 1, 8
    config.data.arithmetic.problems, config.data.warmstart_problems, config.data.held_out_problems = 40, 0, 0
    monkeypatch.setattr(memory_check, "device_memory_limit", lambda: 1 << 20)  # 1 MiB
    with pytest.raises(ConfigError, match=r"^config\.(rollout\.slots|train\.micro_batches|"
                                          r"train\.logprob_micro_batches|train\.prompts_per_step): the step's "):
        with jax.set_mesh(make_mesh(8, 1, 1)):
            run_training(config, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip()
    checkpoints = tmp_path / "checkpoints"
    assert not checkpoints.exists() or not any(p.name.isdigit() for p in checkpoints.iterdir())  # no step saved
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 1


def test_validate_config_names_the_tensor_axis_when_heads_do_not_divide():
    config = tiny_config()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 8  # 4 query heads on tensor 8
    with pytest.raises(ConfigError, match=r"^config\.mesh\.tensor: 8 does not divide the model's num_attention_heads"):
        validate_config(config)


def test_validate_config_names_the_fsdp_axis_when_it_does_not_divide_the_experts():
    """model.expert_parallel splits the experts over fsdp: 6 experts on fsdp 4 are refused naming the field (and
    taken without it), and on a dense model it is refused naming itself."""
    config = tiny_config()
    config.model.model_type, config.model.num_experts, config.model.num_experts_per_tok = "qwen3_moe", 6, 2
    config.model.moe_intermediate_size = 32
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 4, 1
    validate_config(config)
    config.model.expert_parallel = True
    with pytest.raises(ConfigError, match=r"^config\.mesh\.fsdp: 4 does not divide the model's num_experts \(6\): "
                                          r"model\.expert_parallel splits the experts over the fsdp axis"):
        validate_config(config)
    dense = tiny_config()
    dense.model.expert_parallel = True
    with pytest.raises(ConfigError, match=r"^config\.model\.expert_parallel: True splits a mixture-of-experts model's "
                                          r"experts, and the model \(qwen3\) has none"):
        validate_config(dense)


def test_device_memory_limit_is_none_on_cpu():
    assert memory_check.device_memory_limit() is None


@pytest.mark.slow(seconds=50)
def test_tool_compiles_the_three_programs_on_the_cpu_mesh():
    tool = load_tool()
    config = tiny_config()
    config.model.num_hidden_layers = 1
    log = []
    programs = tool.build_programs(RunSpec.unplaced(config), jax.devices(), log=log.append)
    assert [p.name for p in programs] == ["warmstart", "sampler", "pi_old", "update"]  # the demo warm-starts
    for p in programs:
        assert p.argument > 0 and p.peak >= p.argument and not p.error, p
    warm, sampler, pi_old, update = programs
    assert warm.outside == 0 and warm.alias > 0  # before RL: its own AdamW state, donated
    assert sampler.outside == pi_old.outside > 0 and update.outside == 0  # the AdamW state, outside the update only
    assert update.alias > 0  # params and optimizer state donated
    assert any("compiling update" in line for line in log)
    assert sampler.loop_facts[:3] == ("no parameter all-gather inside its loops",  # the decode layout
                                      "no copy of the page pool inside its loops",  # the paged sampler, the default
                                      "no 68-token (prompt + max_new_tokens) cache row inside its loops")
    # what a decode step launches (hlo.loop_profile): the decode loops are one a width, their trips known on device
    assert re.fullmatch(r"its decode loops: \d+ fusions, library kernels: .*; \d+ copies; \d+ loops \([1-9]\d* with a "
                        r"trip count only the device knows\); \d+ conditionals", sampler.loop_facts[3]), sampler.loop_facts
    text, fits = memory_check.report(programs, 16 * GiB, "cpu")
    assert fits and "sampler: no parameter all-gather inside its loops" in text
    assert re.fullmatch(r"peak per device: \d+\.\d\d GiB of 16\.00 GiB \(fits\)", text.splitlines()[-1])
    text, fits = memory_check.report(programs, 1024, "cpu")
    assert not fits and "to shrink the fullest (" in text


@pytest.mark.slow(seconds=40)
def test_tool_compiles_the_critics_programs_for_ppo_on_the_cpu_mesh():
    """PPO: the critic's values and update programs between pi_old and the actor's update (which reads
    the advantages); the critic's state counted outside the actor's programs and the actor's outside
    the critic's."""
    tool = load_tool()
    config = tiny_config()
    config.model.num_hidden_layers = 1
    config.algorithm.objective = "ppo"
    programs = {p.name: p for p in tool.build_programs(RunSpec.unplaced(config), jax.devices(), log=lambda s: None)}
    assert list(programs) == ["warmstart", "sampler", "pi_old", "critic_values", "critic_update", "update"]
    for p in programs.values():
        assert p.argument > 0 and p.peak >= p.argument and not p.error, p
    critic_update, update = programs["critic_update"], programs["update"]
    assert critic_update.alias > 0 and update.alias > 0  # each donates its own params and AdamW state
    # outside the actor's update: the critic's state, which the critic's update donates (XLA's aliased
    # bytes), and the other way round
    assert update.outside == critic_update.alias > 0 and critic_update.outside == update.alias > 0
    assert programs["sampler"].outside > update.outside  # the actor's AdamW state and the critic's state


def test_tool_without_libtpu_says_how_to_install_it(monkeypatch):
    """Without the TPU compiler, the tool's devices say which pip command brings it (libtpu is a test
    requirement, so its absence is simulated)."""
    from pacs_jax import topologies

    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(topologies, "_has_module", lambda name: False)
    with pytest.raises(RuntimeError, match=r'needs libtpu, which is not installed.*pip install "jax\[tpu\]=='
                       + re.escape(jax.__version__) + '"'):
        topologies.abstract_devices("v5p-64")


SHRUNK_LAYERS = ["--config.model.preset=", "--config.model.random_init=True", "--config.model.hidden_size=256",
                 "--config.model.intermediate_size=512", "--config.model.num_hidden_layers=2",
                 "--config.model.head_dim=128",
                 "--config.model.rope_theta=1000000.0"]  # the TPU paged kernel takes head_dim 128, as the presets'
# The sampler plans' vocabulary: what they check (collectives and copies inside the decode loops, the page pool, a
# cache row, fitting) does not depend on it, and the real 151,936 entries made a third of their compile time
SAMPLER_VOCAB = "--config.model.vocab_size=4096"
# Nor on the decode slots, whose count sizes the slot and page arrays of every loop: the plans take an eighth
# of the paper's (the Qwen2.5-7B plan's CPU 92.6 -> 52.8 s at 4096 -> 512 slots)
SLOTS_SHRUNK = 8


@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("model, heads, kv_heads, slots, shard_slots, mesh", [
    ("qwen3_4b", 16, 8, 3072, 96, "{'data': 4, 'fsdp': 8, 'tensor': 1}")])
def test_tool_compiles_a_paper_config_for_v5p_64_with_the_tpus_own_kernels(model, heads, kv_heads, slots, shard_slots,
                                                                           mesh):
    """tools/plan_memory.py on a paper config (its mesh, buckets, dtype, remat and paged sampler, an eighth
    of its slots; the model shrunk to two narrow layers with the real head size and a vocabulary of 4,096)
    for the 32 chips of a v5p-64, compile-only on this CPU: the mesh's TPU devices choose the kernels
    (splash attention, the TPU paged-attention kernel), with nothing patched. Inside the sampler's decode
    loops: no parameter all-gather, no copy of the page pool (a [K, Dh] write window made XLA:TPU copy the
    whole pool to the kernel's layout at every layer of every step: 8 such copies here with Qwen3-4B's 8 KV
    heads on one device), and no [slots, prompt + max_new] cache row. Its tail narrows to 2/3 of the slots
    rather than the config's 1/8 (each width one more loop to compile), enough to compile a narrowed
    loop for the TPU (a queue's 12 slots narrow to 8, a width of the ladder; 3/4, 9 a queue, narrowed to none). Qwen2.5-7B's tensor-parallel mesh is the carry-over plan's below (the same decode step,
    sampling/decode.py, under its (1, 8, 4) mesh: a plan of its own here was 30 of this file's CPU seconds)."""
    assert load_config("paper.py", f"{model},pacs_beta1").rollout.slots == slots  # the paper's, shrunk below
    slots, shard_slots = slots // SLOTS_SHRUNK, shard_slots // SLOTS_SHRUNK
    model_type = "qwen3" if model.startswith("qwen3") else "qwen2"
    shrink = [*SHRUNK_LAYERS, SAMPLER_VOCAB, f"--config.model.model_type={model_type}",
              f"--config.model.num_attention_heads={heads}",
              f"--config.model.num_key_value_heads={kv_heads}", f"--config.rollout.slots={slots}"]
    result = subprocess.run([sys.executable, "tools/plan_memory.py", f"--config=configs/paper.py:{model},pacs_beta1",
                             "--topology=v5p-64", "--programs=sampler", *shrink,
                             f"--config.rollout.tail_slots={slots * 2 // 3}"],
                            cwd=REPO, env=train_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "[plan_memory] v5p-64: 32 compile-only TPU v5 devices, 95 GiB HBM each" in out
    assert re.search(rf"attention splash; mesh {re.escape(mesh)} on 32 TPU v5 devices", out), out
    shards = slots // shard_slots  # one queue a batch shard; a prompt of 512 tokens is 32 pages
    assert re.search(rf"1024 prompts x 512 tokens, n=8: 8192 rows in {slots} decode slots \(narrowing to "
                     rf"{slots * 2 // 3}\) over a page pool a batch shard of {1024 // shards * 32} prompt \+ "
                     rf"{shard_slots * 257} response pages of 16 tokens \(4112 response tokens a slot\)", out), out
    assert "sampler: no parameter all-gather inside its loops" in out
    assert "sampler: no copy of the page pool inside its loops" in out
    assert "sampler: no 4608-token (prompt + max_new_tokens) cache row inside its loops" in out
    assert re.search(r"peak per device: \d+\.\d\d GiB of 95\.00 GiB \(fits\)", out)
    assert "mock" not in (REPO / "tools" / "plan_memory.py").read_text()  # no backend patched


@pytest.mark.slow(seconds=120)
def test_tool_compiles_carry_overs_sampler_for_a_paper_config_on_v5p_64():
    """rollout.carry_over: the sampler plan_memory compiles (and the trainer's warm-up, the same list) is the
    carry-over engine's six programs (init, insert, chunk, harvest; a resume's restore and reseat) for
    the step's one call of 2P prompts, its state of G = max_staleness + 1 generations' rows (the paper
    configs' max_staleness 3) and their one page pool among their arguments: Qwen2.5-7B's config shrunk as
    above (an eighth of its 4096 slots), compile-only for the v5p-64, with the one flag (its tail_slots the mode's:
    none). Its mesh is the paper's tensor-parallel one, (1, 8, 4) with the TPU's kernels, and inside its decode
    loops (the decode step of the paged sampler above) no parameter all-gather, no copy of the page pool and no
    [slots, prompt + max_new] cache row."""
    slots = load_config("paper.py", "qwen25_7b,pacs_beta1").rollout.slots // SLOTS_SHRUNK
    shrink = [*SHRUNK_LAYERS, SAMPLER_VOCAB, "--config.model.model_type=qwen2", "--config.model.num_attention_heads=8",
              "--config.model.num_key_value_heads=4", f"--config.rollout.slots={slots}"]
    result = subprocess.run([sys.executable, "tools/plan_memory.py", "--config=configs/paper.py:qwen25_7b,pacs_beta1",
                             "--topology=v5p-64", "--programs=sampler", *shrink, "--config.rollout.carry_over=True"],
                            cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "[plan_memory] v5p-64: 32 compile-only TPU v5 devices, 95 GiB HBM each" in out
    assert re.search(r"attention splash; mesh \{'data': 1, 'fsdp': 8, 'tensor': 4\} on 32 TPU v5 devices", out), out
    # a prompt of 512 tokens is 32 pages; the response pages every slot's longest row, 257 pages of 16 tokens
    assert ("sampler: carry-over: 2048 prompts x 512 tokens a call, n=8, 4 generations (max_staleness + 1): 65536 "
            f"rows in {slots} decode slots over a page pool of {4 * 2048 * 32} prompt + {slots * 257} response pages "
            "of 16 tokens; 1024 groups returned a call") in out, out
    assert "sampler: no parameter all-gather inside its loops" in out
    assert "sampler: no copy of the page pool inside its loops" in out
    assert "sampler: no 4608-token (prompt + max_new_tokens) cache row inside its loops" in out
    assert re.search(r"peak per device: \d+\.\d\d GiB of 95\.00 GiB \(fits\)", out), out


def test_sampler_lowered_on_abstract_arguments_is_the_program_a_call_runs():
    """lower_sample makes nothing concrete (key, temperature, top_p, stop ids are abstract), and
    the real call afterwards compiles nothing."""
    cfg = models.QwenConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with jax.set_mesh(make_mesh(4, 1, 2)):
        graphdef, state = nnx.split(models.init_random(cfg))
        settings = sampling.SamplingSettings(max_new_tokens=4, n=2, temperature=1.0, stop_token_ids=(3,))
        sharding = placement(("batch", "length"), (8, 16))
        prompts = jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=sharding)
        abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        lowered = lower_sample(graphdef, abstract_state, prompts, prompts, settings)
        lowered.compile()
        tokens = jax.device_put(np.ones((8, 16), np.int32), sharding)
        key = jax.block_until_ready(jax.random.fold_in(jax.random.key(0), 1))  # its own eager programs, before
        with compilations.built() as events:
            jax.block_until_ready(sample(graphdef, state, tokens, tokens, settings, key))
    assert events == []  # nothing compiled, nor read from the persistent compilation cache
