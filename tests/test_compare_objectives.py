"""tools/compare_objectives.py: the table and curves from runs' summaries, and one real run end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from qwen_reference import load_tool
from train_helpers import FAST_DEMO_FLAGS, NO_WARMSTART_FLAGS, compile_cache_dir, train_env

compare = load_tool("compare_objectives")


def _run(before: float, after: float, greedy: float, curve: list[float]) -> dict:
    return {"summary": {"accuracy_before_rl": before, "accuracy_after_rl": after, "greedy_accuracy_after_rl": greedy},
            "curve": curve}


def test_table_gives_mean_and_spread_over_seeds(tmp_path):
    results = {"pacs": {0: _run(0.2, 0.5, 0.6, [0.1, 0.3]), 1: _run(0.3, 0.4, 0.5, [0.2, 0.4])},
               "grpo": {0: _run(0.25, 0.3, 0.35, [0.1, 0.2])}}
    lines = compare.table(results).splitlines()
    # pacs: before 0.25 ± 0.05, after 0.45 ± 0.05, gains 0.3 and 0.1 -> 0.2 ± 0.1 (population std)
    assert lines[2] == "| pacs | 2 | 0.250 ± 0.050 | 0.450 ± 0.050 | 0.200 ± 0.100 | 0.550 ± 0.050 | 0.500, 0.400 |"
    assert lines[3] == "| grpo | 1 | 0.250 | 0.300 | 0.050 | 0.350 | 0.300 |"
    compare.plot(results, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_one_objective_end_to_end(tmp_path):
    """GRPO on a one-step demo without its warm-start (the tool's table is about RL: the accuracy before and
    after it): the tool trains it through configs/demo_objectives.py and reports it."""
    out = tmp_path / "compare"
    flags = " ".join([*FAST_DEMO_FLAGS, *NO_WARMSTART_FLAGS, "--config.train.steps=1"])
    run = subprocess.run([sys.executable, str(REPO / "tools" / "compare_objectives.py"), "--objectives=grpo",
                          "--seeds=3", f"--out={out}", f"--train_flags={flags}"], cwd=REPO, capture_output=True, text=True,
                         env=train_env(compile_cache_dir()), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    summary = results["grpo"]["3"]["summary"]
    config = json.loads((out / "runs" / "grpo_s3" / "config.json").read_text())
    assert config["algorithm"]["objective"] == "grpo" and config["seed"] == 3 and config["optim"]["grad_clip"] == 1.0
    assert summary["final_step"] == 1 and len(results["grpo"]["3"]["curve"]) == 1
    assert f"| grpo | 1 | {summary['accuracy_before_rl']:.3f} |" in (out / "table.md").read_text()
