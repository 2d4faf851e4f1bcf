"""A LoRA run's base model: the weights its adapters train on, which its checkpoints name.

Without a warm-start the base is model.path's weights, or the demo's random ones (``init_random`` at the
run's seed). With one (warmstart.steps > 0) the warm-start trains the model without adapters, the program
a run without LoRA runs, and fresh adapters are drawn after it (training/run.py; decision 0014): it stands in
for a pretrained model, so that full fine-tuning and LoRA at any rank start RL from the same weights. The base is then the warm-started
weights, written once after the warm-start to ``<workdir>/lora_base`` (a pacs_jax model checkpoint): the
checkpoints' model_config.json names that folder, so a resumed run, tools/export_hf.py and the evaluator
load the adapters onto it.

    base = lora_base(spec, workdir)              # checkpoints.LoraBase, None without LoRA
    keep_warm_base(base, workdir)                # after the warm-start: <workdir>/lora_base
    model = build_model(resumed_base(spec, workdir), tokenizer)   # a resume: the base from there
"""

from __future__ import annotations

import dataclasses

import jax
from etils import epath

from pacs_jax.checkpoints import PARAMS_ITEM, LoraBase, absolute_path, save_model
from pacs_jax.models import Qwen
from pacs_jax.training.spec import ConfigError, RunSpec

BASE_FOLDER = "lora_base"


def has_warm_base(spec: RunSpec) -> bool:
    """Whether the run's LoRA base is its warm-started weights (LoRA on, warmstart.steps > 0)."""
    return spec.model.lora_rank > 0 and spec.warmstart.steps > 0


def warm_base_folder(workdir: str | epath.Path) -> epath.Path:
    """<workdir>/lora_base, absolute (a store's path as it is)."""
    return absolute_path(epath.Path(workdir) / BASE_FOLDER)


def lora_base(spec: RunSpec, workdir: str | epath.Path) -> LoraBase | None:
    """The base a LoRA run's checkpoints name (None without LoRA): <workdir>/lora_base after a warm-start,
    else model.path ("" for the demo's random base) and the seed it is drawn from."""
    if not spec.model.lora_rank:
        return None
    return LoraBase(str(warm_base_folder(workdir)) if has_warm_base(spec) else spec.model.path, spec.seed)


def keep_warm_base(base: Qwen, workdir: str | epath.Path) -> None:
    """Write the warm-started ``base`` (a model without adapters) to <workdir>/lora_base, replacing a stopped
    earlier session's (every process takes part)."""
    folder = warm_base_folder(workdir)
    if jax.process_index() == 0:
        print(f"LoRA: writing the warm-started base the adapters train on to {folder}, once", flush=True)
    save_model(base, folder, overwrite=True)


def resumed_base(spec: RunSpec, workdir: str | epath.Path) -> RunSpec:
    """``spec`` for building a resumed run's model: with a warm-started LoRA base, model.path is its folder
    (the checkpoint's adapters go on it); otherwise ``spec`` itself."""
    if not has_warm_base(spec):
        return spec
    folder = warm_base_folder(workdir)
    if not (folder / PARAMS_ITEM).is_dir():
        raise ConfigError(f"{workdir}: model.lora_rank={spec.model.lora_rank} with warmstart.steps="
                          f"{spec.warmstart.steps}: the warm-started base the checkpoints' adapters train on "
                          f"({folder}) is missing; restore that folder or start a new workdir")
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=str(folder)))
