"""Dataset readers: jsonl, JSON-list and parquet files (or a TFDS dataset) into ``Problem`` records.

    problems, stats = load_problems("data/math_500/test.jsonl")                     # format from the folder name
    problems, stats = load_problems("data/deepscaler_subset", format="deepscaler")
    problems, stats = load_problems("tfds:gsm8k:test")                              # needs the 'tfds' extra

The format comes from the folder or file name, else from the first row's fields (a file of one's own
with {problem, answer}, {question, answer} or {prompt, ground_truth} rows), or ``format=``; a spec
``PATH:FORMAT`` names it for one file (``split_format``). The field maps are in ``fields.py``.
Malformed input raises ``DataError`` naming the file and line (JSON list: the line where the item
starts; parquet: the row). A row of valid JSON without its format's fields or with a bad value is
instead skipped and counted in ``ReadStats`` with ``on_error="skip"``, unless every row is (then the
first one's error is raised, ``fields.convert_rows``); a line that is not JSON never is: the file is
damaged.
A path may be a ``gs://`` object or folder (read through ``etils.epath``, data/paths.py).
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator
from typing import Any

from etils import epath

from pacs_jax.data import paths
from pacs_jax.data.fields import FORMATS, GENERIC_FORMATS, ReadStats, convert_rows, format_of_fields
from pacs_jax.data.records import DataError, Problem
from pacs_jax.data.tfds_source import read_tfds

SUFFIXES = (".jsonl", ".json", ".parquet")
BOM = "\ufeff"  # a UTF-8 byte order mark, which some editors write at the start of a file


def split_format(spec: str) -> tuple[str, str | None]:
    """(path, format) of a data spec ``PATH:FORMAT`` (FORMAT a name of ``FORMATS``); (spec, None) for a
    spec without one (``tfds:NAME[:SPLIT]`` included)."""
    path, colon, name = str(spec).rpartition(":")
    if colon and name in FORMATS and path and not str(spec).startswith("tfds:"):
        return path, name
    return str(spec), None


def load_problems(spec: str | pathlib.Path, format: str = "auto", data_source: str | None = None,
                  on_error: str = "raise") -> tuple[list[Problem], ReadStats]:
    """Read a file, a folder of files, or ``tfds:NAME[:SPLIT]`` (split defaults to "test"); a spec
    ``PATH:FORMAT`` reads PATH in FORMAT whatever ``format`` says."""
    spec, named = split_format(spec) if isinstance(spec, str) else (spec, None)
    format = named or format
    if isinstance(spec, str) and spec.startswith("tfds:"):
        name, _, split = spec[len("tfds:"):].partition(":")
        return read_tfds(name, split or "test", format=None if format == "auto" else format,
                         data_source=data_source, on_error=on_error)
    return read_problems(spec, format, data_source, on_error)


def read_problems(path: str | pathlib.Path, format: str = "auto", data_source: str | None = None,
                  on_error: str = "raise") -> tuple[list[Problem], ReadStats]:
    """Read ``path`` (a .jsonl / .json / .parquet file, or a folder of them read in name order)."""
    path = paths.path(path)  # relative and missing here: the repository root's; gs://: read from the store
    if not path.exists():  # a DataError: one line, status 78 in the CLIs, even for a file gone since the check
        raise DataError(paths.missing(path))
    files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path}: no {'/'.join(SUFFIXES)} files in this folder")
    if next((row for file in files for row in _rows(file)), None) is None:
        raise DataError(f"{path}: holds no rows (an empty {'folder of files' if path.is_dir() else 'file'}?)")
    fmt = _resolve_format(path, files[0], format)
    rows = (row for file in files for row in _rows(file))
    return convert_rows(rows, fmt, data_source or _default_source(path, fmt), on_error)


def _resolve_format(path: epath.Path, first_file: epath.Path, format: str) -> str:
    """``format``, or (auto) "pacs" when the rows are ours, else the known format the path is named after,
    else the format the first row's fields name (``fields.format_of_fields``)."""
    if format != "auto":
        if format not in FORMATS:
            raise ValueError(f"format={format!r}: expected 'auto' or one of {sorted(FORMATS)}")
        return format
    where, row = next(_rows(first_file), (str(first_file), {}))
    if isinstance(row, dict) and "ground_truth" in row and "problem" in row:
        return "pacs"
    for name in (path.stem if path.is_file() else path.name, path.parent.name):  # deepscaler.json: "deepscaler"
        for known in FORMATS:
            if name == known or name.startswith(known + "_"):
                return known
    by_fields = format_of_fields(row)
    if by_fields:
        return by_fields
    fields = f"its first row has the fields {sorted(row)[:8]}" if isinstance(row, dict) else \
        "its first row is not a JSON object"
    raise DataError(f"{where}: cannot tell the dataset format from its name or fields ({fields}); name it, as "
                    f"PATH:FORMAT (or the trainer's data.format) with FORMAT one of {sorted(FORMATS)}")


def _default_source(path: epath.Path, format: str) -> str:
    """The data_source of a file's problems: its format's dataset, or the file's own name for our rows
    and for rows read by their fields."""
    if format != "pacs" and format not in GENERIC_FORMATS:
        return format
    return path.stem if path.is_file() else path.name


def _rows(path: epath.Path) -> Iterator[tuple[str, Any]]:
    """(location, decoded row) for each row of one file (a UTF-8 byte order mark, as Windows editors
    write, is dropped: ``BOM``)."""
    if path.suffix == ".jsonl":
        with path.open("r", encoding="utf-8") as f:  # epath reads UTF-8 whatever the encoding given
            for line_number, line in enumerate(f, 1):
                line = line.removeprefix(BOM) if line_number == 1 else line
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.rstrip("\r\n"))  # an error's column on this line, not the next
                except json.JSONDecodeError as error:  # a damaged file, not a row to skip
                    raise DataError(f"{path}:{line_number}: invalid JSON ({error.msg}, column {error.colno})") from None
                yield f"{path}:{line_number}", row
    elif path.suffix == ".json":
        yield from _json_list_items(path)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        with path.open("rb") as f:
            table = pq.read_table(f)
        for row_number, row in enumerate(table.to_pylist(), 1):
            yield f"{path}: row {row_number}", row
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; expected one of {SUFFIXES}")


def _json_list_items(path: epath.Path) -> Iterator[tuple[str, Any]]:
    """Items of a JSON list file, each located by the line where it starts."""
    text = path.read_text(encoding="utf-8").removeprefix(BOM)
    decoder = json.JSONDecoder()
    whitespace = re.compile(r"\s*")
    position = whitespace.match(text, 0).end()
    if not text.startswith("[", position):
        raise DataError(f"{path}:{text.count(chr(10), 0, position) + 1}: expected a JSON list of objects")
    position += 1
    line, counted_to = 1, 0
    while True:
        position = whitespace.match(text, position).end()
        if text.startswith("]", position):
            return
        line += text.count("\n", counted_to, position)
        counted_to = position
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{error.lineno}: invalid JSON ({error.msg}, column {error.colno})") from None
        yield f"{path}:{line}", item
        position = whitespace.match(text, position).end()
        if text.startswith(",", position):
            position += 1
        elif not text.startswith("]", position):
            raise DataError(f"{path}:{text.count(chr(10), 0, position) + 1}: expected ',' or ']' after a list item")


