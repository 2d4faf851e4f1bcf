"""The result of checking one response: a score in {0, 1} and why it got that score."""

from __future__ import annotations

from typing import NamedTuple

# Set by the checkers (math.py, gsm8k.py).
OK = "ok"                # an answer was found and compared (the score says whether it matched)
NO_ANSWER = "no_answer"  # no answer could be extracted from the response
BAD_GOLD = "bad_gold"    # the ground truth itself could not be parsed
REJECTED = "rejected"    # refused before parsing: too costly to evaluate (hostile or runaway output)
ERROR = "error"          # the checker raised; scored 0
# Set by the worker pool (pool.py).
TIMEOUT = "timeout"      # the item overran its time limit; its worker was killed and replaced
CRASH = "crash"          # the worker process died while checking the item
DEADLINE = "deadline"    # the batch deadline passed before the item was checked

STATUSES = (OK, NO_ANSWER, BAD_GOLD, REJECTED, ERROR, TIMEOUT, CRASH, DEADLINE)


class Verdict(NamedTuple):
    score: float  # 1.0 (equivalent to the ground truth) or 0.0
    status: str   # one of STATUSES


def answer_region(response: str) -> str:
    """The part of a response that holds its final answer: the text after the last ``</think>``.

    Reasoning models (Qwen3) think inside <think>...</think>; answers tried there do not count.
    """
    head, sep, tail = response.rpartition("</think>")
    return tail if sep else response
