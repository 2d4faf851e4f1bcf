"""Writing files so that a reader never sees a half-written one, with the modes a plain ``open()`` gives.

``tempfile.mkstemp`` and ``mkdtemp`` create 0600 files and 0700 folders; a file renamed into place
would keep that mode, which colleagues on a shared cluster cannot read. ``atomic_write`` and
``publish_mode`` give them the process's umask instead (0644 and 0755 under the usual umask 022).

``storage_error`` recognises a full disk, a quota or a permission error among an exception's causes
(an ``OSError``, or Orbax's tensorstore error carrying the OS error code), so that a run reports it
in one line naming the path (``StorageError``) rather than in a long traceback.
"""

from __future__ import annotations

import errno
import io
import os
import re
import pathlib
import tempfile
from collections.abc import Callable
from typing import IO

from etils import epath

from pacs_jax.errors import PermanentError

_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an object on a store (``gs://...``, any ``scheme://``), not a local file."""
    return "://" in str(path)


class StorageError(PermanentError):
    """A write failed for a full disk, a quota or a permission; the message names the path. Permanent:
    a restart fails the same way until space is freed or the permission fixed (it then resumes from
    the last checkpoint)."""


def storage_error(exc: BaseException | None) -> str | None:
    """"PATH: No space left on device" (or the quota / permission / read-only error) when ``exc`` or an
    exception it was raised from is one; else None.

    Knows ``OSError`` (its ``filename``) and tensorstore's errors (Orbax's array writes: a ValueError
    whose message quotes the file and ends with ``[os_error_code='28']``).
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS:
            where = exc.filename if exc.filename is not None else "(a file being written)"
            return f"{where}: {os.strerror(exc.errno)}"
        code = re.search(r"os_error_code='?(\d+)", str(exc))
        if code and int(code.group(1)) in _STORAGE_ERRNOS:
            files = re.findall(r'"((?:/|gs://)[^"]+)"', str(exc))
            return f"{files[-1] if files else '(a checkpoint file)'}: {os.strerror(int(code.group(1)))}"
        exc = exc.__cause__ or exc.__context__
    return None


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


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], *, binary: bool = False) -> None:
    """Call ``write(file)`` on a temporary file in ``path``'s folder, then rename it over ``path``.

    The folder is created if missing; on any error the temporary file is removed and ``path`` is
    left as it was. The file gets the mode ``open()`` would give it (``publish_mode``). On an object
    store (``gs://...``; ``path`` a string or an ``epath.Path``) ``write`` fills a buffer in memory,
    which is then uploaded as the object: a store publishes an object only when its upload is
    complete, and an error in ``write`` uploads nothing.
    """
    if is_remote(path):
        buffer = io.BytesIO() if binary else io.StringIO()
        write(buffer)
        data = buffer.getvalue()
        epath.Path(path).write_bytes(data if binary else data.encode("utf-8"))
        return
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            publish_mode(f.fileno())
            write(f)
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:  # name the file a write or close failed on
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """``atomic_write`` of a UTF-8 string."""
    atomic_write(path, lambda f: f.write(text))
