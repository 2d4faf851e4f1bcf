"""The registry of training objectives: a config names one, the trainer calls it.

Every objective has the signature
    fn(logp, old_logp, response_mask, rewards, group_size, *, ref_logp=None, totals=None, **options)
        -> (scalar loss, metrics dict)
with logp, old_logp, response_mask, ref_logp [B, T] and rewards [B] ("ppo" also takes the batch's
per-token ``advantages`` [B, T]); ``get_objective`` binds the options once (checking their names) so
the trainer only passes the batch.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from pacs_jax.rl.pacs import pacs_loss
from pacs_jax.rl.policy_gradient import drgrpo_loss, grpo_loss, policy_gradient_loss, rloo_loss
from pacs_jax.rl.ppo import ppo_objective, ppo_policy_loss

Objective = Callable[..., tuple]

OBJECTIVES: dict[str, Objective] = {
    "pacs": pacs_loss,
    "grpo": grpo_loss,
    "rloo": rloo_loss,
    "drgrpo": drgrpo_loss,
    "ppo": ppo_objective,  # needs per-token advantages in the batch (rl.compute_gae); see rl/ppo.py
}

# Objectives whose rewards are class labels in {0, 1}; the others take any finite reward.
BINARY_REWARD_OBJECTIVES = frozenset({"pacs"})

_BATCH_ARGS = {"logp", "old_logp", "response_mask", "rewards", "group_size", "ref_logp", "totals", "advantages"}
# Where an objective's **options go: the function whose keyword options it forwards them to.
_FORWARDS_TO = {"grpo": policy_gradient_loss, "rloo": policy_gradient_loss, "drgrpo": policy_gradient_loss,
                "ppo": ppo_policy_loss}


def _option_names(fn: Objective, forwards_to: Objective | None = None) -> set[str]:
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    if forwards_to is not None and any(p.kind is p.VAR_KEYWORD for p in params):
        names |= _option_names(forwards_to) - {"adv_estimator"}
    return names - _BATCH_ARGS


def option_names(name: str) -> set[str]:
    """The options objective ``name`` takes (the keyword options of its function and of the one it
    forwards to)."""
    return _option_names(OBJECTIVES[name], _FORWARDS_TO.get(name))


def options_for(name: str, options: dict) -> dict:
    """The entries of ``options`` that objective ``name`` reads: a config's options may also hold those
    of other registered objectives (the demo's PACS options when it runs "ppo"), which are left out;
    names no objective takes stay, so ``get_objective`` refuses them."""
    others = set().union(*(option_names(other) for other in OBJECTIVES if other != name))
    mine = option_names(name)
    return {k: v for k, v in options.items() if k in mine or k not in others}


def get_objective(name: str, **options) -> Objective:
    """The objective registered as ``name`` with ``options`` bound (e.g. beta=1.0 for "pacs").

    Raises ValueError naming the unknown objective or option.
    """
    if name not in OBJECTIVES:
        raise ValueError(f"objective={name!r}: expected one of {sorted(OBJECTIVES)}")
    fn = OBJECTIVES[name]
    known = option_names(name)
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"objective {name!r} has no option(s) {sorted(unknown)}; known: {sorted(known)}")
    return functools.partial(fn, **options)
