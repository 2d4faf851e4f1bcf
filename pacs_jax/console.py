"""What the command-line programs print for a person: their own lines, not other libraries' logs, and
progress bars that stay readable in a log file.

``setup()``, called by the CLIs once their flags are parsed:

- Third-party INFO logs (Orbax's lines about every checkpoint it reads or writes, JAX's) are off: absl's
  verbosity is WARNING unless the command line gives ``--verbosity`` (``--verbosity=0``: INFO, as absl
  defines it); so are gcsfs's logs of its retries (a traceback each) unless ``--verbosity`` is given: a
  store that never answers is the CLI's one line (errors.unreachable_store).
- Orbax's "Metadata file does not exist" warning (a pacs_jax checkpoint's params/ is read on its own,
  without the step's metadata file, which it does not need) is dropped unless ``--verbosity`` is
  given: nothing a user can act on.
- When stderr is not a terminal (a log file, a pipe, ``launch/supervise.sh``'s ``tpu_pod.sh`` log), tqdm's
  bars become plain lines, each written as a line of its own, with the cursor movements of nested bars
  (``ESC[A``) and the carriage returns left out.

``bar(...)`` makes the package's progress bars: off a terminal a bar writes its first line, then at
most one line every ``LOG_INTERVAL_S`` seconds (tqdm's ``mininterval`` and ``maxinterval``, given to
each bar: tqdm reads ``TQDM_MININTERVAL`` only when it is imported, before the flags are parsed), and
its last, once (``leave=True``: a bar that clears itself would leave its first line last; a last
state already written is not written again at ``close``). ``say(line, bar)``: a line above a bar
(on a terminal the bar is redrawn below it; off one the line is written alone, not followed by
another copy of the bar).
"""

from __future__ import annotations

import io
import logging as python_logging
import re
import sys

from tqdm.auto import tqdm

LOG_INTERVAL_S = 30
_CURSOR_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class PlainLines(io.TextIOBase):
    """A text stream that writes to ``stream`` what a terminal would show as separate lines: every
    carriage return ends a line (a progress bar's refresh is a line of its own), terminal control codes
    are dropped, blank lines are left out."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream
        self.open = False  # a line is started and not yet ended
        self.blank = ""    # the spaces a line starts with, written once something else follows them

    def write(self, text: str) -> int:
        refresh = "\r" in text  # a progress bar's: its padding is dropped too
        for piece in re.split(r"(\n)", _CURSOR_CODES.sub("", text).replace("\r", "\n")):
            piece = piece.rstrip(" ") if refresh and piece != "\n" else piece
            if piece == "\n":
                if self.open:
                    self.stream.write("\n")
                self.open, self.blank = False, ""  # a line of spaces only (a bar cleared) is left out
            elif not self.open and not piece.strip():
                self.blank += piece
            elif piece:
                self.stream.write(self.blank + piece)
                self.open, self.blank = True, ""
        if refresh and self.open:  # a bar's refresh is a whole line: a log line after it starts its own
            self.stream.write("\n")
            self.open = False
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


def terminal() -> bool:
    """Whether stderr (where the bars are drawn) is a terminal."""
    return sys.stderr.isatty()


class _Bar(tqdm):
    """tqdm, except that off a terminal ``close`` writes no second copy of a last line already written."""

    def close(self, _terminal=terminal) -> None:  # bound here: tqdm's __del__ may close it as the interpreter exits
        try:
            plain = not _terminal()
        except (AttributeError, TypeError, ValueError):  # the interpreter's teardown (sys.stderr gone): nothing to draw
            plain = False
        if plain and self.leave and getattr(self, "last_print_n", None) == self.n:
            self.leave = False  # its last state is the line before: clear it instead (PlainLines drops that)
        super().close()


def bar(*args, **kwargs):
    """A tqdm progress bar (tqdm's arguments); off a terminal refreshed at most every ``LOG_INTERVAL_S``,
    ending on one line of its last state."""
    if not terminal():  # a log: its last line stays (a bar that clears itself would end on its first)
        kwargs.update(mininterval=LOG_INTERVAL_S, maxinterval=LOG_INTERVAL_S, leave=True)
    return _Bar(*args, **kwargs)


def say(line: str, progress=None) -> None:
    """Print ``line`` on stdout, above the tqdm bar ``progress`` (None: no bar) on a terminal."""
    if progress is not None and terminal():
        progress.write(line)
    else:
        print(line, flush=True)


def _drop_orbax_metadata_warning(record: python_logging.LogRecord) -> bool:
    """A logging filter: False for Orbax's "Metadata file does not exist" warning."""
    return not str(record.msg).startswith("Metadata file does not exist")


def setup(argv: list[str] | None = None) -> None:
    """Quiet third-party INFO logs unless ``--verbosity`` is on the command line, and make progress
    bars write plain lines when stderr is not a terminal (see the module docstring)."""
    from absl import logging

    argv = sys.argv if argv is None else argv
    if not any(arg.split("=")[0] in ("--verbosity", "-v") for arg in argv):
        logging.set_verbosity(logging.WARNING)
        python_logging.getLogger("gcsfs").setLevel(python_logging.CRITICAL)
        logging.get_absl_logger().addFilter(_drop_orbax_metadata_warning)
    if not sys.stderr.isatty() and not isinstance(sys.stderr, PlainLines):
        sys.stderr = PlainLines(sys.stderr)
