"""Compare objectives on the demo task at equal rollout budget, over several seeds.

    python tools/compare_objectives.py --objectives=pacs,grpo,rloo,ppo --seeds=0,1,2 --out=results/compare

Runs ``python -m pacs_jax.train --config=configs/demo_objectives.py:OBJECTIVE --config.seed=SEED`` for
every pair (one after another, or ``--parallel`` at once), each in OUT/runs/OBJECTIVE_sSEED; a pair
whose summary.json exists is not run again, so an interrupted comparison resumes. Then writes
OUT/results.json (every run's summary and train-reward curve), OUT/table.md (mean and spread over
seeds of held-out accuracy before and after RL, and the gain) and OUT/curves.png (train reward per
step, mean over seeds with the min-max band, per objective). ``--train_flags`` go to every run (e.g.
a shorter demo).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pacs_jax.files import atomic_write_text  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objectives", default="pacs,grpo,rloo,ppo", help="comma-separated objectives")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (config.seed: init, warm-start, sampling)")
    parser.add_argument("--out", default="results/compare_objectives", help="output folder")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once")
    parser.add_argument("--train_flags", default="", help="extra flags for every run, space-separated")
    return parser.parse_args(argv)


def _run(objective: str, seed: int, out: pathlib.Path, extra: list[str]) -> dict:
    """Train one (objective, seed) unless its summary exists; returns {summary, curve}."""
    workdir = out / "runs" / f"{objective}_s{seed}"
    summary_file = workdir / "summary.json"
    if not summary_file.is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pacs_jax.train", f"--config=configs/demo_objectives.py:{objective}",
                   f"--config.seed={seed}", f"--workdir={workdir}", *extra]
        with open(workdir / "train.log", "w") as log:
            done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0 or not summary_file.is_file():
            raise RuntimeError(f"{objective} seed {seed} failed (exit {done.returncode}); see {workdir / 'train.log'}")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    curve = {row["step"]: row["reward_mean"] for row in rows}  # a resumed run repeats no step
    return {"summary": json.loads(summary_file.read_text()), "curve": [curve[s] for s in sorted(curve)]}


def _spread(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def table(results: dict[str, dict[int, dict]]) -> str:
    """Markdown table: per objective, held-out accuracy before / after RL and the gain (mean ± std over seeds)."""
    lines = ["| objective | seeds | held-out before RL | held-out after RL | gain | greedy after RL | after RL per seed |",
             "|---|---|---|---|---|---|---|"]
    for objective, runs in results.items():
        seeds = sorted(runs)
        before = [runs[s]["summary"]["accuracy_before_rl"] for s in seeds]
        after = [runs[s]["summary"]["accuracy_after_rl"] for s in seeds]
        greedy = [runs[s]["summary"]["greedy_accuracy_after_rl"] for s in seeds]
        gain = [a - b for a, b in zip(after, before)]
        per_seed = ", ".join(f"{a:.3f}" for a in after)
        lines.append(f"| {objective} | {len(seeds)} | {_spread(before)} | {_spread(after)} | {_spread(gain)} | "
                     f"{_spread(greedy)} | {per_seed} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[int, dict]], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for objective, runs in results.items():
        curves = np.asarray([runs[s]["curve"] for s in sorted(runs)], np.float64)  # [seeds, steps]
        steps = np.arange(1, curves.shape[1] + 1)
        ax.plot(steps, curves.mean(0), label=objective)
        ax.fill_between(steps, curves.min(0), curves.max(0), alpha=0.2)
    ax.set_xlabel("RL step")
    ax.set_ylabel("train reward (mean over seeds; band: min-max)")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str]) -> None:
    args = _parse(argv)
    out = pathlib.Path(args.out).absolute()
    seeds = [int(s) for s in args.seeds.split(",")]
    extra = args.train_flags.split()
    pairs = [(o, s) for o in args.objectives.split(",") for s in seeds]
    with ThreadPoolExecutor(max(args.parallel, 1)) as pool:
        done = list(pool.map(lambda pair: _run(*pair, out, extra), pairs))
    results: dict[str, dict[int, dict]] = {}
    for (objective, seed), run in zip(pairs, done):
        results.setdefault(objective, {})[seed] = run
    atomic_write_text(out / "results.json", json.dumps(results, indent=2))
    text = table(results)
    atomic_write_text(out / "table.md", text)
    plot(results, out / "curves.png")
    print(text)
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'curves.png'}")


if __name__ == "__main__":
    main(sys.argv[1:])
