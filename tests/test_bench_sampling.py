"""tools/bench_sampling.py: --compare's report of how two samplers' tokens differ (it reports, never
asserts: on a GPU or TPU the samplers may differ, docs/design.md 3.2), and --carry-over's comparison
run on a tiny model."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from pacs_jax import models


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


@pytest.mark.slow(seconds=35)
def test_carry_over_mode_runs_both_sides_and_prints_their_ratios(capsys):
    """A tiny model, 4 groups of 2 a step in 4 slots, budgets to 16 (median 2), 3 steps: both sides run,
    print each step and the ratios; carry-over's slots are the fuller."""
    cfg = models.QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_id=None)
    results = _tool().carry_over_steps(cfg, batch=4, n=2, slots=4, page_size=4, prompt=8, new=16, steps=3)
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("step ")] == ["step 1", "step 2",
                                                                                             "step 3"]
    assert "carry-over vs paged: utilisation " in out.splitlines()[-1]
    assert results["carry-over"][0] > results["paged"][0] and all(rate > 0 for _, rate in results.values())
