"""Evaluation CLI: pass@k of a checkpoint on the evaluation sets of a config (docs/design.md section 7.5).

    python -m pacs_jax.evaluate --config=configs/eval.py --checkpoint=DIR [--config.n=16 --config.sets=math_500]

writes, in ``config.output_dir`` (default ``DIR/eval``), the files of pacs_jax/evaluation/outputs.py
(eval_samples.jsonl, eval_metrics.json, pass_at_k.png). The maths, the runner and the outputs are
in pacs_jax/evaluation/. Flag, usage and data errors print one line and exit with status 78
(pacs_jax/errors.py).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from absl import app, flags, logging
from ml_collections import config_flags

from pacs_jax import checkpoints
from pacs_jax.data import load_tokenizer
from pacs_jax.errors import UsageError, run_cli
from pacs_jax.evaluation import evaluate_sets, load_eval_sets, write_outputs
from pacs_jax.rewards import RewardPool
from pacs_jax.sharding import make_mesh


def run(config, checkpoint: str | pathlib.Path) -> dict[str, dict[str, float]]:
    """Evaluate ``checkpoint`` as ``config`` (configs/eval.py) says; write the outputs; return the metrics."""
    checkpoint = pathlib.Path(checkpoint)
    output_dir = pathlib.Path(config.output_dir or checkpoint / "eval")
    eval_sets = load_eval_sets(config.sets, dict(config.set_files), config.data_dir, config.max_problems)
    tokenizer_dir = pathlib.Path(config.tokenizer or checkpoint)
    if not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise UsageError(f"{tokenizer_dir}: no tokenizer files (tokenizer_config.json); pass --config.tokenizer=DIR")
    mesh = make_mesh(**config.mesh) if config.use_mesh else None
    model = checkpoints.from_pretrained(checkpoint, dtype=config.dtype, mesh=mesh)
    tokenizer = load_tokenizer(tokenizer_dir)
    with RewardPool(config.reward.workers or None, item_timeout=config.reward.item_timeout) as pool:
        rows, metrics = evaluate_sets(
            model, tokenizer, eval_sets, n=config.n, temperature=config.temperature, top_p=config.top_p,
            top_k=config.top_k, max_new_tokens=config.max_new_tokens, seed=config.seed,
            stop_token_ids=tuple(config.stop_token_ids), batch_size=config.batch_size,
            slots=config.slots if config.sampler == "continuous" else None,
            max_prompt_length=config.max_prompt_length, reward_pool=pool, progress=config.progress)
    write_outputs(output_dir, rows, metrics)
    for eval_set in eval_sets:
        evaluated = sum(row["data_source"] == eval_set.name for row in rows)
        if evaluated < len(eval_set.problems):
            logging.warning("%s: %d of %d prompts exceed max_prompt_length=%d and were not evaluated",
                            eval_set.name, len(eval_set.problems) - evaluated, len(eval_set.problems),
                            config.max_prompt_length)
    logging.info("wrote %s: %s", output_dir, json.dumps(metrics))
    return metrics


def _cli() -> None:
    """Flags are defined here, not at import, so importing this module (tests call ``run``) defines none."""
    config_flag = config_flags.DEFINE_config_file("config", None, "evaluation config file (configs/eval.py)")
    checkpoint_flag = flags.DEFINE_string("checkpoint", None, "HF model folder or pacs_jax checkpoint folder")
    flags.mark_flags_as_required(["config", "checkpoint"])

    def main(argv: Sequence[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        run(config_flag.value, checkpoint_flag.value)

    run_cli("pacs_jax.evaluate", main)  # flag, usage and data errors: one line, exit status 78


if __name__ == "__main__":
    _cli()
