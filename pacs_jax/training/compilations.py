"""Counting XLA compilations of this process (a metric of every training step).

A run compiles a bounded, known set of programs up front (``StepPrograms.compile``); any later
compilation is a bug (a shape or sharding that escaped the buckets) and shows in this count. A program
read from JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``) counts as compiled: it was
built for a shape or sharding all the same, and XLA's own compile event does not fire for it.
Compilations inside ``uncounted()`` are not counted: the training loop's checkpoint saves, where Orbax
compiles its own small transfer programs at the first save on a multi-device mesh (72 on the demo's 8
CPU devices: a slice of every parameter shape for every device), not the step's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jax import monitoring

_EVENT = "/jax/core/compile/backend_compile_duration"  # a program compiled (a duration event)
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # a program read from the persistent cache (an event)
_count = 0
_paused = 0
_registered = False


def _listener(event: str, duration: float | None = None, **kwargs) -> None:
    global _count
    if event in (_EVENT, _CACHE_HIT) and not _paused:
        _count += 1


def start_counting() -> None:
    """Register the listener (idempotent); compilations before this call are not counted."""
    global _registered
    if not _registered:
        monitoring.register_event_duration_secs_listener(_listener)
        monitoring.register_event_listener(_listener)
        _registered = True


@contextlib.contextmanager
def built() -> Iterator[list[str]]:
    """A list that receives one event name per program built inside the block: compiled by XLA, or read
    from the persistent compilation cache (``[]``: every program called was in memory already)."""
    events: list[str] = []

    def listener(event: str, duration: float | None = None, **kwargs) -> None:
        if event in (_EVENT, _CACHE_HIT):
            events.append(event)

    monitoring.register_event_duration_secs_listener(listener)
    monitoring.register_event_listener(listener)
    try:
        yield events
    finally:
        monitoring.unregister_event_duration_listener(listener)
        monitoring.unregister_event_listener(listener)


def compilations() -> int:
    """Backend compilations since ``start_counting`` (every jitted program and eager op compiled)."""
    return _count


@contextlib.contextmanager
def uncounted():
    """Compilations inside this block are not counted (see the module docstring)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1
