"""The evaluation runner: N samples per problem of each evaluation set, scored by the verifiable reward.

    sets = load_eval_sets("math_500,aime_2024", files, data_dir="data")
    rows, metrics = evaluate_sets(model, tokenizer, sets, n=16, temperature=0.6, top_p=0.95,
                                  max_new_tokens=4096, reward_pool=pool)

Used by the evaluation CLI (pacs_jax/evaluate.py) and the trainer's periodic evaluation, which
passes its own reward pool.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pacs_jax import console, sampling
from pacs_jax.data import INSTRUCTION, Problem, build_prompts, load_problems, paths
from pacs_jax.errors import UsageError
from pacs_jax.evaluation.pass_at_k import pass_at_k_metrics
from pacs_jax.rewards import RewardPool, reward_for

REWARD_BY_SOURCE = {"gsm8k": "gsm8k"}  # strict mode: every other data source is scored with the math reward


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Problems of one data source and the reward that scores them ("math" or "gsm8k")."""

    name: str
    problems: Sequence[Problem]
    reward: str = "math"


def set_reward(name: str, mode: str) -> str:
    """The reward that scores evaluation set ``name`` in ``reward.mode`` ``mode``: "paper" scores every
    set with the authors' math-verify call, as they evaluate (GSM8K included); "strict" scores GSM8K by
    its final number and every other set with the math reward."""
    return reward_for(REWARD_BY_SOURCE.get(name, "math"), mode)


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How one evaluation set is sampled: n samples per problem at a temperature and top_p (0: greedy),
    at most max_new_tokens each."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int


def load_eval_sets(names: str | Sequence[str], files: Mapping[str, str], data_dir: str | pathlib.Path = ".",
                   max_problems: int = 0, reward_mode: str = "strict") -> list[EvalSet]:
    """The named sets; ``files[name]`` is a path relative to ``data_dir`` (or absolute, or ``tfds:NAME``).
    Each set's reward is ``set_reward(name, reward_mode)``.
    A relative path not found from the working directory is read from the repository root (the default
    data_dir "data" is the repository's); found in neither, a ``UsageError`` names it and both places.
    A name without an entry in ``files`` is a ``UsageError`` naming config.eval.sets.

    max_problems > 0 keeps the first max_problems problems of each set.
    """
    names = [n.strip() for n in names.split(",") if n.strip()] if isinstance(names, str) else list(names)
    if not names:
        raise UsageError("config.eval.sets: no evaluation sets given")
    sets = []
    for name in names:
        if name not in files:
            raise UsageError(f"config.eval.sets: evaluation set {name!r} has no entry in config.eval.set_files (known: "
                             f"{sorted(files)})")
        spec = files[name]
        if not spec.startswith("tfds:"):
            path = pathlib.Path(data_dir) / spec
            spec = str(paths.resolve(path))  # relative: the working directory's, else the repository root's
            if not pathlib.Path(spec).exists():
                raise UsageError(f"evaluation set {name!r}: {paths.missing(path)}; set the folder of the sets "
                                 f"with data_dir (now {str(data_dir)!r})")
        problems, _ = load_problems(spec, data_source=name)
        if max_problems > 0:
            problems = problems[:max_problems]
        sets.append(EvalSet(name, problems, set_reward(name, reward_mode)))
    return sets


def evaluate_per_set(model, tokenizer, eval_sets: Sequence[EvalSet], settings: Mapping[str, EvalSettings],
                     default: EvalSettings, **options) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """``evaluate_sets`` with each set's own settings (``settings[name]``, else ``default``): sets that
    share settings are sampled together. options: ``evaluate_sets``'s other keywords.
    Returns (rows, metrics) as ``evaluate_sets``, each set's pass@k up to its own n."""
    groups: dict[EvalSettings, list[EvalSet]] = {}
    for eval_set in eval_sets:
        groups.setdefault(settings.get(eval_set.name, default), []).append(eval_set)
    rows, metrics = [], {}
    for s, group in groups.items():
        group_rows, group_metrics = evaluate_sets(model, tokenizer, group, n=s.n, temperature=s.temperature,
                                                  top_p=s.top_p, max_new_tokens=s.max_new_tokens, **options)
        rows += group_rows
        metrics.update(group_metrics)
    return rows, metrics


def evaluate_sets(model, tokenizer, eval_sets: Sequence[EvalSet], *, n: int, temperature: float, top_p: float,
                  max_new_tokens: int, seed: int = 0, top_k: int = 0, stop_token_ids: Sequence[int] = (),
                  batch_size: int = 32, slots: int | None = None, tail_slots: int | None = None,
                  page_size: int | None = None, pages: int | None = None, max_prompt_length: int = 2048,
                  instruction: str = INSTRUCTION,
                  reward_pool: RewardPool, progress: bool = False) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Sample ``n`` responses per problem, score them, and compute pass@k per data source.

    model: a ``models.Qwen``; tokenizer: its Hugging Face tokenizer (chat template, decoding);
    instruction: what follows each problem in the user message (data/prompts.py).
    stop_token_ids: () means the tokenizer's eos token and the model's eos ids.
    batch_size: prompts per ``sampling.generate`` call (batch_size * n sequences).
    slots: decode slots per call (continuous batching, capped at the call's rows); None: one per row.
    tail_slots: with slots, the narrowest the decode batch gets in a call's tail (SamplingSettings).
    page_size, pages: the paged sampler's pages (SamplingSettings); page_size None: no pages.
    reward_pool: the caller's RewardPool (the trainer's own during training: no second pool).
    Problems whose prompt exceeds max_prompt_length tokens get no row (keep it large for evaluation).

    Returns (rows, metrics): one row per evaluated problem (see ``_row``) and
    {data_source: {"pass@1": ..., "pass@k": ..., "mean@N": ...}}.
    """
    if n < 1 or batch_size < 1:
        raise ValueError(f"n={n} and batch_size={batch_size} must be >= 1")
    examples, rewards_of = [], []
    for eval_set in eval_sets:
        kept, _ = build_prompts(eval_set.problems, tokenizer, max_prompt_length, instruction)
        examples += kept
        rewards_of += [eval_set.reward] * len(kept)
    stops = tuple(stop_token_ids) or default_stop_ids(model, tokenizer)

    rows = []
    with console.bar(total=len(examples), desc="evaluate", unit="problem", disable=not progress) as bar:
        for chunk, start in enumerate(range(0, len(examples), batch_size)):
            batch = examples[start:start + batch_size]
            out = sampling.generate(model, [list(e.prompt_ids) for e in batch], max_new_tokens=max_new_tokens,
                                    n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                    stop_token_ids=stops, seed=seed + chunk, slots=slots, tail_slots=tail_slots,
                                    page_size=page_size, pages=pages)
            texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in out.tokens]
            golds = [e.problem.ground_truth for e in batch for _ in range(n)]
            reward_names = [r for r in rewards_of[start:start + batch_size] for _ in range(n)]
            scores, statuses, _ = reward_pool.score(texts, golds, reward_names)
            for i, example in enumerate(batch):
                samples = slice(i * n, (i + 1) * n)
                rows.append(_row(example.problem, texts[samples], scores[samples], statuses[samples],
                                 out.finish_reason[samples], [len(t) for t in out.tokens[samples]]))
            bar.update(len(batch))
    return rows, pass_at_k_metrics(rows, n)


def _row(problem: Problem, texts: Sequence[str], scores: np.ndarray, statuses: Sequence[str],
         finish_reasons: Sequence[str], lengths: Sequence[int]) -> dict[str, Any]:
    """One problem's record: its fields, and its samples with score, reward status, finish reason, length."""
    samples = [{"response": text, "score": float(score), "status": status, "finish_reason": reason,
                "num_tokens": length}
               for text, score, status, reason, length in zip(texts, scores, statuses, finish_reasons, lengths)]
    return {**problem.to_json(), "num_correct": int(sum(s["score"] == 1.0 for s in samples)), "samples": samples}


def default_stop_ids(model, tokenizer) -> tuple[int, ...]:
    """The model's eos ids (its config) and the tokenizer's eos id, sorted."""
    eos = model.cfg.eos_token_id
    ids = set(eos if isinstance(eos, tuple) else () if eos is None else (eos,))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
