"""The objective registry (pacs_jax/rl/objectives.py) is what the loss, the config check and the docs read."""

import ast
import dataclasses
import re

import numpy as np
import pytest

from pacs_jax import rl
from pacs_jax.rl import objectives
from pacs_jax.training.config_check import ConfigError, validate_config
from train_helpers import REPO
from test_train_config import load_config


def _docs_table() -> dict[str, dict]:
    """docs/design.md section 6's objectives table: {name: {min_group, binary, defaults, choices}}."""
    text = (REPO / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", text, flags=re.MULTILINE)
    table = {}
    for name, min_group, rewards, options, choices in rows:
        defaults = {}
        for item in re.findall(r"`(\w+)=([^`]*)`", options):
            defaults[item[0]] = ast.literal_eval(item[1])
        fixed = {}
        for option, values in re.findall(r"`(\w+)`: ([^;]+)", choices):
            fixed[option] = tuple(v.strip() for v in values.split(" / "))
        table[name] = dict(min_group=int(min_group), binary=rewards.strip() == "{0, 1}", defaults=defaults,
                           choices=fixed)
    return table


def test_the_docs_table_states_the_registry():
    table = _docs_table()
    assert sorted(table) == sorted(rl.OBJECTIVES)
    for name, spec in rl.OBJECTIVES.items():
        row = table[name]
        assert row["min_group"] == spec.min_group_size, name
        assert row["binary"] == spec.binary_rewards, name
        assert row["defaults"] == spec.defaults, name
        assert row["choices"] == dict(spec.choices), name


def test_defaults_are_the_losses_keyword_defaults():
    assert rl.OBJECTIVES["pacs"].defaults == dict(beta=1.0, use_weight=True, weight_mode="question",
                                                  reward_method="1", adv_estimator="rloo")
    assert rl.OBJECTIVES["rloo"].defaults["loss_agg_mode"] == "token-mean"
    for name in ("grpo", "drgrpo"):
        assert rl.OBJECTIVES[name].defaults == dict(loss_agg_mode="seq-mean-token-sum-norm", clip_ratio_low=0.2,
                                                    clip_ratio_high=0.2, clip_ratio_c=3.0, norm_length=None,
                                                    loss_scale="mean", verl_micro_batch_size=0)
    assert rl.OBJECTIVES["ppo"].defaults == dict(loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2,
                                                 clip_ratio_c=3.0, norm_length=None, loss_scale="mean",
                                                 verl_micro_batch_size=0)


def test_the_demo_config_uses_the_registry_defaults():
    config = load_config("default.py")
    assert rl.options_for(config.algorithm) == rl.OBJECTIVES[config.algorithm.objective].defaults


def _batch(group_size: int, rewards=None):
    B = 2 * group_size
    logp = np.full((B, 3), -1.0, np.float32)
    rewards = np.tile(([1.0] + [0.0] * (group_size - 1))[:group_size], 2).astype(np.float32) if rewards is None else rewards
    return logp, logp, np.ones((B, 3), np.float32), rewards


def _call(name: str, batch: tuple, group_size: int):
    """The bound objective on ``batch``; "ppo" also gets per-token advantages (its critic's, normally)."""
    extra = {"advantages": np.linspace(-1.0, 1.0, batch[0].size, dtype=np.float32).reshape(batch[0].shape)} \
        if name == "ppo" else {}
    return rl.get_objective(name)(*batch, group_size, **extra)


@pytest.mark.parametrize("name", sorted(rl.OBJECTIVES))
def test_the_loss_refuses_groups_below_the_registry_minimum(name, monkeypatch):
    spec = rl.OBJECTIVES[name]
    loss, _ = _call(name, _batch(spec.min_group_size), spec.min_group_size)
    assert np.isfinite(float(loss))
    with pytest.raises(ValueError, match=f"group_size={spec.min_group_size - 1}"):
        _call(name, _batch(spec.min_group_size - 1), spec.min_group_size - 1)
    # the minimum is read from the registry, not fixed in the loss
    monkeypatch.setitem(objectives.OBJECTIVES, name, dataclasses.replace(spec, min_group_size=3))
    with pytest.raises(ValueError, match="group_size=2: this objective needs at least 3"):
        _call(name, _batch(2), 2)


@pytest.mark.parametrize("name", sorted(rl.OBJECTIVES))
def test_reward_labels_are_required_where_the_registry_says(name):
    non_binary = np.array([1.0, 0.5, 0.0, 0.25], np.float32)
    if rl.OBJECTIVES[name].binary_rewards:
        with pytest.raises(ValueError, match="rewards must be 0 or 1"):
            _call(name, _batch(2, non_binary), 2)
    else:
        assert np.isfinite(float(_call(name, _batch(2, non_binary), 2)[0]))


def test_option_errors_name_the_option():
    with pytest.raises(rl.OptionError, match="no option") as error:
        rl.get_objective("drgrpo", beta=1.0)
    assert error.value.option == "beta"
    with pytest.raises(rl.OptionError, match="weight_mode='sometimes'") as error:
        rl.get_objective("pacs", weight_mode="sometimes")
    assert error.value.option == "weight_mode"
    rl.get_objective("pacs", reward_method=2)  # compared as a string, as configs may write it
    with pytest.raises(rl.OptionError, match="objective='reinforce'") as error:
        rl.get_objective("reinforce")
    assert error.value.option is None


@pytest.mark.parametrize("name", sorted(set(rl.OBJECTIVES) - {"ppo"}))  # the trainer refuses ppo (no critic yet)
def test_the_config_check_reads_the_minimum_group_from_the_registry(name, monkeypatch):
    config = load_config("default.py")
    config.algorithm.objective = name
    spec = rl.OBJECTIVES[name]
    config.rollout.n = spec.min_group_size
    validate_config(config)
    config.rollout.n = spec.min_group_size - 1
    with pytest.raises(ConfigError, match=rf"^config\.rollout\.n: {name} .* needs n >= {spec.min_group_size}"):
        validate_config(config)
    monkeypatch.setitem(objectives.OBJECTIVES, name, dataclasses.replace(spec, min_group_size=16))
    config.rollout.n = 8
    with pytest.raises(ConfigError, match=r"^config\.rollout\.n: .* needs n >= 16"):
        validate_config(config)
