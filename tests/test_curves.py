"""curves.png (training/curves.py), on the figure object: no empty panel for the periodic evaluations
when a run has none, and no line hidden under another (issue 53 item 7): the accuracy of 0/1 rewards
equals their mean, so only the mean is drawn, its legend naming both."""

from __future__ import annotations

from pacs_jax.training.curves import curves_figure

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
