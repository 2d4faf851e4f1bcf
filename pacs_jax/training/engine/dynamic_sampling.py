"""DAPO's dynamic sampling in a training step (``algorithm.filter_groups``; rl/filter_groups.py; docs/design.md 6.9).

With it on, a step samples and scores a batch of B prompts (B = ``train.prompts_per_step``, a "gen batch"),
keeps the groups whose metric differs, and samples more batches until it holds B such groups (the
first B, in the order they were drawn; a surplus is dropped, as verl's ``batch[:traj_bsz]``). pi_old,
the rollout correction and the update then run on those B groups: the same shapes as without
filtering, so nothing compiles after step 1. Batch g >= 2 of step s samples with
``fold_in(key_s, g - 1)`` (batch 1 with key_s itself, as an unfiltered step).

The kept rows move on the device: ``select_program`` places the kept rows of each gen batch's K
sampler calls into a step buffer of the same K calls' shapes, so what follows (the assembly, pi_old,
the rollout correction's comparison with the sampler's log-probs) runs as in an unfiltered step.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pacs_jax.errors import PermanentError
from pacs_jax.sharding import batch_sharding
from pacs_jax.training.records import CallRows


class FilterGroupsExhausted(PermanentError):
    """``algorithm.filter_groups.max_num_gen_batches`` gen batches did not yield a step's groups."""




def select_program(calls: int, routing: bool = False) -> jax.stages.Wrapped:
    """``(kept, drawn, source) -> kept'``: K = ``calls`` calls' ``CallRows`` each (with their routing records when
    ``routing``); source [B] int32, for each row of the step (the K calls' rows in order) the row of ``drawn`` (its
    calls' rows in order) placed there, or -1 to keep ``kept``'s. Jitted; the results sharded as the sampler's
    rows."""

    def select(kept: Sequence[CallRows], drawn: Sequence[CallRows], source: jax.Array) -> tuple[CallRows, ...]:
        K = len(kept)
        out = []
        for field in range(len(kept[0])):
            if kept[0][field] is None:  # no routing record
                out.append([None] * K)
                continue
            old = jnp.concatenate([call[field] for call in kept], axis=0)
            new = jnp.concatenate([call[field] for call in drawn], axis=0)
            taken = new[jnp.maximum(source, 0)]
            where = (source >= 0).reshape(-1, *(1,) * (old.ndim - 1))
            out.append(jnp.split(jnp.where(where, taken, old), K, axis=0))
        return tuple(CallRows(*fields) for fields in zip(*out))

    rows = CallRows(batch_sharding((0, 0)), batch_sharding((0, 0)), batch_sharding((0,)),
                    batch_sharding((0, 0)) if routing else None)
    return jax.jit(select, out_shardings=(rows,) * calls)


def placement(kept_groups: np.ndarray, have: int, need: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Where a gen batch's kept groups go: kept_groups [G] bool (its groups with spread), ``have`` groups
    already placed of the ``need`` a step takes -> (source [need * n] int32: for each row of the step
    its row in this gen batch, -1 where it keeps what it has; taken [k] int: this batch's groups taken,
    in order, at most need - have)."""
    taken = np.flatnonzero(kept_groups)[:need - have]
    source = np.full(need * n, -1, np.int32)
    for slot, group in enumerate(taken, start=have):
        source[slot * n:(slot + 1) * n] = group * n + np.arange(n)
    return source, taken


def exhausted_message(step: int, batches: int, prompts: int, have: int, metric: str) -> str:
    """The one line of ``FilterGroupsExhausted``."""
    return (f"config.algorithm.filter_groups.max_num_gen_batches: step {step} sampled {batches} batches of {prompts} "
            f"prompts and kept {have} of the {prompts} groups it needs: the others' responses all had the same "
            f"{metric!r} (the prompts are too hard or too easy for the model); raise it, or set it to 0 for no limit")
