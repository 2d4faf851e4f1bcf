"""The registry of training objectives: a config names one, the trainer calls it.

Every objective has the signature
    fn(logp, old_logp, response_mask, rewards, group_size, *, totals=None, **options)
        -> (scalar loss, metrics dict)
with logp, old_logp, response_mask [B, T] and rewards [B]; ``get_objective`` binds the
options once (checking their names) so the trainer only passes the batch.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from pacs_jax.rl.pacs import pacs_loss
from pacs_jax.rl.policy_gradient import drgrpo_loss, grpo_loss, policy_gradient_loss, rloo_loss

Objective = Callable[..., tuple]

OBJECTIVES: dict[str, Objective] = {
    "pacs": pacs_loss,
    "grpo": grpo_loss,
    "rloo": rloo_loss,
    "drgrpo": drgrpo_loss,
}

_BATCH_ARGS = {"logp", "old_logp", "response_mask", "rewards", "group_size", "totals"}


def _option_names(fn: Objective) -> set[str]:
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    if any(p.kind is p.VAR_KEYWORD for p in params):  # the baselines forward **options
        names |= _option_names(policy_gradient_loss) - {"adv_estimator"}
    return names - _BATCH_ARGS


def get_objective(name: str, **options) -> Objective:
    """The objective registered as ``name`` with ``options`` bound (e.g. beta=1.0 for "pacs").

    Raises ValueError naming the unknown objective or option.
    """
    if name not in OBJECTIVES:
        raise ValueError(f"objective={name!r}: expected one of {sorted(OBJECTIVES)}")
    fn = OBJECTIVES[name]
    unknown = set(options) - _option_names(fn)
    if unknown:
        raise ValueError(f"objective {name!r} has no option(s) {sorted(unknown)}; "
                         f"known: {sorted(_option_names(fn))}")
    return functools.partial(fn, **options)
