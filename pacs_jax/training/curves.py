"""curves.png of a run: what a researcher reads first, one panel each.

    train reward and accuracy | loss             | grad norm
    response length           | entropy           | rollout consistency (sampler vs pi_old)
    periodic evals' pass@k    | accuracy before / after RL by set | seconds per step by phase

Panels of metrics a run did not log (an objective without a loss of that name) say so instead of
plotting nothing silently; a run without periodic evaluations has no panel for them. A line equal to
another one everywhere (the accuracy of 0/1 rewards is their mean) is not drawn under it: the legend
of the one drawn says so. The response length's mean is the line, the longest response a light band
above it on an axis from 0 (a max at the budget every step would otherwise fill the panel and squash the
mean). PACS's loss panel says why its line is flat (``loss_note``). The accuracy bars show the sampled
accuracy (eval.final) and the greedy one (eval.final.greedy) of each set, before and after RL.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from etils import epath

from pacs_jax.files import atomic_write

if TYPE_CHECKING:
    from pacs_jax.training.spec import AlgorithmSpec

# title -> ([(metric key, label)], log scale) of the line panels over RL steps
LINE_PANELS = {
    "train reward": ([("reward_mean", "mean reward"), ("accuracy", "accuracy (reward 1)")], False),
    "loss": ([("loss", "loss")], False),
    "grad norm": ([("grad_norm", "grad norm (before clipping)")], False),
    "entropy": ([("entropy", "entropy of the responses")], False),
    "rollout consistency": ([("rollout_logprob_diff_mean", "|sampler - pi_old| log-prob, mean"),
                             ("rollout_logprob_diff_max", "max"), ("rollout_kl", "KL")], True),
}
PHASES = (("time_sample", "sampling"), ("time_reward", "reward"), ("time_old_logprob", "pi_old"),
          ("time_update", "update"))


def plot_curves(history: Sequence[Mapping], before: Mapping[str, float], after: Mapping[str, float],
                path: epath.Path, periodic: Mapping[int, Mapping[str, Mapping[str, float]]] | None = None, *,
                greedy: tuple[Mapping[str, float], Mapping[str, float]] = ({}, {}),
                algorithm: AlgorithmSpec | None = None) -> None:
    """``curves_figure`` written to ``path`` as a PNG."""
    import matplotlib.pyplot as plt

    fig = curves_figure(history, before, after, periodic, greedy=greedy, algorithm=algorithm)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=80), binary=True)
    plt.close(fig)


def curves_figure(history: Sequence[Mapping], before: Mapping[str, float], after: Mapping[str, float],
                  periodic: Mapping[int, Mapping[str, Mapping[str, float]]] | None = None, *,
                  greedy: tuple[Mapping[str, float], Mapping[str, float]] = ({}, {}),
                  algorithm: AlgorithmSpec | None = None):
    """The figure of the panels above. history: per-step metrics rows (``step`` and metrics.jsonl's
    keys); before / after: {eval set: accuracy of the samples} (either may be empty); periodic: {step:
    {eval set: {"pass@k": ..., "mean@n": ...}}}, the periodic evaluations (eval/step_<k>/eval_metrics.json;
    none: no panel); greedy: (before, after) {eval set: greedy accuracy} (eval.final.greedy; empty: none);
    algorithm: the run's objective and options (the loss panel's note, ``loss_note``; None: no note)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]

    def line_panel(title: str):
        series, log = LINE_PANELS[title]
        return lambda ax: _lines(ax, title, steps, _series(history, series), log)

    panels = [line_panel("train reward"), lambda ax: _loss(ax, steps, history, algorithm), line_panel("grad norm"),
              lambda ax: _response_length(ax, steps, history), line_panel("entropy"),
              line_panel("rollout consistency")]
    if periodic:
        panels.append(lambda ax: _periodic(ax, periodic))
    panels.append(lambda ax: _before_after(ax, before, after, greedy))
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
        same = next((i for i, (_, drawn) in enumerate(out) if drawn == values and _logged(values)), None)
        if same is None:
            out.append((label, values))
        else:
            out[same] = (f"{out[same][0]} (= {label})", out[same][1])
    return out


def _value(row: Mapping, key: str) -> float:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) else math.nan


def _step_axis(ax, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _logged(values: Sequence[float]) -> bool:
    return any(math.isfinite(v) for v in values)


def _not_logged(ax) -> None:
    ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes)


def _lines(ax, title: str, steps: Sequence[int], series: Sequence[tuple[str, Sequence[float]]], log: bool) -> None:
    """One line per series that has a finite value; a note when none has."""
    _step_axis(ax, title)
    drawn = [(label, values) for label, values in series if _logged(values)]
    if not drawn:
        _not_logged(ax)
        return
    for label, values in drawn:
        if log:
            values = [v if v > 0 else math.nan for v in values]
        ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=label)
    if log and any(v > 0 for _, values in drawn for v in values if math.isfinite(v)):
        ax.set_yscale("log")
    ax.legend(fontsize="small")


def loss_note(algorithm: AlgorithmSpec | None) -> str | None:
    """Why the loss line is flat by design, for PACS with its reward proxy relative to pi_old (reward_method
    "1", the paper's): psi = beta * sum_t log(pi_theta / pi_old) is 0 at each step's start, where pi_old is
    the weights the step starts from, so each step's BCE starts at ln 2 x the mean class weight and its few
    optimizer steps move it little; else None."""
    if algorithm is None or algorithm.objective != "pacs" or algorithm.options.get("reward_method") != "1":
        return None
    return ("PACS: psi = beta * sum log(pi_theta / pi_old) is 0 at each step's start, so each step's loss "
            "starts at ln 2 x the mean class weight (dashed) and moves little: flat by design. Learning shows "
            "in the train reward and the accuracy bars.")


def _loss(ax, steps: Sequence[int], history: Sequence[Mapping], algorithm: AlgorithmSpec | None) -> None:
    """The loss line; with PACS's ratio reward proxy, the loss at psi = 0 (dashed) and ``loss_note``."""
    series, _ = LINE_PANELS["loss"]
    _lines(ax, "loss", steps, _series(history, series), False)
    note = loss_note(algorithm)
    if note is None or not _logged([_value(h, "loss") for h in history]):
        return
    at_zero = [math.log(2.0) * _value(h, "pacs/weight_mean") for h in history]
    if _logged(at_zero):
        ax.plot(steps, at_zero, linestyle="--", color="tab:gray", label="ln 2 x mean class weight (psi = 0)")
        ax.legend(fontsize="small", loc="upper right")
    ax.set_xlabel("RL step\n\n" + textwrap.fill(note, 75), fontsize="small")  # under the panel: no line hidden


def _response_length(ax, steps: Sequence[int], history: Sequence[Mapping]) -> None:
    """The mean response length as the line, up to the longest response as a light band above it, on an
    axis from 0 tokens."""
    _step_axis(ax, "response length")
    mean = [_value(h, "response_length_mean") for h in history]
    longest = [_value(h, "response_length_max") for h in history]
    if not _logged(mean):
        _not_logged(ax)
        return
    ax.plot(steps, mean, marker="." if len(steps) < 30 else None, label="mean")
    if _logged(longest):
        ax.fill_between(steps, mean, longest, color="tab:blue", alpha=0.15, linewidth=0,
                        label="up to the longest response")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("tokens")
    ax.legend(fontsize="small", loc="lower right")


def _periodic(ax, periodic: Mapping[int, Mapping[str, Mapping[str, float]]]) -> None:
    """Each set's pass@1 and its largest pass@k at every periodic evaluation."""
    _step_axis(ax, "periodic evaluations (eval.periodic)")
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


def _before_after(ax, before: Mapping[str, float], after: Mapping[str, float],
                  greedy: tuple[Mapping[str, float], Mapping[str, float]]) -> None:
    """Bars of each set's accuracy before and after RL: the samples' mean reward (eval.final) and, where
    evaluated, the greedy answer's (eval.final.greedy, hatched)."""
    ax.set_title("accuracy before / after RL (eval.final)")
    sampled = "samples' mean reward"
    bars = [bar for bar in ((before, "tab:gray", None, f"before RL, {sampled}"),
                            (greedy[0], "tab:gray", "//", "before RL, greedy"),
                            (after, "tab:green", None, f"after RL, {sampled}"),
                            (greedy[1], "tab:green", "//", "after RL, greedy")) if bar[0]]
    names = sorted({name for values, *_ in bars for name in values})
    if not names:
        ax.text(0.5, 0.5, "no evaluation sets (eval.sets)", ha="center", va="center", transform=ax.transAxes)
        return
    width = 0.8 / len(bars)
    for k, (values, color, hatch, label) in enumerate(bars):
        drawn = ax.bar([i + (k - (len(bars) - 1) / 2) * width for i in range(len(names))],
                       [values.get(n, 0.0) for n in names], width=width, color=color, hatch=hatch,
                       edgecolor="white", label=label)
        ax.bar_label(drawn, fmt="%.3f", fontsize="small")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.legend(fontsize="small")
