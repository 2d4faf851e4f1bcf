"""A run's summary (workdir/summary.json) and the evaluations' figures it and the curves read: the mean
sample reward of each evaluated set and their mean, before and after RL, and the RL time split."""

from __future__ import annotations

import json

from etils import epath


def mean_reward(set_metrics: dict[str, float]) -> tuple[str, float]:
    """A set's mean sample reward: ("mean@N", value), N its own samples per problem."""
    key = next(k for k in set_metrics if k.startswith("mean@"))
    return key, set_metrics[key]


def accuracy(metrics: dict[str, dict[str, float]]) -> float | None:
    """Mean over the evaluated sets of their mean sample reward (mean@N, each set's own N), or None
    without sets."""
    values = [mean_reward(m)[1] for m in metrics.values()]
    return sum(values) / len(values) if values else None


def periodic_evals(workdir: epath.Path) -> dict[int, dict[str, dict[str, float]]]:
    """{step: eval_metrics.json} of the periodic evaluations in workdir/eval/step_<k> (every session's)."""
    out = {}
    for folder in (workdir / "eval").glob("step_*") if (workdir / "eval").exists() else ():
        metrics = folder / "eval_metrics.json"
        if folder.name.removeprefix("step_").isdigit() and metrics.exists():
            out[int(folder.name.removeprefix("step_"))] = json.loads(metrics.read_text())
    return out


def per_set(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each set's mean sample reward (mean@N at its own N)."""
    return {name: mean_reward(m)[1] for name, m in metrics.items()}


def summary(before: dict, after: dict, history: list[dict], accuracy_metric: str) -> dict:
    """accuracy_{before,after}_rl (mean over the eval sets of the mean sample reward at the final
    settings), their greedy counterparts, every set's metrics, the warm-start and the RL time split;
    accuracy_metric: what the accuracies are, in words."""
    phases = ("time_sample", "time_reward", "time_old_logprob", "time_update")
    evaluated = before.get("eval", {})
    summary = {
        "accuracy_before_rl": accuracy(evaluated.get("sampled", {})),
        "accuracy_after_rl": accuracy(after.get("sampled", {})),
        "greedy_accuracy_before_rl": accuracy(evaluated.get("greedy", {})),
        "greedy_accuracy_after_rl": accuracy(after.get("greedy", {})),
        "accuracy_metric": accuracy_metric,
        "eval_before_rl": evaluated,
        "eval_after_rl": after,
        "warmstart": before.get("warmstart"),
        "rl_time_split_seconds": {p: float(sum(h[p] for h in history)) for p in phases} if history else {},
    }
    return summary
