"""tensorflow-datasets as an optional source: ``load_problems("tfds:gsm8k:test")``.

Needs the ``tfds`` install extra (``pip install 'pacs_jax[tfds]'``). The dataset is read through
``tfds.data_source`` (random access, no TensorFlow graph), its records decoded (bytes -> str, NumPy
scalars -> Python) and mapped to ``Problem`` records with the field map of its format, which by
default is the dataset's name (e.g. "gsm8k"), so it joins the same grain pipeline as files do.
"""

from __future__ import annotations

from typing import Any

from pacs_jax.data.fields import FORMATS, ReadStats, convert_rows
from pacs_jax.data.records import Problem


def read_tfds(name: str, split: str = "test", *, format: str | None = None, data_source: str | None = None,
              data_dir: str | None = None, on_error: str = "raise") -> tuple[list[Problem], ReadStats]:
    """Problems of the registered TFDS dataset ``name`` (e.g. "gsm8k"), split ``split``."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as error:
        raise ImportError(f"tfds:{name} needs tensorflow-datasets: pip install 'pacs_jax[tfds]'") from error
    format = format or name.split("/")[0]
    if format not in FORMATS:
        raise ValueError(f"tfds:{name}: no field map for format {format!r}; pass format= one of {sorted(FORMATS)}")
    source = tfds.data_source(name, split=split, data_dir=data_dir)
    rows = ((f"tfds:{name}:{split} record {i}", _decode(source[i])) for i in range(len(source)))
    return convert_rows(rows, format, data_source or format, on_error)


def _decode(value: Any) -> Any:
    """TFDS record values as JSON-like Python values: bytes -> str, NumPy scalars/arrays -> Python."""
    if isinstance(value, dict):
        return {key: _decode(item) for key, item in value.items()}
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if hasattr(value, "tolist"):  # NumPy scalar or array
        return _decode(value.tolist())
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value
