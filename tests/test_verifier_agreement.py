"""The strict checker against the authors' math-verify call on answer-equivalence cases
(tests/data/answer_equivalence.jsonl: the kinds of pairs other projects' public test suites check),
scored through tools/compare_verifiers.py; and the rules the strict checker adds, one by one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from pacs_jax.rewards import choices, intervals, ordering, precision
from pacs_jax.rewards.normalize import normalize_answer_text
from qwen_reference import load_tool

compare = load_tool("compare_verifiers")
CATEGORIES = {"multiple_choice", "decimal_fraction", "set_tuple", "interval_inequality", "units_text"}


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return compare.load_cases()


@pytest.fixture(scope="module")
def scored(cases) -> list[dict]:
    return compare.score_cases(cases)


def test_case_set_is_well_formed(cases):
    assert len(cases) >= 80
    assert {case["category"] for case in cases} == CATEGORIES
    assert all(case["expected"] in (0, 1) and case["origin"] and case["response"] and case["gold"] for case in cases)
    assert len({(case["response"], case["gold"]) for case in cases}) == len(cases)  # no duplicates
    for category in CATEGORIES:  # positives and negatives in every category
        assert {case["expected"] for case in cases if case["category"] == category} == {0, 1}, category


def test_constant_checkers_fail_every_category(cases):
    always = {"yes": lambda response, gold: _Score(1.0),
              "no": lambda response, gold: _Score(0.0)}
    accuracy = compare.accuracy_by_category(compare.score_cases(cases, always))
    assert all(row["yes"] < 0.9 and row["no"] < 0.9 for row in accuracy.values())


class _Score:
    def __init__(self, score: float):
        self.score = score


def test_strict_beats_paper_and_is_right_on_every_case(scored):
    accuracy = compare.accuracy_by_category(scored)
    misses = [(case["category"], case["response"], case["gold"], case["expected"])
              for case in scored if not case["right"]["strict"]]
    assert misses == []
    assert accuracy["all"]["strict"] > accuracy["all"]["paper"]
    for category in CATEGORIES:
        assert accuracy[category]["strict"] >= accuracy[category]["paper"], category
    assert accuracy["all"]["paper"] < 0.9  # the set tells the checkers apart


def test_table_and_help():
    accuracy = {"x": {"cases": 2, "strict": 1.0, "paper": 0.5}}
    assert compare.table(accuracy).splitlines() == [
        "| category | cases | strict accuracy | paper accuracy |", "|---|---:|---:|---:|", "| x | 2 | 1.000 | 0.500 |"]
    done = subprocess.run([sys.executable, str(REPO / "tools" / "compare_verifiers.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--cases" in done.stdout


@pytest.mark.parametrize("text, want", [
    ("\\text{12 cm}", "12"), ("\\textbf{(051)}", "051"), ("\\mbox{5 inches}", "5"), ("\\text{12}", "12"),
    ("\\text{5 or 6}", "\\text{5 or 6}"), ("\\text{(C)}", "\\text{(C)}"),
    ("0.\\overline{3}", "\\frac{3}{9}"), ("1.2\\overline{45}", "\\frac{1233}{990}"),
    ("-.\\overline{6}", "-\\frac{6}{9}"),
])
def test_normalize(text, want):
    assert normalize_answer_text(text) == want


@pytest.mark.parametrize("text, want", [
    ("x < 3", ("x", "(-\\infty, 3)")), ("3 \\ge x", ("x", "(-\\infty, 3]")), ("1 \\le x < 2", ("x", "[1, 2)")),
    ("5 \\geq x > -2", ("x", "(-2, 5]")), ("x \\neq 2", ("x", "(-\\infty, 2) \\cup (2, \\infty)")),
    ("x < -1 \\text{ or } x > 2", ("x", "(-\\infty, -1) \\cup (2, \\infty)")),
    ("x \\leq \\frac{1}{2}", ("x", "(-\\infty, \\frac{1}{2}]")),
    ("x^2 < 4", None), ("y < 3, x > 2", None), ("1 < x > 2", None), ("x < x + 1", None), ("(1, 2)", None),
    ("\\left(1, 2\\right)", None), ("x = 3", None),
])
def test_inequality_as_interval(text, want):
    assert intervals.inequality_as_interval(text) == want


def test_precision_rule():
    import sympy
    third, eighth = sympy.Rational(1, 3), sympy.Rational(1, 8)
    assert precision.rounds_to_decimal(third, "0.33") and precision.rounds_to_decimal(third, "x = 0.3333")
    assert not precision.rounds_to_decimal(third, "0.3")          # one place: too coarse
    assert not precision.rounds_to_decimal(third, "0.334")        # wrong in the last place
    assert precision.rounds_to_decimal(sympy.Rational(2, 3), "0.67")
    assert not precision.rounds_to_decimal(sympy.Rational(2, 3), "0.66")  # truncated, not rounded
    assert not precision.rounds_to_decimal(eighth, "0.13")        # 1/8 terminates: exact only
    assert not precision.rounds_to_decimal(sympy.pi, "3.14")      # irrational: outside the rule
    assert not precision.rounds_to_decimal(sympy.Integer(3), "3.00")


@pytest.mark.parametrize("region, want", [
    ("\\boxed{C) 12}", "C"), ("\\boxed{\\textbf{(C)}\\ 12}", "C"), ("\\boxed{C, D}", None), ("\\boxed{B^2}", None),
    ("The answer is (C).", "C"), ("Answer: C", "C"), ("the answer choice is C", "C"),
    ("The answer is (B) or (C).", None), ("Checking each option, (C) is correct", "C"),
    ("The answer is a positive number", None), ("The answer is 12.", None),
])
def test_response_choice(region, want):
    assert choices.response_choice(region) == want


def test_gold_choice():
    assert [choices.gold_choice(g) for g in ("C", "(C)", "\\text{(C)}", "\\mathrm{(A)}\\ 12", "c", "F", "x", "12")] == [
        "C", "C", "C", "A", None, None, None, None]


def test_set_and_tuple_kinds():
    assert ordering.kinds_conflict("(1, 2)", "\\{1, 2\\}")
    assert ordering.kinds_conflict("\\left\\{1,2\\right\\}", "(1,2)")
    assert not ordering.kinds_conflict("1, 2", "\\{2, 1\\}")                  # a bare list is a set too
    assert not ordering.kinds_conflict("(1, 2) \\cup (3, 4)", "\\{1, 2\\}")   # not one outer pair
    assert not ordering.kinds_conflict("(x+1)", "\\{1\\}")                    # no comma: not a tuple


_HOSTILE_RUN = """
from pacs_jax.rewards import choices, intervals, ordering
from pacs_jax.rewards.normalize import normalize_answer_text
hostile = ["\\\\text{1" + " " * 50 + "a" * 50] * 2000, ["x<"] * 20000, ["The answer is "] * 20000, ["("] * 20000
for pieces in hostile:
    text = "".join(pieces)
    normalize_answer_text(text)
    intervals.inequality_as_interval(text)
    choices.response_choice(text)
    ordering.written_kind(text)
print("finished")
"""


def test_rules_finish_on_hostile_text():
    """The rules' regexes on long adversarial responses (20-200 kB of repeated openers) do not backtrack
    catastrophically. They take about a second on 2 cores; the child process is only a hang guard (a
    backtracking regex on these inputs runs for hours), not a speed check, so a busy machine cannot
    fail it."""
    try:
        done = subprocess.run([sys.executable, "-c", _HOSTILE_RUN], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the strict reward's rules did not finish on hostile text in 300 s: catastrophic backtracking")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "finished"
