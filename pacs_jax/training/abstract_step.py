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
    ``devices`` set as the context (as the trainer's CLI sets it: attention "auto" and dot dtypes
    follow the devices' platform). model_overrides: QwenConfig fields to replace (e.g. the layers)."""
    from pacs_jax import models, sharding
    from pacs_jax.models.attention import resolve_impl
    from pacs_jax.models.value import ValueModel
    from pacs_jax.sharding import abstract_optimizer_state
    from pacs_jax.training.critic_step import CriticState, critic_optimizer
    from pacs_jax.training.model_spec import model_config
    from pacs_jax.training.step_programs import StepPrograms

    mc = spec.mesh
    cfg = model_config(spec, **model_overrides)
    if cfg is None:
        raise ValueError(f"config.model.path={spec.model.path!r}: no config.json / model_config.json to read")
    mesh = sharding.make_mesh(mc.data, mc.fsdp, mc.tensor, devices=devices)
    with jax.set_mesh(mesh):
        log(f"model {spec.model.preset or spec.model.path or 'custom'}: {cfg.num_hidden_layers} layers, "
            f"dtype {cfg.dtype}, params {cfg.param_dtype}, remat {cfg.remat}, attention "
            f"{resolve_impl(cfg.attention)}; mesh {dict(mesh.shape)} on {len(devices)} {devices[0].device_kind} devices")
        graphdef, params = models.abstract_model(cfg)
        critic = None
        if spec.critic is not None:  # as PPOCritic.from_spec builds it, on abstract state
            critic_graphdef, critic_params = models.abstract_model(cfg, cls=ValueModel)
            optimizer = critic_optimizer(spec.critic)
            critic = CriticState(critic_graphdef, (critic_params, abstract_optimizer_state(optimizer, critic_params)),
                                 optimizer)
        eos = cfg.eos_token_id
        stop_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        yield StepPrograms(spec, graphdef, params, stop_ids, critic=critic)


def slice_devices(spec, topology: str, say: Callable[[str], None]):
    """(the Topology named ``topology``, the spec placed on it, its compile-only devices) for planning
    the unplaced RunSpec ``spec`` on it, after the trainer's check of it for that slice
    (training/config_check.py ``check_for_slice``; a preset without model.path plans as
    ``model.random_init``).

    Raises ValueError for an unknown topology, ConfigError for a config the trainer refuses, and
    RuntimeError when the topology's compiler is not installed."""
    from pacs_jax import topologies
    from pacs_jax.training.config_check import check_for_slice

    topo = topologies.get_topology(topology)
    if not spec.model.path:  # the plan compiles abstract weights: a preset needs no released folder here
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, random_init=True))
    spec, elsewhere = check_for_slice(spec, topo.num_devices)  # the trainer's check, before anything compiles
    if elsewhere:
        say(f"not on this machine, left unchecked: {', '.join(elsewhere)}")
    return topo, spec, topologies.abstract_devices(topo)
