"""The README a newcomer reads (issue 53 item 7): it opens with a map of the commands, one line each, before any
prose; its plan tables are the plan tools' own output (tools/readme_tables.py renders them from docs/plans/, the
tools' stdout kept verbatim), and that output is what the tool prints today for the issue's case: qwen3_4b's
pi_old on v5p-64, which the README had at 7.8 GiB where tools/plan_memory.py printed 3.35."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO
from qwen_reference import load_tool
from train_helpers import train_env

README = REPO / "README.md"


def _map_rows() -> list[tuple[str, str]]:
    """(command, what it is for) of each row of the table that opens the README."""
    lines = README.read_text().splitlines()
    assert lines[0] == "# pacs_jax" and lines[1] == "", lines[:2]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert start == 4 and lines[3] == "" and lines[2].endswith(":"), lines[:start]  # one sentence, then the map
    assert lines[start] == "| command | for |" and lines[start + 1] == "|---|---|"
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 2 and cells[0].startswith("`") and cells[1], line
        rows.append((cells[0].strip("`"), cells[1]))
    return rows


def test_the_readme_opens_with_a_one_line_map_of_every_command():
    """The map is the README's first table, before its prose; every command the repository has is in it (the
    CLIs, each tool with a __main__, the launch scripts; the benchmarks as one row), and every row's command
    exists."""
    rows = _map_rows()
    named = [command for command, _ in rows]
    clis = sorted(f"python -m pacs_jax.{p.stem}" for p in (REPO / "pacs_jax").glob("*.py")
                  if 'if __name__ == "__main__"' in p.read_text())
    assert clis == ["python -m pacs_jax.check_config", "python -m pacs_jax.evaluate", "python -m pacs_jax.train"]
    tools = sorted(f"python tools/{p.name}" for p in (REPO / "tools").glob("*.py")
                   if 'if __name__ == "__main__"' in p.read_text() and not p.name.startswith("bench_"))
    launch = sorted(f"launch/{p.name}" for p in (REPO / "launch").glob("*.sh") if p.name != "common.sh")
    missing = [c for c in (*clis, *tools, *launch, "python tools/bench_*.py", "pytest -q") if c not in named]
    assert not missing, f"not in the README's map: {missing}"
    for command in named:
        path = command.split()[-1] if command.startswith("python tools") or command.startswith("launch") else None
        assert path is None or list(REPO.glob(path)), f"{command}: no such file"
    assert len(rows) == len(set(named)) and len(rows) <= 25


def test_the_readme_plan_tables_are_the_tools_output():
    """Both plan tables (memory, step time) are rendered from the tools' stdout kept in docs/plans/ (each file
    headed by the command that printed it, the paper config on its slice), not typed: a hand edit of a number,
    or an output kept without its table rendered again, fails here. A row without a kept output is not in the
    table but named under it."""
    tool = load_tool("readme_tables")
    assert tool.readme_tables(README.read_text()) == tool.tables()
    assert tool.kept("plan_memory") == list(tool.ROWS)  # every row of the memory table; plan_step: those kept
    assert tool.kept("plan_step")
    for name in tool.TOOLS:
        for config, topology in tool.kept(name):
            header, _ = tool._read(name, config)
            assert header.startswith(f"# python tools/{name}.py --config=configs/paper.py:{config},pacs_beta1 "
                                     f"--topology={topology} (commit "), header
    table = tool.readme_tables(README.read_text())["plan_memory"]
    row = next(line for line in table.splitlines() if line.startswith("| `qwen3_4b` | v5p-64 |"))
    pi_old = tool.memory_programs(tool._read("plan_memory", "qwen3_4b")[1], README)["pi_old"]
    assert row.split(" | ")[5] == f"{pi_old['total']} ({pi_old['peak']})"  # the cell: what the tool printed


@pytest.mark.slow(seconds=20)
def test_the_kept_plan_is_what_plan_memory_prints_today():
    """The issue's case re-run: tools/plan_memory.py compiles qwen3_4b's pi_old for v5p-64 (libtpu, about 15 s)
    and prints the row docs/plans/plan_memory/qwen3_4b.txt keeps (every column but the compile time). A change
    that moves the plan fails here until `python tools/readme_tables.py --run` refreshes the outputs and tables."""
    tool = load_tool("readme_tables")
    args = [*tool.command("plan_memory", "qwen3_4b", "v5p-64")[1:], "--programs=pi_old"]
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=train_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    today = tool.memory_programs(done.stdout, REPO / args[0])["pi_old"]
    kept = tool.memory_programs(tool._read("plan_memory", "qwen3_4b")[1], README)["pi_old"]
    assert {k: v for k, v in today.items() if k != "compile_s"} == {k: v for k, v in kept.items() if k != "compile_s"}
    assert re.search(r"^peak per device: [\d.]+ GiB of 95\.00 GiB \(fits\)$", done.stdout, re.M)
