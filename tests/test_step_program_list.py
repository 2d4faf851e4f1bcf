"""The step's program list (``StepPrograms.programs()``: each program's name, shape, placement and lowered HLO)
on the (2, 2, 2) CPU mesh, for four small runs: the demo, PPO with packing, carry-over and one step off on
split devices. The list is recorded in tests/data/step_program_list.json (issue 64: written before the
training package was split into its engine and learner roles); a change to the trainer that leaves the
programs as they are keeps it equal. Lowered on abstract state (training/abstract_step.py), nothing compiled.

Re-record it (only for a change meant to alter the programs) with ``python tests/test_step_program_list.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import pathlib
import re
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "step_program_list.json"


def _demo():
    """configs/default.py on the (2, 2, 2) mesh as tests/test_memory_check.py shrinks it: a 64-token
    vocabulary, 8 prompts x 8 responses a step (its warm-start's step among the programs)."""
    spec = importlib.util.spec_from_file_location("_program_list_default", ROOT / "configs" / "default.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(name: str):
    c = _demo().get_config("ppo" if name == "ppo_packing" else "pacs_beta1")
    c.model.vocab_size = 64
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
    c.train.prompts_per_step, c.train.mini_batches, c.train.micro_batches = 8, 2, 1
    c.rollout.micro_batches = 2
    if name == "ppo_packing":  # PPO's critic, the passes packed
        c.train.packing = True
    elif name == "carry_over":  # as tests/test_train_carry_over.py: the paged engine, one call a step
        c.rollout.update(n=2, max_new_tokens=10, carry_over=True, max_staleness=1, slots=8, micro_batches=1)
        c.data.max_prompt_length, c.data.prompt_buckets = 16, (8, 16)
        c.train.update(prompts_per_step=4, mini_batches=1, packing=False)
    elif name == "one_step_off":  # as tests/test_train_one_step_off.py: the engine on devices 0-3
        c.mesh.update(data=-1, fsdp=2, tensor=2, rollout_devices=4)
        c.model.dtype = "bfloat16"  # the weights cast for the engine's copy: weight_sync's programs
        c.rollout.update(n=2, max_new_tokens=10, slots=4, micro_batches=1)
        c.data.max_prompt_length, c.data.prompt_buckets = 16, (8, 16)
        c.train.update(prompts_per_step=4, mini_batches=1, packing=False, off_policy_steps=1)
    return c


RUNS = ("demo", "ppo_packing", "carry_over", "one_step_off")


def _mesh_words(mesh) -> str:
    return f"{dict(mesh.shape)} on devices {[d.id for d in mesh.devices.reshape(-1)]}"


def _placement(leaf) -> str:
    sharding = getattr(leaf, "sharding", None)
    spec = getattr(sharding, "spec", None)
    where = "unsharded" if sharding is None else (str(tuple(spec)) if spec is not None else type(sharding).__name__)
    return f"{jax.numpy.dtype(leaf.dtype).name}{list(leaf.shape)} {where}"


def _lowered_texts(lowered) -> list[str]:
    """The HLO text of each program a lowering holds: a jitted function's, or each ``jax.stages.Lowered``
    among its fields (the sampler's start program, carry-over's programs)."""
    if isinstance(lowered, jax.stages.Lowered):
        return [_unnamed(lowered.as_text())]
    fields = [getattr(lowered, field.name) for field in dataclasses.fields(lowered)]
    return [_unnamed(field.as_text()) for field in fields if isinstance(field, jax.stages.Lowered)]


def _unnamed(text: str) -> str:
    """The HLO text without its module's name, which is the jitted Python function's (``module
    @jit_insert_program``): a function renamed in a move is the same program."""
    return re.sub(r"^module @\S+", "module @program", text, count=1, flags=re.M)


def program_list(name: str) -> list[dict]:
    """Each program of run ``name``'s step (its warm-start's first): name, shape, the bytes it counts outside
    itself, its mesh, its arguments' placements and a digest of its lowered HLO."""
    from pacs_jax.training.abstract_step import abstract_step
    from pacs_jax.training.spec import RunSpec

    out = []
    with abstract_step(RunSpec.unplaced(_config(name)), jax.devices(), log=lambda line: None) as step:
        learner_mesh = _mesh_words(step.learner.mesh)
        for program in step.programs(with_warmstart=True):
            mesh = learner_mesh if program.mesh is None else _mesh_words(program.mesh)
            with jax.set_mesh(program.mesh) if program.mesh is not None else contextlib.nullcontext():
                texts = _lowered_texts(program.lower())
            out.append({"name": program.name, "shape": program.shape, "outside": program.outside, "mesh": mesh,
                        "args": [_placement(leaf) for leaf in jax.tree.leaves(program.args)],
                        "hlo": [hashlib.sha256(t.encode()).hexdigest()[:16] for t in texts]})
    return out


@pytest.mark.parametrize("name", RUNS)
def test_the_step_programs_are_the_recorded_ones(name):
    recorded = json.loads(FIXTURE.read_text())[name]
    programs = program_list(name)
    assert [(p["name"], p["shape"]) for p in programs] == [(p["name"], p["shape"]) for p in recorded]
    for now, then in zip(programs, recorded):
        assert now == then, f"{name}: {now['name']} ({now['shape']})"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest  # noqa: F401  (8 CPU devices, set before jax is used)

    FIXTURE.write_text(json.dumps({name: program_list(name) for name in RUNS}, indent=1) + "\n")
    print(f"wrote {FIXTURE}")
