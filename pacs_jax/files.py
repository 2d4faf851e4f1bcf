"""Writing files so that a reader never sees a half-written one."""

from __future__ import annotations

import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import IO

from etils import epath


def atomic_write(path: str | pathlib.Path, write: Callable[[IO], None], *, binary: bool = False) -> None:
    """Call ``write(file)`` on a temporary file in ``path``'s folder, then rename it over ``path``.

    The folder is created if missing; on any error the temporary file is removed and ``path`` is
    left as it was. On an object store (``gs://...``) the object is written directly: a store
    publishes an object whole when it is closed.
    """
    if "://" in str(path):
        with epath.Path(path).open("wb" if binary else "w") as f:
            write(f)
        return
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def atomic_write_text(path: str | pathlib.Path, text: str) -> None:
    """``atomic_write`` of a UTF-8 string."""
    atomic_write(path, lambda f: f.write(text))
