"""The CPU demo (configs/default.py) trained with each objective, at the same rollout budget.

    python -m pacs_jax.train --config=configs/demo_objectives.py:grpo --config.seed=1

OBJECTIVE: pacs | grpo | rloo | drgrpo | ppo. Every objective samples the same prompts, n responses
each, for the same number of steps, after the same warm-start; only the loss (and PPO's critic)
differs. The baselines take the paper's settings (configs/paper.py: GRPO at verl's scale, PPO clip
0.2 / dual clip 3, gradient clipping 1.0), scaled to the demo's response length. Used by
tools/compare_objectives.py.
"""

import ml_collections

from configs import default

OBJECTIVES = ("pacs", "grpo", "rloo", "drgrpo", "ppo")


def _options(objective: str, max_new_tokens: int) -> dict:
    clip = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    if objective == "grpo":
        return dict(clip, loss_agg_mode="seq-mean-token-sum-norm", loss_scale="verl", verl_micro_batch_size=8,
                    norm_length=max_new_tokens)
    if objective == "rloo":
        return dict(clip, loss_agg_mode="token-mean")
    if objective == "drgrpo":
        return dict(clip, loss_agg_mode="seq-mean-token-sum-norm", norm_length=max_new_tokens)
    return dict(clip)  # ppo


def get_config(objective: str = "pacs") -> ml_collections.ConfigDict:
    if objective not in OBJECTIVES:
        raise ValueError(f"config arg {objective!r}: expected one of {OBJECTIVES}")
    c = default.get_config()
    c.workdir = f"workdir/demo_{objective}"
    if objective == "pacs":
        return c
    c.algorithm.objective = objective
    c.algorithm.options = ml_collections.ConfigDict(_options(objective, c.rollout.max_new_tokens))
    c.optim.grad_clip = 1.0
    return c
