"""Device mesh, logical axis rules and sharding helpers (MaxText style).

Every parameter carries *logical* axis names (``embed``, ``mlp``, ``heads``, ...). One table,
``LOGICAL_RULES``, maps them to the mesh axes ``("data", "fsdp", "tensor")``; changing a layout is
editing that table. Activations are constrained with logical names too (``batch``, ``act_heads``).

Mesh axis types: we build meshes with ``AxisType.Auto`` on purpose (GSPMD propagation, the MaxText
default). JAX 0.10's ``jax.make_mesh`` would otherwise give Explicit axes, under which every op needs
its output sharding spelled out.

The mesh is set once, where a run starts (``jax.set_mesh(mesh)``: the trainer's and the evaluator's
CLIs, tools/plan_memory.py for compile-only devices), and read where it is needed:
``current_mesh()`` for placing arrays, ``current_rules()`` (the abstract mesh in context, inside or
outside ``jax.jit``) for constraints, ``platform()`` for kernel choices. Code run with no mesh set
(a notebook, a unit test) runs on a 1 x 1 x 1 mesh over the first device.

Divisibility: a logical axis whose size the mesh axes do not divide is replicated instead, except
for the axes in ``MUST_DIVIDE`` (query heads, MLP and expert widths, the experts), where a silent replication would waste a
factor of the tensor axis in memory; those raise. This is how K/V projections with fewer KV heads
than the tensor axis (Qwen2.5-7B: 4 KV heads on tensor=8) end up replicated, as in vLLM and MaxText.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (a tuple shards over their product; () replicates).
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    # parameters
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "norm": (),
    "experts": ("fsdp",),  # a mixture-of-experts layer's experts, with model.expert_parallel (models/moe.py)
    "expert_mlp": ("tensor",),
    "layers": (),  # the stacking axis of the scanned decoder (and of the KV cache)
    # activations
    "batch": ("data", "fsdp"),
    "length": (),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "cache_length": (),
}

# Logical axes that must be divisible by their mesh axes (otherwise: a clear error).
MUST_DIVIDE = {"heads": "num_attention_heads", "mlp": "intermediate_size",
               "expert_mlp": "moe_intermediate_size", "experts": "num_experts"}


def mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes on ``num_devices`` devices, one given size may be -1 (fills the rest).

    devices: the devices to use (default: all, in the topology-aware order of ``jax.make_mesh``).
    device_order: positions in ``devices`` (process by process, as ``jax.devices()`` lists them) in
    mesh order (row-major over data, fsdp, tensor) instead, e.g. to put one process's devices at
    several places along the batch axes. Raises ValueError naming
    ``mesh.<field>`` when the sizes do not fit the devices or the mesh cannot be built on them.
    """
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    unknown = [k for k, v in sizes.items() if v == -1]
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{name}={size}: sizes must be positive or -1")
    if len(unknown) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {unknown}")
    known = math.prod(v for v in sizes.values() if v != -1)
    if unknown:
        if num_devices % known:
            given = " x ".join(f"mesh.{k}={v}" for k, v in sizes.items() if v not in (-1, 1))
            raise ValueError(f"{given}: {num_devices} devices are not divisible by {known} (mesh.{unknown[0]}=-1 "
                             f"takes the devices the other axes leave): the sizes set must multiply to a divisor of "
                             f"{num_devices}")
        sizes[unknown[0]] = num_devices // known
    shape = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh (data, fsdp, tensor)={shape} needs {math.prod(shape)} devices, "
                         f"{num_devices} are available")
    return shape


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence | None = None,
              device_order: Sequence[int] = ()) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh with Auto axis types; one size may be -1 (fills the rest).

    devices: the devices to use (default: all, in the topology-aware order of ``jax.make_mesh``).
    device_order: positions in ``devices`` (process by process, as ``jax.devices()`` lists them) in
    mesh order (row-major over data, fsdp, tensor) instead, e.g. to put one process's devices at
    several places along the batch axes. Raises ValueError naming ``mesh.<field>`` when the sizes
    do not fit the devices or the mesh cannot be built on them.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices))
    if device_order:
        if sorted(device_order) != list(range(len(devices))):
            raise ValueError(f"mesh.device_order={tuple(device_order)}: must list each of the positions "
                             f"0..{len(devices) - 1} of the devices once")
        devices = [devices[i] for i in device_order]
    elif devices == list(jax.devices()):
        try:
            return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3)
        except (NotImplementedError, ValueError, AssertionError) as e:
            raise ValueError(
                f"mesh.data / mesh.fsdp / mesh.tensor = {shape}: no mesh of that shape fits the "
                f"{len(devices)} devices ({devices[0].device_kind}, {jax.process_count()} processes) in their "
                f"physical topology ({type(e).__name__}: {e}); choose sizes that follow the slice's topology, "
                f"e.g. tensor within a host") from e
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def config_mesh(mesh_config: Mapping) -> Mesh:
    """The mesh a config's ``mesh`` fields (data, fsdp, tensor, device_order) ask for over all devices
    (1 x 1 x 1 on a single device); with ``rollout_devices`` R > 0, the learner's: over the devices
    after the first R of ``jax.devices()`` (``rollout_mesh`` has those)."""
    split = mesh_config.get("rollout_devices", 0)
    return make_mesh(mesh_config["data"], mesh_config["fsdp"], mesh_config["tensor"],
                     devices=jax.devices()[split:] if split else None,
                     device_order=tuple(mesh_config.get("device_order", ())))


def rollout_mesh(mesh_config: Mapping, tensor: int) -> Mesh | None:
    """The rollout engine's own mesh of a config's ``mesh.rollout_devices`` R (one step off on split
    devices): the first R of ``jax.devices()``, R / ``tensor`` over data and the learner's ``tensor``
    axis; None when R is 0 (the roles share the devices). One process only: a ValueError naming the
    field otherwise."""
    split = mesh_config.get("rollout_devices", 0)
    if not split:
        return None
    if jax.process_count() > 1:
        raise ValueError(f"mesh.rollout_devices={split}: the rollout engine's own mesh is built for one process (the "
                         f"weights' move between the two device sets is not built across {jax.process_count()} "
                         "processes); set it to 0 (train.off_policy_steps=1 then shares the devices)")
    return make_mesh(split // tensor, 1, tensor, devices=jax.devices()[:split])


@functools.cache
def _single_device_mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def current_mesh() -> Mesh:
    """The mesh in context (``jax.set_mesh``), or a 1 x 1 x 1 mesh over the first device when none is
    set; for placing arrays (outside ``jax.jit``)."""
    mesh = jax.sharding.get_mesh()
    return _single_device_mesh() if mesh.empty else mesh


def tracing_device(mesh: Mesh):
    """A context in which JAX's default device is ``mesh``'s first when it is a GPU this host does not have
    (compile-only devices: an H200 planned from a CPU host), for tokamax, which reads the GPU's generation from the
    default device while tracing (models/moe_gemm_gpu.py); else nothing."""
    device = mesh.devices.flat[0]
    if device.platform != "gpu" or jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    return jax.default_device(device)


def current_rules() -> MeshRules:
    """The logical rules over the abstract mesh in context (inside ``jax.jit`` too; inside a
    ``shard_map`` its manual axes are marked), or over the single-device mesh when none is set."""
    mesh = jax.sharding.get_abstract_mesh()
    return MeshRules(_single_device_mesh().abstract_mesh if mesh.empty else mesh)


def platform() -> str:
    """The platform of the mesh in context ("cpu", "gpu", "tpu"): what kernels and dot operand dtypes
    are chosen for, also when compiling for devices this process cannot use (compile-only TPU devices
    on a CPU host)."""
    name = current_rules().mesh.abstract_device.platform
    return "gpu" if name in ("cuda", "rocm") else name


def partition_spec(logical_axes: Sequence[str | None], shape: Sequence[int], axis_sizes: Mapping[str, int],
                   rules: Mapping[str, tuple[str, ...]] | None = None) -> PartitionSpec:
    """PartitionSpec for an array of ``shape`` whose dims carry ``logical_axes``, on a mesh of
    ``axis_sizes`` ({mesh axis: size}; no devices needed) under ``rules`` (default LOGICAL_RULES).

    A dim whose size its mesh axes do not divide is replicated (or raises for MUST_DIVIDE axes);
    a mesh axis is used at most once per array; axes of size 1 are left out.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    table = LOGICAL_RULES if rules is None else rules
    used: set[str] = set()
    out = []
    for name, size in zip(logical_axes, shape):
        axes = tuple(a for a in table.get(name, ()) if a not in used) if name else ()
        ways = math.prod(axis_sizes[a] for a in axes)
        if axes and size % ways:
            if name in MUST_DIVIDE:
                raise ValueError(
                    f"{MUST_DIVIDE[name]}: size {size} is not divisible by mesh axes {axes} "
                    f"(size {ways}); choose a mesh whose {' x '.join(axes)} axis divides it")
            axes = ()
        axes = tuple(a for a in axes if axis_sizes[a] > 1)
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def shard_count(spec: PartitionSpec, axis_sizes: Mapping[str, int]) -> int:
    """Into how many pieces ``spec`` splits an array on a mesh of ``axis_sizes`` (the product of the
    sizes of the mesh axes it uses)."""
    ways = 1
    for entry in spec:
        for axis in ((entry,) if isinstance(entry, str) else (entry or ())):
            ways *= axis_sizes[axis]
    return ways


@dataclasses.dataclass(frozen=True)
class MeshRules:
    """A mesh (concrete, or abstract inside ``jax.jit``) plus the logical rules table: turns logical
    axis names into shardings."""

    mesh: Mesh | jax.sharding.AbstractMesh
    rules: tuple[tuple[str, tuple[str, ...]], ...] = tuple(LOGICAL_RULES.items())  # hashable table

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
        """PartitionSpec for an array of ``shape`` whose dims carry ``logical_axes``.

        A dim whose size its mesh axes do not divide is replicated (or raises for MUST_DIVIDE axes);
        a mesh axis is used at most once per array (see ``partition_spec``).
        """
        return partition_spec(logical_axes, shape, dict(self.mesh.shape), dict(self.rules))

    def sharding(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, shape))

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        """``with_sharding_constraint`` by logical names (activations at layer boundaries).

        Inside a ``shard_map`` that is manual over some mesh axes (the sampler's per-shard decode
        loop is manual over the batch axes), those axes are left out: the array is already local
        to them, and only the remaining (auto) axes are constrained.
        """
        manual = manual_axes()
        if not manual:
            return jax.lax.with_sharding_constraint(x, self.sharding(logical_axes, x.shape))
        table = {name: tuple(a for a in axes if a not in manual) for name, axes in self.rules}
        spec = partition_spec(logical_axes, x.shape, dict(self.mesh.shape), table)
        return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), spec))

    def without(self, *mesh_axes: str) -> "MeshRules":
        """These rules with ``mesh_axes`` removed from every logical axis (e.g. the sampler's decode
        layout: parameters replicated over "data" and "fsdp", still split over "tensor")."""
        return MeshRules(self.mesh, tuple((name, tuple(a for a in axes if a not in mesh_axes))
                                          for name, axes in self.rules))

    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes of size > 1 that split the batch ("data", "fsdp" by default)."""
        return tuple(a for a in dict(self.rules)["batch"] if self.mesh.shape[a] > 1)


def decode_rules(rules: MeshRules) -> MeshRules:
    """The rules of the sampler's decode layout: ``rules`` without their batch axes, so that a weight is
    replicated over them and split over "tensor" only (gathered once a sampler call, never a decode step)."""
    return rules.without(*rules.batch_axes())


def placement(logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    """Where an array of ``shape`` whose dims carry ``logical_axes`` lives on the mesh in context."""
    return MeshRules(current_mesh()).sharding(logical_axes, shape)


def replicated() -> NamedSharding:
    """A whole copy on every device of the mesh in context."""
    return NamedSharding(current_mesh(), PartitionSpec())


def batch_sharding(shape: tuple[int, ...], mesh: Mesh | None = None) -> NamedSharding:
    """The sharding of a per-row array of a training step on ``mesh`` (default: the mesh in context): rows over the batch
    axes, the rest replicated (all replicated when the rows do not divide, e.g. a few prompts on many
    devices).

    The same objects place host arrays, pin the programs' outputs and compile them ahead of time,
    so every call finds its program already compiled.
    """
    rules = MeshRules(current_mesh() if mesh is None else mesh)
    axes = rules.batch_axes()
    if shape[0] % math.prod(rules.mesh.shape[a] for a in axes):
        axes = ()
    return NamedSharding(rules.mesh, PartitionSpec(axes or None, *([None] * (len(shape) - 1))))


def batch_shards(mesh: Mesh | None = None) -> int:
    """Into how many pieces the batch axes of ``mesh`` (default: the mesh in context, inside ``jax.jit`` too)
    split a batch."""
    rules = current_rules() if mesh is None else MeshRules(mesh)
    return math.prod(rules.mesh.shape[a] for a in rules.batch_axes())


def state_shardings(tree):
    """The shardings a training state (parameters, optimizer state) is committed to, which every later
    program keeps (no recompilation on a layout change): each array's own, and replicated over the
    mesh in context for the optimizer's scalars that live on one device."""
    return jax.tree.map(lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated(), tree)


def abstract(tree):
    """``jax.ShapeDtypeStruct``s (with their shardings) of a tree of arrays or ShapeDtypeStructs."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def abstract_optimizer_state(optimizer, params) -> object:
    """AdamW's state for ``params`` (arrays or abstract), abstract: mu and nu sharded like the
    parameters, the scalars (step counts) replicated over the mesh."""
    params = abstract(params)
    params_def = jax.tree.structure(params)
    whole = NamedSharding(jax.tree.leaves(params)[0].sharding.mesh, PartitionSpec())

    def like_params(node) -> bool:
        return jax.tree.structure(node) == params_def

    def place(node):
        if like_params(node):
            return jax.tree.map(lambda o, p: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=p.sharding), node, params)
        return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=whole), node)

    return jax.tree.map(place, jax.eval_shape(optimizer.init, params), is_leaf=like_params)


def manual_axes() -> frozenset[str]:
    """The mesh axes that are manual in the current tracing context (inside ``shard_map``); empty
    outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return frozenset()
    return frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` of ``x`` by logical names on the mesh in context (an eager call,
    e.g. a custom VJP's backward under an unjitted ``jax.grad``, constrains on the concrete mesh)."""
    if isinstance(x, jax.core.Tracer):
        return current_rules().constrain(x, logical_axes)
    return jax.lax.with_sharding_constraint(x, placement(logical_axes, x.shape))
