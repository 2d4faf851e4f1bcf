"""tools/accelerator_check.py, as a user runs it on new hardware, here on the CPU at its tiny sizes: every
check runs its tool in a process of its own and reports figures; on a CPU the samplers agree token for
token and the sampler's log-probs equal pi_old's (the float32 CPU arithmetic is the same program's);
a check that crashes is reported and the exit status is 1.

Issue 53 item 1: on a host without an accelerator the full size is refused in one line naming --size=tiny
(it ran the 1.5B shapes on the CPU for 15 minutes, out of memory); a check's whole process group is
killed when it times out (a trainer child outlived the check); a share of the copy rate is never above 1
nor a step time negative ("n/a (too short to time)"); the temporary logs are deleted when every check
passed (297 MB were left in /tmp)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO
from pacs_jax.errors import PERMANENT_ERROR_STATUS
from train_helpers import compile_cache_dir, train_env


def _tool(name: str = "accelerator_check"):
    path = REPO / "tools" / f"{name}.py"
    if str(path.parent) not in sys.path:  # its sibling modules (device_rates), as when run as a script
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow(seconds=200)
def test_tiny_check_runs_every_tool_and_prints_one_table(small_tokenizer_dir, tmp_path):
    """Its tools write every program they compile to the suite's compilation cache, so that one check reads
    what another compiled (the random model's initialisers, the trainer's learner programs). The trainer
    checks take the Qwen tokenizer cut to 4,096 entries (conftest.py's small_tokenizer_dir, ``--tokenizer``):
    what they check, the sampler's log-probs against pi_old's, is not about the vocabulary, and the real
    151,936 entries' head and logits cost 13 of its 137 CPU seconds (the tool alone: 137 -> 124 s)."""
    result = subprocess.run([sys.executable, "tools/accelerator_check.py", "--size=tiny", f"--logs={tmp_path}",
                             f"--out={tmp_path / 'check.json'}", f"--tokenizer={small_tokenizer_dir}"], cwd=REPO,
                            env=train_env(compile_cache_dir()),
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout[result.stdout.index("check  "):result.stdout.index("predicted: ")]
    assert "\npredicted: none on a CPU (tools/plan_step.py compiles for an accelerator's topology)\n" in result.stdout
    rows = {line[:28].strip(): line for line in table.splitlines()[1:] if line[:28].strip() and "logs:" not in line}
    assert set(rows) == {"decode fill 16", "decode fill 48", "sampling", "update packed vs padded",
                         "train 2 steps (paged)", "train 2 steps (continuous)"}, table
    assert all(line[28:50].strip() == "ok" for line in rows.values()), table
    figure = lambda row, name: float(re.search(rf"{re.escape(name)} (-?[\d.e+-]+)", rows[row]).group(1))  # noqa: E731
    assert figure("sampling", "continuous differing %") == 0 and figure("sampling", "paged differing %") == 0
    assert figure("update packed vs padded", "tokens ratio") > 1  # packed rows compute fewer tokens
    for sampler in ("paged", "continuous"):
        assert 0 <= figure(f"train 2 steps ({sampler})", "rollout_logprob_diff_mean") < 1e-5
    assert re.search(r"^decode step ([\d.]+ ms|n/a)", (tmp_path / "decode_fill_16.log").read_text(), re.M)  # its log
    for sampler in ("paged", "continuous"):  # the model the trainer built: the tokenizer's vocabulary
        assert json.loads((tmp_path / f"train_{sampler}" / "config.json").read_text())["model"]["vocab_size"] == 4096


def test_a_check_that_crashes_or_prints_no_figures_is_reported(tmp_path, monkeypatch):
    tool = _tool()
    crash = tool.Check("crash", (sys.executable, "-c", "print('boom'); raise SystemExit(3)"), {"x": r"x (\d+)"}, 60)
    silent = tool.Check("silent", (sys.executable, "-c", "print('nothing to read')"), {"x": r"x (\d+)"}, 60)
    fine = tool.Check("fine", (sys.executable, "-c", "print('x 7')"), {"x": r"x (\d+)"}, 60)
    results = {c.name: tool.run_check(c, tmp_path / f"{c.name}.log") for c in (crash, silent, fine)}
    assert results["crash"]["status"] == "crashed (status 3)" and results["crash"]["last_line"] == "boom"
    assert results["silent"]["status"] == "no figures" and results["fine"]["figures"] == {"x": 7.0}
    assert "crashed (status 3)" in tool.table(results) and "boom" in tool.table(results)
    monkeypatch.setattr(tool, "default_backend", lambda: "cpu")
    monkeypatch.setattr(tool, "checks", lambda size, workdir, tokenizer: [fine, crash])
    assert tool.main(["--size=tiny", f"--logs={tmp_path}"]) == 1
    monkeypatch.setattr(tool, "checks", lambda size, workdir, tokenizer: [fine])
    assert tool.main(["--size=tiny", f"--logs={tmp_path}"]) == 0


def test_the_full_size_on_a_cpu_host_is_refused_in_its_first_line_naming_size_tiny(tmp_path):
    """It ran the 1.5B shapes on the CPU (timed out, crashed, killed out of memory; no table after 900 s)."""
    result = subprocess.run([sys.executable, str(REPO / "tools" / "accelerator_check.py")], cwd=tmp_path,
                            env=train_env(), capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stdout) == (PERMANENT_ERROR_STATUS, ""), result.stdout[-3000:]
    assert result.stderr.splitlines() == [
        "accelerator_check: error: no accelerator here (jax's default backend is cpu): the full size would run this "
        "CPU out of memory; --size=tiny checks the same paths at tiny shapes on any machine"]


def test_a_check_that_times_out_leaves_no_process_of_its_own(tmp_path):
    """A timed-out check's tool and what it started (a trainer's processes) are killed, its group whole."""
    tool = _tool()
    spawn = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
             "time.sleep(120)'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print('child', child.pid, "
             "flush=True); time.sleep(120)")
    result = tool.run_check(tool.Check("hang", (sys.executable, "-c", spawn), {"x": r"x (\d+)"}, 3), tmp_path / "h.log")
    assert result["status"] == "timed out"
    child = int(re.search(r"child (\d+)", (tmp_path / "h.log").read_text()).group(1))
    try:
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the check's child process outlived it"
    finally:
        if _alive(child):
            os.kill(child, 9)


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, waiting for its parent to read its status


def test_a_step_time_or_a_share_that_could_not_be_measured_is_n_a(tmp_path):
    """bench_decode printed "1.47 of the measured copy bandwidth" and, on a busy CPU, negative step times."""
    line = _tool("bench_decode").result_line
    gb, rate = 0.5e9, 100e9  # 0.5 GB live, a copy rate of 100 GB/s: 5 ms a step reads at the copy rate
    assert line(0.01, gb, rate) == "decode step 10.00 ms, 0.500 GB live, 0.50 of the measured copy bandwidth"
    assert line(0.005, gb, rate) == "decode step 5.00 ms, 0.500 GB live, 1.00 of the measured copy bandwidth"
    assert line(0.001, gb, rate) == ("decode step 1.00 ms, 0.500 GB live, n/a (too short to time) of the measured "
                                     "copy bandwidth")  # 5 times the copy rate: not a share
    for step in (-0.002, 0.0, float("nan")):
        assert line(step, gb, rate) == ("decode step n/a (too short to time), 0.500 GB live, n/a (too short to time) "
                                        "of the measured copy bandwidth")
    tool = _tool()
    figures = tool.checks("tiny", REPO)[0].figures
    check = tool.Check("decode", (sys.executable, "-c", f"print({line(-0.002, gb, rate)!r})"), figures, 60)
    assert tool.run_check(check, tmp_path / "decode.log")["figures"] == {"decode step ms": "n/a", "of copy rate": "n/a"}
    check = tool.Check("decode", (sys.executable, "-c", f"print({line(0.01, gb, rate)!r})"), figures, 60)
    result = tool.run_check(check, tmp_path / "decode.log")
    assert result["figures"] == {"decode step ms": 10.0, "of copy rate": 0.5}
    assert tool.table({"decode": result}).endswith("decode step ms 10, of copy rate 0.5")


def test_the_temporary_logs_are_deleted_when_every_check_passed_and_kept_when_one_failed(tmp_path, monkeypatch,
                                                                                          capsys):
    tool = _tool()
    monkeypatch.setattr(tool.tempfile, "tempdir", str(tmp_path))  # where its temporary logs folder goes
    monkeypatch.setattr(tool, "default_backend", lambda: "cpu")
    fine = tool.Check("fine", (sys.executable, "-c", "print('x 7')"), {"x": r"x (\d+)"}, 60)
    crash = tool.Check("crash", (sys.executable, "-c", "raise SystemExit(3)"), {"x": r"x (\d+)"}, 60)
    monkeypatch.setattr(tool, "checks", lambda size, workdir, tokenizer: [fine])
    assert tool.main(["--size=tiny"]) == 0
    assert list(tmp_path.iterdir()) == []
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("[accelerator_check] no accelerator here (jax's default backend is cpu): the "
                                   "tiny sizes")
    assert out.splitlines()[-1] == "logs: deleted (every check passed; --keep_logs keeps them)"
    assert tool.main(["--size=tiny", "--keep_logs"]) == 0
    kept = list(tmp_path.iterdir())
    assert [p.name for p in kept[0].iterdir()] == ["fine.log"]
    assert capsys.readouterr().out.endswith(f"logs: {kept[0]}\n")
    monkeypatch.setattr(tool, "checks", lambda size, workdir, tokenizer: [fine, crash])
    assert tool.main(["--size=tiny"]) == 1
    failed = [p for p in tmp_path.iterdir() if p not in kept]
    assert len(failed) == 1 and capsys.readouterr().out.endswith(f"logs: {failed[0]}\n")


# tools/plan_step.py's table and step line, as it prints them (h200x1, the paged trainer check's shape)
PLAN_REPORT = """phase             GFLOP       GB  coll GB   trips  ms flops   ms HBM  ms coll  XLA ms        bound  seconds  ratio
prefill          1234.5     9.87    0.000       1      1.25     2.06     0.00       -          HBM     0.02
decode            790.3    17.45    0.000     511      0.80     3.64     0.00       -          HBM     1.86  0.430 must-read/compiled bytes
pi_old          12345.6    45.67    0.000       2     12.48     9.51     0.00    12.0        flops     0.40  0.812 useful/compiled FLOPs
update          45678.9   456.78    0.000       1     46.19    95.16     0.00       -          HBM     2.10  0.610 useful/compiled FLOPs
step: 4.4 s predicted (the phases at their bounds' peaks; reward scoring, on the host and overlapped with pi_old, not counted); at 100 % of every bound 2.0 s: ratio 0.455
"""


def test_plan_steps_prediction_is_printed_beside_each_phase_the_trainer_measured(tmp_path):
    """Issue 52 item 4: on a GPU that pacs_jax/topologies.py knows, the check runs tools/plan_step.py for the paged
    trainer check's shape and prints each predicted phase beside the measured one; elsewhere it says why not."""
    tool = _tool()
    assert tool.plan_checks("full", None) == []
    plan = tool.plan_checks("full", "h200x1")[0]
    assert plan.argv[1:4] == (str(REPO / "tools" / "plan_step.py"), "--topology=h200x1", "--lengths=budget")
    train = next(c for c in tool.checks("full", tmp_path) if c.name == "train 2 steps (paged)")
    assert plan.argv[4:] == train.argv[3:-1]  # the trainer check's config flags, less its workdir
    check = tool.Check(plan.name, (sys.executable, "-c", f"print({PLAN_REPORT!r})"), plan.figures, 60)
    results = {plan.name: tool.run_check(check, tmp_path / "plan.log")}
    assert results[plan.name]["figures"] == {"prefill s": 0.02, "decode s": 1.86, "pi_old s": 0.4, "update s": 2.1,
                                             "step s": 4.4}
    metrics = ('{"time_sample": 7.52, "time_old_logprob": 0.8, "time_update": 6.3, "time_step": 15.7, '
               '"rollout_kl": 1e-05}')
    check = tool.Check(train.name, (sys.executable, "-c", f"print({metrics!r})"), train.figures, 60)
    results[train.name] = tool.run_check(check, tmp_path / "train.log")
    assert tool.comparison(results, "unused").splitlines() == [
        "phase        predicted s  measured s  predicted/measured",
        "sampling            1.88        7.52  0.25",
        "pi_old              0.40        0.80  0.50",
        "update              2.10        6.30  0.33",
        "step                4.40       15.70  0.28"]
    del results[plan.name]
    assert tool.comparison(results, "none on a CPU") == "predicted: none on a CPU"


def test_the_full_size_times_the_decode_step_with_xla_gpus_split_k_and_without(tmp_path, monkeypatch):
    """Issue 52: the decode step's 256-row gemms are split 8 ways by XLA:GPU's heuristic (float32 partials: 14.74
    GB compiled with them, 13.23 without, docs/design.md 3.2); the full size runs the short fill's bench again
    with XLA_FLAGS=--xla_gpu_experimental_force_split_k=1 added to the tool's own flags, so a GPU run says which
    is faster."""
    tool = _tool()
    full = {c.name: c for c in tool.checks("full", tmp_path)}
    plain, split = full["decode fill 64"], full["decode fill 64, split_k 1"]
    assert split.argv == plain.argv and plain.env == () and split.env == (tool.SPLIT_K_1,)
    assert not any(c.env for c in tool.checks("tiny", tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    show = tool.Check("flags", (sys.executable, "-c", "import os; print('flags', os.environ['XLA_FLAGS'])"),
                      {"x": r"(\d)"}, 60, env=split.env)
    tool.run_check(show, tmp_path / "flags.log")
    assert "flags --xla_cpu_foo=1 --xla_gpu_experimental_force_split_k=1\n" in (tmp_path / "flags.log").read_text()
