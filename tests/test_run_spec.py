"""training/spec.py: the typed run spec, one test per kind of check (a section's own value, a check
across sections, a check against the devices) and the values derived from it, against the numbers the
demo config (configs/default.py) and rl/packing.py give on their own."""

import dataclasses

import pytest

from pacs_jax.rl.packing import pass_rows
from pacs_jax.training.spec import ConfigError, RunSpec
from train_helpers import load_config


@pytest.fixture
def demo():
    return load_config("default.py")


def test_a_section_checks_its_own_values_also_when_a_tool_replaces_one(demo):
    spec = RunSpec.from_config(demo, device_count=1)
    with pytest.raises(ConfigError, match=r"^config\.train\.steps: must be an integer >= 1, got 0$"):
        dataclasses.replace(spec.train, steps=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.train.steps = 5  # noqa: the spec is read-only; tools replace
    demo.rollout.top_p = 1.5
    with pytest.raises(ConfigError, match=r"^config\.rollout\.top_p: must be in \(0, 1\], got 1.5$"):
        RunSpec.from_config(demo, device_count=1)


def test_the_spec_checks_how_sections_fit_together(demo):
    spec = RunSpec.from_config(demo, device_count=1)
    with pytest.raises(ConfigError, match=r"^config\.rollout\.micro_batches: 5 must be an integer >= 1 dividing "
                                          r"train\.prompts_per_step=32$"):
        dataclasses.replace(spec, rollout=dataclasses.replace(spec.rollout, micro_batches=5))
    with pytest.raises(ConfigError, match=r"^config\.train\.packed_rows: 1 rows a pass on each of 1 batch shards "
                                          r"cannot hold a prompt group's 8 sequences .* set it to 0 or at least 8$"):
        dataclasses.replace(spec, train=dataclasses.replace(spec.train, packed_rows=1))


def test_the_spec_checks_the_mesh_against_its_devices(demo):
    RunSpec.from_config(demo, device_count=8)  # data=-1 fills them
    demo.mesh.data = 16
    with pytest.raises(ConfigError, match=r"^config\.mesh .* needs 16 devices, 8 are available$"):
        RunSpec.from_config(demo, device_count=8)
    demo.mesh.data, demo.mesh.fsdp = -1, 3  # issue 53 item 7: the error names the field set, not data's -1
    with pytest.raises(ConfigError, match=r"^config\.mesh\.fsdp=3: 8 devices are not divisible by 3 \(mesh\.data=-1 "):
        RunSpec.from_config(demo, device_count=8)
    demo.mesh.fsdp, demo.mesh.tensor = 2, 3
    with pytest.raises(ConfigError, match=r"^config\.mesh\.fsdp=2 x mesh\.tensor=3: 8 devices are not divisible by 6 "):
        RunSpec.from_config(demo, device_count=8)
    demo.mesh.fsdp, demo.mesh.tensor = 1, 1
    demo.mesh.data, demo.train.prompts_per_step, demo.rollout.n, demo.train.mini_batches = 8, 4, 2, 1
    RunSpec.from_config(demo, device_count=8)  # 8 responses a micro-batch
    demo.train.mini_batches = 2  # 4 responses a micro-batch on 8 batch shards
    with pytest.raises(ConfigError, match=r"^config\.train\.prompts_per_step: a micro-batch of 4 responses"):
        RunSpec.from_config(demo, device_count=8)


def test_the_derived_values_of_the_demo(demo):
    """The demo: 32 prompts x 8 responses, 4 mini-batches, prompts of up to 56 tokens, 12 new tokens."""
    spec = RunSpec.from_config(demo, device_count=1)
    assert (spec.responses, spec.micro_rows, spec.row_width, spec.packed_length) == (256, 64, 68, 68)
    assert spec.total_updates == 240 * 4 and spec.logprob_micro_batches == 4
    assert spec.eval.sets == ("held_out",) and spec.critic is None
    layouts = spec.packed_layouts(1, critic=False)
    assert [name for name, _ in layouts.items()] == ["logprob", "update"]
    assert layouts.update.rows == pass_rows(64, 68, 68, unit=8, shards=1)
    assert layouts.logprob.mini_batches == 1 and layouts.update.mini_batches == 4
    # the sampler: the paged one, 128 slots capped at a call's 256 responses; eval's uncapped
    assert spec.rollout.sampler.call_settings(spec.call_responses) == dict(slots=128, tail_slots=None, page_size=16,
                                                                          pages=None)
    assert spec.eval.sampler.call_settings() == dict(slots=256, tail_slots=None, page_size=16, pages=None)
    static = dataclasses.replace(spec.rollout.sampler, sampler="static")
    assert static.call_settings(256) == dict(slots=None, tail_slots=None, page_size=None, pages=None)
    narrowing = dataclasses.replace(spec.rollout.sampler, sampler="continuous", slots=512, tail_slots=300)
    assert narrowing.call_settings(256) == dict(slots=256, tail_slots=256, page_size=None, pages=None)


def test_ppo_reads_the_critic_and_its_aggregation(demo):
    demo.algorithm.objective = "ppo"
    spec = RunSpec.from_config(demo, device_count=1)
    assert spec.critic is not None and spec.critic_loss_agg == (demo.algorithm.ppo.loss_agg_mode,
                                                                demo.algorithm.ppo.norm_length)
    assert [name for name, _ in spec.packed_layouts(1, critic=True).items()] == ["logprob", "critic", "update"]
    demo.critic.loss_agg_mode = "seq-mean-token-mean"
    assert RunSpec.from_config(demo, device_count=1).critic_loss_agg[0] == "seq-mean-token-mean"


def test_below_the_edge_only_config_json_reads_the_raw_config():
    """tools/count_config_reads.py: outside the CLIs and the spec's construction, the one module that reads
    the ConfigDict is workdir.py, which records it (config.json)."""
    import importlib.util

    from train_helpers import REPO

    spec = importlib.util.spec_from_file_location("count_config_reads", REPO / "tools" / "count_config_reads.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    counts = tool.package_reads()
    below = {path: n for path, n in counts.items() if path not in tool.EDGE}
    assert list(below) == ["pacs_jax/training/workdir.py"], below
    assert counts["pacs_jax/training/spec.py"] > 0  # the count sees the reads it is meant to see
