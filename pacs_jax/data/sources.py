"""The training data of a config (``config.data``): its problems, their splits, its prompts.

    train, warm, held_out, counts = training_problems(config.data, seed=config.seed)
    examples, dropped = build_prompts(train, tokenizer, config.data.max_prompt_length, config.data.instruction)

``data.source`` is "files" (the problems of ``data.train_files``, readers.load_problems, each in the
format its name or its rows' fields say, ``data.format`` when set, or its own ``FILE:FORMAT``) or
"arithmetic" (generated word problems, data/arithmetic.py). The problems are split three ways, in
this order:

    [ warm-start only (data.warmstart_problems) | RL (train) | held out (data.held_out_problems) ]

``data.held_out_problems`` problems are set aside and never trained on; the evaluation set named
"held_out" measures them. ``data.warmstart_problems`` problems go to the supervised warm-start only
and RL never samples them (0: none set aside, the warm-start trains on RL's problems). Files: a
``data.shuffle_seed`` permutation of all problems read is split (file order when nothing is set
aside); arithmetic: the problems in the order generated.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pacs_jax.data import arithmetic
from pacs_jax.data.readers import load_problems
from pacs_jax.data.records import DataError, Problem
from pacs_jax.errors import UsageError

SOURCES = ("files", "arithmetic")


def training_problems(data_config: Mapping, seed: int
                      ) -> tuple[list[Problem], list[Problem], list[Problem], dict]:
    """(RL's problems, the warm-start's own problems, held-out problems, counts) of ``data_config``;
    counts: rows read, skipped (malformed rows, with data.allow_skips), held_out, warmstart, and
    skipped_rows: each skipped row's message, "FILE:LINE: why" (the trainer names them in its log and in
    workdir/skipped_rows.txt)."""
    source, held, warm = data_config["source"], data_config["held_out_problems"], data_config["warmstart_problems"]
    if source == "arithmetic":
        task = data_config["arithmetic"]
        problems = arithmetic.make_problems(task["problems"] + held, seed, task["max_operand"])
        skipped, skipped_rows = 0, []
    elif source == "files":
        problems, skipped, skipped_rows = [], 0, []
        for spec in data_config["train_files"]:
            try:
                read, stats = load_problems(spec, format=data_config.get("format", "auto"),
                                            on_error="skip" if data_config["allow_skips"] else "raise")
            except DataError as error:
                if not error.skippable:
                    raise
                raise DataError(f"{error} (a malformed row; --config.data.allow_skips=True skips such rows, "
                                "naming each in the log and in the workdir's skipped_rows.txt)") from None
            problems += read
            skipped += stats.skipped
            skipped_rows += stats.skipped_rows
        order = np.random.default_rng(data_config["shuffle_seed"]).permutation(len(problems))
        problems = [problems[i] for i in order] if held or warm else problems
    else:
        raise ValueError(f"data.source={source!r}: expected one of {SOURCES}")
    if held >= len(problems):
        raise UsageError(f"config.data.held_out_problems: {held} leaves no training problems of the {len(problems)} "
                         f"read; set it below {len(problems)}")
    if warm + held >= len(problems):
        raise UsageError(f"config.data.warmstart_problems: {warm} with data.held_out_problems={held} leaves no RL "
                         f"problems of the {len(problems)} read; set them to less than {len(problems)} together")
    cut = len(problems) - held
    counts = {"rows": len(problems), "skipped": skipped, "held_out": held, "warmstart": warm,
              "skipped_rows": skipped_rows}
    return problems[warm:cut], problems[:warm], problems[cut:], counts
