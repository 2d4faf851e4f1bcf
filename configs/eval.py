"""Evaluation: ``python -m pacs_jax.evaluate --config=configs/eval.py[:paper] --checkpoint=DIR``.

configs/base.py with the evaluation's values; the CLI reads ``eval`` (the sets and the final settings),
``evaluate`` (its own fields), ``seed``, ``model.dtype`` (the compute dtype: bfloat16; "float32" on CPU
for exactness), ``mesh``, ``data.tokenizer`` ("": the checkpoint's tokenizer files, else its training
run's) and ``reward``.
Defaults: 16 samples per problem at temperature 0.6, top_p 0.95, up to 4096 new tokens, on MATH-500,
AIME 2024, AIME 2025 and AMC23, scored by the strict reward. ``configs/eval.py:paper`` evaluates as the
paper's tables (configs/paper_evaluation.py): 256 samples per problem on AIME 2024 / 2025 and AMC23,
32 on MATH-500, scored by the authors' math-verify call (reward.mode "paper"). Override any field,
e.g. ``--config.eval.sets=math_500,gsm8k --config.eval.final.n=64 --config.eval.max_problems=20
--config.eval.final.per_set.aime_2024.n=64``.
"""

import ml_collections

from configs import base, paper_evaluation


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    if arg not in ("", "paper"):
        raise ValueError(f"config arg {arg!r}: expected nothing (the defaults) or 'paper' (the paper's tables)")
    c = base.get_config()
    c.eval.update(sets="math_500,aime_2024,aime_2025,amc23", max_new_tokens=4096,
                  final=dict(n=16, temperature=0.6, top_p=0.95))
    if arg == "paper":
        c.eval.sets = paper_evaluation.SETS
        c.eval.final.per_set = paper_evaluation.per_set()
        c.reward.mode = "paper"
    return c
