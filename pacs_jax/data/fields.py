"""Field maps of the native dataset formats and the conversion of decoded rows into ``Problem`` records.

Shared by the file readers (``readers.py``) and the TFDS source (``tfds_source.py``). Field mapping
(docs/design.md section 7.2): the first key present wins.

    format       problem              answer
    deepscaler   problem              answer
    math_500     problem              answer
    aime_2024    Problem | problem    Answer | answer
    aime_2025    problem              answer (an int)
    amc23        question | problem   answer (a float like 27.0, read as "27")
    gsm8k        question             answer: the text after the last "####" ("1,600" read as "1600")
    pacs         problem              ground_truth (our own jsonl, written by tools/prepare_data.py)

and, for files of one's own (named after no dataset), formats named by their fields, which a reader
picks from the first row's fields (``GENERIC_FORMATS``, in this order):

    problem_answer       problem          answer
    question_answer      question         answer
    prompt_ground_truth  prompt           ground_truth

An answer may be a string or a number; anything else (list, object, null, boolean) is malformed, and
so is an empty one (the DeepScaleR MATH file has two null and two empty answers: a problem nobody
can score would only teach the policy that everything is wrong). Malformed rows raise ``DataError``
naming their location, or with ``on_error="skip"`` are skipped and counted in ``ReadStats``; a read
whose every row is malformed (a file without its format's answer field) raises even so, naming the
first row's error and the fields the format reads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

from pacs_jax.data.records import DataError, Problem


@dataclasses.dataclass(frozen=True)
class FieldMap:
    """Where a format keeps the problem and the answer (candidate keys, first present wins)."""

    problem: tuple[str, ...]
    answer: tuple[str, ...]
    answer_after: str | None = None  # the answer is the text after the last occurrence of this marker


FORMATS: dict[str, FieldMap] = {
    "pacs": FieldMap(("problem",), ("ground_truth",)),
    "deepscaler": FieldMap(("problem",), ("answer",)),
    "math_500": FieldMap(("problem",), ("answer",)),
    "aime_2024": FieldMap(("Problem", "problem"), ("Answer", "answer")),
    "aime_2025": FieldMap(("problem",), ("answer",)),
    "amc23": FieldMap(("question", "problem"), ("answer",)),
    "gsm8k": FieldMap(("question",), ("answer",), answer_after="####"),
    "problem_answer": FieldMap(("problem",), ("answer",)),
    "question_answer": FieldMap(("question",), ("answer",)),
    "prompt_ground_truth": FieldMap(("prompt",), ("ground_truth",)),
}
# Formats named by their fields, not by a dataset: a file of one's own whose rows have them is read by
# them whatever its name (readers._resolve_format), and its problems' data_source is the file's name.
GENERIC_FORMATS = ("problem_answer", "question_answer", "prompt_ground_truth")


def format_of_fields(row: Any) -> str | None:
    """The first of ``GENERIC_FORMATS`` whose problem and answer fields ``row`` (a decoded row) has, or
    None."""
    if not isinstance(row, dict):
        return None
    for name in GENERIC_FORMATS:
        fields = FORMATS[name]
        if any(k in row for k in fields.problem) and any(k in row for k in fields.answer):
            return name
    return None

_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


@dataclasses.dataclass
class ReadStats:
    """What a read produced: problems kept, malformed rows skipped (only with on_error="skip")."""

    rows: int = 0
    skipped: int = 0
    first_errors: list[str] = dataclasses.field(default_factory=list)  # up to 5 messages of skipped rows
    skipped_rows: list[str] = dataclasses.field(default_factory=list)  # every skipped row's message ("FILE:LINE: why")


def convert_rows(rows: Iterable[tuple[str, Any]], format: str, data_source: str,
                 on_error: str = "raise") -> tuple[list[Problem], ReadStats]:
    """(location, row) pairs -> Problems; ``location`` (e.g. "file.jsonl:12") prefixes every error. With
    ``on_error="skip"`` a malformed row is skipped and counted, but rows all malformed are an error."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error={on_error!r}: expected 'raise' or 'skip'")
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: expected one of {sorted(FORMATS)}")
    fields = FORMATS[format]
    problems, stats = [], ReadStats()
    for index, (where, row) in enumerate(rows):
        try:
            problems.append(_to_problem(row, fields, format, data_source, index, where))
        except DataError as error:
            if on_error == "raise":
                error.skippable = True  # one row's: on_error="skip" would have skipped it
                raise
            stats.skipped += 1
            stats.skipped_rows.append(str(error))
            if len(stats.first_errors) < 5:
                stats.first_errors.append(str(error))
    if stats.skipped and not problems:
        raise DataError(f"{stats.first_errors[0]}; no row of the {stats.skipped} read is a problem (all malformed): "
                        f"format {format!r} reads the problem from {_alternatives(fields.problem)} and the answer "
                        f"from {_alternatives(fields.answer)}")
    stats.rows = len(problems)
    return problems, stats


def _to_problem(row: Any, fields: FieldMap, format: str, data_source: str, index: int, where: str) -> Problem:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    problem_key = _first_present(row, fields.problem, where)
    answer_key = _first_present(row, fields.answer, where)
    problem = row[problem_key]
    if not isinstance(problem, str) or not problem.strip():
        raise DataError(f"{where}: field {problem_key!r} must be a non-empty string, got {_describe(problem)}")
    answer = _answer_text(row[answer_key], answer_key, where)
    if fields.answer_after:
        head, marker, tail = answer.rpartition(fields.answer_after)
        if not marker:
            raise DataError(f"{where}: field {answer_key!r} has no {fields.answer_after!r} before its final answer")
        answer = tail.strip()
        if _THOUSANDS.fullmatch(answer):
            answer = answer.replace(",", "")
    if not answer.strip():
        raise DataError(f"{where}: field {answer_key!r} holds no answer")
    if format == "pacs":
        source = row.get("data_source", data_source)
        if not isinstance(source, str) or not source:
            raise DataError(f"{where}: field 'data_source' must be a non-empty string, got {_describe(source)}")
        extra = row.get("extra", {})
        if not isinstance(extra, dict):
            raise DataError(f"{where}: field 'extra' must be an object, got {_describe(extra)}")
        position = row.get("index", index)
        if not isinstance(position, int) or isinstance(position, bool):
            raise DataError(f"{where}: field 'index' must be an integer, got {_describe(position)}")
        return Problem(source, problem, answer.strip(), position, dict(extra))
    used = {problem_key} if fields.answer_after else {problem_key, answer_key}  # gsm8k keeps its worked answer
    extra = {k: v for k, v in row.items() if k not in used}
    return Problem(data_source, problem, answer.strip(), index, extra)


def _first_present(row: dict, keys: tuple[str, ...], where: str) -> str:
    for key in keys:
        if key in row:
            return key
    raise DataError(f"{where}: missing field {_alternatives(keys)}")


def _alternatives(keys: tuple[str, ...]) -> str:
    return " or ".join(repr(k) for k in keys)


def _answer_text(value: Any, key: str, where: str) -> str:
    """A string as is; an integer as its digits; a float as an integer when whole (27.0 -> "27")."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else repr(value)
    raise DataError(f"{where}: field {key!r} must be a string or a number, got {_describe(value)}")


def _describe(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
