"""Math answer checking: is the response's final answer mathematically equivalent to the gold one?

The engine is math-verify (Hugging Face): the gold answer is wrapped as ``\\boxed{gold}``, both
sides are parsed (LaTeX and plain expressions, boxed answer first) and compared for equivalence
(symbolic, numeric with 6-decimal float rounding, sets, intervals, relations). On top of it:

- only the text after the last ``</think>`` is read (answers tried while thinking do not count);
- numbers wrapped in text commands are read as numbers: ``\\textbf{(051)}`` (AIME solutions write
  them), ``\\text{12 cm}``; repeating decimals ``0.\\overline{3}`` as fractions (rewards/normalize.py);
- beyond math-verify's verdict, answers equal the gold when (one rule per module):
  the same multiple-choice letter is picked, in a box or in prose (rewards/choices.py);
  a decimal is a non-terminating fraction rounded to the decimal's own places (rewards/precision.py);
  an inequality in one variable denotes the gold interval, or the other way round (rewards/intervals.py);
- and they differ when one is written as a set ``\\{...\\}`` and the other as a tuple ``(a, b)``,
  which math-verify equates (rewards/ordering.py);
- an answer region that is exactly ``\\boxed{integer}`` against an integer gold is decided by comparing
  the two integers, the verdict math-verify would give, without parsing (2 ms -> 3 us an item; every
  response of the arithmetic demo has this form, real solutions with reasoning text do not);
- hostile or runaway output is refused before sympy sees it (status REJECTED, score 0): bracket
  nesting deeper than ``MAX_NESTING`` (math-verify's LaTeX parser is exponential in the depth of
  bare ``{...}`` groups: depth 12 takes 3 s, 16 takes 12 s, 20 takes 8 minutes)
  and numbers of more than ``MAX_DIGITS`` digits (``9^{9^{9^{9}}}``; exact sympy arithmetic on them
  never returns).

Model output is never executed: math-verify parses LaTeX with its own grammar and plain
expressions with sympy's tokenizer (no ``eval`` of raw text). ``judge_math`` has no time bound of its
own: math-verify's signal-based timeouts are switched off (they only work on a main thread and
cannot interrupt C code); run it through ``rewards.pool``, whose worker processes are killed when an
item overruns.
"""

from __future__ import annotations

import functools
import logging
import math
import re

import sympy
from math_verify import parse, verify
from sympy.matrices import MatrixBase

from pacs_jax.rewards import choices, intervals, ordering, precision
from pacs_jax.rewards.normalize import normalize_answer_text
from pacs_jax.rewards.verdict import BAD_GOLD, ERROR, NO_ANSWER, OK, REJECTED, Verdict, answer_region

MAX_NESTING = 12       # brackets open at once in the answer region (real solutions: <= 7)
MAX_DIGITS = 100_000   # decimal digits of any number the answer denotes (10000! has 35,660)

# math-verify logs the whole input (model output, up to megabytes) at WARNING on parse failures and
# warns once that its timeouts are off; we count those events in the pool's metrics instead.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BRACKET = re.compile(r"[{(\[\]})]")
_INTEGER = r"-?(?:0|[1-9][0-9]{0,17})"  # no leading zeros, exact in a Python int whatever the reader
_BOXED_INTEGER = re.compile(r"\s*\\boxed\{\s*(" + _INTEGER + r")\s*\}\s*")
_GOLD_INTEGER = re.compile(r"\s*(" + _INTEGER + r")\s*")
_OPENERS = frozenset("{([")


def judge_math(response: str, ground_truth: str) -> Verdict:
    """Score ``response`` against ``ground_truth`` (LaTeX, e.g. ``\\frac{14}{3}``); never raises."""
    try:
        region = answer_region(response)
        integers = _BOXED_INTEGER.fullmatch(region), _GOLD_INTEGER.fullmatch(str(ground_truth))
        if all(integers):
            pred_value, gold_value = (int(match.group(1)) for match in integers)
            return Verdict(1.0 if pred_value == gold_value else 0.0, OK)
        gold = _parse_gold(str(ground_truth))
        if not gold:
            return Verdict(0.0, BAD_GOLD)
        region = normalize_answer_text(region)
        if nesting_depth(region, stop_above=MAX_NESTING) > MAX_NESTING:
            return Verdict(0.0, REJECTED)
        choice = choices.gold_choice(str(ground_truth))
        pred = parse(region, parsing_timeout=None)
        if not pred:
            picked = choices.response_choice(region) if choice is not None else None
            if picked is not None:  # a letter in prose: "The answer is (C)."
                return Verdict(1.0 if picked == choice else 0.0, OK)
            return Verdict(0.0, NO_ANSWER)
        if any(_log10_bound(p) > MAX_DIGITS for p in pred if not isinstance(p, str)):
            return Verdict(0.0, REJECTED)
        return Verdict(1.0 if _equivalent(gold, pred, choice, region) else 0.0, OK)
    except Exception:  # math-verify catches its own errors; this is the last line of defence
        return Verdict(0.0, ERROR)


def _equivalent(gold: tuple, pred: list, choice: str | None, region: str) -> bool:
    """math-verify's verdict, vetoed for sets against tuples, extended by the choice, precision and
    interval rules (see the module docstring)."""
    gold_text, pred_text = _written(gold), _written(pred)
    if verify(list(gold), pred, timeout_seconds=None):
        return not ordering.kinds_conflict(gold_text, pred_text)
    if choice is not None:
        return choices.response_choice(region) == choice
    gold_values = [g for g in gold if not isinstance(g, str)]
    pred_values = [p for p in pred if not isinstance(p, str)]
    if any(precision.rounds_to_decimal(g, pred_text) for g in gold_values) or any(
            precision.rounds_to_decimal(p, gold_text) for p in pred_values):
        return True
    return _inequality_equivalent(gold, pred, gold_text, pred_text)


def _inequality_equivalent(gold: tuple, pred: list, gold_text: str, pred_text: str) -> bool:
    """Equal once inequalities are written as intervals (same variable when both sides have one)."""
    gold_interval = intervals.inequality_as_interval(gold_text)
    pred_interval = intervals.inequality_as_interval(pred_text)
    if gold_interval is None and pred_interval is None:
        return False
    if gold_interval is not None and pred_interval is not None and gold_interval[0] != pred_interval[0]:
        return False
    gold_side = _parse_interval(gold_interval[1]) if gold_interval else list(gold)
    pred_side = _parse_interval(pred_interval[1]) if pred_interval else pred
    return bool(gold_side and pred_side) and verify(gold_side, pred_side, timeout_seconds=None)


def _parse_interval(latex: str) -> list:
    """math-verify's parse of an interval built from an answer's own bounds (guards re-applied)."""
    boxed = "\\boxed{" + latex + "}"
    if nesting_depth(boxed, stop_above=MAX_NESTING) > MAX_NESTING:
        return []
    parsed = parse(boxed, parsing_timeout=None)
    if any(_log10_bound(p) > MAX_DIGITS for p in parsed if not isinstance(p, str)):
        return []
    return parsed


def _written(parsed) -> str:
    """The answer text math-verify extracted (the string it returns after the parsed value)."""
    return next((p for p in reversed(parsed) if isinstance(p, str)), "")


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str) -> tuple:
    """Parsed ``\\boxed{ground_truth}``; empty when unparseable or too costly (cached: n responses share it)."""
    boxed = "\\boxed{" + normalize_answer_text(ground_truth) + "}"
    if nesting_depth(boxed, stop_above=MAX_NESTING) > MAX_NESTING:
        return ()
    gold = tuple(parse(boxed, parsing_timeout=None))
    if any(_log10_bound(g) > MAX_DIGITS for g in gold if not isinstance(g, str)):
        return ()
    return gold


def nesting_depth(text: str, stop_above: int) -> int:
    """Largest number of brackets open at once in ``text`` (all kinds pooled); stops early once above."""
    depth = deepest = 0
    for match in _BRACKET.finditer(text):
        if match.group() in _OPENERS:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_above:
                    break
        elif depth:
            depth -= 1
    return deepest


def _log10_bound(expr: sympy.Basic | MatrixBase) -> float:
    """Rough upper bound of log10 |value| of the numbers ``expr`` denotes (inf: astronomically large).

    Symbols and functions count as 1; only integers, rationals, powers, factorials and their sums
    and products can make it large. Used to refuse answers that exact arithmetic cannot finish.
    """
    if isinstance(expr, MatrixBase):
        return max((_log10_bound(e) for e in expr), default=0.0)
    if isinstance(expr, sympy.Integer):
        return math.log10(abs(int(expr))) if expr != 0 else 0.0
    if isinstance(expr, sympy.Rational):
        return max(math.log10(abs(int(expr.p))), math.log10(int(expr.q)))
    if isinstance(expr, sympy.Pow):
        base, exponent = _log10_bound(expr.base), _log10_bound(expr.exp)
        if exponent > 300:  # |exponent| > 1e300
            return math.inf
        return max(base, 0.0) * 10.0 ** exponent
    if isinstance(expr, sympy.factorial):
        n = _log10_bound(expr.args[0])
        return math.inf if n > 300 else 10.0 ** n * max(n, 1.0)
    parts = [_log10_bound(a) for a in expr.args]
    if isinstance(expr, sympy.Mul):
        return sum(parts)
    if isinstance(expr, sympy.Add):
        return max(parts, default=0.0) + math.log10(max(len(parts), 1))
    return max(parts, default=0.0)
