"""tools/bench_sampling.py --compare's report of how two samplers' tokens differ (it reports, never
asserts: on a GPU or TPU the samplers may differ, docs/design.md 3.2)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np


def _tool():
    path = pathlib.Path(__file__).parents[1] / "tools" / "bench_sampling.py"
    if str(path.parent) not in sys.path:  # its sibling modules (device_rates), as when run as a script
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("bench_sampling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_divergence_counts_differing_tokens_within_rows_and_where_rows_first_differ():
    divergence = _tool().divergence
    reference = np.arange(24).reshape(3, 8)
    lengths = np.array([8, 4, 6])
    assert divergence(reference.copy(), reference, lengths) == (0.0, "differing tokens 0.00 % of 18, rows 0 of 3")
    tokens = reference.copy()
    tokens[0, 2:] = -1   # row 0 diverges at token 2: 6 of its 8 tokens differ
    tokens[1, 5:] = -1   # past row 1's length: not a difference
    tokens[2, 3] = -1    # row 2: one token
    assert divergence(tokens, reference, lengths) == (7 / 18,
        "differing tokens 38.89 % of 18, rows 2 of 3; they first diverge at token 2 .. 2 .. 3 "
        "(min .. median .. max), 38% of the way into a row (median)")
