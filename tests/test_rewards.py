"""Math and GSM8K rewards on hand-written equivalences, the real datasets' answers and math-verify's own
verdicts where ours must differ from them."""

from __future__ import annotations

import json
import re

import pytest
from math_verify import parse, verify

from pacs_jax import rewards
from pacs_jax.data.arithmetic import make_problems
from pacs_jax.rewards import math as math_reward_module
from pacs_jax.rewards import verdict
from pacs_jax.rewards.math import MAX_NESTING, nesting_depth
from pacs_jax.rewards.verdict import answer_region

_INTEGER = re.compile(r"-?\d+")
_FRACTION = re.compile(r"\\frac\{(-?\d+)\}\{(\d+)\}")


def _math_verify_verdict(response: str, gold: str) -> float:
    """The reference: math-verify's own verdict on the gold answer wrapped as \\boxed{gold}."""
    return float(verify(parse("\\boxed{" + gold + "}"), parse(response)))


def _category(gold: str) -> str:
    if _INTEGER.fullmatch(gold):
        return "integer"
    if _FRACTION.fullmatch(gold):
        return "fraction"
    if re.fullmatch(r"[\[(].*,.*[\])]", gold):
        return "interval"
    if "\\text" in gold:
        return "text"
    inner = gold[2:-2] if gold.startswith("\\{") and gold.endswith("\\}") else gold
    if re.fullmatch(r"[^()\[\]{}!]*,[^()\[\]{}!]*", inner) and not re.fullmatch(r"\d{1,3}(,\d{3})+", inner):
        return "set"
    return "expression"


def _rewrite(gold: str, category: str) -> str:
    """An equivalent way to write ``gold``: decimal for a fraction, \\dfrac, spacing, units, reordering."""
    if category == "integer":
        return f"{gold}\\text{{ units}}"
    if category == "fraction":
        numerator, denominator = map(int, _FRACTION.fullmatch(gold).groups())
        return f"{numerator / denominator:.9f}"
    if category == "interval":
        return "\\left" + gold[0] + " " + gold[1:-1].replace(",", " , ") + " \\right" + gold[-1]
    if category == "set":  # "a, b" or "\\{a, b\\}": the same elements in reverse order
        braced = gold.startswith("\\{")
        elements = ", ".join(reversed([part.strip() for part in (gold[2:-2] if braced else gold).split(",")]))
        return "\\{" + elements + "\\}" if braced else elements
    if category == "text":
        without = re.sub(r"\\text\{[A-Za-z ]*\}", "", gold).strip()  # drop units ...
        return without if without not in ("", gold) else re.sub(r"\\text\{([^{}]*)\}", r"\1", gold)  # ... or unwrap
    if "\\frac" in gold:
        return gold.replace("\\frac", "\\dfrac")
    spaced = re.sub(r"\s*([+\-=])\s*", r" \1 ", gold).replace("{", " {").strip()
    return spaced if spaced != gold else f"\\; {gold} \\;"


def _wrong(gold: str, category: str, other: str) -> str:
    if category == "integer":
        return str(int(gold) + 1)
    return other if other != gold else gold + "+1"


@pytest.fixture(scope="module")
def golds(shared_data) -> list[str]:
    """About 230 real gold answers: up to 25 of each kind from MATH (MATH-500, then the DeepScaleR MATH
    subset), plus AIME 2024/2025 and AMC23."""
    math = [json.loads(line)["answer"] for line in open(shared_data / "math_500" / "test.jsonl")]
    math += [row["answer"] for row in json.load(open(shared_data / "deepscaler_subset" / "math.json")) if row["answer"]]
    picked, per_category = [], {}
    for gold in math:
        category = _category(gold)
        if per_category.get(category, 0) < 25:
            per_category[category] = per_category.get(category, 0) + 1
            picked.append(gold)
    for name in ("aime_2024", "aime_2025", "amc23"):
        picked += [str(int(float(json.loads(line)["answer"]))) for line in open(shared_data / name / "test.jsonl")]
    return picked


# (the response's boxed answer, the gold answer, whether they are equal as mathematics), written by hand
EQUIVALENCES = [
    ("\\frac{1}{2}", "0.5", True), ("\\dfrac{3}{4}", "\\frac34", True), ("0.75", "\\frac{3}{4}", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True), ("\\sqrt{12}", "2\\sqrt{3}", True), ("(x+1)^2", "x^2+2x+1", True),
    ("x^2+2x+1", "(x+1)^2", True), ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}", True), ("2^{10}", "1024", True),
    ("10\\%", "10", True), ("\\$18", "18", True), ("1{,}000", "1000", True), ("-\\frac{1}{2}", "-0.5", True),
    ("\\frac{-1}{2}", "-\\frac{1}{2}", True), ("3\\pi", "3 \\pi", True), ("\\pi/2", "\\frac{\\pi}{2}", True),
    ("(1, 2)", "(1,2)", True), ("[0, 1)", "[0,1)", True), ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}", True),
    ("x = 5", "5", True), ("y=2x+3", "y = 3 + 2x", True), ("e^{i\\pi}", "-1", True), ("\\log_2 8", "3", True),
    ("\\binom{5}{2}", "10", True), ("5!", "120", True), ("\\frac{6}{4}", "\\frac{3}{2}", True),
    ("1.5", "\\frac32", True), ("\\infty", "\\infty", True), ("(-\\infty, 2]", "(-\\infty,2]", True),
    ("4\\sqrt{2}", "\\sqrt{32}", True),
    ("\\frac{1}{2}", "0.51", False), ("\\sqrt{8}", "3", False), ("(x+1)^2", "x^2+1", False), ("2^{10}", "1000", False),
    ("(1, 2)", "[1, 2]", False), ("\\{1, 2\\}", "\\{1, 2, 3\\}", False), ("-5", "5", False), ("\\pi", "3.14", False),
    ("\\frac{3}{4}", "\\frac{4}{3}", False), ("x = 4", "5", False), ("10", "100", False), ("0", "1", False),
    ("\\sqrt{2}", "1.41", False), ("2x+3", "2x+4", False), ("[0, 1)", "[0, 1]", False),
]
# Where the verifier and mathematics part: math-verify does not evaluate complex exponentials.
KNOWN_MISSES = {("e^{i\\pi}", "-1")}


def test_math_reward_on_hand_written_equivalences():
    wrong = {(answer, gold) for answer, gold, equal in EQUIVALENCES
             if rewards.math_reward(f"The answer is $\\boxed{{{answer}}}$.", gold) != float(equal)}
    assert wrong == KNOWN_MISSES


def test_math_reward_on_real_answers_rewritten(golds):
    """Each real gold answer, written as itself, rewritten in an equivalent form, and made wrong: the
    labels come from the construction, not from running a verifier."""
    pairs = []  # (kind, response, gold)
    for i, gold in enumerate(golds):
        category = _category(gold)
        pairs.append(("correct", f"Let me work through it.\nTherefore, the final answer is $\\boxed{{{gold}}}$.", gold))
        pairs.append(("rewrite", f"So we get $\\boxed{{{_rewrite(gold, category)}}}$.", gold))
        wrong = _wrong(gold, category, golds[(i + 7) % len(golds)])
        pairs.append(("wrong", f"I conclude the answer is $\\boxed{{{wrong}}}$.", gold))
    ours = [rewards.math_reward(response, gold) for _, response, gold in pairs]

    assert len(pairs) >= 300
    by_kind = {kind: [o for (k, _, _), o in zip(pairs, ours) if k == kind] for kind in ("correct", "rewrite", "wrong")}
    assert sum(by_kind["correct"]) >= 0.97 * len(by_kind["correct"])
    assert sum(by_kind["rewrite"]) >= 0.85 * len(by_kind["rewrite"])
    assert sum(by_kind["wrong"]) <= 0.03 * len(by_kind["wrong"])


def test_boxed_integers_are_compared_without_parsing(monkeypatch):
    """A response that is just \\boxed{integer} against an integer gold (every demo response) gets
    math-verify's own verdict without math-verify: parsing is switched off and the verdicts still agree."""
    problems = make_problems(300, seed=0, max_operand=99)
    pairs = [(f"\\boxed{{{int(p.ground_truth) + offset}}}", p.ground_truth) for p in problems for offset in (0, 1, -3)]
    pairs += [("\\boxed{-7}", "-7"), ("  \\boxed{ 0 }\n", "-0"), ("\\boxed{123456789012345678}", "123456789012345678"),
              ("\\boxed{12}", " 12 "), ("<think>\\boxed{4}</think>\\boxed{5}", "5"), ("\\boxed{5}", "-5")]
    reference = [_math_verify_verdict(answer_region(response), gold) for response, gold in pairs]
    assert 0 < sum(reference) < len(pairs)

    def no_parsing(*args, **kwargs):
        raise AssertionError("math-verify was called")

    monkeypatch.setattr(math_reward_module, "parse", no_parsing)
    assert [rewards.judge_math(response, gold) for response, gold in pairs] == [
        (score, verdict.OK) for score in reference]
    # anything else goes to math-verify: leading zeros, a second box, a decimal, text around the box
    parsed: list[str] = []
    monkeypatch.setattr(math_reward_module, "parse",
                        lambda text, **kwargs: parsed.append(text) or parse(text, **kwargs))
    others = (("\\boxed{042}", "42"), ("\\boxed{4}\\boxed{2}", "2"), ("\\boxed{4.0}", "4"), ("So \\boxed{4}", "4"),
              ("\\boxed{4}", "4.0"))  # the last: a decimal gold
    for response, gold in others:
        parsed.clear()
        assert rewards.judge_math(response, gold) == (_math_verify_verdict(response, gold), verdict.OK)
        assert parsed, (response, gold)  # math-verify parsed it


def test_answers_tried_while_thinking_do_not_count():
    response = "<think>Maybe it is $\\boxed{5}$? No, I made an error.</think>\nThe answer is 3."
    assert _math_verify_verdict(response, "5") == 1.0  # math-verify alone reads the boxed guess
    assert rewards.judge_math(response, "5") == (0.0, verdict.OK)
    assert rewards.judge_math(response, "3") == (1.0, verdict.OK)
    assert rewards.judge_math("<think>unfinished \\boxed{5}", "5").score == 1.0  # no </think>: all text


def test_text_wrapped_aime_numbers(shared_data):
    """AIME solutions box answers as \\textbf{(051)}: math-verify reads '051' as a symbol, we as 51."""
    solutions = [row for row in json.load(open(shared_data / "deepscaler_subset" / "aime.json"))
                 if re.search(r"\\boxed\{\\textbf\{\(\d+\) ?\}\}", row["solution"] or "")]
    leading_zero = [row for row in solutions if re.search(r"\\textbf\{\(0", row["solution"])]
    assert len(solutions) >= 3 and len(leading_zero) >= 2
    for row in leading_zero:
        assert _math_verify_verdict(row["solution"], row["answer"]) == 0.0
    for row in solutions:
        assert rewards.judge_math(row["solution"], row["answer"]) == (1.0, verdict.OK)
        assert rewards.judge_math(row["solution"], str(int(row["answer"]) + 1)).score == 0.0


def test_guards_leave_real_answers_alone(shared_data):
    solutions = [json.loads(line)["solution"] for line in open(shared_data / "math_500" / "test.jsonl")]
    assert max(nesting_depth(s, stop_above=MAX_NESTING) for s in solutions) <= MAX_NESTING
    assert rewards.judge_math("\\boxed{10000!}", "10000!") == (1.0, verdict.OK)  # 35,660 digits: allowed
    assert rewards.judge_math("\\boxed{2^{10}}", "1024") == (1.0, verdict.OK)
    assert rewards.judge_math("\\boxed{" + "{" * (MAX_NESTING + 1) + "1" + "}" * (MAX_NESTING + 1) + "}", "1") == (
        0.0, verdict.REJECTED)


def test_math_statuses():
    assert rewards.judge_math("I give up.", "3") == (0.0, verdict.NO_ANSWER)
    assert rewards.judge_math("\\boxed{3}", "") == (0.0, verdict.BAD_GOLD)
    assert rewards.judge_math(None, "3") == (0.0, verdict.ERROR)  # type: ignore[arg-type]
    assert rewards.math_reward(12345, "3") == 0.0  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gsm8k_test(shared_data) -> list[tuple[str, str]]:
    """(reference solution ending in '#### N', N) for the 1319 GSM8K test problems."""
    rows = [json.loads(line) for line in open(shared_data / "gsm8k" / "test.jsonl")]
    return [(row["answer"], row["answer"].rpartition("####")[2].strip()) for row in rows]


def test_gsm8k_reward_on_reference_solutions(gsm8k_test):
    assert len(gsm8k_test) == 1319
    assert all(rewards.gsm8k_reward(solution, gold) == 1.0 for solution, gold in gsm8k_test)
    for solution, gold in gsm8k_test[:200]:
        head = solution.rpartition("####")[0]
        assert rewards.gsm8k_reward(head + f"#### {int(gold.replace(',', '')) + 1}", gold) == 0.0
        assert rewards.gsm8k_reward(head.replace("<<", "").replace(">>", "") + f" The answer is $\\boxed{{{gold}}}$.",
                                    gold) == 1.0


@pytest.mark.parametrize("response, gold, expected", [
    ("So she makes $1,600 in total.", "1600", 1.0),
    ("So she makes 1600 dollars.", "1,600", 1.0),
    ("The total is \\boxed{18.00}.", "18", 1.0),
    ("The total is \\boxed{\\$18} and 5 more words", "18", 1.0),       # boxed wins over later numbers
    ("It drops to -3 degrees.", "-3", 1.0),
    ("Pages 10-12 are missing, so 12", "-12", 0.0),                     # a dash between numbers is no sign
    ("<think>maybe 18</think> The answer is 17.", "18", 0.0),
    ("#### 18\nI hope 17 is not right", "18", 1.0),
    ("no numbers here", "18", 0.0),
    ("9" * 200, "9", 0.0),
])
def test_gsm8k_cases(response, gold, expected):
    assert rewards.gsm8k_reward(response, gold) == expected


def test_gsm8k_statuses():
    assert rewards.judge_gsm8k("42", "forty-two") == (0.0, verdict.BAD_GOLD)
    assert rewards.judge_gsm8k("nothing", "42") == (0.0, verdict.NO_ANSWER)
    assert rewards.judge_gsm8k("9" * 200, "42") == (0.0, verdict.REJECTED)
