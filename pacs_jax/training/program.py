"""One program of a training step for one bucket, lowered on demand (training/step_programs.py lists them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of a step for one bucket: ``lower()`` lowers it on abstract ``args``.

    name: a key of memory_check.FIELDS. shape: its shapes in words. outside: the training state
    resident on the device during it but not among its arguments (bytes per device)."""

    name: str
    shape: str
    lower: Callable[[], jax.stages.Lowered]
    args: tuple
    outside: int
