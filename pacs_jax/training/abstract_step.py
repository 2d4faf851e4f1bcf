"""A training step's programs on abstract state, for a mesh over any devices (compile-only TPU / GPU
devices on a CPU host, or real ones): what tools/plan_memory.py and tools/plan_step.py compile.

    with abstract_step(config, devices, log=print) as step:    # the mesh is the context inside
        step.programs(largest_only=True)                       # training/step_programs.py's list

Nothing is allocated: the model, AdamW state and PPO's critic are ``jax.ShapeDtypeStruct``s with
the shardings the trainer gives them, and the programs are the trainer's own (``StepPrograms``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import ml_collections


@contextlib.contextmanager
def abstract_step(config: ml_collections.ConfigDict, devices, *, log: Callable[[str], None] = print,
                  **model_overrides) -> Iterator:
    """The ``StepPrograms`` of ``config`` on abstract state, on a mesh of ``config.mesh`` over
    ``devices`` set as the context (as the trainer's CLI sets it: attention "auto" and dot dtypes
    follow the devices' platform). model_overrides: QwenConfig fields to replace (e.g. the layers)."""
    from pacs_jax import models, sharding
    from pacs_jax.models.attention import resolve_impl
    from pacs_jax.models.value import ValueModel
    from pacs_jax.sharding import abstract_optimizer_state
    from pacs_jax.training.critic_step import CriticState, config_critic_optimizer
    from pacs_jax.training.model_spec import model_config
    from pacs_jax.training.step_programs import StepPrograms

    mc = config.mesh
    cfg = model_config(config, **model_overrides)
    if cfg is None:
        raise ValueError(f"config.model.path={config.model.path!r}: no config.json / model_config.json to read")
    mesh = sharding.make_mesh(mc.data, mc.fsdp, mc.tensor, devices=devices)
    with jax.set_mesh(mesh):
        log(f"model {config.model.preset or config.model.path or 'custom'}: {cfg.num_hidden_layers} layers, "
            f"dtype {cfg.dtype}, params {cfg.param_dtype}, remat {cfg.remat}, attention "
            f"{resolve_impl(cfg.attention)}; mesh {dict(mesh.shape)} on {len(devices)} {devices[0].device_kind} devices")
        graphdef, params = models.abstract_model(cfg)
        critic = None
        if config.algorithm.objective == "ppo":  # as PPOCritic.from_config builds it, on abstract state
            critic_graphdef, critic_params = models.abstract_model(cfg, cls=ValueModel)
            critic_optimizer = config_critic_optimizer(config)
            critic = CriticState(critic_graphdef, (critic_params, abstract_optimizer_state(critic_optimizer, critic_params)),
                                 critic_optimizer)
        eos = cfg.eos_token_id
        stop_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        yield StepPrograms(config, graphdef, params, stop_ids, critic=critic)


def slice_devices(config: ml_collections.ConfigDict, topology: str, say: Callable[[str], None]):
    """(the Topology named ``topology``, its compile-only devices) for planning ``config`` on it,
    after the trainer's check of the config for that slice (training/config_check.py
    ``check_for_slice``; a preset without model.path plans as ``model.random_init``).

    Raises ValueError for an unknown topology, ConfigError for a config the trainer refuses, and
    RuntimeError when the topology's compiler is not installed."""
    from pacs_jax import topologies
    from pacs_jax.training.config_check import check_for_slice

    topo = topologies.get_topology(topology)
    if not config.model.path:  # the plan compiles abstract weights: a preset needs no released folder here
        config.model.random_init = True
    elsewhere = check_for_slice(config, topo.num_devices)  # the trainer's check, before anything compiles
    if elsewhere:
        say(f"not on this machine, left unchecked: {', '.join(elsewhere)}")
    return topo, topologies.abstract_devices(topo)
