"""Evaluation: N samples per problem, scored by the verifiable reward, pass@k per data source.

    python -m pacs_jax.evaluate --config=configs/eval.py --checkpoint=DIR [--config.n=16 --config.sets=math_500]

writes, in ``config.output_dir`` (default ``DIR/eval``):
    eval_rollout.jsonl   one row per problem: its fields, and its samples with their scores
    eval_metrics.json    {data_source: {"pass@1": x, "pass@2": x, ..., "mean@N": x}}, fractions in [0, 1]
    pass_at_k.png        pass@k against k, one curve per data source

pass@k is the unbiased estimator of Chen et al. (2021), averaged over problems:
1 - C(n - c, k) / C(n, k) for n samples of which c are correct, k = 1, 2, 4, ... <= n. mean@N is the
mean score of all samples. The trainer calls ``evaluate_sets`` for its periodic evaluation.
"""

from __future__ import annotations

import dataclasses
import fractions
import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pacs_jax.data import Problem, build_prompts, load_problems
from pacs_jax.files import atomic_write
from pacs_jax.rewards import RewardPool

REWARD_BY_SOURCE = {"gsm8k": "gsm8k"}  # every other data source is scored with the math reward


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: n samples, c of them correct; exact for any n.

    1 - C(n - c, k) / C(n, k), computed with exact integers and rounded once to a float (binomials
    as floats overflow float64 from n ~ 1030; a running float product accumulates rounding).
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"pass_at_k: {name}={value!r} must be an integer")
    if n < 1:
        raise ValueError(f"pass_at_k: n={n} must be >= 1")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}]")
    if n - c < k:
        return 1.0
    return float(1 - fractions.Fraction(math.comb(int(n - c), int(k)), math.comb(int(n), int(k))))


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n."""
    return [2**i for i in range(n.bit_length())]


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Problems of one data source and the reward that scores them ("math" or "gsm8k")."""

    name: str
    problems: Sequence[Problem]
    reward: str = "math"


def load_eval_sets(names: str | Sequence[str], files: Mapping[str, str], data_dir: str | pathlib.Path = ".",
                   max_problems: int = 0) -> list[EvalSet]:
    """The named sets; ``files[name]`` is a path relative to ``data_dir`` (or absolute, or ``tfds:NAME``).

    max_problems > 0 keeps the first max_problems problems of each set.
    """
    names = [n.strip() for n in names.split(",") if n.strip()] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError("no evaluation sets given (config.sets)")
    sets = []
    for name in names:
        if name not in files:
            raise ValueError(f"evaluation set {name!r} has no entry in config.set_files (known: {sorted(files)})")
        spec = files[name]
        spec = spec if spec.startswith("tfds:") else str(pathlib.Path(data_dir) / spec)
        problems, _ = load_problems(spec, data_source=name)
        if max_problems > 0:
            problems = problems[:max_problems]
        sets.append(EvalSet(name, problems, REWARD_BY_SOURCE.get(name, "math")))
    return sets


def evaluate_sets(model, tokenizer, eval_sets: Sequence[EvalSet], *, n: int, temperature: float, top_p: float,
                  max_new_tokens: int, seed: int = 0, top_k: int = 0, stop_token_ids: Sequence[int] = (),
                  batch_size: int = 32, max_prompt_length: int = 2048, reward_pool: RewardPool | None = None,
                  progress: bool = False) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Sample ``n`` responses per problem, score them, and compute pass@k per data source.

    model: a ``models.Qwen``; tokenizer: its Hugging Face tokenizer (chat template, decoding).
    stop_token_ids: () means the tokenizer's eos token and the model's eos ids.
    batch_size: prompts per ``sampling.generate`` call (batch_size * n sequences).
    reward_pool: an existing RewardPool (the trainer's); by default one is started and closed here.
    Problems whose prompt exceeds max_prompt_length tokens get no row (keep it large for evaluation).

    Returns (rows, metrics): one row per evaluated problem (see ``_row``) and
    {data_source: {"pass@1": ..., "pass@k": ..., "mean@N": ...}}.
    """
    from tqdm import tqdm

    from pacs_jax import sampling

    if n < 1 or batch_size < 1:
        raise ValueError(f"n={n} and batch_size={batch_size} must be >= 1")
    examples, rewards_of = [], []
    for eval_set in eval_sets:
        kept, _ = build_prompts(eval_set.problems, tokenizer, max_prompt_length)
        examples += kept
        rewards_of += [eval_set.reward] * len(kept)
    stops = tuple(stop_token_ids) or default_stop_ids(model, tokenizer)

    pool = reward_pool or RewardPool()
    rows = []
    try:
        with tqdm(total=len(examples), desc="evaluate", unit="problem", disable=not progress) as bar:
            for chunk, start in enumerate(range(0, len(examples), batch_size)):
                batch = examples[start:start + batch_size]
                out = sampling.generate(model, [list(e.prompt_ids) for e in batch], max_new_tokens=max_new_tokens,
                                        n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                        stop_token_ids=stops, seed=seed + chunk)
                texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in out.tokens]
                golds = [e.problem.ground_truth for e in batch for _ in range(n)]
                reward_names = [r for r in rewards_of[start:start + batch_size] for _ in range(n)]
                scores, statuses, _ = pool.score(texts, golds, reward_names)
                for i, example in enumerate(batch):
                    samples = slice(i * n, (i + 1) * n)
                    rows.append(_row(example.problem, texts[samples], scores[samples], statuses[samples],
                                     out.finish_reason[samples], [len(t) for t in out.tokens[samples]]))
                bar.update(len(batch))
    finally:
        if reward_pool is None:
            pool.close()
    return rows, pass_at_k_metrics(rows, n)


def pass_at_k_metrics(rows: Sequence[Mapping[str, Any]], n: int) -> dict[str, dict[str, float]]:
    """{data_source: {"pass@k": mean over its problems, ..., "mean@n": mean sample score}} from eval rows."""
    correct: dict[str, list[int]] = {}
    for row in rows:
        correct.setdefault(row["data_source"], []).append(row["num_correct"])
    metrics = {}
    for source, counts in correct.items():
        metrics[source] = {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in counts])) for k in k_values(n)}
        metrics[source][f"mean@{n}"] = float(np.sum(counts) / (n * len(counts)))
    return metrics


def _row(problem: Problem, texts: Sequence[str], scores: np.ndarray, statuses: Sequence[str],
         finish_reasons: Sequence[str], lengths: Sequence[int]) -> dict[str, Any]:
    """One problem's record: its fields, and its samples with score, reward status, finish reason, length."""
    samples = [{"response": text, "score": float(score), "status": status, "finish_reason": reason,
                "num_tokens": length}
               for text, score, status, reason, length in zip(texts, scores, statuses, finish_reasons, lengths)]
    return {**problem.to_json(), "num_correct": int(sum(s["score"] == 1.0 for s in samples)), "samples": samples}


def default_stop_ids(model, tokenizer) -> tuple[int, ...]:
    eos = model.cfg.eos_token_id
    ids = set(eos if isinstance(eos, tuple) else () if eos is None else (eos,))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def write_outputs(output_dir: str | pathlib.Path, rows: Sequence[Mapping[str, Any]],
                  metrics: Mapping[str, Mapping[str, float]]) -> None:
    """eval_rollout.jsonl, eval_metrics.json and pass_at_k.png in ``output_dir``, each written atomically."""
    output_dir = pathlib.Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(output_dir / "eval_rollout.jsonl",
                  lambda f: f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    atomic_write(output_dir / "eval_metrics.json", lambda f: json.dump(metrics, f, indent=2, sort_keys=True))
    atomic_write(output_dir / "pass_at_k.png", lambda f: _plot(metrics, f), binary=True)


def _plot(metrics: Mapping[str, Mapping[str, float]], file) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for source, values in sorted(metrics.items()):
        ks = sorted(int(key.split("@")[1]) for key in values if key.startswith("pass@"))
        axes.plot(ks, [values[f"pass@{k}"] for k in ks], marker="o", label=source)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("k")
    axes.set_ylabel("pass@k")
    axes.set_ylim(0, 1)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(file, format="png", dpi=120)
    plt.close(figure)


def run(config, checkpoint: str | pathlib.Path) -> dict[str, dict[str, float]]:
    """Evaluate ``checkpoint`` as ``config`` (configs/eval.py) says; write the outputs; return the metrics."""
    from absl import logging

    from pacs_jax import checkpoints
    from pacs_jax.data import load_tokenizer
    from pacs_jax.sharding import make_mesh

    checkpoint = pathlib.Path(checkpoint)
    output_dir = pathlib.Path(config.output_dir or checkpoint / "eval")
    eval_sets = load_eval_sets(config.sets, dict(config.set_files), config.data_dir, config.max_problems)
    tokenizer_dir = pathlib.Path(config.tokenizer or checkpoint)
    if not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise ValueError(f"{tokenizer_dir}: no tokenizer files (tokenizer_config.json); pass --config.tokenizer=DIR")
    mesh = make_mesh(**config.mesh) if config.use_mesh else None
    model = checkpoints.from_pretrained(checkpoint, dtype=config.dtype, mesh=mesh)
    tokenizer = load_tokenizer(tokenizer_dir)
    with RewardPool(config.reward.workers or None, item_timeout=config.reward.item_timeout) as pool:
        rows, metrics = evaluate_sets(
            model, tokenizer, eval_sets, n=config.n, temperature=config.temperature, top_p=config.top_p,
            top_k=config.top_k, max_new_tokens=config.max_new_tokens, seed=config.seed,
            stop_token_ids=tuple(config.stop_token_ids), batch_size=config.batch_size,
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
    """Flags are defined here, not at import, so the trainer can import this module beside its own flags."""
    from absl import app, flags
    from ml_collections import config_flags

    config_flag = config_flags.DEFINE_config_file("config", None, "evaluation config file (configs/eval.py)")
    checkpoint_flag = flags.DEFINE_string("checkpoint", None, "HF model folder or pacs_jax checkpoint folder")
    flags.mark_flags_as_required(["config", "checkpoint"])

    def main(argv: Sequence[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        run(config_flag.value, checkpoint_flag.value)

    app.run(main)


if __name__ == "__main__":
    _cli()
