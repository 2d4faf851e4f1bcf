"""The learner's weights to the rollout engine's own mesh (one step off on split devices:
``train.off_policy_steps=1``, ``mesh.rollout_devices``; issue 50; docs/design.md section 3.2c).

    sync = WeightSync(params, rollout_mesh, "bfloat16")   # the engine's copy: its shapes and shardings
    engine_params = sync(params, previous=engine_params)   # after an update, before the next one

The engine's copy is the parameters as the decode step reads them (sampling/engine.py
``_decode_layout``): floats cast to the compute dtype, split over the engine's "tensor" axis and
replicated over its batch axes. Every parameter is cast to the compute dtype where the model uses it
(models/qwen.py), so sampling from the copy gives the tokens and log-probs sampling from the learner's
own parameters would on the engine's mesh. The move goes a parameter at a time: the previous copy's
buffer of it freed, then the parameter cast on the learner's devices, put on the engine's
(``jax.device_put`` across the two device sets; always a copy of its own, also where the engine shares the
learner's devices, dtype and layout) and waited for, so that an engine device never holds
more than one copy, and a learner device holds its training state and one cast parameter
(``casts``: the programs, which the warm-up compiles and the memory check reads with the step's).
With LoRA (``adapters_only``) the base weights are frozen: the first move copies every parameter, the
later ones the adapters alone, the engine's copy keeping its base buffers (``moved_bytes``: what the
last move copied, the step's ``weight_sync_bytes`` metric).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pacs_jax.sharding import MeshRules, decode_rules
from pacs_jax.training import memory_check


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


class WeightSync:
    """Moves the learner's parameters (an nnx.State of arrays with their shardings and ``logical_axes``)
    to the engine's ``mesh`` in ``dtype``; ``abstract``: the copy's ShapeDtypeStructs with shardings
    (the engine's programs are compiled on them)."""

    def __init__(self, params: nnx.State, mesh: Mesh, dtype, *, adapters_only: bool = False):
        self.mesh, self.dtype = mesh, jnp.dtype(dtype)
        # the leaves a later move keeps from the engine's copy: LoRA's base weights (frozen)
        self.frozen = [adapters_only and not isinstance(var, nnx.LoRAParam)
                       for var in jax.tree.leaves(params, is_leaf=_is_variable)]
        self.moved_bytes = 0
        decode = decode_rules(MeshRules(mesh))  # the layout the sampler's decode reads (sampling/engine.py)

        def target(var: nnx.Variable) -> nnx.Variable:
            x = var.get_value()
            dtype = self.dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
            axes = getattr(var, "logical_axes", None)
            sharding = decode.sharding(axes, x.shape) if axes is not None else NamedSharding(mesh, PartitionSpec())
            return var.replace(value=jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding))

        self.abstract = jax.tree.map(target, params, is_leaf=_is_variable)
        self.cast = jax.jit(lambda x: x.astype(self.dtype))  # on the learner's devices, keeping their sharding
        # the learner's parameters the move casts, abstract, one of each shape, dtype and sharding
        self.casts = list({(x.shape, x.dtype, x.sharding): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                           for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(self.abstract), strict=True)
                           if x.dtype != t.dtype}.values())

    def __call__(self, params: nnx.State, previous: nnx.State | None = None) -> nnx.State:
        """``params`` (the learner's) -> the engine's copy, a parameter at a time (module docstring).
        previous: the engine's copy it replaces, whose buffers are freed as the new ones arrive (nothing
        may read it afterwards; LoRA: its base buffers are the new copy's)."""
        leaves, treedef = jax.tree.flatten(params)
        targets = jax.tree.leaves(self.abstract)
        old = jax.tree.leaves(previous) if previous is not None else [None] * len(leaves)
        moved, self.moved_bytes = [], 0
        for x, target, stale, frozen in zip(leaves, targets, old, self.frozen, strict=True):
            if stale is not None and frozen:  # LoRA's base: the engine's copy already holds it
                moved.append(stale)
                continue
            if stale is not None:
                stale.delete()
            self.moved_bytes += x.size * jnp.dtype(target.dtype).itemsize
            if x.dtype != target.dtype:  # the cast is a buffer of its own
                y = jax.device_put(self.cast(x), target.sharding)
            else:  # on shared devices in the learner's layout, device_put would hand back the learner's own
                y = jax.device_put(x, target.sharding, may_alias=False)  # buffer, which the next update donates
            moved.append(y.block_until_ready())  # one parameter in flight: the move's peak is one of them
        return jax.tree.unflatten(treedef, moved)

    def copy_bytes(self) -> int:
        """The engine's copy, bytes an engine device holds (resident there between its programs)."""
        return memory_check.per_device_bytes(self.abstract)
