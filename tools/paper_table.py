"""The paper's Tables 1 and 2 from our runs: pass@k per method and set, beside the published numbers.

    python tools/paper_table.py workdir/qwen25_7b_pacs_beta1 workdir/qwen25_7b_pacs_beta1_noweight \\
        workdir/qwen25_7b_grpo workdir/qwen25_7b_ppo --out=results/table2

Each RUN_DIR is a training workdir (its final evaluation, WORKDIR/eval/final, is the run's row; its
evaluation before RL, WORKDIR/eval/before_rl, the "Base" row) or one evaluation's output folder (the
one holding eval_metrics.json, e.g. the folder `python -m pacs_jax.evaluate` wrote). A row's method
comes from the workdir's config.json (objective "grpo": GRPO, "ppo": PPO, "pacs" as the paper runs
it: PACS, or "PACS w/o weight" with use_weight False; PACS with other options names them, e.g. "PACS
(adv_estimator=grpo)" or "PACS (beta=0.5)", as the published ablation rows do; anything else its objective);
LABEL=RUN_DIR names it instead (e.g. Base=/models/Qwen2.5-7B/eval). The Base row is the first one
given: an explicit Base=..., else the first workdir with an evaluation before RL.

The published numbers (``--published``, default data/paper_results/pacs_2509.02522.json: v1's Tables 1
and 2, v2's Tables 2 and 6-13, with the table and row of each number) are those of ``--model`` (default:
the runs' model.preset: Qwen2.5-3B -> v1 Table 1, Qwen2.5-7B -> v1 Table 2, Qwen3-4B -> v2 Tables 6, 7
and the score-function ablation's 9-13, Qwen3-8B -> v2 Tables 2 and 8). A table may carry its own sets
and k (``k``, ``set_names``: v2 reports k = 1 ... 64 and BeyondAIME), else the file's. Writes OUT/paper_table.md (per
set, as the paper lays it out: rows the methods, columns pass@k for the k the paper reports, each
cell "ours / paper (ours - paper)" in percent), OUT/paper_table.json (the same numbers) and
OUT/pass_at_k.png (pass@k against k per set: ours solid, the paper's dashed).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pacs_jax.files import atomic_write, atomic_write_text  # noqa: E402

DEFAULT_PUBLISHED = REPO / "data" / "paper_results" / "pacs_2509.02522.json"
METRICS_FILE = "eval_metrics.json"
BASE = "Base"
# The paper's order of rows (v2's Tables 9-13 after Tables 2 and 6); methods of ours that it does not report
# come after them.
PAPER_METHODS = (BASE, "PPO", "GRPO", "PACS", "PACS w/o weight", "PACS (adv_estimator=grpo)",
                 "PACS (adv_estimator=drgrpo)")
# configs/paper.py's PACS as the tables run it: the authors' scripts/pacs/pacs_beta_1.0.sh (v2 section 4.1: beta 1)
PAPER_PACS = dict(beta="1.0", weight_mode="question", reward_method="1", adv_estimator="rloo")


class TableError(Exception):
    """A run or data file that cannot be read as this tool needs; the message names the file."""


# ------------------------------------------------------------------------------------------- inputs
def _read_json(path: pathlib.Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TableError(f"{path}: no such file ({what})") from None
    except (OSError, ValueError) as error:
        raise TableError(f"{path}: cannot read {what}: {error}") from None


def read_metrics(folder: pathlib.Path) -> dict[str, dict[int, float]]:
    """{set: {k: pass@k as a fraction}} of one evaluation's eval_metrics.json."""
    path = folder / METRICS_FILE
    raw = _read_json(path, "an evaluation's metrics")
    if not isinstance(raw, dict) or not raw:
        raise TableError(f"{path}: expected {{set: {{'pass@k': value}}}}, got {type(raw).__name__} {str(raw)[:80]}")
    metrics = {}
    for name, values in raw.items():
        if not isinstance(values, dict):
            raise TableError(f"{path}: set {name!r}: expected {{'pass@k': value}}, got {values!r}")
        try:
            metrics[name] = {int(key.split("@", 1)[1]): float(value) for key, value in values.items()
                             if key.startswith("pass@")}
        except (ValueError, TypeError) as error:
            raise TableError(f"{path}: set {name!r}: a pass@k entry is not pass@INTEGER: number ({error})") from None
        if not metrics[name]:
            raise TableError(f"{path}: set {name!r} has no pass@k entry")
    return metrics


def method_of(config: Mapping[str, Any]) -> str:
    """The table's name for a run's algorithm (config.json's ``algorithm``)."""
    algorithm = config.get("algorithm", {})
    objective, options = algorithm.get("objective", "?"), dict(algorithm.get("options", {}))
    if objective in ("grpo", "ppo"):
        return objective.upper()
    if objective != "pacs":
        return objective
    if "beta" in options:
        options["beta"] = float(options["beta"])  # 1 and 1.0 alike
    if all(str(options.get(k, v)) == v for k, v in PAPER_PACS.items()):
        return "PACS" if options.get("use_weight", True) else "PACS w/o weight"
    changed = ", ".join(f"{k}={options[k]}" for k in sorted(PAPER_PACS) if str(options.get(k, PAPER_PACS[k]))
                        != PAPER_PACS[k])
    return f"PACS ({changed}{'' if options.get('use_weight', True) else ', w/o weight'})"


class Row:
    """One row of ours: a method, the evaluation folder it was read from, its metrics and model preset."""

    def __init__(self, method: str, folder: pathlib.Path, preset: str | None):
        self.method, self.folder, self.preset = method, folder, preset
        self.metrics = read_metrics(folder)


def _workdir_config(workdir: pathlib.Path) -> dict | None:
    path = workdir / "config.json"
    return _read_json(path, "the run's config") if path.is_file() else None


def collect_rows(arguments: Sequence[str]) -> list[Row]:
    """Our rows from RUN_DIR arguments ([LABEL=]PATH; see the module docstring), Base first."""
    rows: list[Row] = []
    base: Row | None = None
    base_named = False  # base came from an explicit Base=RUN_DIR
    for argument in arguments:
        label, path_text = (None, argument)
        if "=" in argument and not pathlib.Path(argument).exists():
            label, path_text = argument.split("=", 1)
        path = pathlib.Path(path_text)
        if not path.is_dir():
            raise TableError(f"{path}: no such folder (RUN_DIR: a training workdir or an evaluation's output folder)")
        if (path / METRICS_FILE).is_file():  # one evaluation's folder
            workdir = path.parent.parent if path.parent.name == "eval" else None
            config = _workdir_config(workdir) if workdir else None
            preset = (config or {}).get("model", {}).get("preset") or None
            if label:
                method = label
            elif path.name == "before_rl":
                method = BASE
            elif config is not None:
                method = method_of(config)
            else:
                raise TableError(f"{path}: an evaluation outside a training workdir: name its row, LABEL={path} "
                                 f"(e.g. {BASE}={path})")
            found = [Row(method, path, preset)]
        else:
            config = _workdir_config(path)
            final = path / "eval" / "final"
            if config is None or not (final / METRICS_FILE).is_file():
                raise TableError(f"{path}: neither an evaluation's folder (no {METRICS_FILE}) nor a finished training "
                                 f"workdir (needs config.json and eval/final/{METRICS_FILE})")
            preset = config.get("model", {}).get("preset") or None
            found = [Row(label or method_of(config), final, preset)]
            before = path / "eval" / "before_rl"
            if (before / METRICS_FILE).is_file():
                found.append(Row(BASE, before, preset))
        for row in found:
            if row.method == BASE:  # an explicit Base=... wins; else the first evaluation before RL
                named = label == BASE
                if named and base_named:
                    raise TableError(f"two Base rows given: {base.folder} and {row.folder}")
                if base is None or (named and not base_named):
                    base, base_named = row, named
                continue
            twin = next((r for r in rows if r.method == row.method), None)
            if twin is not None:
                raise TableError(f"two runs are both {row.method!r}: {twin.folder} and {row.folder}; name them "
                                 f"with LABEL=RUN_DIR")
            rows.append(row)
    if base is not None:
        rows.insert(0, base)
    if not rows:
        raise TableError("no runs given")
    return rows



def table_k(published: Mapping[str, Any], model: str) -> dict[str, list[int]]:
    """{set: the k of its columns} of one published table: the table's own "k", else the file's."""
    return published["tables"][model].get("k", published["k"])


def load_published(path: pathlib.Path) -> dict:
    """The published numbers' file (see data/paper_results/), checked for the fields this tool reads."""
    data = _read_json(path, "the published numbers")
    try:
        for model, table in data["tables"].items():
            ks = table_k(data, model)
            for method, row in table["rows"].items():
                for name, values in row.items():
                    if name != "source" and len(values) != len(ks[name]):
                        raise TableError(f"{path}: {model} {method} {name}: {len(values)} numbers for "
                                         f"k = {ks[name]}")
                if "source" not in row:
                    raise TableError(f"{path}: {model} {method}: no 'source' (the table and row it is from)")
    except (KeyError, TypeError, AttributeError) as error:
        raise TableError(f"{path}: expected {{k: {{set: [k...]}}, tables: {{model: {{rows: {{method: {{source, "
                         f"set: [...]}}}}}}}}}}: {error!r}") from None
    return data


def pick_model(rows: Sequence[Row], requested: str | None, published: dict) -> str | None:
    """The published table to compare with: ``requested``, else the runs' preset (None: no published table)."""
    models = published["tables"]
    if requested:
        if requested not in models:
            raise TableError(f"--model={requested!r}: the published numbers have {sorted(models)}")
        return requested
    presets = {r.preset for r in rows if r.preset}
    if len(presets) > 1:
        raise TableError(f"the runs are of several models {sorted(presets)}: compare one model at a time, or pass "
                         f"--model")
    preset = next(iter(presets), None)
    return preset if preset in models else None


# ------------------------------------------------------------------------------------------- table
def build(rows: Sequence[Row], published: dict, model: str | None) -> dict:
    """{"model", "source", "sets": [{"name", "title", "k": [...], "rows": [{"method", "cells": [{"k", "ours",
    "paper", "diff"}], "ours_from", "paper_source"}]}]}; numbers in percent, None where there is none."""
    table = published["tables"][model] if model else {"rows": {}}
    paper_rows = table["rows"]
    paper_k = table_k(published, model) if model else {}
    set_names = {**published["set_names"], **table.get("set_names", {})}
    paper_sets = list(paper_k)
    our_sets = [s for r in rows for s in r.metrics if s not in paper_sets]
    methods = [m for m in PAPER_METHODS if m in paper_rows or any(r.method == m for r in rows)]
    methods += [r.method for r in rows if r.method not in methods]
    by_method = {r.method: r for r in rows}
    sets = []
    for name in paper_sets + list(dict.fromkeys(our_sets)):
        if name in paper_sets:
            ks = list(paper_k[name])
        else:
            ks = sorted({k for r in rows for k in r.metrics.get(name, {})})
        out_rows = []
        for method in methods:
            ours = by_method.get(method)
            paper = paper_rows.get(method, {})
            if ours is None and name not in paper:
                continue
            cells = []
            for i, k in enumerate(ks):
                our_value = ours.metrics.get(name, {}).get(k) if ours else None
                our_value = None if our_value is None else 100.0 * our_value
                paper_value = paper[name][i] if name in paper else None
                diff = None if our_value is None or paper_value is None else our_value - paper_value
                cells.append(dict(k=k, ours=our_value, paper=paper_value, diff=diff))
            out_rows.append(dict(method=method, cells=cells, ours_from=str(ours.folder) if ours and name in ours.metrics else None,
                                 paper_source=paper.get("source") if name in paper else None))
        sets.append(dict(name=name, title=set_names.get(name, name) if model else name, k=ks,
                         rows=out_rows))
    return dict(model=model, source=table.get("source"), sets=sets)


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def cell_text(cell: Mapping[str, Any]) -> str:
    """"ours / paper (ours - paper)", or what of it there is."""
    if cell["paper"] is None:
        return _number(cell["ours"])
    text = f"{_number(cell['ours'])} / {cell['paper']:.2f}"
    return text if cell["diff"] is None else f"{text} ({cell['diff']:+.2f})"


def markdown(result: Mapping[str, Any], published_path: pathlib.Path, rows: Sequence[Row]) -> str:
    if result["model"]:
        lines = [f"# pass@k of our runs against {result['source']}", "",
                 "Each cell: ours / paper (ours - paper), pass@k in percent. Ours: the runs' eval_metrics.json. "
                 f"Paper: {published_path.name}, which names the table and row of every number. '—': not "
                 "evaluated (a set our runs did not evaluate, or k above its samples per problem)."]
    else:
        lines = ["# pass@k of our runs", "",
                 "No published table for these runs' model (pass --model=NAME to compare with one); pass@k in "
                 "percent, '—': k above the set's samples per problem."]
    lines += ["", "Runs:"] + [f"- {r.method}: {r.folder}" for r in rows]
    for s in result["sets"]:
        lines += ["", f"## {s['title']} (pass@k)", "",
                  "| Model | " + " | ".join(f"k={k}" if i == 0 else str(k) for i, k in enumerate(s["k"])) + " |",
                  "|---|" + "---|" * len(s["k"])]
        for row in s["rows"]:
            lines.append(f"| {row['method']} | " + " | ".join(cell_text(c) for c in row["cells"]) + " |")
    return "\n".join(lines) + "\n"


def plot(result: Mapping[str, Any], path: pathlib.Path) -> None:
    """pass@k against k (log2 axis) per set: ours solid with markers, the paper's dashed, one colour per method."""
    import matplotlib  # only when plotting, and then with the file-only backend

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    sets = result["sets"]
    columns = min(len(sets), 2)
    rows = math.ceil(len(sets) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for s in sets for r in s["rows"]))
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    for axis, s in zip(axes.flat, sets):
        for row in s["rows"]:
            for key, style, suffix in (("ours", "-o", ""), ("paper", "--", " (paper)")):
                points = [(c["k"], c[key]) for c in row["cells"] if c[key] is not None]
                if points:
                    axis.plot(*zip(*points), style, color=colours[row["method"]], label=row["method"] + suffix,
                              markersize=4)
        axis.set_xscale("log", base=2)
        axis.set_title(s["title"])
        axis.set_xlabel("k")
        axis.set_ylabel("pass@k (%)")
        axis.set_ylim(0, 100)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(sets):]:
        axis.set_visible(False)
    figure.tight_layout()
    atomic_write(path, lambda f: figure.savefig(f, format="png", dpi=110), binary=True)
    plt.close(figure)


# ------------------------------------------------------------------------------------------- command
def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/paper_table.py", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="[LABEL=]RUN_DIR",
                        help="a training workdir or an evaluation's output folder, optionally named LABEL")
    parser.add_argument("--out", default="paper_table", help="output folder (default: ./paper_table)")
    parser.add_argument("--model", default=None,
                        help="the published table to compare with (Qwen2.5-3B: v1 Table 1, Qwen2.5-7B: v1 Table 2, "
                             "Qwen3-4B: v2 Tables 6, 7, 9-13, Qwen3-8B: v2 Tables 2, 8); default: the runs' "
                             "model.preset")
    parser.add_argument("--published", default=str(DEFAULT_PUBLISHED), help="the published numbers (JSON)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    try:
        rows = collect_rows(args.runs)
        published_path = pathlib.Path(args.published)
        published = load_published(published_path)
        model = pick_model(rows, args.model, published)
        result = build(rows, published, model)
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        text = markdown(result, published_path, rows)
        atomic_write_text(out / "paper_table.md", text)
        atomic_write_text(out / "paper_table.json", json.dumps(result, indent=2))
        plot(result, out / "pass_at_k.png")
    except TableError as error:
        print(f"paper_table.py: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"paper_table.py: error: {error}", file=sys.stderr)
        return 1
    print(text, end="")
    print(f"wrote {out / 'paper_table.md'}, {out / 'paper_table.json'}, {out / 'pass_at_k.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
