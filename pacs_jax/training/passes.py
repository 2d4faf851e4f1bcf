"""One value for each packed pass of a step (``train.packing``; rl/packing.py): its layout, its plan, the
plan's arrays on the device.

    layouts = spec.packed_layouts(shards, critic=True)     # Passes[PassLayout]
    plans = layouts.map(lambda layout: plan_packing(..., **layout.options()))   # Passes[PackedPlan]
    plans.logprob, plans.update, plans.critic              # pi_old's (also PPO's values), the update's, PPO's critic update's
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


@dataclasses.dataclass(frozen=True)
class PassLayout:
    """How a packed pass cuts a step's rows (rl/packing.py ``plan_packing``'s arguments past the lengths and
    widths): ``mini_batches`` of the step, a prompt group's ``unit`` sequences kept in one mini-batch,
    ``shards`` batch shards, ``rows`` packed rows a pass and shard, at most ``passes`` passes a mini-batch."""

    mini_batches: int
    unit: int
    shards: int
    rows: int
    passes: int

    def options(self) -> dict[str, int]:
        """``plan_packing``'s keyword arguments."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Passes(Generic[T]):
    """A value for each packed pass: ``logprob`` pi_old's (PPO's values pass too), ``update`` the actor's
    update's, ``critic`` PPO's critic update's (None without a critic)."""

    logprob: T
    update: T
    critic: T | None = None

    def map(self, fn: Callable[[T], U]) -> Passes[U]:
        """``fn`` of each pass's value (no critic stays none)."""
        return Passes(fn(self.logprob), fn(self.update), None if self.critic is None else fn(self.critic))

    def items(self) -> Iterator[tuple[str, T]]:
        """(pass name, value) in the order a step runs the passes: logprob, PPO's critic, update."""
        yield "logprob", self.logprob
        if self.critic is not None:
            yield "critic", self.critic
        yield "update", self.update
