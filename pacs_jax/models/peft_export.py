"""A model's LoRA adapters as the PEFT adapter folder a ``peft`` user loads onto the Hugging Face base model:

    export_peft(model, "out/adapter", base_model="Qwen/Qwen2.5-7B")
    # then: peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "out/adapter")

The folder holds ``adapter_config.json`` (models/lora.py ``peft_config``), ``adapter_model.safetensors``
(``peft_tensors``: PEFT's names and [r, in] / [out, r] layouts for a Qwen) and ``pacs_jax_export.json``.
It is written as ``write_hf_dir`` writes a model (a temporary folder beside it, renamed at the end;
replacing only an export with ``overwrite``); every process takes part (the adapters are gathered),
process 0 writes.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax
import numpy as np
from safetensors.numpy import save_file

from pacs_jax.models import lora
from pacs_jax.models.hf_weights import publish_export, staging_folder
from pacs_jax.models.qwen import Qwen

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def export_peft(model: Qwen, out_dir: str | os.PathLike, *, base_model: str, overwrite: bool = False) -> pathlib.Path:
    """Write ``model``'s adapters to ``out_dir`` (a PEFT LoRA folder for ``base_model``, its path or hub name);
    returns the folder. ValueError when the model has no adapters."""
    if not model.cfg.lora_rank:
        raise ValueError("the model has no LoRA adapters (model.lora_rank 0): export it with export_hf")
    out_dir = pathlib.Path(out_dir)
    tensors = {name: np.ascontiguousarray(array) for name, array in lora.peft_tensors(model)}
    if jax.process_index() != 0:
        return out_dir
    tmp = staging_folder(out_dir, overwrite=overwrite)
    try:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(lora.peft_config(model.cfg, base_model), indent=2))
        publish_export(tmp, out_dir, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
