"""tools/compare_expert_parallel.py as a user runs it: a Qwen3-MoE block's gradient compiled for TPUs (compile-only)
with and without expert parallelism, one row each. Shrunk to a tiny block on a v5p-8 (data 1, fsdp 2, tensor 2): the
default gathers every expert's weights (8 experts x 3 x 256 x 64 bfloat16 a device, 0.75 MiB) and reduce-scatters
nothing; with expert_parallel the kernels line names the split (4 experts a device), the sums are reduce-scattered,
and the temporaries grow with the worst-case receive buffer."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO
from train_helpers import train_env


def test_both_layouts_compile_and_print_a_row_each():
    run = subprocess.run([sys.executable, "tools/compare_expert_parallel.py", "--topology=v5p-8", "--mesh=1,2,2",
                          "--tokens-per-shard=256", "--hidden=256", "--experts=8", "--experts-per-token=2",
                          "--expert-width=128"], cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    header, *rows = run.stdout.strip().splitlines()[-3:]
    assert header.split()[:2] == ["expert_parallel", "collectives"] and "all-gather" in header, run.stdout
    off, on = (dict(zip(header.split(), row.split()[:len(header.split())])) for row in rows)
    assert off["expert_parallel"] == "False" and rows[0].endswith("per batch shard"), run.stdout
    assert on["expert_parallel"] == "True" and rows[1].endswith(
        "per batch shard, experts over fsdp (4 a device: tokens all-gathered, sums reduce-scattered)"), run.stdout
    assert float(on["temp"]) > float(off["temp"]) > 0
    assert float(off["all-gather"]) >= 0.75 and float(off["reduce-scatter"]) == 0 < float(on["reduce-scatter"])
