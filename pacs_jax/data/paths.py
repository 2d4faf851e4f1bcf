"""Relative data paths: the configs name the repository's files relative to its root ("data/math_500/...",
"data/tokenizers/qwen3"), which works from the root only. ``resolve`` keeps a path that exists as
given (relative ones against the working directory) and otherwise tries the repository root, so the
commands also work from another folder; ``missing`` says where a path that exists in neither was
looked for.
"""

from __future__ import annotations

import os
import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]  # pacs_jax/data/paths.py -> the repository


def resolve(path: str | os.PathLike) -> str | os.PathLike:
    """``path`` itself when it exists (a relative one against the working directory), is absolute, or is
    no local path (``gs://...``, a hub name); else the same relative path under the repository root when
    it exists there; else ``path`` itself."""
    local = pathlib.Path(path)
    if "://" in str(path) or local.is_absolute() or local.exists() or not (REPO_ROOT / local).exists():
        return path
    return REPO_ROOT / local


def missing(path: str | os.PathLike, hint: str = "") -> str:
    """"PATH does not exist" + ``hint`` + where a relative ``path`` was looked for (the working directory,
    then the repository root)."""
    path = pathlib.Path(path)
    where = "" if path.is_absolute() else (f" (a relative path: looked for in the working directory "
                                           f"{pathlib.Path.cwd()}, then in the repository root {REPO_ROOT})")
    return f"{path} does not exist{hint}{where}"
