"""The decode loops of a narrowing decode batch (docs/design.md section 3.2): one ``while_loop`` per
decode width, around the decode step of sampling/decode.py, run a chunk of decode steps at a time
(the sampler is a program per chunk: engine.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class WidthLoop(NamedTuple):
    """Where a queue's decode loops are between two chunks: carry (decode.DecodeState) at the first
    (widest) width, a narrower width's slots first; phase [] int32, the index of the width whose
    loop runs (len(widths): the queue is done); slot_steps [] int32, each width times its decode
    steps so far."""

    carry: Any
    phase: jax.Array
    slot_steps: jax.Array


def fit(x: jax.Array, width: int, fill=0) -> jax.Array:
    """A per-slot array [w, ...] -> [width, ...]: its first ``width`` entries, or all of them then ``fill``."""
    w = x.shape[0]
    if width <= w:
        return x[:width]
    return jnp.concatenate([x, jnp.full((width - w, *x.shape[1:]), fill, x.dtype)])


def start_widths(carry) -> WidthLoop:
    """The loops' position before the first decode step."""
    return WidthLoop(carry, jnp.int32(0), jnp.int32(0))


def run_widths(loop: WidthLoop, widths: Sequence[int], steps: int, decode_step: Callable, narrow: Callable,
               resize: Callable, running: Callable, waiting: Callable) -> WidthLoop:
    """Up to ``steps`` more decode steps of the width loops (fewer when the queue ends): one
    ``while_loop`` of ``decode_step(carry, refills=...)`` per decode width (widest first; only the
    first refills slots): a width's loop runs while more rows run than the next width holds, or rows
    wait and some run; then ``narrow(carry, width)`` moves the running rows to the next width's slots.
    A chunk goes on from the width ``loop.phase`` and on into the next widths when one ends within
    it, so the decode steps, and the tokens, are those of one loop run to its end whatever ``steps``.
    carry.steps counts decode steps (decode.DecodeState); resize(carry, width): its slots cut to (or
    padded to) ``width``; running(carry), waiting(carry): int32 [] running rows, bool [] rows still
    queued."""
    limit = loop.carry.steps + steps
    for k, width in enumerate(widths):
        following = widths[k + 1] if k + 1 < len(widths) else 0

        def more(c, following=following):
            rows = running(c)
            return (rows > following) | (waiting(c) & (rows > 0))

        def phase(loop, k=k, width=width, more=more, following=following):
            carry = resize(loop.carry, width)
            start = carry.steps
            carry = jax.lax.while_loop(lambda c: more(c) & (c.steps < limit),
                                       functools.partial(decode_step, refills=k == 0), carry)
            slot_steps = loop.slot_steps + width * (carry.steps - start)
            ended = ~more(carry)
            if following:
                carry = jax.lax.cond(ended, lambda c: resize(narrow(c, following), widths[0]),
                                     lambda c: resize(c, widths[0]), carry)
            else:
                carry = resize(carry, widths[0])
            return WidthLoop(carry, loop.phase + ended.astype(jnp.int32), slot_steps)

        loop = jax.lax.cond(loop.phase == k, phase, lambda loop: loop, loop)
    return loop
