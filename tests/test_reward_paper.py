"""reward.mode = "paper": the PACS authors' math-verify call on the whole response, against
math-verify's own parse / verify with their extraction targets; where it differs from the strict
default; the trainer's reward selection."""

from __future__ import annotations

import json

import pytest
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from pacs_jax import rewards
from pacs_jax.rewards import verdict
from train_helpers import load_config


def authors_verdict(response: str, gold: str) -> float:
    """The reference: verify(parse(\\boxed{gold}, Latex), parse(whole response, (Expr, Latex)))."""
    gold_parsed = parse("\\boxed{" + gold + "}", [LatexExtractionConfig()])
    pred_parsed = parse(response, [ExprExtractionConfig(), LatexExtractionConfig()])
    return float(verify(gold_parsed, pred_parsed))


@pytest.fixture(scope="module")
def cases(shared_data):
    """(response, gold) pairs: MATH-500 answers written right, wrong, unboxed, or only while thinking."""
    golds = [json.loads(line)["answer"] for line in open(shared_data / "math_500" / "test.jsonl")][:60]
    out = []
    for k, gold in enumerate(golds):
        wrong = golds[(k + 7) % len(golds)]
        out += [(f"Step by step... so the final answer is $\\boxed{{{gold}}}$.", gold),
                (f"We get $\\boxed{{{wrong}}}$.", gold),
                (f"<think>Maybe {gold}? Let me check: yes, $\\boxed{{{gold}}}$.</think> The answer is \\boxed{{{wrong}}}.",
                 gold),
                (f"Adding them up gives {gold}", gold)]
    return out


def test_paper_mode_is_the_authors_call(cases):
    got = [rewards.judge_paper(response, gold) for response, gold in cases]
    want = [authors_verdict(response, gold) for response, gold in cases]
    assert [v.score for v in got] == want
    assert 0.3 < sum(want) / len(want) < 0.9  # both verdicts occur
    assert all(v.status in (verdict.OK, verdict.NO_ANSWER) for v in got)


def test_paper_mode_reads_the_whole_response_unlike_strict():
    thought = "<think>It is $\\boxed{12}$.</think>"  # an answer only while thinking
    assert rewards.judge_paper(thought, "12") == rewards.Verdict(1.0, verdict.OK)
    assert rewards.judge_math(thought, "12") == rewards.Verdict(0.0, verdict.NO_ANSWER)  # strict: after </think>
    assert rewards.judge_paper("no number here", "12") == rewards.Verdict(0.0, verdict.NO_ANSWER)
    assert rewards.judge_paper("\\boxed{3}", "\\frac{").score == 0.0  # an unparseable gold scores 0, never raises


def test_trainer_scores_with_the_mode():
    assert rewards.reward_for("math", "strict") == "math" and rewards.reward_for("gsm8k", "strict") == "gsm8k"
    assert rewards.reward_for("math", "paper") == "paper" == rewards.reward_for("gsm8k", "paper")
    with pytest.raises(ValueError, match="reward.mode='lenient'"):
        rewards.reward_for("math", "lenient")
    with rewards.RewardPool(num_workers=1) as pool:
        scored = pool.score(["<think>\\boxed{12}</think>"] * 2, ["12", "12"], ["paper", "math"])
    assert scored.scores.tolist() == [1.0, 0.0]
    paper = load_config("paper.py", "qwen3_4b,grpo").reward
    assert (paper.mode, paper.item_timeout) == ("paper", 15.0)  # math-verify's own 5 s limits expire first
    assert load_config("default.py").reward.mode == "strict"
