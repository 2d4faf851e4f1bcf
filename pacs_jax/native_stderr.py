"""What a native library writes to the process's standard error (file descriptor 2), shown only on failure.

libtpu writes its start-up complaints on a host without a TPU straight to descriptor 2 (glog and
``fprintf``, not Python's ``sys.stderr``), and no log-level variable silences them all
(``TPU_MIN_LOG_LEVEL`` / ``TPU_STDERR_LOG_LEVEL`` leave its first line, checked with libtpu 0.0.42).
``shown_only_on_error`` points descriptor 2 at a temporary file for a block and writes the file's
text back to standard error only when the block raises (``pacs_jax.topologies`` making TPU devices).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def shown_only_on_error() -> Iterator[None]:
    """Whatever is written to descriptor 2 in the block, by any thread or library, is dropped if the
    block ends normally and written to standard error before its exception propagates otherwise; keep
    the block to the native call whose lines it holds back."""
    sys.stderr.flush()  # Python's own buffered lines go out before, not into the file
    saved = os.dup(2)
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                file.seek(0)
                os.write(2, file.read())
