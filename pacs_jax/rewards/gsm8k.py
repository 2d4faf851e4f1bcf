"""GSM8K-style numeric reward: the response's final number equals the gold number exactly.

The final number is read from the answer region (after the last ``</think>``): the last number
inside the last ``\\boxed{...}``, else the first number after the last ``####`` (GSM8K's own answer
format), else the last number in the text. Numbers may carry thousands separators (``1,000``) and
a sign; they are compared as exact fractions, so ``18.00`` equals ``18``. Everything here is a
linear-time regular expression over the text, so it runs in-process without a time limit.
"""

from __future__ import annotations

import fractions
import re

from pacs_jax.rewards.verdict import BAD_GOLD, ERROR, NO_ANSWER, OK, REJECTED, Verdict, answer_region

MAX_NUMBER_CHARS = 64  # a longer digit run is not an answer (and int() of huge strings is slow)

# A sign only when not glued to a word or number ("10-12" is two numbers, not 10 and -12).
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_BRACE = re.compile(r"[{}]")


def judge_gsm8k(response: str, ground_truth: str) -> Verdict:
    """Score ``response`` against a numeric ``ground_truth`` (e.g. ``"70000"``, ``"2,125"``); never raises."""
    try:
        gold = _to_fraction(str(ground_truth).strip())
        if gold is None:
            return Verdict(0.0, BAD_GOLD)
        number = final_number(answer_region(response))
        if number is None:
            return Verdict(0.0, NO_ANSWER)
        if len(number) > MAX_NUMBER_CHARS:
            return Verdict(0.0, REJECTED)
        return Verdict(1.0 if _to_fraction(number) == gold else 0.0, OK)
    except Exception:
        return Verdict(0.0, ERROR)


def gsm8k_reward(response: str, ground_truth: str) -> float:
    """1.0 if the response's final number equals ``ground_truth``, else 0.0; never raises."""
    return judge_gsm8k(response, ground_truth).score


def final_number(text: str) -> str | None:
    """The answer number of ``text`` as written (see the module docstring), or None."""
    boxed = _last_boxed_content(text)
    if boxed is not None:
        numbers = _NUMBER.findall(boxed)
        return numbers[-1] if numbers else None
    head, sep, tail = text.rpartition("####")
    if sep:
        match = _NUMBER.search(tail)
        return match.group() if match else None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed_content(text: str) -> str | None:
    """Text inside the last ``\\boxed{...}`` (to its matching brace, or to the end if unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    start += len("\\boxed{")
    depth = 1
    for match in _BRACE.finditer(text, start):
        depth += 1 if match.group() == "{" else -1
        if depth == 0:
            return text[start:match.start()]
    return text[start:]


def _to_fraction(number: str) -> fractions.Fraction | None:
    """Exact value of a decimal number with optional thousands separators, or None."""
    if not _NUMBER.fullmatch(number) or len(number) > MAX_NUMBER_CHARS:
        return None
    return fractions.Fraction(number.replace(",", ""))
