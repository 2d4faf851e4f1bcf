"""Building Qwen models: random init, loading HF or Orbax weights straight into sharded arrays.

Parameters are created tensor by tensor with ``jax.make_array_from_callback``: each device takes its
slice of the one host copy of the tensor being loaded, so no second full copy of the model is ever
held on a host.
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from pacs_jax import console
from pacs_jax.files import is_remote
from pacs_jax.models.config import QwenConfig
from pacs_jax.models.hf_weights import HFWeightReader, read_param, weight_map, write_hf_dir
from pacs_jax.models.params import init_value
from pacs_jax.models.qwen import Qwen
from pacs_jax.sharding import MUST_DIVIDE, current_mesh, placement



def check_mesh(cfg: QwenConfig) -> None:
    """Raise a ValueError naming the config field when the tensor axis of the mesh in context does
    not divide it (or the fsdp axis the experts, which it splits)."""
    mesh = current_mesh()
    sizes = {"heads": cfg.num_attention_heads, "mlp": cfg.intermediate_size}
    if cfg.num_experts:
        sizes["expert_mlp"] = cfg.moe_intermediate_size
    if cfg.expert_parallel:
        sizes["experts"] = cfg.num_experts
    for logical, size in sizes.items():
        axis = "fsdp" if logical == "experts" else "tensor"
        if size % mesh.shape[axis]:
            raise ValueError(f"{MUST_DIVIDE[logical]}={size} is not divisible by mesh.{axis}={mesh.shape[axis]}")


def abstract_model(cfg: QwenConfig, cls: type[nnx.Module] = Qwen) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of ``cls(cfg)`` (a Qwen, or a module built on one such as
    models.value.ValueModel) without allocating; values carry their shardings on the mesh in context."""
    check_mesh(cfg)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
    state = jax.tree.map(
        lambda v: v.replace(value=jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=placement(v.logical_axes, v.shape))),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return graphdef, state


def dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def param_shapes(cfg: QwenConfig, kind: type[nnx.Param] = nnx.Param) -> dict[str, tuple[int, ...]]:
    """{dotted path: shape} of every parameter of ``Qwen(cfg)`` (of variable type ``kind``: ``nnx.LoRAParam``,
    what a LoRA run trains), traced abstractly (nothing allocated, no mesh needed)."""
    state = nnx.state(nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0))), kind)
    return {dotted(path): tuple(var.get_value().shape) for path, var in nnx.to_flat_state(state)}


def hf_shapes(cfg: QwenConfig) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of every tensor an HF checkpoint of ``cfg``'s model holds (what
    ``load_hf`` reads)."""
    ours = param_shapes(cfg)
    return {name: shape for path, tmap in weight_map(cfg).items() for name, shape in tmap.hf_shapes(ours[path])}


def build_from_arrays(cfg: QwenConfig, load: Callable[[str, jax.ShapeDtypeStruct, tuple[slice, ...] | None], np.ndarray], *,
                      progress: str | None = None) -> Qwen:
    """A model whose parameters come from ``load(dotted_path, abstract, index)``, one at a time.

    index: the block one of this process's devices holds (on the mesh in context); each distinct block
    is loaded once per process, so a host reads only what it holds.
    """
    graphdef, state = abstract_model(cfg)
    items = []
    flat = list(nnx.to_flat_state(state))
    for path, var in console.bar(flat, desc=progress, disable=progress is None, leave=False):
        abstract = var.get_value()
        name = dotted(path)
        blocks: dict[tuple, np.ndarray] = {}

        def block(index, name=name, abstract=abstract, blocks=blocks):
            key = tuple(s.indices(n)[:2] for s, n in zip(index, abstract.shape))
            if key not in blocks:
                blocks[key] = load(name, abstract, index)
            return blocks[key]

        items.append((path, var.replace(value=jax.make_array_from_callback(abstract.shape, abstract.sharding, block))))
    return nnx.merge(graphdef, nnx.from_flat_state(items))


def init_random(cfg: QwenConfig, seed: int = 0) -> Qwen:
    """A randomly initialised model (normal(0, 0.02) weights, norm scales 1, biases 0) on the mesh in
    context.

    Each parameter is created directly in its sharding by a small jitted initialiser (one compile
    per distinct shape / sharding, cached), not by one program over the whole model: seconds for
    billions of parameters, and every device computes only its own shard.
    """
    graphdef, abstract = abstract_model(cfg)
    key = jax.random.key(seed)
    items = [(path, var.replace(value=random_param(var, jax.random.fold_in(key, i))))
             for i, (path, var) in enumerate(nnx.to_flat_state(abstract))]
    return nnx.merge(graphdef, nnx.from_flat_state(items))


def random_param(var: nnx.Variable, key: jax.Array) -> jax.Array:
    """A fresh value for the abstract parameter ``var`` (an entry of ``abstract_model``'s state), drawn
    by its ``init_kind`` (normal(0, 0.02), ones or zeros): an array of its shape and dtype in its
    sharding, made by a small jitted initialiser."""
    a = var.get_value()
    return _initialiser(var.init_kind, a.shape, jnp.dtype(a.dtype), a.sharding)(key)


@functools.lru_cache(maxsize=None)
def _initialiser(kind: str, shape: tuple[int, ...], dtype, sharding) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(functools.partial(init_value, kind, shape=shape, dtype=dtype), out_shardings=sharding)


def _hf_param_dtype(hf_dir: pathlib.Path) -> str:
    hf = json.loads((hf_dir / "config.json").read_text())
    return str(hf.get("dtype") or hf.get("torch_dtype") or "float32")


def load_hf(hf_dir: str | pathlib.Path, *, dtype: str = "float32",
            param_dtype: str | None = "float32", remat: str = "none", progress: bool = True, **run_options) -> Qwen:
    """Load an HF directory (config.json + safetensors) into a model sharded on the mesh in context.

    ``param_dtype=None`` keeps the dtype the checkpoint declares (config.json "dtype").
    """
    hf_dir = pathlib.Path(hf_dir)
    param_dtype = param_dtype or _hf_param_dtype(hf_dir)
    cfg = QwenConfig.from_hf_file(hf_dir, dtype=dtype, param_dtype=param_dtype, remat=remat, **run_options)
    reader = HFWeightReader(hf_dir)
    mapping = weight_map(cfg)
    return build_from_arrays(
        cfg, lambda path, abstract, index: read_param(reader, path, mapping[path], abstract.shape,
                                                            abstract.dtype, index),
        progress=f"loading {hf_dir.name}" if progress else None)


def host_params(model: Qwen) -> Iterator[tuple[str, np.ndarray]]:
    """(dotted path, host numpy array) for each parameter, one at a time (gathered if sharded)."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        yield dotted(path), host_array(var.get_value())


def host_array(value: jax.Array) -> np.ndarray:
    """A (possibly sharded) array as one host NumPy array, gathered across processes when it spans them
    (every process must call it)."""
    if jax.process_count() > 1 and not value.is_fully_addressable:
        from jax.experimental import multihost_utils
        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(jax.device_get(value))


def export_hf(model: Qwen, out_dir: str | pathlib.Path, *, fmt: str = "safetensors",
              max_shard_bytes: int = 4 * 1024**3, tokenizer_dir: str | pathlib.Path | None = None,
              overwrite: bool = False, progress: bool = False,
              no_tokenizer: str = "no tokenizer folder was given to the export") -> pathlib.Path | epath.Path:
    """Write ``model`` as an HF directory that ``transformers`` loads (atomic; dtype preserved); returns
    the folder (``out_dir`` local or on ``gs://``: ``write_hf_dir``; without ``tokenizer_dir`` its
    README.md says it has no tokenizer, ``no_tokenizer`` saying why).

    Multi-process: every process must call it (each tensor is gathered); process 0 writes."""
    cfg = model.cfg
    mapping = weight_map(cfg)
    params = console.bar(host_params(model), total=len(mapping), desc=f"exporting to {pathlib.Path(out_dir).name}",
                  disable=not progress, leave=False)
    tensors = ((name, np.ascontiguousarray(hf)) for path, array in params for name, hf in mapping[path].hf_tensors(array))
    if jax.process_index() != 0:  # every process takes part in gathering each tensor; process 0 writes
        for _ in tensors:
            pass
        return epath.Path(out_dir) if is_remote(out_dir) else pathlib.Path(out_dir)
    return write_hf_dir(out_dir, cfg, tensors, fmt=fmt, max_shard_bytes=max_shard_bytes,
                        tokenizer_dir=tokenizer_dir, overwrite=overwrite, no_tokenizer=no_tokenizer)
