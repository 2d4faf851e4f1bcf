"""The decode loops of a narrowing decode batch (docs/design.md section 3.2): one ``while_loop`` per
decode width, around the decode step of sampling/decode.py."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp


def run_widths(carry, widths: Sequence[int], decode_step: Callable, narrow: Callable,
               running: Callable, waiting: Callable):
    """One ``while_loop`` of ``decode_step(carry, refills=...)`` per decode width (widest first; only
    the first refills slots): a width's loop runs while more rows run than the next width holds, or
    rows wait and some run; then ``narrow(carry, width)`` moves the running rows to the next width's
    slots. carry.steps counts decode steps (decode.DecodeState); running(carry), waiting(carry): int32 []
    running rows, bool [] rows still queued. Returns (the last carry, slot steps: each width times its decode steps)."""
    slot_steps = jnp.int32(0)
    for k, width in enumerate(widths):
        following = widths[k + 1] if k + 1 < len(widths) else 0

        def more(c, following=following):
            rows = running(c)
            return (rows > following) | (waiting(c) & (rows > 0))

        if k:
            carry = narrow(carry, width)
        start = carry.steps
        carry = jax.lax.while_loop(more, functools.partial(decode_step, refills=k == 0), carry)
        slot_steps = slot_steps + width * (carry.steps - start)
    return carry, slot_steps
