"""The KL loss's reference model under full fine-tuning (``algorithm.use_kl_loss``, model.lora_rank 0): a
frozen copy of the weights RL starts from (after the warm-start), held on the learner's devices beside
the trained ones and written once to ``<workdir>/kl_reference`` so that a resumed run reads it back.
With LoRA the reference is the learner's weights with the adapters off (models/lora.py ``switched_off``), no
second copy but of the modules LoRA trains whole (model.modules_to_save), whose original values it puts back.

    reference = frozen_reference(spec, workdir, params, resumed=start > 0)   # nnx.State or None
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from pacs_jax.checkpoints import flat_params, params_from_flat, restore_flat_params
from pacs_jax.models import lora
from pacs_jax.sharding import abstract
from pacs_jax.training.spec import ConfigError, RunSpec

REFERENCE_FOLDER = "kl_reference"


def needs_copy(spec: RunSpec) -> bool:
    """Whether the run holds a frozen reference copy (the KL loss on, without LoRA or with modules LoRA trains
    whole: model.modules_to_save)."""
    return spec.algorithm.use_kl_loss and (not spec.model.lora_rank or bool(spec.model.modules_to_save))


def frozen_reference(spec: RunSpec, workdir: epath.Path, params: nnx.State, *, resumed: bool) -> nnx.State | None:
    """The run's frozen reference (None when ``needs_copy`` is False): a fresh run's copy of ``params`` (the
    weights RL starts from; with LoRA, of the modules it trains whole alone: ``lora.saved``), saved to
    workdir/kl_reference; a resumed run's read from there into ``params``' shardings."""
    if not needs_copy(spec):
        return None
    if spec.model.lora_rank:
        params = lora.saved(params)
    folder = epath.Path(workdir).absolute() / REFERENCE_FOLDER
    if resumed:
        if not folder.is_dir():
            raise ConfigError(f"{workdir}: algorithm.use_kl_loss is on, but the run's reference model "
                              f"({folder}) is missing: the checkpoints were written without the KL loss; resume "
                              "with algorithm.use_kl_loss=False or start a new workdir")
        return params_from_flat(params, restore_flat_params(folder, abstract(flat_params(params))))
    if jax.process_index() == 0:  # a 7B's copy is tens of GB to write: say what the wait is
        what = ("the modules LoRA trains whole, as RL starts them" if spec.model.lora_rank
                else "the weights RL starts from")
        print(f"KL loss: writing the reference (a frozen copy of {what}) to {folder}, once", flush=True)
    reference = jax.tree.map(jnp.copy, params)  # the update donates params: a copy of its own
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder, flat_params(reference), force=True)  # force: a stopped fresh run's copy is replaced
    checkpointer.wait_until_finished()
    return reference
