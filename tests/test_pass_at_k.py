"""pass@k against brute-force enumeration (n <= 10) and 50-digit arithmetic (n = 1024)."""

from __future__ import annotations

import fractions
import itertools

import mpmath
import pytest

from pacs_jax.evaluation import k_values, pass_at_k, pass_at_k_metrics


def _brute_force(n: int, c: int, k: int) -> fractions.Fraction:
    """Fraction of the k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return fractions.Fraction(sum(any(i < c for i in subset) for subset in subsets), len(subsets))


def test_equals_brute_force_for_all_small_n():
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == float(_brute_force(n, c, k)), (n, c, k)


def test_exact_at_n_1024():
    mpmath.mp.dps = 50
    n = 1024
    for c in list(range(0, n + 1, 7)) + [1, 2, n - 1, n]:
        previous = -1.0
        for k in k_values(n):
            reference = 1 - mpmath.binomial(n - c, k) / mpmath.binomial(n, k)
            value = pass_at_k(n, c, k)
            assert abs(value - float(reference)) <= 1e-15 * max(1.0, abs(float(reference))), (c, k)
            assert 0.0 <= value <= 1.0 and value >= previous
            previous = value
        assert pass_at_k(n, c, 1) == c / n
    assert k_values(n)[-1] == 1024 and len(k_values(n)) == 11


@pytest.mark.parametrize("n, c, k, message", [
    (0, 0, 1, "n=0"), (4, 5, 1, "c=5"), (4, -1, 1, "c=-1"), (4, 2, 5, "k=5"), (4, 2, 0, "k=0"),
    (4.0, 2, 1, "n=4.0"), (4, True, 1, "c=True"),
])
def test_bad_arguments_name_the_argument(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_metrics_average_over_problems_per_source():
    rows = [{"data_source": "a", "num_correct": 0}, {"data_source": "a", "num_correct": 2},
            {"data_source": "b", "num_correct": 4}]
    metrics = pass_at_k_metrics(rows, n=4)
    assert metrics["a"] == {"pass@1": 0.25, "pass@2": (0 + 5 / 6) / 2, "pass@4": 0.5, "mean@4": 0.25}
    assert metrics["b"] == {"pass@1": 1.0, "pass@2": 1.0, "pass@4": 1.0, "mean@4": 1.0}
