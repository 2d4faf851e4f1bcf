"""Checkpoints: loading a model from disk (HF or ours), Orbax model and train-state save / restore.

Entry points: ``from_pretrained`` reads an HF directory (config.json + safetensors) or a pacs_jax
checkpoint; ``save_model`` / ``load_model`` write and read a model checkpoint; ``TrainCheckpointer``
saves and restores the trainer's whole state. HF export is ``models.export_hf``
(``tools/export_hf.py``); HF import into a checkpoint is ``load_hf`` + ``save_model``
(``tools/import_hf.py``).

A model checkpoint directory holds ``model_config.json`` (the HF config fields plus our dtypes)
and ``params/``, an Orbax PyTree checkpoint of a flat {dotted path: array} dict. The trainer's
root (``<workdir>/checkpoints``) holds ``model_config.json`` and one ``<step>/`` per checkpoint
with items ``params`` (the same flat format), ``opt_state`` and ``meta`` (JSON: step,
data-iterator state, counters), and for PPO ``critic_params`` (flat, like ``params``) and
``critic_opt_state``; ``find_params_dir`` resolves either layout to the (actor's) params to load
(the latest step for a root). Every process takes part in saves and restores.

``TrainCheckpointer.restore_latest`` restores the newest step that restores: a damaged one (a
truncated array file, a corrupt metadata file) is moved aside to ``<step>.damaged`` with a warning
naming it, and the next older step is tried. Orbax's own error logs of a save that fails for a full
disk or a permission (``files.storage_error``) are left out: the trainer reports that error in one
line naming the path.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from pacs_jax.data.remote import local_folder
from pacs_jax.errors import PermanentError
from pacs_jax.files import atomic_write_text, is_remote, storage_error
from pacs_jax.models.config import QwenConfig
from pacs_jax.models.hf_weights import hf_weight_shapes
from pacs_jax.models import lora
from pacs_jax.models.loading import abstract_model, dotted, hf_shapes, init_random, load_hf, param_shapes
from pacs_jax.models.qwen import Qwen
from pacs_jax.sharding import abstract

MODEL_CONFIG_FILE = "model_config.json"
PARAMS_ITEM = "params"


def model_config_dict(cfg: QwenConfig, base: LoraBase | None = None) -> dict:
    """model_config.json: the HF config fields and ours; with LoRA adapters, their rank, alpha and targets and
    the base they were trained on (``base``: a training checkpoint holds the adapters alone)."""
    run = ("param_dtype", "dtype", "remat", "attention", "attention_block_size")
    ours = {k: getattr(cfg, k) for k in run}
    if cfg.num_experts:
        ours["expert_parallel"] = cfg.expert_parallel
    if cfg.lora_rank:
        ours["lora"] = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "targets": list(cfg.lora_targets),
                        "modules_to_save": list(cfg.lora_saved), **({} if base is None else base._asdict())}
    return {**cfg.to_hf_dict(), "pacs_jax": ours}


class LoraBase(NamedTuple):
    """The base model a training checkpoint's LoRA adapters were trained on: ``model_path`` (an HF folder or a
    pacs_jax checkpoint), or "" for a base drawn at random (``init_random`` with ``seed``: the demo's)."""

    model_path: str
    seed: int


def write_model_config(directory: str | os.PathLike, cfg: QwenConfig, base: LoraBase | None = None) -> None:
    atomic_write_text(epath.Path(directory) / MODEL_CONFIG_FILE, json.dumps(model_config_dict(cfg, base), indent=2))


def _read_model_config(directory: str | os.PathLike) -> tuple[dict, dict]:
    path = epath.Path(directory) / MODEL_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (not a pacs_jax checkpoint directory)")
    raw = json.loads(path.read_text())
    return raw, raw.pop("pacs_jax", {})


def read_model_config(directory: str | os.PathLike, **overrides) -> QwenConfig:
    """The model a checkpoint directory holds (LoRA's adapters included: their fields from model_config.json)."""
    raw, ours = _read_model_config(directory)
    adapters = ours.pop("lora", None)
    if adapters is not None:
        ours.update(lora_rank=adapters["rank"], lora_alpha=adapters["alpha"], lora_targets=tuple(adapters["targets"]),
                    lora_saved=tuple(adapters.get("modules_to_save", ())))
    return QwenConfig.from_hf_dict(raw, source=str(epath.Path(directory) / MODEL_CONFIG_FILE), **{**ours, **overrides})


def read_lora_base(directory: str | os.PathLike) -> LoraBase | None:
    """The base of a training checkpoint of LoRA adapters (None: the checkpoint holds every weight)."""
    adapters = _read_model_config(directory)[1].get("lora")
    return None if adapters is None or "model_path" not in adapters else LoraBase(adapters["model_path"],
                                                                                  adapters["seed"])


def flat_params(params: nnx.State) -> dict[str, jax.Array]:
    """{dotted path: array} of a parameter state (the tree we store in Orbax)."""
    return {dotted(path): var.get_value() for path, var in nnx.to_flat_state(params)}


def params_from_flat(template: nnx.State, flat: dict[str, jax.Array]) -> nnx.State:
    """Rebuild an nnx.State shaped like ``template`` from a flat {dotted path: array} dict."""
    items = [(path, var.replace(value=flat[dotted(path)])) for path, var in nnx.to_flat_state(template)]
    return nnx.from_flat_state(items)


def absolute_path(directory: str | os.PathLike) -> epath.Path:
    """``directory`` as the absolute path Orbax wants; a store's (``gs://...``) as it is (``absolute()``
    would put the working directory in front of it)."""
    directory = epath.Path(directory)
    return directory if is_remote(directory) else directory.absolute()


def save_model(model: Qwen, directory: str | os.PathLike, *, overwrite: bool = False) -> epath.Path:
    """Save ``model`` as ``directory/{model_config.json, params/}`` (every process takes part); an existing
    one is refused, or replaced with ``overwrite``."""
    directory = absolute_path(directory)
    if (directory / PARAMS_ITEM).exists() and not overwrite:
        raise FileExistsError(f"{directory / PARAMS_ITEM}: already exists")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / PARAMS_ITEM, flat_params(nnx.state(model, nnx.Param)), force=overwrite)
    checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        write_model_config(directory, model.cfg)
    return directory


def find_params_dir(directory: str | os.PathLike) -> tuple[epath.Path, epath.Path]:
    """(dir holding model_config.json, params dir) for a model checkpoint, a manager root (its latest
    step) or one ``<root>/<step>`` of it."""
    directory = absolute_path(directory)
    if (directory / PARAMS_ITEM).is_dir():  # a model checkpoint, or one step of a manager root
        step_of_root = directory.name.isdigit() and not (directory / MODEL_CONFIG_FILE).is_file()
        return (directory.parent if step_of_root else directory), directory / PARAMS_ITEM
    steps = sorted((int(p.name), p) for p in directory.iterdir() if p.name.isdigit() and (p / PARAMS_ITEM).is_dir()) \
        if directory.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"{directory}: no {PARAMS_ITEM}/ and no <step>/{PARAMS_ITEM}/ checkpoints")
    return directory, steps[-1][1] / PARAMS_ITEM


def abstract_params(cfg: QwenConfig) -> tuple[nnx.GraphDef, nnx.State, dict]:
    """(graphdef, abstract state, {dotted path: ShapeDtypeStruct with sharding}) for restoring on the
    mesh in context."""
    graphdef, state = abstract_model(cfg)
    target = {dotted(path): var.get_value() for path, var in nnx.to_flat_state(state)}
    return graphdef, state, target


def restore_flat_params(params_dir: epath.Path, target: dict) -> dict[str, jax.Array]:
    """Restore a flat params dict into the shardings/dtypes of ``target``."""
    stored = ocp.StandardCheckpointer().metadata(params_dir)
    stored_tree = getattr(stored, "item_metadata", stored)
    stored_keys = set(stored_tree.keys()) if hasattr(stored_tree, "keys") else set(target)
    missing = sorted(set(target) - stored_keys)
    if missing:
        raise ValueError(f"{params_dir}: parameters missing from the checkpoint: {missing[:5]}")
    for key, wanted in target.items():
        meta = stored_tree[key]
        if tuple(meta.shape) != tuple(wanted.shape):
            raise ValueError(f"{params_dir}: parameter {key} has shape {tuple(meta.shape)}, the config "
                             f"needs {tuple(wanted.shape)}")
    return ocp.StandardCheckpointer().restore(params_dir, target)


def load_model(directory: str | os.PathLike, *, dtype: str | None = None,
               param_dtype: str | None = None, remat: str | None = None, **run_options) -> Qwen:
    """Load a pacs_jax checkpoint (model dir or trainer root: latest step) into a model sharded on the
    mesh in context.

    ``None`` keeps the stored dtypes / remat policy.
    """
    config_dir, params_dir = find_params_dir(directory)
    overrides = {k: v for k, v in dict(dtype=dtype, param_dtype=param_dtype, remat=remat, **run_options).items()
                 if v is not None}
    cfg = read_model_config(config_dir, **overrides)
    base = read_lora_base(config_dir)
    if base is None:
        graphdef, state, target = abstract_params(cfg)
        return nnx.merge(graphdef, params_from_flat(state, restore_flat_params(params_dir, target)))
    # a training checkpoint of LoRA adapters: the base loaded (or drawn) as the run built it, the adapters restored
    plain = cfg.without_adapters()
    run = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, remat=cfg.remat, attention=cfg.attention,
               attention_block_size=cfg.attention_block_size, expert_parallel=cfg.expert_parallel)
    model = lora.attach(from_pretrained(base.model_path, **run) if base.model_path else init_random(plain, base.seed),
                        rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_targets, modules_to_save=cfg.lora_saved)
    graphdef, state = nnx.split(model)
    adapters, frozen = lora.split(state)
    restored = params_from_flat(adapters, restore_flat_params(params_dir, abstract(flat_params(adapters))))
    return nnx.merge(graphdef, nnx.merge_state(restored, frozen))


def from_pretrained(path: str | os.PathLike, dtype: str = "float32", *,
                    param_dtype: str | None = "float32", remat: str = "none", **run_options) -> Qwen:
    """Load an HF directory (config.json + safetensors) or a pacs_jax Orbax checkpoint directory; either
    may be on ``gs://`` (an HF directory is copied to the host's cache once, data/remote.py; Orbax
    reads the store).

    dtype: compute dtype ("float32" for tests, "bfloat16" on accelerators); param_dtype: storage
    dtype of the parameters (fp32 master weights by default; None keeps the checkpoint's dtype).
    Parameters are created directly in their sharding on the mesh in context (pacs_jax/sharding.py).
    run_options: other QwenConfig fields of how to run it (``attention``, ``attention_block_size``).
    """
    path = epath.Path(path)
    if (path / "config.json").is_file():  # gs://: read from the host's local copy (data/remote.py)
        local = epath.Path(local_folder(path)) if is_remote(path) else path
        return load_hf(local, dtype=dtype, param_dtype=param_dtype, remat=remat, **run_options)
    if path.is_dir():
        return load_model(path, dtype=dtype, param_dtype=param_dtype, remat=remat, **run_options)
    raise FileNotFoundError(f"{path}: not an HF model directory (config.json) nor a pacs_jax checkpoint")


class ModelFolderError(PermanentError):
    """A folder given as a model is not one that loads; the message starts with the folder and says what
    it lacks. Callers put the flag or field that named it in front."""


def _is_training_config(path: epath.Path) -> bool:
    """Whether ``path`` (a config.json) is a training run's config (a workdir's), not an HF model's."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and all(isinstance(config.get(k), dict) for k in ("model", "data", "train"))


def check_model_dir(path: str | os.PathLike) -> QwenConfig:
    """The config of the model ``from_pretrained(path)`` would load, after checking, without loading a
    weight, that it loads: an HF folder's config.json parses and its safetensors (model.safetensors, or
    the shards of model.safetensors.index.json) hold every tensor the config's model needs at its
    shape (read from the files' headers: a copy cut short is caught too; on a store, only that the
    files exist); a pacs_jax checkpoint's model_config.json parses and its Orbax metadata lists every
    parameter at its shape. Raises ``ModelFolderError`` naming the folder and what is wrong."""
    folder = epath.Path(path)
    if not folder.is_dir():
        raise ModelFolderError(f"{path}: {'is a file, not a model folder' if folder.exists() else 'does not exist'}")
    if (folder / "config.json").is_file():
        if _is_training_config(folder / "config.json"):
            raise ModelFolderError(f"{path}: a training workdir, not a model: name its checkpoints/ (the newest "
                                   "step), checkpoints/<step> or hf_export/")
        try:
            cfg = QwenConfig.from_hf_file(folder)
            found = hf_weight_shapes(folder, read_headers=not is_remote(folder))
        except FileNotFoundError as e:
            raise ModelFolderError(f"{path}: holds config.json but {e}: copy the model's *.safetensors files (and "
                                   "model.safetensors.index.json) into it") from None
        except (OSError, ValueError) as e:
            raise ModelFolderError(f"{path}: {e}") from None
        needed = hf_shapes(cfg) if found or not is_remote(folder) else {}  # a store's single file: not read
        _check_shapes(path, {name: found.get(name) for name in needed}, needed, "the weights",
                      "config.json's model")
        _check_stop_ids(path, cfg)
        return cfg
    try:
        config_dir, params_dir = find_params_dir(folder)
    except FileNotFoundError:
        raise ModelFolderError(f"{path}: not a model: no config.json (an HF model folder), no {PARAMS_ITEM}/ (a "
                               f"pacs_jax checkpoint) and no <step>/{PARAMS_ITEM}/ (a trainer's checkpoints/)") from None
    try:
        cfg = read_model_config(config_dir)
        stored = ocp.StandardCheckpointer().metadata(params_dir)
    except (OSError, ValueError) as e:
        raise ModelFolderError(f"{path}: {_first_line(e).split(': ', 1)[-1]}") from None
    tree = getattr(stored, "item_metadata", stored)
    shapes = {key: tuple(meta.shape) for key, meta in tree.items()} if hasattr(tree, "items") else {}
    base = read_lora_base(config_dir)
    # a training checkpoint of LoRA adapters: they alone are in it (and the modules trained whole), the base is its
    # model.path
    needed = param_shapes(cfg, nnx.Param if base is None else nnx.LoRAParam)
    if base is not None:
        if base.model_path:
            try:
                check_model_dir(base.model_path)
            except ModelFolderError as e:
                raise ModelFolderError(f"{path}: the base model of its LoRA adapters: {e}") from None
    _check_shapes(str(params_dir), {k: shapes.get(k) for k in needed}, needed, "the checkpoint",
                  f"{MODEL_CONFIG_FILE}'s model")
    _check_stop_ids(path, cfg)
    return cfg


def _check_stop_ids(where, cfg: QwenConfig) -> None:
    """Refuse eos ids (config.json's and generation_config.json's) outside the model's vocabulary: the
    sampler stops on them and would refuse them mid-run."""
    eos = cfg.eos_token_id
    for token in () if eos is None else (eos,) if isinstance(eos, int) else eos:
        if not 0 <= token < cfg.vocab_size:
            raise ModelFolderError(f"{where}: eos_token_id {token} (config.json / generation_config.json) is outside "
                                   f"the model's vocabulary of {cfg.vocab_size}: a config of another model?")


def _check_shapes(where: str, found: dict, needed: dict[str, tuple[int, ...]], holder: str, model: str) -> None:
    """Refuse (``ModelFolderError`` naming ``where``) when ``found`` lacks a name of ``needed`` (value None)
    or holds it at another shape (an empty shape: not known, not compared)."""
    missing = [name for name, shape in found.items() if shape is None]
    if missing:
        raise ModelFolderError(f"{where}: {holder} lack {len(missing)} of the {len(needed)} tensors {model} needs "
                               f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): an incomplete copy?")
    for name, shape in found.items():
        if shape and tuple(shape) != tuple(needed[name]):
            raise ModelFolderError(f"{where}: tensor {name} has shape {tuple(shape)}, {model} needs "
                                   f"{tuple(needed[name])}: weights of another model?")


class CheckpointError(PermanentError):
    """No checkpoint of a trainer's root restores (each damaged, or not of this config's shapes)."""


class _QuietStorageErrors(logging.Filter):
    """Drops Orbax's error records (with their tracebacks, from its save threads) whose exception is
    a full disk or a permission error: the trainer reports it once, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[1] is not None and storage_error(record.exc_info[1]))


_QUIET = _QuietStorageErrors()


def _all_processes(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (a collective in a multi-process run)."""
    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _first_line(exc: BaseException) -> str:
    """The error's first line, from its innermost cause (tensorstore's read error names the file; the
    error Orbax raises from it prints the whole TensorStore spec)."""
    seen = set()
    while (exc.__cause__ or exc.__context__) is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    text = str(exc).split(" See full TensorStore details")[0].strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:400] if text else ''}"


class _Manager(ocp.CheckpointManager):
    """Orbax's CheckpointManager, whose own question at each save (was a preemption reached at this
    step? for its logs) does not reach JAX's preemption sync point: the run's safe points are its one
    caller, with a count of safe points rather than a step (training/signals.py), and a call with a
    step number, from a save or its finalizing thread, would move the counter the processes agree on."""

    def reached_preemption(self, step: int) -> bool:
        return False


class RestoredStep(NamedTuple):
    """A training checkpoint restored (``TrainCheckpointer.restore``): its step, the actor's params and
    AdamW state in the templates' shardings, its meta (JSON: step, seed, data_state) and PPO's critic
    (params, opt_state), or None without one."""

    step: int
    params: nnx.State
    opt_state: Any
    meta: dict
    critic: tuple[nnx.State, Any] | None


def read_meta(directory: str | os.PathLike, step: int) -> dict:
    """The meta item (JSON: step, seed, data_state) of step ``step`` of the trainer's root ``directory``,
    read as ``TrainCheckpointer.restore`` reads it but without a manager (no collective: any process, at
    any time). Raises ``OSError`` (no such file) or ``ValueError`` (not JSON)."""
    return dict(ocp.JsonCheckpointHandler().restore(absolute_path(directory) / str(step) / "meta"))


class TrainCheckpointer:
    """Saves every ``every`` steps (and on demand), keeps the last ``keep``, restores the latest.

    with_critic: the checkpoints also hold PPO's critic (its parameters and optimizer state), which
    ``save`` and ``restore`` then take as ``critic=(params, opt_state)``.
    """

    def __init__(self, directory: str | os.PathLike, model_config: QwenConfig, *, every: int, keep: int,
                 with_critic: bool = False, lora_base: LoraBase | None = None):
        self.directory = absolute_path(directory)
        self.every = every
        self.with_critic = with_critic
        self.manager = _Manager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("params", "opt_state", "meta") + (("critic_params", "critic_opt_state") if with_critic else ()))
        if jax.process_index() == 0:
            write_model_config(self.directory, model_config, lora_base)  # LoRA: the base its adapters need
        logging.getLogger("absl").addFilter(_QUIET)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def _check_critic(self, critic) -> None:
        if (critic is not None) != self.with_critic:
            raise ValueError(f"this checkpointer was made with with_critic={self.with_critic}: pass critic="
                             f"{'(params, opt_state)' if self.with_critic else 'None'}")

    def save(self, step: int, params: nnx.State, opt_state: Any, meta: dict | Callable[[], dict], *,
             force: bool = False, critic: tuple[nnx.State, Any] | None = None) -> bool:
        """Save when ``step`` is a multiple of ``every`` (or ``force``); returns whether it saved. meta: the
        JSON item, or a function that makes it, called only when the step is saved (a carry-over data
        state reads the rows in flight from the device: training/engine/carry_over.py)."""
        self._check_critic(critic)
        if not force and (self.every <= 0 or step % self.every):
            return False
        if step in self.manager.all_steps():
            return False
        items = dict(params=ocp.args.StandardSave(flat_params(params)), opt_state=ocp.args.StandardSave(opt_state),
                     meta=ocp.args.JsonSave(meta() if callable(meta) else meta))
        if critic is not None:
            items.update(critic_params=ocp.args.StandardSave(flat_params(critic[0])),
                         critic_opt_state=ocp.args.StandardSave(critic[1]))
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        return True

    def restore(self, step: int, params: nnx.State, opt_state: Any, critic: tuple[nnx.State, Any] | None = None
                ) -> RestoredStep:
        """Restore ``step`` into the shardings/dtypes of the given (template) params and opt_state (and
        the critic's)."""
        self._check_critic(critic)
        items = dict(params=ocp.args.StandardRestore(abstract(flat_params(params))),
                     opt_state=ocp.args.StandardRestore(abstract(opt_state)), meta=ocp.args.JsonRestore())
        if critic is not None:
            items.update(critic_params=ocp.args.StandardRestore(abstract(flat_params(critic[0]))),
                         critic_opt_state=ocp.args.StandardRestore(abstract(critic[1])))
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        critic_state = None if critic is None else (params_from_flat(critic[0], restored["critic_params"]),
                                                    restored["critic_opt_state"])
        return RestoredStep(step, params_from_flat(params, restored["params"]), restored["opt_state"], restored["meta"],
                            critic_state)

    def restore_latest(self, params: nnx.State, opt_state: Any, critic: tuple[nnx.State, Any] | None = None,
                       *, warn=print) -> RestoredStep | None:
        """Restore the newest step that restores (``restore``), or None without steps.

        A step that fails to restore while an older one restores is damaged: it is moved aside to
        ``<root>/<step>.damaged`` (process 0) and ``warn`` gets a line naming it and the error.
        Raises ``CheckpointError`` (one line, every step's error) when no step restores. Every
        process takes part and they agree on the step.
        """
        failures: list[tuple[int, str]] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored, error = self.restore(step, params, opt_state, critic), None
            except Exception as e:  # damaged files raise ValueError, JSONDecodeError, tensorstore errors
                restored, error = None, _first_line(e)
            if _all_processes(error is None):
                if failures:
                    moved = self._set_aside([s for s, _ in failures])
                    for bad, why in failures:
                        warn(f"warning: checkpoint step {bad} in {self.directory} is damaged ({why}); moved it to "
                             f"{moved.get(bad, f'{bad}.damaged')} and resumed from step {step}")
                return restored
            failures.append((step, error or "failed on another process"))
        if not failures:
            return None
        raise CheckpointError(f"{self.directory}: no checkpoint restores: " +
                              "; ".join(f"step {s}: {why}" for s, why in failures)
                              + ". Delete the damaged steps (or the folder, to start afresh) or resume with the "
                                "config that wrote them")

    def _set_aside(self, steps: list[int]) -> dict[int, epath.Path]:
        """Rename damaged ``<root>/<step>`` folders to ``<step>.damaged``; the manager forgets them.
        Returns {step: its new path} (process 0)."""
        moved = {}
        if jax.process_index() == 0:
            for step in steps:
                target = self.directory / f"{step}.damaged"
                n = 1
                while target.exists():
                    n += 1
                    target = self.directory / f"{step}.damaged{n}"
                (self.directory / str(step)).rename(target)
                moved[step] = target
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("pacs_jax damaged checkpoints moved")
        self.manager.reload()
        return moved

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
