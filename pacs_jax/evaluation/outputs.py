"""The files of an evaluation: eval_samples.jsonl, eval_metrics.json and pass_at_k.png, each written atomically.

    eval_samples.jsonl   one row per problem: its fields, and its samples with their scores
    eval_metrics.json    {data_source: {"pass@1": x, "pass@2": x, ..., "mean@N": x}}, fractions in [0, 1]
    pass_at_k.png        pass@k against k, one curve per data source
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from pacs_jax.files import atomic_write


def write_outputs(output_dir: str | os.PathLike, rows: Sequence[Mapping[str, Any]],
                  metrics: Mapping[str, Mapping[str, float]]) -> None:
    """eval_samples.jsonl, eval_metrics.json and pass_at_k.png in ``output_dir`` (a local folder, made if
    missing, or one on ``gs://``), each written atomically."""
    output_dir = epath.Path(output_dir)
    atomic_write(output_dir / "eval_samples.jsonl",
                 lambda f: f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    atomic_write(output_dir / "eval_metrics.json", lambda f: json.dump(metrics, f, indent=2, sort_keys=True))
    atomic_write(output_dir / "pass_at_k.png", lambda f: _plot(metrics, f), binary=True)


def _plot(metrics: Mapping[str, Mapping[str, float]], file) -> None:
    """pass@k against k (log2 axis), one curve per data source, as a PNG into ``file``."""
    import matplotlib  # only when plotting, and then with the file-only backend

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for source, values in sorted(metrics.items()):
        ks = sorted(int(key.split("@")[1]) for key in values if key.startswith("pass@"))
        axes.plot(ks, [values[f"pass@{k}"] for k in ks], marker="o", label=source)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("k")
    axes.set_ylabel("pass@k")
    axes.set_ylim(0, 1)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(file, format="png", dpi=120)
    plt.close(figure)
