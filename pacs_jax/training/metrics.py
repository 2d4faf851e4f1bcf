"""Training metrics: a progress bar with the key numbers, ``metrics.jsonl`` and TensorBoard events.

Only process 0 writes; other processes get a logger that does nothing.
"""

from __future__ import annotations

import json
import math
import os

import jax
from etils import epath
from tqdm.auto import tqdm

# Shown on the progress bar (when present), in this order.
KEY_METRICS = ("reward_mean", "accuracy", "loss", "response_length_mean", "grad_norm", "tokens_per_second",
               "slot_utilisation", "reward_unscored")


class MetricsLogger:
    """``log(step, metrics)`` appends one JSON line, writes TensorBoard scalars, updates the bar."""

    def __init__(self, workdir: str | os.PathLike, total_steps: int, initial_step: int = 0, *,
                 tensorboard: bool = True, desc: str = "train"):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        self.workdir = epath.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.jsonl = (self.workdir / "metrics.jsonl").open("a")
        self.writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self.writer = SummaryWriter(str(self.workdir / "tensorboard"))
        self.bar = tqdm(total=total_steps, initial=initial_step, desc=desc, dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        self.jsonl.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for k, v in clean.items():
                self.writer.add_scalar(k, v, step)
        shown = {k.replace("_mean", ""): f"{clean[k]:.4g}" for k in KEY_METRICS if k in clean}
        self.bar.set_postfix(shown, refresh=False)
        if advance:
            self.bar.update(1)

    def write(self, message: str) -> None:
        """A line on the console that does not break the progress bar."""
        if self.enabled:
            self.bar.write(message)

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
