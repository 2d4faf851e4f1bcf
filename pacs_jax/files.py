"""Writing files so that a reader never sees a half-written one, with the modes a plain ``open()`` gives.

``tempfile.mkstemp`` and ``mkdtemp`` create 0600 files and 0700 folders; a file renamed into place
would keep that mode, which colleagues on a shared cluster cannot read. ``atomic_write`` and
``publish_mode`` give them the process's umask instead (0644 and 0755 under the usual umask 022).
"""

from __future__ import annotations

import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import IO

from etils import epath


def current_umask() -> int:
    """The process's umask (read from /proc where there is one: setting it to read it is racy)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_mode(path: str | os.PathLike | int, *, directory: bool = False) -> None:
    """Give ``path`` (or an open file descriptor) the mode ``open()`` / ``mkdir()`` would have: 0666
    (files) or 0777 (folders) less the umask. For files and folders made by ``tempfile``."""
    mode = (0o777 if directory else 0o666) & ~current_umask()
    if isinstance(path, int):
        os.fchmod(path, mode)
    else:
        os.chmod(path, mode)


def atomic_write(path: str | pathlib.Path, write: Callable[[IO], None], *, binary: bool = False) -> None:
    """Call ``write(file)`` on a temporary file in ``path``'s folder, then rename it over ``path``.

    The folder is created if missing; on any error the temporary file is removed and ``path`` is
    left as it was. The file gets the mode ``open()`` would give it (``publish_mode``). On an object
    store (``gs://...``) the object is written directly: a store publishes an object whole when it
    is closed.
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
            publish_mode(f.fileno())
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def atomic_write_text(path: str | pathlib.Path, text: str) -> None:
    """``atomic_write`` of a UTF-8 string."""
    atomic_write(path, lambda f: f.write(text))
