"""The one record type every dataset reader produces."""

from __future__ import annotations

import dataclasses
from typing import Any

from pacs_jax.errors import PermanentError


class DataError(PermanentError, ValueError):
    """Malformed input; the message names the file (or source) and the line, item or row.

    Permanent (pacs_jax/errors.py): the trainer exits with status 78 and launch/supervise.sh does not
    restart it. ``skippable``: the error is one row's, which reading with ``on_error="skip"`` (the
    trainer's ``data.allow_skips``) would skip; False for a whole file's (its format, its structure)."""

    skippable: bool = False


@dataclasses.dataclass(frozen=True)
class Problem:
    """One math problem with its verifiable answer.

    data_source: the dataset it came from (e.g. "math_500"); eval metrics are grouped by it.
    problem: the question text (the prompt is built from it, see prompts.py).
    ground_truth: the gold answer as a string (LaTeX or a plain number), checked by rewards.
    index: position of the row in its source (line order), for tracing a result back.
    extra: every other field of the source row, kept as read (JSON values).
    """

    data_source: str
    problem: str
    ground_truth: str
    index: int
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The row of our own jsonl format (read back by readers with format "pacs")."""
        return {"data_source": self.data_source, "problem": self.problem, "ground_truth": self.ground_truth,
                "index": self.index, "extra": self.extra}
