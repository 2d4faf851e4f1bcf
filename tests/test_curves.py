"""curves.png (training/curves.py), on the figure object: no empty panel for the periodic evaluations
when a run has none, and no line hidden under another (issue 53 item 7): the accuracy of 0/1 rewards
equals their mean, so only the mean is drawn, its legend naming both. Issue 67 item 7: the longest
response is a band over the mean's line on an axis from 0, not a line that fills the panel; PACS's flat
loss says why it is flat; the accuracy bars include the greedy evaluation."""

from __future__ import annotations

import math

from matplotlib.collections import PolyCollection

from pacs_jax.training.curves import curves_figure
from pacs_jax.training.spec import AlgorithmSpec
from train_helpers import load_config

HISTORY = [{"step": s, "reward_mean": r, "accuracy": r, "loss": 0.5 / s, "time_sample": 1.0} for s, r in
           ((1, 0.25), (2, 0.5), (3, 0.75))]


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes]


def test_no_periodic_panel_without_periodic_evaluations_and_no_line_hidden_under_another():
    fig = curves_figure(HISTORY, {"held_out": 0.2}, {"held_out": 0.6}, periodic={})
    assert len(fig.axes) == 8 and "periodic evaluations (eval.periodic)" not in _titles(fig)
    reward = fig.axes[_titles(fig).index("train reward")]
    assert [line.get_label() for line in reward.get_lines()] == ["mean reward (= accuracy (reward 1))"]


def test_the_periodic_panel_and_both_reward_lines_when_they_differ():
    history = [dict(row, reward_mean=row["reward_mean"] / 2) for row in HISTORY]  # partial credit: they differ
    periodic = {2: {"held_out": {"pass@1": 0.3, "pass@4": 0.5, "mean@4": 0.3}}}
    fig = curves_figure(history, {}, {"held_out": 0.6}, periodic=periodic)
    assert len(fig.axes) == 9 and "periodic evaluations (eval.periodic)" in _titles(fig)
    reward = fig.axes[_titles(fig).index("train reward")]
    assert [line.get_label() for line in reward.get_lines()] == ["mean reward", "accuracy (reward 1)"]


def _algorithm(objective: str) -> AlgorithmSpec:
    section = load_config("default.py").algorithm  # the demo's PACS, reward_method "1"
    section.objective = objective
    return AlgorithmSpec.from_config(section)


def _panel(fig, title: str):
    return fig.axes[_titles(fig).index(title)]


def test_the_longest_response_is_a_band_over_the_mean_on_an_axis_from_zero():
    """A max at the budget every step (12) beside a mean near 6: the mean is the one line, the max the
    top of a light band, and the axis starts at 0 tokens."""
    history = [dict(row, response_length_mean=6.0 + row["step"] / 10, response_length_max=12.0) for row in HISTORY]
    length = _panel(curves_figure(history, {}, {}), "response length")
    assert [line.get_label() for line in length.get_lines()] == ["mean"]
    (band,) = [c for c in length.collections if isinstance(c, PolyCollection)]
    assert band.get_label() == "up to the longest response"
    assert max(y for path in band.get_paths() for _, y in path.vertices) == 12.0
    assert length.get_ylim()[0] == 0


def test_pacs_s_loss_says_why_it_is_flat_and_other_objectives_do_not():
    """PACS (reward proxy relative to pi_old): a dashed line at ln 2 x the mean class weight, the loss at
    psi = 0 where each step starts, and a note under the panel; GRPO's loss panel has neither."""
    history = [dict(row, **{"pacs/weight_mean": 1.0}) for row in HISTORY]
    loss = _panel(curves_figure(history, {}, {}, algorithm=_algorithm("pacs")), "loss")
    dashed = [line for line in loss.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and all(math.isclose(y, math.log(2.0)) for y in dashed[0].get_ydata())
    assert "flat by design" in loss.get_xlabel() and "pi_old" in loss.get_xlabel()
    grpo = _panel(curves_figure(history, {}, {}, algorithm=_algorithm("grpo")), "loss")
    assert grpo.get_xlabel() == "RL step" and [line.get_label() for line in grpo.get_lines()] == ["loss"]


def test_the_accuracy_bars_include_the_greedy_evaluation_before_and_after_rl():
    fig = curves_figure(HISTORY, {"amc23": 0.2, "math_500": 0.3}, {"amc23": 0.4, "math_500": 0.5},
                        greedy=({"amc23": 0.25, "math_500": 0.35}, {"amc23": 0.45, "math_500": 0.55}))
    bars = _panel(fig, "accuracy before / after RL (eval.final)")
    labels = [container.get_label() for container in bars.containers]
    assert labels == ["before RL, samples' mean reward", "before RL, greedy", "after RL, samples' mean reward",
                      "after RL, greedy"]
    heights = {label: [round(bar.get_height(), 3) for bar in container]
               for label, container in zip(labels, bars.containers)}
    assert heights["before RL, greedy"] == [0.25, 0.35] and heights["after RL, greedy"] == [0.45, 0.55]
