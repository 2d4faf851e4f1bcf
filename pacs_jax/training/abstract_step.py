"""A training step's programs on abstract state, for a mesh over any devices (compile-only TPU / GPU
devices on a CPU host, or real ones): what tools/plan_memory.py and tools/plan_step.py compile.

    with abstract_step(spec, devices, log=print) as step:      # the mesh is the context inside
        step.programs(largest_only=True)                       # training/step_programs.py's list

Nothing is allocated: the model, AdamW state and PPO's critic are ``jax.ShapeDtypeStruct``s with
the shardings the trainer gives them, and the programs are the trainer's own (``StepPrograms``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import jax


@contextlib.contextmanager
def abstract_step(spec, devices, *, log: Callable[[str], None] = print, **model_overrides) -> Iterator:
    """The ``StepPrograms`` of the RunSpec ``spec`` on abstract state, on a mesh of ``spec.mesh`` over
    ``devices`` (the rollout engine's on the first ``mesh.rollout_devices`` of them) set as the context (as the trainer's CLI sets it: attention "auto" and dot dtypes
    follow the devices' platform). model_overrides: QwenConfig fields to replace (e.g. the layers)."""
    from pacs_jax import models, sharding
    from pacs_jax.models.attention import resolve_impl
    from pacs_jax.training.learner.critic_step import abstract_critic
    from pacs_jax.training.model_spec import model_config
    from pacs_jax.training.step_programs import StepPrograms

    mc = spec.mesh
    cfg = model_config(spec, **model_overrides)
    if cfg is None:
        raise ValueError(f"config.model.path={spec.model.path!r}: no config.json / model_config.json to read")
    split = mc.rollout_devices  # one step off on split devices: the engine's mesh on the first of them
    mesh = sharding.make_mesh(mc.data, mc.fsdp, mc.tensor, devices=devices[split:])
    engine = None
    if split:
        engine = sharding.make_mesh(split // mesh.shape["tensor"], 1, mesh.shape["tensor"], devices=devices[:split])
    with jax.set_mesh(mesh):
        log(f"model {spec.model.preset or spec.model.path or 'custom'}: {cfg.num_hidden_layers} layers, "
            f"dtype {cfg.dtype}, params {cfg.param_dtype}, remat {cfg.remat}, attention "
            f"{resolve_impl(cfg.attention)}; mesh {dict(mesh.shape)} on {len(devices) - split} {devices[0].device_kind} "
            "devices" + (f", the rollout engine's {dict(engine.shape)} on {split} of their own" if split else ""))
        graphdef, params = models.abstract_model(cfg)
        eos = cfg.eos_token_id
        stop_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        yield StepPrograms(spec, graphdef, params, stop_ids, mesh=mesh, critic=abstract_critic(spec, cfg),
                           rollout_mesh=engine)


def slice_devices(spec, topology: str, say: Callable[[str], None], *, tool: str):
    """(the Topology named ``topology``, the spec placed on it, its compile-only devices) for planning
    the unplaced RunSpec ``spec`` on it, after the trainer's check of it for that slice
    (training/config_check.py ``check_for_slice``, whose ConfigError propagates: one line, status 78;
    a preset without model.path plans as ``model.random_init``). An unknown topology is a usage
    error; a compiler that is not installed ends ``tool`` with its message and status 2."""
    import sys

    from absl import app

    from pacs_jax import topologies
    from pacs_jax.training.config_check import check_for_slice

    try:
        topo = topologies.get_topology(topology)
    except ValueError as e:
        raise app.UsageError(f"--topology: {e}") from None
    if not spec.model.path:  # the plan compiles abstract weights: a preset needs no released folder here
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, random_init=True))
    spec, elsewhere = check_for_slice(spec, topo.num_devices)  # the trainer's check, before anything compiles
    if elsewhere:
        say(f"not on this machine, left unchecked: {', '.join(elsewhere)}")
    try:
        return topo, spec, topologies.abstract_devices(topo)
    except RuntimeError as e:
        print(f"{tool}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def plan_tool_flags(topology_examples: str):
    """The ``--config`` (a trainer config file, default the paper's 7B PACS setup) and ``--topology``
    flags of a planning tool (tools/plan_memory.py, tools/plan_step.py): (config flag, topology flag)."""
    import pathlib

    from absl import flags
    from ml_collections import config_flags

    paper = pathlib.Path(__file__).resolve().parents[2] / "configs" / "paper.py"
    config = config_flags.DEFINE_config_file("config", f"{paper}:qwen25_7b,pacs_beta1",
                                             "trainer config (as for python -m pacs_jax.train), FILE.py:ARG",
                                             lock_config=True)
    topology = flags.DEFINE_string("topology", "v5p-64", "target: a name of pacs_jax.topologies.TOPOLOGIES "
                                                         f"({topology_examples}, ...)")
    return config, topology


def run_plan_tool(name: str, main: Callable) -> None:
    """Run a planning tool's ``main(argv) -> status`` as a CLI: bad input one line, status 78."""
    import sys

    from pacs_jax import console
    from pacs_jax.data import paths
    from pacs_jax.errors import run_cli

    def _main(argv) -> None:
        from pacs_jax.cpu_host import use_cpu_without_accelerator

        console.setup()
        use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
        sys.exit(main(argv))

    run_cli(name, _main, sys.argv, prepare=paths.config_file_args)
