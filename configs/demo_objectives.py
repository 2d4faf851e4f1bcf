"""The CPU demo (configs/default.py) trained with each objective, at the same rollout budget.

    python -m pacs_jax.train --config=configs/demo_objectives.py:grpo --config.seed=1

OBJECTIVE: pacs | grpo | rloo | drgrpo | ppo | gspo | cispo. Every objective samples the same prompts, n responses
each, for the same number of steps, after the same warm-start; only the loss (and PPO's critic)
differs. Each runs a setup of configs/algorithms.py (SETUPS), its losses' L_max the demo's response
length, with the demo's gradient clipping 1.0: PACS as the paper's pacs_beta1, GRPO at verl's scale
as the paper's, PPO-clip 0.2 / dual clip 3 for the others (RLOO and PPO at token-mean, Dr.GRPO
seq-mean-token-sum-norm; GSPO and CISPO as verl's examples, configs/algorithms.py). Used by tools/compare_objectives.py.
"""

import ml_collections

from configs import default
from pacs_jax.errors import did_you_mean

SETUPS = {"pacs": "pacs_beta1", "grpo": "grpo", "rloo": "rloo", "drgrpo": "drgrpo", "ppo": "ppo_token_mean",
          "gspo": "gspo", "cispo": "cispo"}


def get_config(objective: str = "pacs") -> ml_collections.ConfigDict:
    if objective not in SETUPS:
        raise ValueError(f"config arg {objective!r}: expected one of {tuple(SETUPS)}{did_you_mean(objective, SETUPS)}")
    c = default.get_config(SETUPS[objective])
    c.workdir = f"workdir/demo_{objective}"
    return c
