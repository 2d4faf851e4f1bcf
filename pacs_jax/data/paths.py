"""Paths a config names: relative ones, and object-store ones (``gs://bucket/...``).

The configs name the repository's files relative to its root ("data/math_500/...",
"data/tokenizers/qwen3"), which works from the root only. ``resolve`` keeps a path that exists as
given (relative ones against the working directory) and otherwise tries the repository root, so the
commands also work from another folder; ``missing`` says where a path that exists in neither was
looked for. ``path`` is the one way a reader opens what a config names: an ``etils.epath.Path``,
which reads a local file and a ``gs://`` object alike (data files, JSON files beside a model).
Readers that take local files only (transformers' tokenizer, the HF weights loader) get a local copy
of a ``gs://`` folder from data/remote.py.
"""

from __future__ import annotations

import os
import pathlib

from etils import epath

from pacs_jax.errors import UsageError
from pacs_jax.files import is_remote

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]  # pacs_jax/data/paths.py -> the repository


def resolve(path: str | os.PathLike) -> str | os.PathLike:
    """``path`` itself when it exists (a relative one against the working directory), is absolute, or is
    no local path (``gs://...``, a hub name); else the same relative path under the repository root when
    it exists there; else ``path`` itself."""
    if is_remote(path):
        return path
    local = pathlib.Path(path)
    if local.is_absolute() or local.exists() or not (REPO_ROOT / local).exists():
        return path
    return REPO_ROOT / local


def path(name: str | os.PathLike) -> epath.Path:
    """``resolve(name)`` as an ``epath.Path``: a local path, or a ``gs://`` object read through the store."""
    return epath.Path(resolve(name))


def join(folder: str | os.PathLike, name: str | os.PathLike) -> str:
    """``folder / name`` as a string, for a local folder or a ``gs://`` one (``name`` absolute or
    ``gs://...``: itself)."""
    if is_remote(name) or pathlib.PurePath(name).is_absolute():
        return str(name)
    return str(epath.Path(folder) / name)


def config_file_args(argv: list[str], flag: str = "config") -> list[str]:
    """``argv`` with its ``--FLAG=FILE[:ARG]`` (FILE relative) naming the file ``resolve`` finds: the
    README's ``--config=configs/paper.py:...`` works from any folder, as the configs' data paths do.
    Raises ``UsageError`` (one line, naming the flag and where FILE was looked for) when FILE exists in
    neither place."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if eq and name in (f"--{flag}", f"-{flag}") and value:
            file, colon, rest = value.partition(":")
            found = resolve(file)
            if not pathlib.Path(found).is_file():
                raise UsageError(f"{name}={value}: {missing(file)}")
            arg = f"{name}={found}{colon}{rest}"
        out.append(arg)
    return out


def missing(path: str | os.PathLike, hint: str = "") -> str:
    """"PATH does not exist" + ``hint`` + where a relative ``path`` was looked for (the working directory,
    then the repository root); a ``gs://`` path: "no object or folder PATH"."""
    if is_remote(path):
        return f"{path} does not exist (no object or folder of that name in the store){hint}"
    path = pathlib.Path(path)
    where = "" if path.is_absolute() else (f" (a relative path: looked for in the working directory "
                                           f"{pathlib.Path.cwd()}, then in the repository root {REPO_ROOT})")
    return f"{path} does not exist{hint}{where}"
