"""One program of a training step for one bucket, lowered on demand (training/step_programs.py lists them)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
from jax.sharding import Mesh

from pacs_jax import sharding

if TYPE_CHECKING:
    from pacs_jax.sampling.engine import SamplerCompiled


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of a step for one bucket: ``lower()`` lowers it on abstract ``args``.

    name: a key of memory_check.FIELDS. shape: its shapes in words. outside: the training state
    resident on the device during it but not among its arguments (bytes per device). mesh: the mesh it
    is lowered and compiled on (the rollout engine's own), or None: the mesh in context."""

    name: str
    shape: str
    lower: Callable[[], jax.stages.Lowered]
    args: tuple
    outside: int
    mesh: Mesh | None = None

    def compile(self) -> jax.stages.Compiled | SamplerCompiled:
        """The program lowered and compiled ahead of time on its mesh (the sampler's: its programs read as one)."""
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            with sharding.tracing_device(sharding.current_mesh()):
                return self.lower().compile()
