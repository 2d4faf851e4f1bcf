"""The reward exactly as the PACS authors compute it (``reward.mode = "paper"``).

Their reward function (src/reward_function.py of the released code, on verl 0.3.1) is one
math-verify call on the whole response, for every data source:

    math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))(
        ["\\boxed{" + ground_truth + "}"], [response])

with any exception or math-verify timeout scoring 0. Unlike ``rewards.math`` (the default, "strict"
mode) it reads the whole response, including answers tried inside ``<think>``, extracts plain
expressions as well as LaTeX (the last number written can be the answer), and applies no guard
before sympy; math-verify's own signal-based time limits stay on (a worker process runs it on its
main thread) and the pool's ``item_timeout`` still bounds each item.
"""

from __future__ import annotations

from math_verify.errors import TimeoutException
from math_verify.metric import math_metric
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

from pacs_jax.rewards.verdict import BAD_GOLD, ERROR, NO_ANSWER, OK, TIMEOUT, Verdict

_AUTHORS_METRIC = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                              pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))


def judge_paper(response: str, ground_truth: str) -> Verdict:
    """The authors' score of ``response`` against ``ground_truth`` (LaTeX); never raises."""
    try:
        score, extracted = _AUTHORS_METRIC(["\\boxed{" + str(ground_truth) + "}"], [response])
    except TimeoutException:  # math-verify's own time limit (a BaseException): 0, as the authors score it
        return Verdict(0.0, TIMEOUT)
    except ValueError as e:
        return Verdict(0.0, BAD_GOLD if str(e).startswith("No gold targets found") else ERROR)
    except Exception:
        return Verdict(0.0, ERROR)
    no_prediction = extracted is not None and not extracted[1]
    return Verdict(float(score), NO_ANSWER if no_prediction else OK)
