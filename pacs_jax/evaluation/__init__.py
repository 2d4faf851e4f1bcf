"""pass@k evaluation, by job: the maths (``pass_at_k``), the runner (``runner``: sample, score, count),
the output files (``outputs``). The CLI is ``python -m pacs_jax.evaluate``.
"""

from pacs_jax.evaluation.outputs import write_outputs
from pacs_jax.evaluation.pass_at_k import k_values, pass_at_k, pass_at_k_metrics
from pacs_jax.evaluation.runner import (EvalSet, EvalSettings, default_stop_ids, evaluate_per_set, evaluate_sets,
                                       load_eval_sets, set_reward)

__all__ = ["write_outputs", "k_values", "pass_at_k", "pass_at_k_metrics", "EvalSet", "EvalSettings",
           "default_stop_ids", "evaluate_per_set", "evaluate_sets", "load_eval_sets", "set_reward"]
