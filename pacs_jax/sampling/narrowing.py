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


def _select_slots(take: jax.Array, new, old, resize: Callable, width: int):
    """``new`` where ``take`` for the per-slot arrays (those ``resize`` changes), else ``old``'s; the
    other arrays (the K/V cache or pool, the outputs) ``new``'s, unselected: no copy of them."""
    grown = jax.eval_shape(lambda c: resize(c, width + 1), new)
    return jax.tree.map(lambda n, o, g: jnp.where(take, n, o) if g.shape != n.shape else n, new, old, grown)


def run_widths(loop: WidthLoop, widths: Sequence[int], steps: int, decode_step: Callable, narrow: Callable,
               resize: Callable, running: Callable, waiting: Callable) -> WidthLoop:
    """Up to ``steps`` more decode steps of the width loops (fewer when the queue ends): one
    ``while_loop`` of ``decode_step(carry, refills=...)`` per decode width (widest first; only the
    first refills slots): a width's loop runs while more rows run than the next width holds, or rows
    wait and some run; then ``narrow(carry, width, active)`` moves the running rows to the next
    width's slots (``active`` False: nothing moves). A chunk goes on from the width ``loop.phase``
    and on into the next widths when one ends within it, so the decode steps, and the tokens, are
    those of one loop run to its end whatever ``steps``. Every width's loop is in the program, in
    order, and runs no trip unless its width is the queue's: no conditional holds the K/V (XLA would
    copy it). carry.steps counts decode steps (decode.DecodeState); resize(carry, width): its per-slot
    arrays cut to (or padded to) ``width``; running(carry), waiting(carry): int32 [] running rows,
    bool [] rows still queued."""
    carry, phase, slot_steps = loop
    limit = carry.steps + steps
    for k, width in enumerate(widths):
        following = widths[k + 1] if k + 1 < len(widths) else 0

        def more(c, following=following):
            rows = running(c)
            return (rows > following) | (waiting(c) & (rows > 0))

        active = phase == k
        view = resize(carry, width)
        start = view.steps
        view = jax.lax.while_loop(lambda c: active & more(c) & (c.steps < limit),
                                  functools.partial(decode_step, refills=k == 0), view)
        slot_steps = slot_steps + width * (view.steps - start)
        ended = active & ~more(view)
        if following:
            view = _select_slots(ended, resize(narrow(view, following, ended), widths[0]), resize(view, widths[0]),
                                 resize, widths[0])
        else:
            view = resize(view, widths[0])
        carry = _select_slots(active, view, carry, resize, widths[0])
        phase = phase + ended.astype(jnp.int32)
    return WidthLoop(carry, phase, slot_steps)
