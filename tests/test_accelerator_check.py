"""tools/accelerator_check.py, as a user runs it on new hardware, here on the CPU at its tiny sizes: every
check runs its tool in a process of its own and reports figures; on a CPU the samplers agree token for
token and the sampler's log-probs equal pi_old's (the float32 CPU arithmetic is the same program's);
a check that crashes is reported and the exit status is 1."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from conftest import REPO
from train_helpers import train_env


def _tool():
    path = REPO / "tools" / "accelerator_check.py"
    spec = importlib.util.spec_from_file_location("accelerator_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow(seconds=240)
def test_tiny_check_runs_every_tool_and_prints_one_table(tmp_path):
    result = subprocess.run([sys.executable, "tools/accelerator_check.py", "--size=tiny", f"--logs={tmp_path}",
                             f"--out={tmp_path / 'check.json'}"], cwd=REPO, env=train_env(), capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout[result.stdout.index("check  "):]
    rows = {line[:28].strip(): line for line in table.splitlines()[1:] if line[:28].strip() and "logs:" not in line}
    assert set(rows) == {"decode fill 16", "decode fill 48", "sampling", "update packed vs padded",
                         "train 2 steps (paged)", "train 2 steps (continuous)"}, table
    assert all(line[28:50].strip() == "ok" for line in rows.values()), table
    figure = lambda row, name: float(re.search(rf"{re.escape(name)} (-?[\d.e+-]+)", rows[row]).group(1))  # noqa: E731
    assert figure("sampling", "continuous differing %") == 0 and figure("sampling", "paged differing %") == 0
    assert figure("update packed vs padded", "tokens ratio") > 1  # packed rows compute fewer tokens
    for sampler in ("paged", "continuous"):
        assert 0 <= figure(f"train 2 steps ({sampler})", "rollout_logprob_diff_mean") < 1e-5
    assert re.search(r"^decode step -?[\d.]+ ms", (tmp_path / "decode_fill_16.log").read_text(), re.M)  # its full log


def test_a_check_that_crashes_or_prints_no_figures_is_reported(tmp_path, monkeypatch):
    tool = _tool()
    crash = tool.Check("crash", (sys.executable, "-c", "print('boom'); raise SystemExit(3)"), {"x": r"x (\d+)"}, 60)
    silent = tool.Check("silent", (sys.executable, "-c", "print('nothing to read')"), {"x": r"x (\d+)"}, 60)
    fine = tool.Check("fine", (sys.executable, "-c", "print('x 7')"), {"x": r"x (\d+)"}, 60)
    results = {c.name: tool.run_check(c, tmp_path / f"{c.name}.log") for c in (crash, silent, fine)}
    assert results["crash"]["status"] == "crashed (status 3)" and results["crash"]["last_line"] == "boom"
    assert results["silent"]["status"] == "no figures" and results["fine"]["figures"] == {"x": 7.0}
    assert "crashed (status 3)" in tool.table(results) and "boom" in tool.table(results)
    monkeypatch.setattr(tool, "checks", lambda size, workdir: [fine, crash])
    assert tool.main([f"--logs={tmp_path}"]) == 1
    monkeypatch.setattr(tool, "checks", lambda size, workdir: [fine])
    assert tool.main([f"--logs={tmp_path}"]) == 0
