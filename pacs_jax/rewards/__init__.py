"""Verifiable rewards: math answer equivalence (math-verify) and GSM8K numbers, batch-scored in a worker pool;
reward mode "paper" scores with the PACS authors' exact math-verify call instead (rewards/paper.py).

    score = rewards.math_reward(response, ground_truth)        # 1.0 / 0.0, never raises, bounded time
    score = rewards.gsm8k_reward(response, ground_truth)
    with rewards.RewardPool(item_timeout=5.0) as pool:
        scores, statuses, metrics = pool.score(responses, ground_truths, reward="math", deadline=60.0)
"""

import importlib

from pacs_jax.rewards.gsm8k import gsm8k_reward, judge_gsm8k
from pacs_jax.rewards.pool import RewardPool, ScoredBatch, UnscoredError, math_reward, score_metrics
from pacs_jax.rewards.verdict import STATUSES, Verdict
from pacs_jax.rewards.worker import REWARD_MODES, REWARDS, reward_for

__all__ = ["math_reward", "gsm8k_reward", "judge_math", "judge_gsm8k", "judge_paper", "RewardPool", "ScoredBatch",
           "UnscoredError", "REWARDS", "REWARD_MODES", "reward_for", "STATUSES", "Verdict", "score_metrics"]

# judge_math and judge_paper, imported on first use (``__getattr__``): sympy and math-verify, which they import, cost
# ~1.5 s of CPU, and the trainer and the evaluator only name them (their reward workers import them: rewards/worker.py)
_CHECKERS = {"judge_math": "pacs_jax.rewards.math", "judge_paper": "pacs_jax.rewards.paper"}


def __getattr__(name: str):
    if name in _CHECKERS:
        return getattr(importlib.import_module(_CHECKERS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
