"""curves.png of a run: what a researcher reads first, one panel each.

    train reward and accuracy | loss             | grad norm
    response length           | entropy           | rollout consistency (sampler vs pi_old)
    periodic evals' pass@k    | accuracy before / after RL by set | seconds per step by phase

Panels of metrics a run did not log (an objective without a loss of that name) say so instead of
plotting nothing silently; a run without periodic evaluations has no panel for them. A line equal to
another one everywhere (the accuracy of 0/1 rewards is their mean) is not drawn under it: the legend
of the one drawn says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from etils import epath

from pacs_jax.files import atomic_write

# (title, [(metric key, label)], log scale) of the line panels over RL steps
LINE_PANELS = (
    ("train reward", [("reward_mean", "mean reward"), ("accuracy", "accuracy (reward 1)")], False),
    ("loss", [("loss", "loss")], False),
    ("grad norm", [("grad_norm", "grad norm (before clipping)")], False),
    ("response length", [("response_length_mean", "mean"), ("response_length_max", "max")], False),
    ("entropy", [("entropy", "entropy of the responses")], False),
    ("rollout consistency", [("rollout_logprob_diff_mean", "|sampler - pi_old| log-prob, mean"),
                             ("rollout_logprob_diff_max", "max"), ("rollout_kl", "KL")], True),
)
PHASES = (("time_sample", "sampling"), ("time_reward", "reward"), ("time_old_logprob", "pi_old"),
          ("time_update", "update"))


def plot_curves(history: Sequence[Mapping], before: Mapping[str, float], after: Mapping[str, float],
                path: epath.Path, periodic: Mapping[int, Mapping[str, Mapping[str, float]]] | None = None) -> None:
    """``curves_figure`` written to ``path`` as a PNG."""
    import matplotlib.pyplot as plt

    fig = curves_figure(history, before, after, periodic)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=80), binary=True)
    plt.close(fig)


def curves_figure(history: Sequence[Mapping], before: Mapping[str, float], after: Mapping[str, float],
                  periodic: Mapping[int, Mapping[str, Mapping[str, float]]] | None = None):
    """The figure of the panels above. history: per-step metrics rows (``step`` and metrics.jsonl's
    keys); before / after: {eval set: accuracy} (either may be empty); periodic: {step: {eval set:
    {"pass@k": ..., "mean@n": ...}}}, the periodic evaluations (eval/step_<k>/eval_metrics.json; none:
    no panel)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    panels = [lambda ax, t=title, s=series, log=log: _lines(ax, t, steps, _series(history, s), log)
              for title, series, log in LINE_PANELS]
    if periodic:
        panels.append(lambda ax: _periodic(ax, periodic))
    panels.append(lambda ax: _before_after(ax, before, after))
    panels.append(lambda ax: _lines(ax, "seconds per step", steps, _series(history, PHASES), False))
    rows = math.ceil(len(panels) / 3)
    fig, axes = plt.subplots(rows, 3, figsize=(16, 4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        fig.delaxes(ax)
    for draw, ax in zip(panels, axes.flat):
        draw(ax)
    fig.tight_layout()
    return fig


def _series(history: Sequence[Mapping], series: Sequence[tuple[str, str]]) -> list[tuple[str, list[float]]]:
    """(label, values) of each (metric key, label); a series equal to an earlier one at every step is
    left out, the earlier one's label then naming it ("mean reward (= accuracy)")."""
    out: list[tuple[str, list[float]]] = []
    for key, label in series:
        values = [_value(h, key) for h in history]
        same = next((i for i, (_, drawn) in enumerate(out) if drawn == values and
                     any(math.isfinite(v) for v in values)), None)
        if same is None:
            out.append((label, values))
        else:
            out[same] = (f"{out[same][0]} (= {label})", out[same][1])
    return out


def _value(row: Mapping, key: str) -> float:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) else math.nan


def _lines(ax, title: str, steps: Sequence[int], series: Sequence[tuple[str, Sequence[float]]], log: bool) -> None:
    """One line per series that has a finite value; a note when none has."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    drawn = [(label, values) for label, values in series if any(math.isfinite(v) for v in values)]
    if not drawn:
        ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes)
        return
    for label, values in drawn:
        if log:
            values = [v if v > 0 else math.nan for v in values]
        ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=label)
    if log and any(v > 0 for _, values in drawn for v in values if math.isfinite(v)):
        ax.set_yscale("log")
    ax.legend(fontsize="small")


def _periodic(ax, periodic: Mapping[int, Mapping[str, Mapping[str, float]]]) -> None:
    """Each set's pass@1 and its largest pass@k at every periodic evaluation."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title("periodic evaluations (eval.periodic)")
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    steps = sorted(periodic)
    sets = sorted({name for metrics in periodic.values() for name in metrics})
    for name in sets:
        ks = sorted({int(key.split("@")[1]) for step in steps for key in periodic[step].get(name, {})
                     if key.startswith("pass@")})
        for k in dict.fromkeys((ks[0], ks[-1])) if ks else ():
            ax.plot(steps, [periodic[s].get(name, {}).get(f"pass@{k}", math.nan) for s in steps], marker="o",
                    label=f"{name} pass@{k}")
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")


def _before_after(ax, before: Mapping[str, float], after: Mapping[str, float]) -> None:
    """Bars of each set's accuracy (mean reward of the samples) before and after RL."""
    ax.set_title("accuracy before / after RL (eval.final)")
    names = sorted(set(before) | set(after))
    if not names:
        ax.text(0.5, 0.5, "no evaluation sets (eval.sets)", ha="center", va="center", transform=ax.transAxes)
        return
    x = range(len(names))
    for values, shift, color, label in ((before, -0.2, "tab:gray", "before RL"), (after, 0.2, "tab:green", "after RL")):
        if values:
            bars = ax.bar([i + shift for i in x], [values.get(n, 0.0) for n in names], width=0.4, color=color,
                          label=label)
            ax.bar_label(bars, fmt="%.3f", fontsize="small")
    ax.set_xticks(list(x), names)
    ax.set_ylim(0, 1)
    ax.set_ylabel("mean reward of the samples")
    ax.legend(fontsize="small")
