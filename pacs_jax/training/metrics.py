"""Training metrics: a progress bar with the key numbers, ``metrics.jsonl`` and TensorBoard events.

Only process 0 writes; other processes get a logger that does nothing. A resumed run's logger first
rewrites metrics.jsonl (atomically) with the rows of the steps up to the checkpoint it resumed from,
the last row of each step: the steps it runs again replace those a killed session had logged after
its last checkpoint, and no step appears twice. A local metrics.jsonl is appended to, a line a
step; an object store (a ``gs://`` workdir) has no appends, so there the object is uploaded again,
whole, at every step.
"""

from __future__ import annotations

import json
import math
import os

import jax
from etils import epath

from pacs_jax import console
from pacs_jax.files import atomic_write_text, is_remote

# Shown on the progress bar (when present), in this order.
KEY_METRICS = ("reward_mean", "accuracy", "loss", "response_length_mean", "grad_norm", "tokens_per_second",
               "slot_utilisation", "packing_efficiency", "reward_unscored", "rollout_logprob_diff_mean",
               "rollout_logprob_diff_max", "rollout_kl")


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a metrics.jsonl in file order; a line that does not parse (a write cut short by a
    kill) is left out. Non-finite values, written as strings, come back as floats."""
    path = epath.Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append({k: (float(v) if isinstance(v, str) and v in ("nan", "inf", "-inf") else v)
                         for k, v in row.items()})
    return rows


def _jsonl_line(row: dict) -> str:
    return json.dumps({k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in row.items()}) + "\n"


def keep_rows_up_to(path: str | os.PathLike, step: int) -> list[dict]:
    """Rewrite metrics.jsonl ``path`` atomically with one row per step up to ``step`` (the last row of
    each, in step order); returns them. Rows of later steps (logged after the checkpoint a run
    resumes from) are dropped."""
    last: dict[int, dict] = {}
    for row in read_rows(path):
        if row["step"] <= step:
            last[row["step"]] = row
    kept = [last[s] for s in sorted(last)]
    atomic_write_text(path, "".join(_jsonl_line(row) for row in kept))
    return kept


class MetricsLogger:
    """``log(step, metrics)`` appends one JSON line, writes TensorBoard scalars, updates the bar.

    initial_step > 0 (a resumed run): metrics.jsonl keeps the rows of the steps up to it
    (``keep_rows_up_to``); ``earlier`` holds them.
    """

    def __init__(self, workdir: str | os.PathLike, total_steps: int, initial_step: int = 0, *,
                 tensorboard: bool = True, desc: str = "train"):
        self.enabled = jax.process_index() == 0
        self.earlier: list[dict] = []
        if not self.enabled:
            return
        self.workdir = epath.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / "metrics.jsonl"
        if initial_step > 0:
            self.earlier = keep_rows_up_to(self.path, initial_step)
        local = not is_remote(self.path)
        self.jsonl = self.path.open("a") if local else None
        self.text = "" if local or not self.path.exists() else self.path.read_text()  # a store's object
        # TensorBoard's writer is made with the first row: tensorboardX closes it at exit, which on Python 3.12
        # cannot start its queue's thread, so a run that stops before its first row (an error, a Ctrl-C while
        # compiling) would print a traceback after its one line
        self.tensorboard = tensorboard
        self.writer = None
        self.bar = console.bar(total=total_steps, initial=initial_step, desc=desc, dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        line = _jsonl_line({"step": step, **clean})
        if self.jsonl is None:  # on a store: the whole object again
            self.text += line
            atomic_write_text(self.path, self.text)
        else:
            try:
                self.jsonl.write(line)
                self.jsonl.flush()
            except OSError as e:  # name the file (a failed flush does not)
                raise OSError(e.errno, e.strerror, str(self.path)) from e
        if self.tensorboard and self.writer is None:
            from tensorboardX import SummaryWriter
            self.writer = SummaryWriter(str(self.workdir / "tensorboard"))
        if self.writer is not None:
            for k, v in clean.items():
                self.writer.add_scalar(k, v, step)
        shown = {k.replace("_mean", ""): f"{clean[k]:.4g}" for k in KEY_METRICS if k in clean}
        self.bar.set_postfix(shown, refresh=False)
        if advance:
            self.bar.update(1)

    def write(self, message: str) -> None:
        """A line on the console that does not break the progress bar (console.say)."""
        if self.enabled:
            console.say(message, self.bar)

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        if self.writer is not None:  # first: the file's close may fail (a full disk flushing its last row)
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()



class EvalScalars:
    """TensorBoard scalars ``tag/<set>/<metric>`` (``pass_at_k``, ``mean_at_n``: TensorBoard's tags take
    no "@") of a session's evaluations, in
    workdir/tensorboard beside the training metrics: one events file a session (suffix ``.eval``),
    opened at the first evaluation. A context manager (closing uploads it to a ``gs://`` workdir)."""

    def __init__(self, workdir: str | os.PathLike):
        self.directory = epath.Path(workdir) / "tensorboard"
        self.writer = None

    def write(self, tag: str, step: int, metrics: dict[str, dict[str, float]]) -> None:
        """One evaluation's {set: {metric: value}} at RL step ``step``."""
        if self.writer is None:
            from tensorboardX import SummaryWriter
            self.writer = SummaryWriter(str(self.directory), filename_suffix=".eval")
        for name, values in sorted(metrics.items()):
            for key, value in sorted(values.items()):
                self.writer.add_scalar(f"{tag}/{name}/{key.replace('@', '_at_')}", float(value), step)
        self.writer.flush()

    def __enter__(self) -> EvalScalars:
        return self

    def __exit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.close()
