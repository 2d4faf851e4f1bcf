"""The registry of training objectives (docs/design.md section 6): every fact about each objective.

For each name: the loss function, its options and their defaults (the loss's keyword defaults),
the options that take one of a fixed set of values, the minimum group size (responses per
prompt) and whether rewards must be labels in {0, 1}. The trainer's loss (``get_objective``), the
config check (training/config_check.py) and the objectives table of docs/design.md (checked by
tests/test_rl_objectives.py) all read it.

A bound objective is called as
    objective(logp, old_logp, response_mask, rewards, group_size, *, totals=None, advantages=None,
              rollout_is_weights=None) -> (scalar loss, metrics)
with logp, old_logp, response_mask [B, T] and rewards [B] ("ppo" also takes the batch's per-token
``advantages`` [B, T] from rl.compute_gae; every objective takes rollout-correction weights [B, T],
rl/rollout_correction.py, which multiply its per-token loss, PACS's per-response loss by their
response means); it checks the batch (``check_batch``) with the registry's
minimum group and reward kind, then runs the loss.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from pacs_jax.errors import did_you_mean
from pacs_jax.rl.advantages import ADVANTAGE_ESTIMATORS
from pacs_jax.rl.batch import check_batch
from pacs_jax.rl.cispo import cispo_loss, cispo_policy_loss
from pacs_jax.rl.gspo import gspo_loss, gspo_policy_loss
from pacs_jax.rl.pacs import REWARD_METHODS, WEIGHT_MODES, pacs_loss
from pacs_jax.rl.policy_gradient import (LOSS_AGG_MODES, LOSS_SCALES, VERL091_LOSS_AGG_MODES, drgrpo_loss, grpo_loss,
                                         policy_gradient_loss, rloo_loss)
from pacs_jax.rl.ppo import ppo_objective, ppo_policy_loss

# Arguments of every loss that are the batch, not options.
_BATCH_ARGS = ("logp", "old_logp", "response_mask", "rewards", "group_size", "totals", "advantages",
               "rollout_is_weights")


class OptionError(ValueError):
    """An objective option is unknown or has a value outside its choices; ``option`` names it (None: the
    objective itself)."""

    def __init__(self, option: str | None, message: str):
        super().__init__(message)
        self.option = option


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """One registered objective.

    loss: ``fn(logp, old_logp, response_mask, rewards, group_size, *, totals, **options)``, unchecked.
    min_group_size: responses per prompt it needs (rollout.n). binary_rewards: rewards are labels in
    {0, 1}. choices: options whose value is one of a fixed tuple (compared as strings).
    """

    loss: Callable[..., tuple]
    min_group_size: int
    binary_rewards: bool
    choices: Mapping[str, tuple[str, ...]]
    forwards_to: Callable[..., tuple] | None = None  # where the loss's **options go

    @property
    def defaults(self) -> dict[str, Any]:
        """{option: default} from the loss's keyword-only parameters (and those it forwards to)."""
        return _keyword_defaults(self.loss, self.forwards_to)

    def check_options(self, options: Mapping[str, Any]) -> None:
        """Raise OptionError naming the first unknown option or value outside its choices."""
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise OptionError(unknown[0], f"no option(s) {unknown}; known: {sorted(self.defaults)}")
        for name, value in options.items():
            if name in self.choices and str(value) not in self.choices[name]:
                raise OptionError(name, f"{name}={value!r}: expected one of {self.choices[name]}"
                                  f"{did_you_mean(str(value), self.choices[name])}")


def _keyword_defaults(fn: Callable, forwards_to: Callable | None = None) -> dict[str, Any]:
    params = inspect.signature(fn).parameters.values()
    found = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name not in _BATCH_ARGS}
    if forwards_to is not None and any(p.kind is p.VAR_KEYWORD for p in params):
        forwarded = _keyword_defaults(forwards_to)
        found = {**{k: v for k, v in forwarded.items() if k != "adv_estimator"}, **found}
    return found


_PG_CHOICES = {"loss_agg_mode": LOSS_AGG_MODES, "loss_scale": LOSS_SCALES}
_VERL091_CHOICES = {**_PG_CHOICES, "loss_agg_mode": VERL091_LOSS_AGG_MODES}  # GSPO's and CISPO's: verl 0.9.1's

# Every objective here compares the responses to one prompt: a group of one has a zero advantage
# (rloo and grpo are not even defined for it), so each needs at least two.
OBJECTIVES: dict[str, ObjectiveSpec] = {
    "pacs": ObjectiveSpec(pacs_loss, min_group_size=2, binary_rewards=True,
                          choices={"reward_method": REWARD_METHODS, "weight_mode": WEIGHT_MODES,
                                   "adv_estimator": tuple(ADVANTAGE_ESTIMATORS)}),
    "grpo": ObjectiveSpec(grpo_loss, min_group_size=2, binary_rewards=False, choices=_PG_CHOICES,
                          forwards_to=policy_gradient_loss),
    "rloo": ObjectiveSpec(rloo_loss, min_group_size=2, binary_rewards=False, choices=_PG_CHOICES,
                          forwards_to=policy_gradient_loss),
    "drgrpo": ObjectiveSpec(drgrpo_loss, min_group_size=2, binary_rewards=False, choices=_PG_CHOICES,
                          forwards_to=policy_gradient_loss),
    # GSPO and CISPO (verl 0.9.1's compute_policy_loss_gspo / _cispo) on GRPO's group advantages
    "gspo": ObjectiveSpec(gspo_loss, min_group_size=2, binary_rewards=False, choices=_VERL091_CHOICES,
                          forwards_to=gspo_policy_loss),
    "cispo": ObjectiveSpec(cispo_loss, min_group_size=2, binary_rewards=False, choices=_VERL091_CHOICES,
                           forwards_to=cispo_policy_loss),
    # PPO's advantages come from the critic (GAE), not from a group: one response per prompt is enough.
    "ppo": ObjectiveSpec(ppo_objective, min_group_size=1, binary_rewards=False, choices=_PG_CHOICES,
                         forwards_to=ppo_policy_loss),
}


def objective_spec(name: str) -> ObjectiveSpec:
    """The registry entry of ``name``; OptionError (option None) names the known objectives."""
    if name not in OBJECTIVES:
        raise OptionError(None, f"objective={name!r}: expected one of {sorted(OBJECTIVES)}"
                                f"{did_you_mean(name, OBJECTIVES)}")
    return OBJECTIVES[name]


def options_for(algorithm: Mapping[str, Any]) -> dict[str, Any]:
    """The options a config's ``algorithm`` section runs its objective with: the namespace named by
    ``algorithm["objective"]`` (configs/base.py: one per registered objective, every option at its
    default unless set); OptionError (option None) names the known objectives."""
    name = algorithm["objective"]
    objective_spec(name)
    return dict(algorithm[name])


def get_objective(name: str, **options) -> Callable[..., tuple]:
    """The objective registered as ``name`` with ``options`` bound (e.g. beta=1.0 for "pacs").

    Options are checked now (OptionError naming the option); the batch is checked on every call,
    before anything is traced when its arrays are concrete.
    """
    spec = objective_spec(name)
    try:
        spec.check_options(options)
    except OptionError as error:
        raise OptionError(error.option, f"objective {name!r}: {error}") from None
    loss = functools.partial(spec.loss, **options)

    def objective(logp, old_logp, response_mask, rewards, group_size: int, *, totals=None, advantages=None,
                  rollout_is_weights=None):
        check_batch(logp, old_logp, response_mask, rewards, group_size, min_group_size=spec.min_group_size,
                    binary_rewards=spec.binary_rewards)
        extra = {} if advantages is None else {"advantages": advantages}
        if rollout_is_weights is not None:
            extra["rollout_is_weights"] = rollout_is_weights
        return loss(logp, old_logp, response_mask, rewards, group_size, totals=totals, **extra)

    return objective
