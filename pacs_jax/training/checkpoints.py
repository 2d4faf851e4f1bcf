"""Train-state checkpoints: Orbax CheckpointManager over params, optimizer state and metadata.

Layout of ``<workdir>/checkpoints``: ``model_config.json`` and one ``<step>/`` per checkpoint with
items ``params`` (flat {dotted path: array}, the same format as pacs_jax.checkpoint, so
``models.from_pretrained`` and ``tools/export_hf.py`` read it), ``opt_state`` and ``meta`` (JSON:
step, data-iterator state, counters). Every process takes part in saves and restores.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from pacs_jax.checkpoint import write_model_config
from pacs_jax.models.config import QwenConfig
from pacs_jax.models.loading import dotted


def params_to_flat(params: nnx.State) -> dict[str, jax.Array]:
    return {dotted(path): var.get_value() for path, var in nnx.to_flat_state(params)}


def flat_to_params(template: nnx.State, flat: dict[str, jax.Array]) -> nnx.State:
    """Rebuild an nnx.State shaped like ``template`` from a flat {dotted path: array} dict."""
    items = [(path, var.replace(value=flat[dotted(path)])) for path, var in nnx.to_flat_state(template)]
    return nnx.from_flat_state(items)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class TrainCheckpointer:
    """Saves every ``every`` steps (and on demand), keeps the last ``keep``, restores the latest."""

    def __init__(self, directory: str | pathlib.Path, model_config: QwenConfig, *, every: int, keep: int):
        self.directory = pathlib.Path(directory).absolute()
        self.every = every
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("params", "opt_state", "meta"))
        if jax.process_index() == 0:
            write_model_config(self.directory, model_config)

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption was signalled (multi-process: JAX's preemption sync point, so that
        every process answers True at the same step; every process must call it every step)."""
        return self.manager.reached_preemption(step)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: nnx.State, opt_state: Any, meta: dict, *, force: bool = False) -> bool:
        """Save when ``step`` is a multiple of ``every`` (or ``force``); returns whether it saved."""
        if not force and (self.every <= 0 or step % self.every):
            return False
        if step in self.manager.all_steps():
            return False
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params_to_flat(params)),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)), force=True)
        return True

    def restore(self, step: int, params: nnx.State, opt_state: Any) -> tuple[nnx.State, Any, dict]:
        """Restore ``step`` into the shardings/dtypes of the given (template) params and opt_state."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params_to_flat(params))),
            opt_state=ocp.args.StandardRestore(_abstract(opt_state)),
            meta=ocp.args.JsonRestore()))
        return flat_to_params(params, restored["params"]), restored["opt_state"], restored["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
