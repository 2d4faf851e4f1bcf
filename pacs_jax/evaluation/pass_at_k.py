"""pass@k: the unbiased estimator of Chen et al. (2021) and its mean over problems (docs/design.md section 7.5).

For one problem with n samples of which c are correct, pass@k = 1 - C(n - c, k) / C(n, k); a data
source's pass@k is its mean over problems, for k = 1, 2, 4, ... <= n, and mean@n is the mean score
of all its samples.
"""

from __future__ import annotations

import fractions
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: n samples, c of them correct; exact for any n.

    1 - C(n - c, k) / C(n, k), computed with exact integers and rounded once to a float (binomials
    as floats overflow float64 from n ~ 1030; a running float product accumulates rounding).
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"pass_at_k: {name}={value!r} must be an integer")
    if n < 1:
        raise ValueError(f"pass_at_k: n={n} must be >= 1")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}]")
    if n - c < k:
        return 1.0
    return float(1 - fractions.Fraction(math.comb(int(n - c), int(k)), math.comb(int(n), int(k))))


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n."""
    return [2**i for i in range(n.bit_length())]


def pass_at_k_metrics(rows: Sequence[Mapping[str, Any]], n: int) -> dict[str, dict[str, float]]:
    """{data_source: {"pass@k": mean over its problems, ..., "mean@n": mean sample score}} from eval rows."""
    correct: dict[str, list[int]] = {}
    for row in rows:
        correct.setdefault(row["data_source"], []).append(row["num_correct"])
    metrics = {}
    for source, counts in correct.items():
        metrics[source] = {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in counts])) for k in k_values(n)}
        metrics[source][f"mean@{n}"] = float(np.sum(counts) / (n * len(counts)))
    return metrics
