"""Errors that running the same command again cannot fix, and the exit status that reports them.

A config value, a command-line flag or a data file that is wrong stays wrong after a restart, so the
command-line programs (``python -m pacs_jax.train``, ``python -m pacs_jax.evaluate``) exit with
``PERMANENT_ERROR_STATUS`` (78, ``EX_CONFIG`` of sysexits.h) and one line on stderr instead of a
traceback; ``launch/supervise.sh`` then stops at once instead of restarting the run. Every other
failure (a crash, a preemption, a lost coordinator) keeps its usual status and is restarted.

The argparse tools (tools/export_hf.py) report one alike with ``run_main``.

A ``gs://`` store that does not answer (no network, no credentials) is one line too, with status 75
(``UNREACHABLE_STORE_STATUS``, EX_TEMPFAIL), which supervise.sh restarts.

``--help`` prints the usage and, for a CLI with a config flag, where the config's fields are
(``CONFIG_HELP``), with status 0 (absl's own exits with 1).

A run stopped by SIGTERM or SIGINT before ``train.steps`` (training/signals.py) exits with
``RESUME_NEEDED_STATUS`` (79), in whichever phase the signal came (the warm-start, an evaluation, RL):
unfinished, its last finished step checkpointed if RL had begun; the same command resumes it.

Permanent: ``PermanentError`` and its subclasses (``UsageError``, ``pacs_jax.data.DataError``: malformed data),
absl's ``app.UsageError`` (the trainer raises it for config errors, ``ConfigError`` of
pacs_jax/training/config_check.py, and for bad flags), flag-parsing errors and config overrides that
name a field the config lacks (``--config.train.stepz=3``: one line naming the likely field), and a
tuple field's override given twice (``repeated_tuple_override``).
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

PERMANENT_ERROR_STATUS = 78  # launch/supervise.sh does not restart a command that exits with it
UNREACHABLE_STORE_STATUS = 75  # EX_TEMPFAIL: a store (gs://) that did not answer; supervise.sh restarts it
RESUME_NEEDED_STATUS = 79  # a stop signal ended the run before train.steps: run it again to resume (supervise.sh:
#                            a restart when the signal was the trainer's alone, a stop when supervise.sh got it too)
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort", "--helpfull", "-helpfull")
# configs/base.py's sections, in its order (tests/test_cli_errors.py checks them against it)
CONFIG_SECTIONS = ("model", "mesh", "data", "warmstart", "rollout", "algorithm", "critic", "optim", "train", "reward",
                   "eval", "evaluate")
CONFIG_HELP = ("config: --config=FILE.py[:ARG] loads a config file (configs/), --config.SECTION.FIELD=VALUE sets one "
               "of its fields (--config.train.steps=3); configs/base.py lists every field with its default and what "
               f"it does: seed, workdir and the sections {', '.join(CONFIG_SECTIONS)}.")
# Fields a config does not have, by what a user may reach for (a path under the config flag), and the one that does it
MEANT_FIELDS = {"algorithm.name": "algorithm.objective", "algorithm.algorithm": "algorithm.objective",
                "algorithm.algo": "algorithm.objective", "algorithm.type": "algorithm.objective"}
# Where a store's client code lives: an error raised through these is the store's (or the network's)
_STORE_CLIENTS = ("/gcsfs/", "/fsspec/", "/google/auth/", "/google/cloud/", "/aiohttp/")


class PermanentError(Exception):
    """An error in what the user gave (config, flags, data): a restart would fail the same way."""


class UsageError(PermanentError, ValueError):
    """A flag or config value that cannot work (a missing file, a wrong combination); the message
    names the flag or field."""


def _words(text) -> list[str]:
    """The words of a name (split at "_", "-", ".", " "), lower case, sorted."""
    return sorted(re.split(r"[_\-. ]+", str(text).lower()))


def did_you_mean(value, choices) -> str:
    """"; did you mean 'CHOICE'?" for the one of ``choices`` a misspelled string ``value`` most likely
    meant: the same words in another order or case (``tis_token``: 'token_tis'), else the closest spelling
    (``difflib``'s, as ml_collections' for a field's name); "" when none is close or ``value`` is no string."""
    if not isinstance(value, str) or not value:
        return ""
    same_words = [c for c in choices if _words(c) == _words(value)]
    close = same_words or difflib.get_close_matches(value.lower(), [str(c).lower() for c in choices], n=1)
    if not close:
        return ""
    meant = next(c for c in choices if str(c).lower() == str(close[0]).lower())
    return f"; did you mean {meant!r}?"


def unknown_config_field(error: BaseException, argv: Sequence[str], flag: str = "config") -> str | None:
    """One line for ml_collections' refusal of an override naming a field the config lacks
    (``--config.train.stepz=3``), which it raises while the flags are defined or parsed, as a KeyError or
    an AttributeError wrapping one whose text is ``'stepz'`` plus, for a close name, ``Did you mean
    "steps" instead of "stepz"?``. The line names the override as given, its section and the likely
    field (``MEANT_FIELDS``' for a field a user may reach for under another name: ``--config.algorithm.name=gspo``,
    algorithm.objective); None when ``error`` is not that refusal of one of ``argv``'s ``--flag.PATH=`` overrides."""
    while error.args and isinstance(error.args[0], BaseException):  # AttributeError(KeyError(text))
        error = error.args[0]
    if not isinstance(error, (KeyError, AttributeError)) or not error.args or not isinstance(error.args[0], str):
        return None
    first, _, rest = error.args[0].partition("\n")
    key = first.strip().strip("'\"")
    suggestion = re.search(r'Did you mean "([^"]+)"', rest)
    for arg in argv:
        match = re.match(rf"^--?{re.escape(flag)}\.([^=]+)", arg)
        if not match:
            continue
        parts = match.group(1).split(".")
        if key not in parts:
            continue
        parent = ".".join([flag, *parts[:parts.index(key)]])
        name, given, value = arg.partition("=")
        line = f"{name}: {parent} has no field {key!r}"
        meant = MEANT_FIELDS.get(".".join(parts[:parts.index(key) + 1]))
        if meant:
            line += f"; did you mean --{flag}.{meant}{given}{value}?"
        elif suggestion:
            fixed = ".".join([*parts[:parts.index(key)], suggestion.group(1), *parts[parts.index(key) + 1:]])
            line += f"; did you mean --{flag}.{fixed}?"
        return line
    return None


def exit_on_unknown_config_field(program: str, define: Callable[[], T], argv: Sequence[str] | None = None,
                                 flag: str = "config") -> T:
    """``define()`` (a ``config_flags.DEFINE_config_file`` call, which already applies the command line's
    overrides to a default config file); an unknown override field prints one line (``unknown_config_field``)
    and exits with ``PERMANENT_ERROR_STATUS`` instead of a traceback."""
    try:
        return define()
    except (KeyError, AttributeError) as e:
        message = unknown_config_field(e, sys.argv if argv is None else argv, flag)
        if message is None:
            raise
        _fail(program, message)


def flag_error_line(error: BaseException) -> str:
    """One line for a flag-parsing error. ml_collections reports a config file whose ``get_config`` raised
    (a misspelled setup name: ``configs/paper.py:qwen25_7b,pacs_bet1``) with the whole traceback in the
    message; the line keeps the flag and the exception's own last line."""
    text = str(error)
    if "Traceback (most recent call last)" not in text:
        return f"{text} (--helpshort lists the flags)"
    flag = text.split(": Error whilst parsing config file", 1)[0]
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    return f"{flag}: {re.sub(r'^[A-Za-z_.]*(Error|Exception): ', '', last.strip())}"


def _fail(program: str, message: str) -> None:
    print(f"{program}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(PERMANENT_ERROR_STATUS)


def _help(args: Sequence[str], config_files: Callable[[], str] | None = None) -> None:
    """Exit with status 0 after the help ``args`` ask for: absl's usage (--helpfull: every module's flags,
    else the program's), then ``CONFIG_HELP`` when the program has a config flag, and ``config_files()``
    (the program's: the config files it runs and their arguments)."""
    from absl import app, flags

    full = any(arg in ("--helpfull", "-helpfull") for arg in args)
    app.usage(shorthelp=not full, writeto_stdout=True)
    if "config" in flags.FLAGS:
        print(f"\n{CONFIG_HELP}")
    if config_files is not None:
        print(config_files())
    if not full:
        print("--helpfull lists every flag, the libraries' too.")
    sys.exit(0)


def run_main(program: str, main: Callable[..., T], *args) -> T:
    """``main(*args)``, except that a ``PermanentError`` prints "``program``: error: MESSAGE" on stderr and
    exits with ``PERMANENT_ERROR_STATUS`` (the argparse tools': tools/export_hf.py)."""
    try:
        return main(*args)
    except PermanentError as e:
        _fail(program, str(e))


def unreachable_store(error: BaseException) -> str | None:
    """"TypeName: message" when ``error`` (or an exception it was raised from) is a connection error or
    time-out raised inside a store's client (gcsfs, fsspec, google-auth, aiohttp: a ``gs://`` path with
    no network, or no credentials to reach it); else None."""
    import traceback

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        network = isinstance(error, (ConnectionError, TimeoutError)) or type(error).__module__.split(".")[0] in (
            "aiohttp", "google", "gcsfs")
        frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
        if network and any(part in frame.filename for frame in frames for part in _STORE_CLIENTS):
            text = str(error).strip().splitlines()
            return f"{type(error).__name__}: {text[0][:300] if text else ''}"
        error = error.__cause__ or error.__context__
    return None


def repeated_tuple_override(argv: Sequence[str], flag: str, config) -> str | None:
    """One line for a tuple field of ``config`` (the value of config flag ``flag``) overridden more than
    once in ``argv`` (``--config.data.train_files=a --config.data.train_files=b``, which ml_collections
    joins into one tuple without a word), else None."""
    if not hasattr(config, "to_dict"):  # not a ConfigDict
        return None
    seen: dict[str, int] = {}
    for arg in argv:
        match = re.match(rf"^--?{re.escape(flag)}\.([^=]+)=", arg)
        if match:
            seen[match.group(1)] = seen.get(match.group(1), 0) + 1
    for field, count in seen.items():
        value = config
        for part in field.split("."):
            value = value.get(part) if hasattr(value, "get") else None
        if count > 1 and isinstance(value, (tuple, list)):
            return (f"--{flag}.{field} is given {count} times; give the tuple once, e.g. "
                    f"--{flag}.{field}=\"('a.jsonl', 'b.jsonl')\"")
    return None


def run_cli(program: str, main: Callable[[list[str]], None], argv: Sequence[str] | None = None,
            permanent: tuple[type[BaseException], ...] = (),
            prepare: Callable[[list[str]], list[str]] | None = None,
            config_files: Callable[[], str] | None = None) -> None:
    """``absl.app.run(main)``, except that ``--help`` exits with status 0 (``_help``; ``config_files()``: the
    config files the program runs, printed after the flags), and that flag errors,
    ``app.UsageError``, ``PermanentError`` and the ``permanent`` exception types print "``program``: error:
    MESSAGE" on stderr and exit with ``PERMANENT_ERROR_STATUS`` (no traceback, no flag listing). prepare:
    rewrites the command line before the flags are parsed (the CLIs': ``data.paths.config_file_args``); a
    ``PermanentError`` it raises is reported alike. A store that does not answer (``unreachable_store``) is
    one line too, saying how long the command ran, with ``UNREACHABLE_STORE_STATUS``: a restart may find
    it again."""
    import time

    from absl import app, flags

    start = time.monotonic()

    def parse_flags(args: list[str]) -> list[str]:
        flag_args = args[1:args.index("--")] if "--" in args else args[1:]
        if any(arg in HELP_FLAGS for arg in flag_args):
            _help(flag_args, config_files)
        try:
            rest = flags.FLAGS(prepare(args) if prepare else args)
            for name in flags.FLAGS:  # ml_collections' config flags: a tuple field's override given twice
                message = repeated_tuple_override(args, name, flags.FLAGS[name].value)
                if message is not None:
                    _fail(program, message)
            return rest
        except PermanentError as e:
            _fail(program, str(e))
        except flags.Error as e:
            _fail(program, flag_error_line(e))
        except (KeyError, AttributeError) as e:  # an override naming a field the --config file lacks
            message = unknown_config_field(e, args)
            if message is None:
                raise
            _fail(program, message)

    def checked_main(args: list[str]) -> None:
        try:
            main(args)
        except (PermanentError, app.UsageError, *permanent) as e:
            _fail(program, str(e))
        except Exception as e:
            detail = unreachable_store(e)
            if detail is None:
                raise
            print(f"{program}: error: a store (gs://) did not answer; gave up after {time.monotonic() - start:.0f} s "
                  f"({detail}): check the network and the credentials (gcloud auth application-default login)",
                  file=sys.stderr, flush=True)
            sys.exit(UNREACHABLE_STORE_STATUS)

    app.run(checked_main, argv=list(sys.argv if argv is None else argv), flags_parser=parse_flags)
