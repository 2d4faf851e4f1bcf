"""One source for the config schema: configs/base.py states every field and its default; the run's spec
(pacs_jax/training/spec.py) declares the fields each section reads, with no defaults of its own.

A field added to one and not the other, or a default given in the spec (a second statement of the
schema that could drift from base.py's), fails here naming it.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from configs import base
from pacs_jax.rl.objectives import OBJECTIVES
from pacs_jax.training import spec

# Config keys a section's spec reads other than as a field of the same name: {section: {key: how}}.
READ_OTHERWISE = {
    "algorithm": {name: "AlgorithmSpec.options (the chosen objective's)" for name in OBJECTIVES},
    "algorithm.rollout_correction": {"preset": "RolloutCorrectionSpec.from_config (its fields under those set)"},
    "eval": {"periodic": "EvalSpec.periodic, .every", "final": "EvalSpec.final, .greedy, .per_set"},
}
# Spec fields that are no config key of their section: {class: {field: what it is}}.
NOT_KEYS = {
    spec.SamplerSpec: {"field": "the section's name, for messages"},
    spec.EvalSettingsSpec: {"field": "the section's name, for messages"},
    spec.AlgorithmSpec: {"options": "the chosen objective's namespace",
                         "correction_by_default": "run_algorithm's: the correction carry-over or one step off chose"},
    spec.EvalSpec: {"every": "eval.periodic.every", "periodic": "eval.periodic", "final": "eval.final",
                    "greedy": "eval.final.greedy", "per_set": "eval.final.per_set"},
}
# {config section: the spec classes whose fields it holds (a sampler's fields sit in its section: its
# field "sampler" is the sampler's kind, a key of the section)}
SECTIONS = {
    "model": (spec.ModelSpec,), "mesh": (spec.MeshSpec,), "data": (spec.DataSpec,),
    "data.arithmetic": (spec.ArithmeticSpec,), "warmstart": (spec.WarmstartSpec,),
    "rollout": (spec.RolloutSpec, spec.SamplerSpec), "algorithm": (spec.AlgorithmSpec,),
    "algorithm.rollout_correction": (spec.RolloutCorrectionSpec,), "algorithm.filter_groups": (spec.FilterGroupsSpec,),
    "critic": (spec.CriticSpec,), "optim": (spec.OptimSpec,), "train": (spec.TrainSpec,), "reward": (spec.RewardSpec,),
    "eval": (spec.EvalSpec, spec.SamplerSpec),
}


def section(config, path: str):
    for name in path.split("."):
        config = config[name]
    return config


def spec_classes() -> list[type]:
    """Every dataclass of training/spec.py."""
    return [cls for _, cls in inspect.getmembers(spec, inspect.isclass)
            if dataclasses.is_dataclass(cls) and cls.__module__ == spec.__name__]


@pytest.mark.parametrize("path", sorted(SECTIONS))
def test_every_config_field_is_a_spec_field_and_back(path):
    keys = set(section(base.get_config(), path).keys()) - set(READ_OTHERWISE.get(path, {}))
    classes = SECTIONS[path]
    fields = {f.name for cls in classes for f in dataclasses.fields(cls)} - {
        name for cls in classes for name in NOT_KEYS.get(cls, {})}
    missing_in_spec = keys - fields
    missing_in_config = fields - keys
    assert not missing_in_spec, f"config.{path} fields no spec reads: {sorted(missing_in_spec)}"
    assert not missing_in_config, f"spec fields of config.{path} that configs/base.py lacks: {sorted(missing_in_config)}"


def test_the_sections_cover_the_run_spec():
    """Every section of a training run (RunSpec's fields) is checked above, and every spec class too."""
    run = {f.name for f in dataclasses.fields(spec.RunSpec)} - {"seed", "workdir", "devices"}
    assert run == {path for path in SECTIONS if "." not in path}
    assert {"seed", "workdir"} <= set(base.get_config().keys())
    covered = {cls for classes in SECTIONS.values() for cls in classes} | {spec.EvalSettingsSpec, spec.RunSpec}
    assert set(spec_classes()) == covered


@pytest.mark.parametrize("cls", spec_classes(), ids=lambda cls: cls.__name__)
def test_the_spec_states_no_defaults(cls):
    """A default in the spec would state the schema a second time: every value comes from the config."""
    with_default = [f.name for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    assert not with_default, f"{cls.__name__}: defaults for {with_default}; configs/base.py holds the defaults"


def test_eval_settings_sections_hold_the_spec_fields():
    """eval.periodic and eval.final hold EvalSettingsSpec's sampling fields (their max_new_tokens is eval's)."""
    sampling = {f.name for f in dataclasses.fields(spec.EvalSettingsSpec)} - {"field", "max_new_tokens"}
    config = base.get_config()
    assert set(config.eval.periodic.keys()) == sampling | {"every"}
    assert set(config.eval.final.keys()) == sampling | {"greedy", "per_set"}
