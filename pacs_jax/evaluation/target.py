"""What ``python -m pacs_jax.evaluate --checkpoint=PATH`` evaluates, and what the training run recorded
about it.

PATH may be an HF model folder (config.json + safetensors), a pacs_jax checkpoint (a model folder, a
trainer's ``checkpoints/`` root or one ``checkpoints/<step>/``), or a training workdir, which holds
the run's config as ``config.json`` beside ``checkpoints/`` and ``hf_export/``: its newest checkpoint
``checkpoints/<step>/`` is evaluated, or its ``hf_export/`` when it has none. A checkpoint inside a
workdir brings the run's config along (``training_config``): its tokenizer (``data.tokenizer``, e.g.
the demo's "char", which writes no tokenizer files), its prompt instruction and its held-out problems.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from pacs_jax.errors import UsageError

CHECKPOINTS = "checkpoints"  # <workdir>/checkpoints/<step>/params: the trainer's Orbax checkpoints
HF_EXPORT = "hf_export"      # <workdir>/hf_export: the trainer's final HF export
PARAMS = "params"


@dataclasses.dataclass(frozen=True)
class Target:
    """model_dir: what to load (``checkpoints.from_pretrained``); workdir: the training workdir it is in
    (None: none found); training_config: that run's config.json as a dict (None without a workdir);
    label: "step_<N>", "hf_export" or "" (a model outside a workdir), naming the default output folder;
    note: the line that says which checkpoint of a workdir was chosen ("" when PATH named it)."""

    model_dir: pathlib.Path
    workdir: pathlib.Path | None
    training_config: dict[str, Any] | None
    label: str
    note: str = ""

    def recorded_tokenizer(self) -> str | None:
        """The training run's tokenizer, as the run loaded it (``data.run_tokenizer`` of its
        config.json): "char" (the demo's, no files), a folder (local or ``gs://``), or None without a
        training run or a recorded ``data.tokenizer``."""
        from pacs_jax.data import run_tokenizer

        data = (self.training_config or {}).get("data", {})
        if data.get("tokenizer") is None:
            return None
        return run_tokenizer(data, self.training_config.get("model", {}).get("path", ""))

    def default_output_dir(self) -> pathlib.Path:
        """``<workdir>/eval/evaluate_<label>`` for a workdir's checkpoint or export (never inside an Orbax
        step folder or an export, which the trainer rotates or replaces); ``<model_dir>/eval`` otherwise."""
        if self.workdir is not None and self.label:
            return self.workdir / "eval" / f"evaluate_{self.label}"
        return self.model_dir / "eval"


def _training_config(folder: pathlib.Path) -> dict[str, Any] | None:
    """``folder/config.json`` when it is a training config (sections model, data and train), else None."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and all(isinstance(config.get(k), dict) for k in ("model", "data", "train")):
        return config
    return None


def _steps(root: pathlib.Path) -> list[int]:
    """Steps of the complete checkpoints under a trainer's checkpoint root (``<step>/params``)."""
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / PARAMS).is_dir())


def resolve(path: str | pathlib.Path) -> Target:
    """The model to evaluate for ``--checkpoint=path`` (see the module docstring); a workdir with neither
    a checkpoint nor an export, or a path that does not exist, is a ``UsageError`` naming it."""
    path = pathlib.Path(path)
    if not path.exists():
        raise UsageError(f"--checkpoint={path}: does not exist")
    config = _training_config(path)
    if config is not None:  # a training workdir (its config.json is the run's, not an HF model's)
        steps = _steps(path / CHECKPOINTS)
        if steps:
            model_dir = path / CHECKPOINTS / str(steps[-1])
            return Target(model_dir, path, config, f"step_{steps[-1]}",
                          f"{path} is a training workdir: evaluating its newest checkpoint, {model_dir} "
                          f"(step {steps[-1]}; --checkpoint={path / CHECKPOINTS}/STEP picks another, "
                          f"--checkpoint={path / HF_EXPORT} the final HF export)")
        if (path / HF_EXPORT / "config.json").is_file():
            model_dir = path / HF_EXPORT
            return Target(model_dir, path, config, HF_EXPORT,
                          f"{path} is a training workdir without checkpoints: evaluating its HF export, {model_dir}")
        raise UsageError(f"--checkpoint={path}: a training workdir (config.json) with no checkpoint "
                         f"({CHECKPOINTS}/<step>/) and no {HF_EXPORT}/ yet")
    # inside a workdir: <workdir>/hf_export, <workdir>/checkpoints or <workdir>/checkpoints/<step>
    resolved = path.resolve()
    if resolved.name in (HF_EXPORT, CHECKPOINTS):
        workdir = resolved.parent
    elif resolved.name.isdigit() and resolved.parent.name == CHECKPOINTS:
        workdir = resolved.parent.parent
    else:
        return Target(path, None, None, "")
    config = _training_config(workdir)
    if config is None:
        return Target(path, None, None, "")
    if resolved.name == HF_EXPORT:
        label = HF_EXPORT
    elif resolved.name == CHECKPOINTS:  # the root: checkpoints.from_pretrained loads its newest step
        steps = _steps(resolved)
        label = f"step_{steps[-1]}" if steps else ""
    else:
        label = f"step_{resolved.name}"
    return Target(path, workdir, config, label)
