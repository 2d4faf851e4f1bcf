"""The plan tables of docs/plan_tables.md, made from the plan tools' own output (never typed by hand).

    python tools/plan_tables.py            # docs/plan_tables.md's two tables from the outputs kept in docs/plans/
    python tools/plan_tables.py --run      # first run the tools on every paper config (libtpu, no TPU needed;
                                           # about an hour on a 2-core CPU), keeping their outputs in docs/plans/
    python tools/plan_tables.py --check    # exit 1 naming the page's table that is not the outputs' (no writing)

``docs/plans/<tool>/<config>.txt`` is the stdout of ``python tools/<tool>.py --config=configs/paper.py:<config>,pacs_beta1
--topology=<slice>`` (tools/plan_memory.py, tools/plan_step.py) verbatim, after one header line starting with "# " that
names the command, the commit it ran at, the date and its wall time. The tables are rendered from those files alone,
so each number in them is a number the tool printed (a row without a kept output is left out, and named under
its table with the command that adds it): the memory table from plan_memory's per-program table (each
program's total: XLA's peak plus the state resident outside it, and the peak in brackets) and its last line, the
step table from plan_step's phase table, its "step:" and "run:" lines and its carry-over and one-step-off lines
(issue 50; "-" in a row whose kept output predates them). In docs/plan_tables.md each table sits between
``<!-- plan_memory table -->`` / ``<!-- plan_step table -->`` and ``<!-- end of table -->``;
tests/test_plan_tables.py checks that the page's tables are these files' (and that the stored qwen3_4b pi_old is
what plan_memory prints today). After a change that moves a plan, ``--run`` and commit docs/plans/ and
docs/plan_tables.md.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import re
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
PLANS = REPO / "docs" / "plans"
PAGE = REPO / "docs" / "plan_tables.md"
TOOLS = ("plan_memory", "plan_step")
# The tables' rows: a paper config (configs/paper.py, with pacs_beta1) and the slice it is planned for.
ROWS = (("qwen25_3b", "v5p-64"), ("qwen25_7b", "v5p-64"), ("qwen3_4b", "v5p-64"), ("qwen3_8b", "v5p-64"),
        ("qwen25_7b_v6e", "v6e-64"))
ALGORITHM = "pacs_beta1"
END = "<!-- end of table -->"


class OutputError(ValueError):
    """A stored output lacks a line the table needs (a tool's output changed shape, or a run failed)."""


def command(tool: str, config: str, topology: str) -> list[str]:
    return [sys.executable, f"tools/{tool}.py", f"--config=configs/paper.py:{config},{ALGORITHM}",
            f"--topology={topology}"]


def output_file(tool: str, config: str) -> pathlib.Path:
    return PLANS / tool / f"{config}.txt"


def run_tools(tools: tuple[str, ...] = TOOLS, configs: tuple[str, ...] | None = None) -> None:
    """Run each tool on each row (one at a time: a compile takes the CPU) and keep its stdout."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "pacs_jax", "tools", "configs"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    for tool in tools:
        for config, topology in ROWS:
            if configs and config not in configs:
                continue
            args = command(tool, config, topology)
            print(f"[plan_tables] {' '.join(args[1:])} ...", flush=True)
            start = time.time()
            done = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"plan_tables: error: {' '.join(args[1:])} exited with status {done.returncode}:\n"
                         + done.stderr[-3000:])
            seconds = time.time() - start
            header = (f"# python {' '.join(args[1:])} (commit {commit}{' + changes' if dirty else ''}, "
                      f"{datetime.date.today().isoformat()}, {seconds:.0f} s)\n")
            output_file(tool, config).parent.mkdir(parents=True, exist_ok=True)
            output_file(tool, config).write_text(header + done.stdout)
            print(f"[plan_tables]   {seconds:.0f} s", flush=True)


def _read(tool: str, config: str) -> tuple[str, str]:
    """(header, the tool's stdout) of a stored output."""
    path = output_file(tool, config)
    if not path.is_file():
        raise OutputError(f"{path}: missing; run python tools/plan_tables.py --run")
    header, _, text = path.read_text().partition("\n")
    if not header.startswith("# "):
        raise OutputError(f"{path}: its first line is not the '# COMMAND (...)' header")
    return header, text


def _search(pattern: str, text: str, path: pathlib.Path, what: str) -> re.Match:
    match = re.search(pattern, text, re.M)
    if match is None:
        raise OutputError(f"{path}: no {what} (pattern {pattern!r})")
    return match


def _required(rows: dict, names: tuple[str, ...], path: pathlib.Path, table: str) -> list:
    """The rows ``names`` of a parsed table, in that order; a missing one is an OutputError naming it."""
    missing = [name for name in names if name not in rows]
    if missing:
        raise OutputError(f"{path}: no {missing[0]} row in the {table}")
    return [rows[name] for name in names]


def memory_programs(text: str, path: pathlib.Path) -> dict[str, dict[str, str]]:
    """plan_memory's per-program table: {program: {column: value as printed}}."""
    head = _search(r"^program\s+args\s+.*$", text, path, "per-program table")
    columns = head.group(0).split()[1:]  # args output alias temp peak +outside total "of HBM" "compile s"
    rows = {}
    for line in text[head.end():].lstrip("\n").splitlines():
        fields = line.split()
        if not fields or line.startswith(("(", " ")):
            break
        rows[fields[0]] = dict(zip(("args", "output", "alias", "temp", "peak", "outside", "total", "of_hbm",
                                    "compile_s"), fields[1:]))
    if len(columns) < 7 or not rows:
        raise OutputError(f"{path}: the per-program table has no rows")
    return rows


def memory_row(config: str, topology: str) -> str:
    header, text = _read("plan_memory", config)
    path = output_file("plan_memory", config)
    mesh = _search(r"mesh \{'data': (\d+), 'fsdp': (\d+), 'tensor': (\d+)\}", text, path, "mesh")
    slots = _search(r"in (\d+) decode slots(?: \(narrowing to (\d+)\))?", text, path, "sampler slots")
    peak = _search(r"^peak per device: ([\d.]+) GiB of ([\d.]+) GiB \((fits|does not fit)\)$", text, path,
                   "'peak per device' line")
    programs = memory_programs(text, path)
    cells = [f"{p['total']} ({p['peak']})"
             for p in _required(programs, ("sampler", "pi_old", "update"), path, "per-program table")]
    narrowing = f" → {slots.group(2)}" if slots.group(2) else ""
    return (f"| `{config}` | {topology} | ({', '.join(mesh.groups())}) | {slots.group(1)}{narrowing} | "
            + " | ".join(cells) + f" | {peak.group(1)} of {peak.group(2)} GiB: {peak.group(3)} |")


MEMORY_HEAD = ("| config | slice | mesh (data, fsdp, tensor) | slots | sampler GiB | pi_old GiB | update GiB | peak of HBM |\n"
               "|---|---|---|---|---|---|---|---|")


def step_phases(text: str, path: pathlib.Path) -> dict[str, tuple[str, str, str]]:
    """plan_step's phase table: {phase: (bound, seconds, ratio) as printed}."""
    head = _search(r"^phase\s+GFLOP\s+.*$", text, path, "phase table")
    phases = {}
    for line in text[head.end():].lstrip("\n").splitlines():
        match = re.match(r"^(\S+)\s+(?:[\d.-]+\s+){8}(\S+)\s+([\d.]+)\s*(?:([\d.]+)\s\S.*)?$", line)
        if match is None:
            break
        name, bound, seconds, ratio = match.groups()
        phases[name] = (bound, seconds, ratio or "-")
    if not phases:
        raise OutputError(f"{path}: the phase table has no rows")
    return phases


def step_row(config: str, topology: str) -> str:
    header, text = _read("plan_step", config)
    path = output_file("plan_step", config)
    step = _search(r"^step: ([\d.]+) s predicted .*: ratio ([\d.]+)$", text, path, "'step:' line")
    run = _search(r"^run: (\d+) steps, ([\d.]+) h, (\d+) chip-hours on ", text, path, "'run:' line")
    seconds = _search(r"\((?:[^,]*), (?:[^,]*), (\d+) s\)$", header, path, "wall time in the header")
    phases = step_phases(text, path)
    cells = [f"{bound}, {phase_seconds} s, {ratio}"
             for bound, phase_seconds, ratio in _required(phases, ("decode", "pi_old", "update"), path, "phase table")]
    # issue 50's lines (outputs kept before them have none: "-")
    carry = re.search(r"^with carry-over \(rollout.carry_over, max_staleness (\d+);.*, ([\d.]+%) of decoded tokens "
                      r"dropped as stale: decode [\d.]+ s, prefill x\d+ [\d.]+ s, step ([\d.]+) s predicted", text, re.M)
    split = re.search(r"^one step off .*: best mesh.rollout_devices=(\d+) of \d+: step ([\d.]+) s", text, re.M)
    cells.append(f"{carry.group(3)} s ({carry.group(2)} dropped at max_staleness {carry.group(1)})" if carry else "-")
    cells.append(f"{split.group(2)} s ({split.group(1)} chips sample)" if split else "-")
    return (f"| `{config}` | {topology} | {step.group(1)} s | {run.group(2)} h | {run.group(3)} | "
            + " | ".join(cells) + f" | {step.group(2)} | {int(seconds.group(1)) / 60:.1f} min |")


def kept(tool: str) -> list[tuple[str, str]]:
    """The rows of ``ROWS`` whose output ``tool`` has kept in docs/plans/."""
    return [(c, t) for c, t in ROWS if output_file(tool, c).is_file()]


def _missing(tool: str) -> list[str]:
    """The table's last line when some rows have no output kept: which, and the command that adds them."""
    missing = [c for c, _ in ROWS if not output_file(tool, c).is_file()]
    if not missing:
        return []
    return ["", f"Not planned yet: {', '.join(f'`{c}`' for c in missing)} (`python tools/plan_tables.py --run "
                f"--tools={tool} --configs={','.join(missing)}` adds their rows)."]


def step_head() -> str:
    steps = {re.search(r"^run: (\d+) steps", _read("plan_step", c)[1], re.M).group(1) for c, _ in kept("plan_step")}
    runs = f"{steps.pop()} steps" if len(steps) == 1 else "run"
    return (f"| config | slice | step | {runs} | chip-hours | decode (bound, s, bytes ratio) | pi_old (bound, s, FLOPs "
            "ratio) | update (bound, s, FLOPs ratio) | step with carry-over | one step off, best split | step ratio | "
            "tool's time here |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")


def tables() -> dict[str, str]:
    """{tool: the page's markdown table of its stored outputs}."""
    commits = sorted({re.search(r"\(commit ([^,]+),", _read(t, c)[0]).group(1) for t in TOOLS for c, _ in kept(t)})
    source = (f"<!-- generated by tools/plan_tables.py from docs/plans/{{tool}}/ (commit {', '.join(commits)}): "
              "edit those, not this table -->")
    return {
        "plan_memory": "\n".join([source.format(tool="plan_memory"), MEMORY_HEAD,
                                  *(memory_row(c, t) for c, t in kept("plan_memory")), *_missing("plan_memory")]),
        "plan_step": "\n".join([source.format(tool="plan_step"), step_head(),
                                *(step_row(c, t) for c, t in kept("plan_step")), *_missing("plan_step")]),
    }


def page_tables(text: str) -> dict[str, str]:
    """{tool: the table between its markers in the page's ``text``}."""
    out = {}
    for tool in TOOLS:
        start = f"<!-- {tool} table -->\n"
        if text.count(start) != 1:
            raise OutputError(f"{PAGE}: expected one '{start.strip()}' marker, found {text.count(start)}")
        begin = text.index(start) + len(start)
        end = text.find(f"\n{END}", begin)
        if end < 0:
            raise OutputError(f"{PAGE}: no '{END}' after '{start.strip()}'")
        out[tool] = text[begin:end]
    return out


def with_tables(text: str, new: dict[str, str]) -> str:
    for tool, table in new.items():
        start = f"<!-- {tool} table -->\n"
        begin = text.index(start) + len(start)
        end = text.find(f"\n{END}", begin)
        text = text[:begin] + table + text[end:]
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true", help="run the tools first (about an hour on a 2-core CPU)")
    parser.add_argument("--configs", default="", help="with --run: only these configs (comma-separated)")
    parser.add_argument("--tools", default=",".join(TOOLS), help="with --run: only these tools (comma-separated)")
    parser.add_argument("--check", action="store_true", help="compare only: exit 1 if the page differs")
    args = parser.parse_args(argv)
    if args.run:
        run_tools(tuple(t for t in args.tools.split(",") if t), tuple(c for c in args.configs.split(",") if c) or None)
    try:
        new = tables()
        text = PAGE.read_text()
        current = page_tables(text)
    except OutputError as e:
        print(f"plan_tables: error: {e}", file=sys.stderr)
        return 78
    differ = [tool for tool in TOOLS if current[tool] != new[tool]]
    if args.check:
        for tool in differ:
            print(f"plan_tables: docs/plan_tables.md's {tool} table is not docs/plans/{tool}/'s: run "
                  "python tools/plan_tables.py", file=sys.stderr)
        return 1 if differ else 0
    if differ:
        PAGE.write_text(with_tables(text, new))
    print(f"plan_tables: docs/plan_tables.md: {', '.join(differ) or 'no'} table{'s' if len(differ) != 1 else ''} "
          f"rewritten", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
