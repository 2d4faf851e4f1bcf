"""tools/paper_table.py on the evaluation outputs of two real shrunk demo runs (PACS and GRPO, one RL
step each, with their evaluation before RL): the Markdown's rows, columns and values against the runs'
eval_metrics.json and the published numbers' file, the PNG, the row names and the errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO
from qwen_reference import load_tool
from train_helpers import FAST_DEMO_FLAGS, compile_cache_dir, train_env

table_tool = load_tool("paper_table")
PUBLISHED = REPO / "data" / "paper_results" / "pacs_2509.02522.json"
N = 4  # samples per problem of the runs' final evaluation: pass@1, 2, 4
FLAGS = (*FAST_DEMO_FLAGS, "--config.train.steps=1", f"--config.eval.final.n={N}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{method: workdir} of two shrunk demo runs, PACS (configs/default.py) and GRPO (demo_objectives.py)."""
    root = tmp_path_factory.mktemp("paper_table_runs")
    env = train_env(compile_cache_dir(tmp_path_factory))
    workdirs = {}
    for method, config in (("PACS", "configs/default.py"), ("GRPO", "configs/demo_objectives.py:grpo")):
        workdir = root / method.lower()
        done = subprocess.run([sys.executable, "-m", "pacs_jax.train", f"--config={config}", f"--workdir={workdir}",
                               *FLAGS], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        workdirs[method] = workdir
    return workdirs


def _tool(*args, cwd=REPO):
    return subprocess.run([sys.executable, str(REPO / "tools" / "paper_table.py"), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _tables(markdown: str) -> dict[str, dict[str, list[str]]]:
    """{section title: {"header": [...], method: [cells...]}} of the tool's Markdown."""
    tables, title = {}, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            title = line[3:].removesuffix(" (pass@k)")
            tables[title] = {}
        elif title and line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            key = "header" if cells[0] == "Model" else cells[0]
            assert key not in tables[title], f"{title}: row {key} twice"
            tables[title][key] = cells[1:]
    return tables


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.2f}"


@pytest.mark.slow(seconds=80)
def test_the_paper_layout_from_two_real_runs(runs, tmp_path):
    out = tmp_path / "table"
    done = _tool(*runs.values(), "--model=Qwen2.5-7B", f"--out={out}")
    assert done.returncode == 0, done.stderr
    markdown = (out / "paper_table.md").read_text()
    assert done.stdout.startswith(markdown)
    assert markdown.startswith("# pass@k of our runs against arXiv 2509.02522v1, Table 2 (Qwen2.5-7B)")
    ours = {"Base": runs["PACS"] / "eval" / "before_rl", "PACS": runs["PACS"] / "eval" / "final",
            "GRPO": runs["GRPO"] / "eval" / "final"}  # Base: the first run's evaluation before RL
    for method, folder in ours.items():
        assert f"- {method}: {folder}\n" in markdown
    metrics = {m: json.loads((f / "eval_metrics.json").read_text()) for m, f in ours.items()}
    published = json.loads(PUBLISHED.read_text())
    paper = published["tables"]["Qwen2.5-7B"]["rows"]
    tables = _tables(markdown)
    # the paper's four sets in its order, then the set our runs evaluated (the demo's held-out problems)
    assert list(tables) == ["MATH 500", "AMC 23", "AIME 2024", "AIME 2025", "held_out"]
    for name, title in published["set_names"].items():
        ks = published["k"][name]
        table = tables[title]
        assert table["header"] == [f"k={ks[0]}", *map(str, ks[1:])]
        assert list(table)[1:] == ["Base", "PPO", "GRPO", "PACS", "PACS w/o weight"]  # the paper's rows, in order
        for method, cells in table.items():
            if method == "header":
                continue
            assert len(cells) == len(ks)
            for k, value, cell in zip(ks, paper[method][name], cells):
                assert cell == f"— / {value:.2f}", (title, method, k)  # the runs evaluated held_out only
    held_out = tables["held_out"]
    assert held_out["header"] == ["k=1", "2", "4"]
    assert list(held_out)[1:] == ["Base", "GRPO", "PACS"]  # the paper's order; no published row for this set
    for method, folder_metrics in metrics.items():
        values = folder_metrics["held_out"]
        assert held_out[method] == [_percent(values[f"pass@{k}"]) for k in (1, 2, 4)], method
    data = json.loads((out / "paper_table.json").read_text())
    assert data["model"] == "Qwen2.5-7B" and [s["name"] for s in data["sets"]][-1] == "held_out"
    math_pacs = next(r for r in data["sets"][0]["rows"] if r["method"] == "PACS")
    assert math_pacs["paper_source"] == "arXiv 2509.02522v1, Table 2, row PACS" and math_pacs["ours_from"] is None
    png = (out / "pass_at_k.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    # Without --model: the runs' preset (the demo's is "", no paper model) has no published table
    plain = _tool(*runs.values(), f"--out={tmp_path / 'plain'}")
    assert plain.returncode == 0, plain.stderr
    text = (tmp_path / "plain" / "paper_table.md").read_text()
    assert "No published table for these runs' model" in text and list(_tables(text)) == ["held_out"]

    # Rows named on the command line: an explicit Base wins over the first run's evaluation before RL, and
    # an evaluation's own folder is a row too
    grpo_before = runs["GRPO"] / "eval" / "before_rl"
    named = _tool(f"Base={grpo_before}", runs["PACS"], f"PACS w/o weight={runs['GRPO'] / 'eval' / 'final'}",
                  "--model=Qwen2.5-7B", f"--out={tmp_path / 'named'}")
    assert named.returncode == 0, named.stderr
    text = (tmp_path / "named" / "paper_table.md").read_text()
    assert f"- Base: {grpo_before}\n" in text
    rows = _tables(text)["held_out"]
    before = json.loads((grpo_before / "eval_metrics.json").read_text())["held_out"]
    assert list(rows)[1:] == ["Base", "PACS", "PACS w/o weight"]
    assert rows["Base"] == [_percent(before[f"pass@{k}"]) for k in (1, 2, 4)]

    # Two runs of one method, a folder that is neither, an evaluation outside a workdir without a name
    twice = _tool(runs["PACS"], runs["PACS"], f"--out={tmp_path / 'x'}")
    assert twice.returncode == 2 and "two runs are both 'PACS'" in twice.stderr and "LABEL=RUN_DIR" in twice.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    neither = _tool(empty, f"--out={tmp_path / 'x'}")
    assert neither.returncode == 2 and str(empty) in neither.stderr and "eval/final/eval_metrics.json" in neither.stderr
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "eval_metrics.json").write_bytes((ours["PACS"] / "eval_metrics.json").read_bytes())
    unnamed = _tool(loose, f"--out={tmp_path / 'x'}")
    assert unnamed.returncode == 2 and f"LABEL={loose}" in unnamed.stderr
    unknown = _tool(runs["PACS"], "--model=Qwen9-1T", f"--out={tmp_path / 'x'}")
    assert unknown.returncode == 2 and "Qwen9-1T" in unknown.stderr and "Qwen2.5-7B" in unknown.stderr


def test_cells_are_ours_beside_the_paper_and_the_difference_at_the_papers_k():
    """The cell arithmetic on the published file: ours at each of the paper's k (none above a set's n),
    the paper's number of that row, table and k, and ours - paper."""
    published = table_tool.load_published(PUBLISHED)
    row = table_tool.Row.__new__(table_tool.Row)  # metrics of a run with 64 samples per problem
    row.method, row.folder, row.preset = "GRPO", REPO, None
    row.metrics = {"math_500": {k: 0.5 + k / 100 for k in (1, 2, 4, 8, 16, 32, 64)},
                   "aime_2024": {k: k / 1000 for k in (1, 2, 4, 8, 16, 32, 64)}}
    result = table_tool.build([row], published, "Qwen2.5-3B")
    sets = {s["name"]: s for s in result["sets"]}
    assert list(sets) == ["math_500", "amc23", "aime_2024", "aime_2025"]
    grpo = {s: next(r for r in sets[s]["rows"] if r["method"] == "GRPO") for s in sets}
    cells = grpo["math_500"]["cells"]
    assert [c["k"] for c in cells] == [1, 2, 4, 8, 16, 32]
    assert cells[0] == dict(k=1, ours=pytest.approx(51.0), paper=66.92, diff=pytest.approx(51.0 - 66.92))
    assert table_tool.cell_text(cells[0]) == "51.00 / 66.92 (-15.92)"
    assert table_tool.cell_text(cells[5]) == "82.00 / 89.00 (-7.00)"
    aime = grpo["aime_2024"]["cells"]
    assert [c["k"] for c in aime] == [1, 8, 32, 64, 128, 256]
    assert [table_tool.cell_text(c) for c in aime] == [
        "0.10 / 8.14 (-8.04)", "0.80 / 19.13 (-18.33)", "3.20 / 26.06 (-22.86)", "6.40 / 31.65 (-25.25)",
        "— / 37.75", "— / 42.76"]  # k = 128, 256 above the run's 64 samples
    assert table_tool.cell_text(dict(k=1, ours=90.0, paper=89.0, diff=1.0)) == "90.00 / 89.00 (+1.00)"
    assert all(r["ours_from"] is None for s in sets.values() for r in s["rows"] if r["method"] != "GRPO")
    assert grpo["aime_2024"]["paper_source"] == "arXiv 2509.02522v1, Table 1, row GRPO"


def test_the_published_file_holds_tables_1_and_2_with_a_source_for_every_row():
    published = table_tool.load_published(PUBLISHED)
    assert published["k"] == {"math_500": [1, 2, 4, 8, 16, 32], "amc23": [1, 8, 32, 64, 128, 256],
                              "aime_2024": [1, 8, 32, 64, 128, 256], "aime_2025": [1, 8, 32, 64, 128, 256]}
    for model, number, methods in (("Qwen2.5-3B", 1, ["Base", "PPO", "GRPO", "PACS"]),
                                   ("Qwen2.5-7B", 2, ["Base", "PPO", "GRPO", "PACS", "PACS w/o weight"])):
        table = published["tables"][model]
        assert table["source"] == f"arXiv 2509.02522v1, Table {number} ({model})"
        assert list(table["rows"]) == methods
        for method, row in table["rows"].items():
            assert re.fullmatch(rf"arXiv 2509\.02522v1, Table {number}, row .+", row["source"])
            assert all(0 < v <= 100 for name in published["k"] for v in row[name])
            for name in published["k"]:  # pass@k grows with k
                assert row[name] == sorted(row[name]), (model, method, name)
    # the v1 abstract's 59.78 at pass@256 and its margins over PPO (13.32) and GRPO (14.36)
    rows = published["tables"]["Qwen2.5-7B"]["rows"]
    pacs = rows["PACS"]["aime_2024"][-1]
    assert pacs == 59.78 and [round(pacs - rows[m]["aime_2024"][-1], 2) for m in ("PPO", "GRPO")] == [13.32, 14.36]
