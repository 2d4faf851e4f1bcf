"""The lock of a run's workdir (docs/design.md section 3.7).

``WorkdirLock``: ``<workdir>/trainer.lock`` holds the host and pid of the trainer using the
workdir; a second trainer refuses to start, naming them. A lock whose holder is gone (same host,
that pid no longer running, or running a process started after the lock) is taken over with a
message. The holder's pid cannot be looked up from another host (a workdir on a shared file
system), so the holder refreshes the lock file's modification time every ``heartbeat`` seconds
(60, from a thread of its own: a long step or compilation does not delay it); a lock from another
host is stale when its last refresh is older than ``stale_after`` seconds (600), and is then taken
over with a message naming its host, pid and the age of its last refresh. Only process 0 of a
multi-process run takes it (the others learn whether it did). On an object store (a ``gs://``
workdir) the lock is an object created only if absent (GCS's ``ifGenerationMatch=0``, through
fsspec), and the heartbeat uploads it again (a store cannot set an object's modification time).
A takeover of a stale lock deletes it and creates it again, on a store as on a file system: two
trainers taking over the same stale lock at the same moment may both start.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time

import fsspec
import jax
import numpy as np
from etils import epath

from pacs_jax.files import is_remote
from pacs_jax.training.spec import ConfigError

LOCK_FILE = "trainer.lock"


class WorkdirLockedError(ConfigError):
    """Another trainer holds the workdir (its host and pid are in the message)."""


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (/proc/PID/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def agree(ok: bool) -> bool:
    """Process 0's ``ok``, on every process (a collective in a multi-process run)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


class _LocalLockFile:
    """The lock file on a file system (local or shared): created with ``O_EXCL``; a refresh sets its
    modification time."""

    def __init__(self, path: epath.Path):
        self.path = os.fspath(path)

    def create(self, record: str) -> bool:
        """Create the file holding ``record``; False when it exists."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(record)
        return True

    def read(self) -> str:
        with open(self.path, encoding="utf-8") as f:
            return f.read()

    def modified(self) -> float:
        """When it was created or last refreshed (seconds since the epoch)."""
        return os.stat(self.path).st_mtime

    def refresh(self, record: str) -> None:
        os.utime(self.path)

    def remove(self) -> None:
        os.unlink(self.path)


class _StoreLockFile:
    """The lock file as an object on a store (``gs://``), through fsspec: created only if absent
    (``pipe_file(mode="create")``; gcsfs sends it with ``ifGenerationMatch=0``, which GCS refuses when
    the object exists); a store cannot set an object's modification time, so a refresh uploads the
    holder's record again."""

    def __init__(self, path: epath.Path):
        self.fs, self.key = fsspec.core.url_to_fs(str(path))

    def create(self, record: str) -> bool:
        """Create the object holding ``record``; False when it exists."""
        try:
            self.fs.pipe_file(self.key, record.encode(), mode="create")
        except FileExistsError:
            return False
        return True

    def read(self) -> str:
        return self.fs.cat_file(self.key).decode()

    def modified(self) -> float:
        """When it was created or last refreshed (seconds since the epoch)."""
        mtime = self.fs.info(self.key)["mtime"]
        return mtime.timestamp() if isinstance(mtime, datetime.datetime) else float(mtime)

    def refresh(self, record: str) -> None:
        self.fs.pipe_file(self.key, record.encode())

    def remove(self) -> None:
        self.fs.rm_file(self.key)


class WorkdirLock:
    """``with WorkdirLock(workdir):`` holds ``workdir/trainer.lock`` (see the module docstring).

    heartbeat: seconds between the holder's refreshes of the lock file's modification time;
    stale_after: seconds without a refresh after which another host's lock is taken over. Raises
    ``WorkdirLockedError`` (a permanent error) when another live trainer holds it.
    """

    def __init__(self, workdir: str | os.PathLike, *, heartbeat: float = 60.0, stale_after: float = 600.0):
        self.workdir = epath.Path(workdir)
        self.path = self.workdir / LOCK_FILE
        self.heartbeat, self.stale_after = heartbeat, stale_after
        self._file = _StoreLockFile(self.path) if is_remote(self.workdir) else _LocalLockFile(self.path)
        self.held = False
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def _record(self) -> str:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
                           "since": datetime.datetime.now().isoformat(timespec="seconds")})

    def _holder(self) -> dict:
        try:
            return json.loads(self._file.read())
        except (OSError, ValueError):
            return {}

    def _age(self) -> float | None:
        """Seconds since the holder last refreshed the lock file (None: no file)."""
        try:
            return max(time.time() - self._file.modified(), 0.0)
        except OSError:
            return None

    def _beat(self, record: str) -> None:
        """The heartbeat thread: refresh the lock file (``record``, this holder's) until ``release``; a
        refresh that fails (a file system or a store out of reach) is tried again at the next beat."""
        while not self._stop.wait(self.heartbeat):
            try:
                self._file.refresh(record)
            except Exception:  # noqa: BLE001 -- a store client raises its own errors, not only OSError
                pass

    def _stale(self, holder: dict) -> str | None:
        """Why the holder is gone (None: it may be running)."""
        if holder.get("host") != socket.gethostname():
            age = self._age()
            if age is None or age <= self.stale_after:
                return None
            return (f"no heartbeat for {age:.0f} s; a running trainer refreshes its lock every {self.heartbeat:g} s, "
                    f"and another host's lock is stale after {self.stale_after:g} s")
        if not isinstance(holder.get("pid"), int):
            return None
        pid = holder["pid"]
        if not _alive(pid):
            return f"process {pid} is not running"
        start = _process_start(pid)
        if holder.get("start") is not None and start is not None and start != holder["start"]:
            return f"process {pid} is another process now"
        return None

    def acquire(self) -> None:
        ok, message = True, None
        if jax.process_index() == 0:
            self.workdir.mkdir(parents=True, exist_ok=True)
            for _ in range(3):  # a takeover races another one at most this often
                record = self._record()
                if self._file.create(record):
                    self.held = True
                    self._stop.clear()
                    self._beating = threading.Thread(target=self._beat, args=(record,), name="workdir-lock-heartbeat",
                                                     daemon=True)
                    self._beating.start()
                    break
                holder = self._holder()
                reason = self._stale(holder)
                if reason is None and holder:
                    ok = False
                    age = self._age()
                    elsewhere = ("" if holder.get("host") == socket.gethostname() or age is None else
                                 f"; another host: its last heartbeat was {age:.0f} s ago, and its lock is taken over "
                                 f"once that is over {self.stale_after:g} s")
                    message = (f"{self.workdir}: another trainer is using this workdir: pid {holder.get('pid')} on "
                               f"host {holder.get('host')} (since {holder.get('since')}; lock file {self.path}"
                               f"{elsewhere}). Use another --workdir, or delete the lock file if that trainer is gone")
                    break
                if not holder:  # unreadable: being written right now, or damaged
                    time.sleep(0.5)
                    if not self._holder():
                        reason = "its lock file is empty or unreadable"
                if reason is not None:
                    print(f"{self.workdir}: taking over the lock of a trainer that is gone (pid {holder.get('pid')} "
                          f"on host {holder.get('host')}: {reason})", flush=True)
                    try:
                        self._file.remove()
                    except FileNotFoundError:
                        pass
        if not agree(ok):
            raise WorkdirLockedError(message or f"{self.workdir}: process 0 found the workdir locked by another "
                                                f"trainer (its message names it)")

    def release(self) -> None:
        if self.held:
            self.held = False
            self._stop.set()
            if self._beating is not None:
                self._beating.join()
                self._beating = None
            try:
                if self._holder().get("pid") == os.getpid():
                    self._file.remove()
            except OSError:
                pass

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ------------------------------------------------------------------------------------------ resume
