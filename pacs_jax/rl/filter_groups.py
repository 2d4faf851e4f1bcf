"""DAPO's dynamic sampling (arXiv 2503.14476, section 3.2; verl's ``algorithm.filter_groups``): a prompt
group whose responses all score the same gives every response the same advantage under a group
baseline (GRPO, RLOO, PACS's reward - mean) and so no gradient; such groups are dropped and more
prompts sampled until the step holds B groups that differ.

Shapes: G groups of n responses, rows g*n .. g*n+n-1 of group g (the trainer's row order).

verl keeps a group when the population standard deviation of its metric is above 0, or when it has a
single response (n = 1). The metric names are verl's; this trainer scores a response once, so
``score``, ``seq_reward`` and ``seq_final_reward`` are all the reward (no KL penalty is folded into it)
and ``acc`` is whether it is correct (reward 1).
"""

from __future__ import annotations

import numpy as np

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def group_metric(rewards: np.ndarray, metric: str) -> np.ndarray:
    """Each response's value of ``metric`` (one of FILTER_METRICS): rewards [G*n] -> [G*n] float64."""
    rewards = np.asarray(rewards, np.float64)
    if metric == "acc":
        return (rewards == 1.0).astype(np.float64)
    if metric in FILTER_METRICS:
        return rewards
    raise ValueError(f"metric {metric!r} is not one of {FILTER_METRICS}")


def groups_with_spread(values: np.ndarray, n: int) -> np.ndarray:
    """[G] bool: the groups of values [G*n] (float64) whose responses differ (std > 0), or all of them when
    n is 1 (verl: a single response is kept)."""
    values = np.asarray(values, np.float64).reshape(-1, n)
    return np.ones(values.shape[0], bool) if n == 1 else values.std(axis=1) > 0
