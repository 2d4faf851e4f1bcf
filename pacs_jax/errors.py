"""Errors that running the same command again cannot fix, and the exit status that reports them.

A config value, a command-line flag or a data file that is wrong stays wrong after a restart, so the
command-line programs (``python -m pacs_jax.train``, ``python -m pacs_jax.evaluate``) exit with
``PERMANENT_ERROR_STATUS`` (78, ``EX_CONFIG`` of sysexits.h) and one line on stderr instead of a
traceback; ``launch/supervise.sh`` then stops at once instead of restarting the run. Every other
failure (a crash, a preemption, a lost coordinator) keeps its usual status and is restarted.

Permanent: ``PermanentError`` and its subclasses (``UsageError``, ``pacs_jax.data.DataError``: malformed data),
absl's ``app.UsageError`` (the trainer raises it for config errors, ``ConfigError`` of
pacs_jax/training/config_check.py, and for bad flags) and flag-parsing errors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

PERMANENT_ERROR_STATUS = 78  # launch/supervise.sh does not restart a command that exits with it


class PermanentError(Exception):
    """An error in what the user gave (config, flags, data): a restart would fail the same way."""


class UsageError(PermanentError, ValueError):
    """A flag or config value that cannot work (a missing file, a wrong combination); the message
    names the flag or field."""


def _fail(program: str, message: str) -> None:
    print(f"{program}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(PERMANENT_ERROR_STATUS)


def run_cli(program: str, main: Callable[[list[str]], None], argv: Sequence[str] | None = None,
            permanent: tuple[type[BaseException], ...] = ()) -> None:
    """``absl.app.run(main)``, except that flag errors, ``app.UsageError``, ``PermanentError`` and the
    ``permanent`` exception types print "``program``: error: MESSAGE" on stderr and exit with
    ``PERMANENT_ERROR_STATUS`` (no traceback, no flag listing)."""
    from absl import app, flags

    def parse_flags(args: list[str]) -> list[str]:
        try:
            return flags.FLAGS(args)
        except flags.Error as e:
            _fail(program, f"{e} (--helpshort lists the flags)")

    def checked_main(args: list[str]) -> None:
        try:
            main(args)
        except (PermanentError, app.UsageError, *permanent) as e:
            _fail(program, str(e))

    app.run(checked_main, argv=list(sys.argv if argv is None else argv), flags_parser=parse_flags)
