"""docs/plan_tables.md (issue 53 item 7, moved out of the README by issue 64 item 4): its plan tables are the plan
tools' own output (tools/plan_tables.py renders them from docs/plans/, the tools' stdout kept verbatim), and that
output is what the tool prints today for issue 53's case: qwen3_4b's pi_old on v5p-64, which the README had at
7.8 GiB where tools/plan_memory.py printed 3.35."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO
from qwen_reference import load_tool
from train_helpers import train_env

PAGE = REPO / "docs" / "plan_tables.md"


def test_the_plan_tables_are_the_tools_output():
    """Both plan tables (memory, step time) are rendered from the tools' stdout kept in docs/plans/ (each file
    headed by the command that printed it, the paper config on its slice), not typed: a hand edit of a number,
    or an output kept without its table rendered again, fails here. A row without a kept output is not in the
    table but named under it."""
    tool = load_tool("plan_tables")
    assert tool.page_tables(PAGE.read_text()) == tool.tables()
    assert tool.kept("plan_memory") == list(tool.ROWS)  # every row of the memory table; plan_step: those kept
    assert tool.kept("plan_step")
    for name in tool.TOOLS:
        for config, topology in tool.kept(name):
            header, _ = tool._read(name, config)
            assert header.startswith(f"# python tools/{name}.py --config=configs/paper.py:{config},pacs_beta1 "
                                     f"--topology={topology} (commit "), header
    table = tool.page_tables(PAGE.read_text())["plan_memory"]
    row = next(line for line in table.splitlines() if line.startswith("| `qwen3_4b` | v5p-64 |"))
    pi_old = tool.memory_programs(tool._read("plan_memory", "qwen3_4b")[1], PAGE)["pi_old"]
    assert row.split(" | ")[5] == f"{pi_old['total']} ({pi_old['peak']})"  # the cell: what the tool printed


@pytest.mark.slow(seconds=20)
def test_the_kept_plan_is_what_plan_memory_prints_today():
    """The issue's case re-run: tools/plan_memory.py compiles qwen3_4b's pi_old for v5p-64 (libtpu, about 15 s)
    and prints the row docs/plans/plan_memory/qwen3_4b.txt keeps (every column but the compile time). A change
    that moves the plan fails here until `python tools/plan_tables.py --run` refreshes the outputs and tables."""
    tool = load_tool("plan_tables")
    args = [*tool.command("plan_memory", "qwen3_4b", "v5p-64")[1:], "--programs=pi_old"]
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=train_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    today = tool.memory_programs(done.stdout, REPO / args[0])["pi_old"]
    kept = tool.memory_programs(tool._read("plan_memory", "qwen3_4b")[1], PAGE)["pi_old"]
    assert {k: v for k, v in today.items() if k != "compile_s"} == {k: v for k, v in kept.items() if k != "compile_s"}
    assert re.search(r"^peak per device: [\d.]+ GiB of 95\.00 GiB \(fits\)$", done.stdout, re.M)
