"""The check before anything runs (docs/design.md section 3.0); every error names its field.

Unknown keys are refused by ml_collections itself (configs are locked; ``--config.train.stepz=1``
fails naming the key); ``validate_config`` builds the run's ``RunSpec`` (training/spec.py: every value
and how the values fit together), then ``check_spec`` checks what the spec names outside itself: the
model folder (config and weight headers, ``checkpoints.check_model_dir``), the files, the tokenizer,
and every length against the model's context; ``check_inputs`` (the trainer, before its workdir exists) also reads the training data and the
evaluation sets as the run will; ``check_for_slice`` (tools/plan_memory.py, pacs_jax/check_config.py for
launch/tpu_pod.sh) runs it for a slice's devices on a machine that may lack the workers' files. Relative
data paths are looked for as the readers look for them (data/paths.py: the working directory, then the
repository); ``gs://`` paths (model.path, data.tokenizer, data files, the evaluation sets' folder) in
the store.
"""

from __future__ import annotations

import contextvars
import dataclasses

import jax

import ml_collections

from pacs_jax import checkpoints
from pacs_jax.data import deepscaler, paths
from pacs_jax.data.prompts import CHAR_TOKENIZER, MODEL_TOKENIZER, TokenizerChoiceError, load_tokenizer, run_tokenizer
from pacs_jax.data.readers import split_format
from pacs_jax.data.records import DataError
from pacs_jax.data.sources import training_problems
from pacs_jax.evaluation.runner import load_eval_sets
from pacs_jax.training.model_spec import base_model_config, lora_options
from pacs_jax.training.spec import ConfigError, DataSpec, ModelSpec, RunSpec, require


def validate_config(config: ml_collections.ConfigDict, device_count: int | None = None) -> None:
    """Check ``config`` against the devices there are, or ``device_count`` of them (it builds nothing:
    ``sharding.config_mesh`` then makes its mesh): its ``RunSpec``, then ``placed``."""
    placed(RunSpec.unplaced(config), device_count)


def placed(spec: RunSpec, device_count: int | None = None) -> RunSpec:
    """An unplaced spec (``RunSpec.unplaced``: every value and how the values fit together), checked for
    what it names outside itself (``check_spec``), then on the devices there are (or ``device_count``):
    the mesh, and the tensor axis against the model's config."""
    check_spec(spec)
    spec = spec.on_devices(device_count or jax.device_count())
    cfg = _model_if_readable(spec)
    if cfg is not None:
        spec.check_tensor_axis(cfg)
        spec.check_router_replay(cfg)
    return spec


def check_spec(spec: RunSpec) -> None:
    """What a spec names outside itself: the evaluation sets' files, the model folder (config and weight
    headers, ``checkpoints.check_model_dir``), the training files, the tokenizer, PPO's critic folder,
    and every length against the model's context."""
    ec, m, dc = spec.eval, spec.model, spec.data
    for name in ec.sets:
        if name == "held_out":
            continue
        path = paths.join(ec.data_dir, ec.set_files[name])
        if not ec.set_files[name].startswith("tfds:") and not _elsewhere(path, f"eval.set_files.{name}"):
            require(paths.path(path).exists(), f"eval.set_files.{name}", paths.missing(path))
    if m.path and not _elsewhere(m.path, "model.path"):
        require(paths.path(m.path).exists(), "model.path", paths.missing(m.path))
    if dc.source == "files":
        for i, f in enumerate(dc.train_files):
            path, _ = split_format(f)
            if not path.startswith("tfds:") and not _elsewhere(path, f"data.train_files[{i}]"):
                require(paths.path(path).exists(), f"data.train_files[{i}]",
                        paths.missing(path, deepscaler.missing_file_hint(path)))
    require(dc.tokenizer in (CHAR_TOKENIZER, MODEL_TOKENIZER) or _elsewhere(dc.tokenizer, "data.tokenizer")
            or paths.path(dc.tokenizer).is_dir(),
            "data.tokenizer", f"tokenizer directory {dc.tokenizer!r} does not exist (or \"{CHAR_TOKENIZER}\", or "
            f"\"\" for model.path's own)")
    m.check_source()
    if m.path and not _elsewhere(m.path, "model.path"):
        _check_model_folder(m.path, "model.path")
    _check_tokenizer(dc, m)
    cfg = _model_if_readable(spec)
    if cfg is not None:
        spec.check_context(cfg.max_position_embeddings)
    cc = spec.critic
    if cc is not None and cc.path and not _elsewhere(cc.path, "critic.path"):
        require(paths.path(cc.path).exists(), "critic.path", paths.missing(cc.path))
        _check_model_folder(cc.path, "critic.path")


def check_inputs(config: ml_collections.ConfigDict, device_count: int | None = None) -> RunSpec:
    """``inputs_checked`` of the config's spec; returns the spec on its devices."""
    return inputs_checked(RunSpec.unplaced(config), device_count)


def inputs_checked(spec: RunSpec, device_count: int | None = None) -> RunSpec:
    """``placed`` (as ``validate_config``), then every input a run reads, read as the run reads it, before anything is
    built: the training problems (each file parsed, each row with its format's fields, enough of them
    for the held-out and warm-start splits, one step's prompts and one warm-start batch) and the
    evaluation sets' files. The
    trainer runs it before it creates its workdir; every failure is one line naming the field or file
    (``ConfigError``, ``DataError``: permanent, status 78). ``device_count``: as ``validate_config``.
    Returns the spec on its devices."""
    spec = placed(spec, device_count)
    dc, prompts = spec.data, spec.train.prompts_per_step
    absent = dc.source == "files" and any([_elsewhere(split_format(f)[0], f"data.train_files[{i}]")  # each noted
                                           for i, f in enumerate(dc.train_files)])
    if not absent:
        try:
            train, warm, _, counts = training_problems(dataclasses.asdict(dc), seed=spec.seed)
        except DataError as e:
            raise ConfigError(f"config.data.train_files: {e}") from None
        require(len(train) >= prompts, "train.prompts_per_step",
                 f"{prompts} is more than the {len(train)} problems RL samples from ({counts['rows']} read, "
                 f"{counts['held_out']} held out, {counts['warmstart']} for the warm-start only): a step takes "
                 f"{prompts} distinct prompts; lower it or the splits, or add problems")
        wc = spec.warmstart
        warm_count, whose = (len(warm), "data.warmstart_problems") if warm else (
            len(train), "RL's, data.warmstart_problems being 0")
        require(not wc.steps or warm_count >= wc.batch_size, "warmstart.batch_size",
                 f"{wc.batch_size} is more than the {warm_count} problems the warm-start trains on ({whose}): a "
                 "warm-start step takes that many distinct prompts; lower it, or set more problems aside")
    ec = spec.eval
    for name in (n for n in ec.sets if n != "held_out"):
        file = ec.set_files[name]
        if not file.startswith("tfds:") and not _elsewhere(paths.join(ec.data_dir, file), f"eval.set_files.{name}"):
            try:
                load_eval_sets([name], ec.set_files, ec.data_dir)
            except DataError as e:
                raise ConfigError(f"config.eval.set_files.{name}: {e}") from None
    return spec


def check_for_slice(spec: RunSpec, device_count: int) -> tuple[RunSpec, list[str]]:
    """``inputs_checked`` of an unplaced spec on the machine that launches a run on a slice of ``device_count`` devices
    (launch/tpu_pod.sh, through pacs_jax/check_config.py): the mesh against the slice, and a local path
    that is not on this machine (model.path, data.tokenizer, data files on the workers' disks) left
    unchecked; what is there (``gs://`` paths included) is read as the trainer reads it. Returns the
    spec on the slice's devices and the paths left unchecked ("field=path"), which the trainer checks on
    the workers."""
    skipped: list[str] = []
    token = _ON_WORKERS.set(skipped)
    try:
        spec = inputs_checked(spec, device_count)
    finally:
        _ON_WORKERS.reset(token)
    return spec, list(dict.fromkeys(skipped))


# While check_for_slice runs: the fields whose local paths are not on this machine (else None)
_ON_WORKERS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("on_workers", default=None)


def _elsewhere(path: str, field: str) -> bool:
    """Whether ``path`` (named by ``field``) is left unchecked: while ``check_for_slice`` runs, a local
    path this machine does not have (it is noted); never otherwise."""
    skipped = _ON_WORKERS.get()
    if skipped is None or not path or paths.is_remote(path) or paths.path(path).exists():
        return False
    skipped.append(f"{field}={path}")
    return True


def _check_tokenizer(dc: DataSpec, m: ModelSpec) -> None:
    """The run's tokenizer (data/prompts.py run_tokenizer): "" needs model.path with tokenizer files, and
    a folder of another model family than model.path's is refused unless data.tokenizer_force. A folder
    the user named (data.tokenizer, or model.path's own files) is loaded as the run loads it: files
    that do not make a tokenizer (vocab.json without merges.txt) are refused naming the folder."""
    if _elsewhere(m.path, "model.path") or (dc.tokenizer not in (CHAR_TOKENIZER, MODEL_TOKENIZER)
                                            and _elsewhere(dc.tokenizer, "data.tokenizer")):
        return
    try:
        folder = run_tokenizer(dataclasses.asdict(dc), m.path)
    except TokenizerChoiceError as e:
        raise ConfigError(f"config.{e.field}: {e}") from None
    if folder == CHAR_TOKENIZER or not (dc.tokenizer or m.path):  # "char", or the repository's own
        return
    try:
        load_tokenizer(folder)
    except Exception as e:  # transformers' loaders raise what their file readers raise
        field = "data.tokenizer" if dc.tokenizer else "model.path"
        files = paths.path(folder)
        half_bpe = (files / "vocab.json").is_file() and not any((files / name).is_file()
                                                               for name in ("merges.txt", "tokenizer.json"))
        hint = "it has vocab.json but no merges.txt (nor tokenizer.json)" if half_bpe else f"{type(e).__name__}: {e}"
        raise ConfigError(f"config.{field}: the tokenizer in {folder} does not load: {hint}") from None


def _check_model_folder(path: str, field: str) -> None:
    """The model folder ``field`` names (model.path, critic.path): ``checkpoints.check_model_dir`` (config,
    weights and their shapes, read without loading them)."""
    try:
        checkpoints.check_model_dir(paths.resolve(path))
    except checkpoints.ModelFolderError as e:
        raise ConfigError(f"config.{field}: {e}") from None


def _model_if_readable(spec: RunSpec):
    """The model's QwenConfig (``model_config``), or None when it has none yet or its source does not
    read: that source is checked, and named, by ``check_spec``. A preset's or the config's own fields that
    make no model, and LoRA's adapters that a model (model.path's too) cannot take (the experts' on a dense
    one), raise ConfigError naming config.model."""
    try:
        base = base_model_config(spec)
    except OSError:
        return None
    except ValueError as e:
        if spec.model.path:
            return None
        raise ConfigError(f"config.model: {e}") from None
    if base is None:
        return None
    try:
        return base.replace(**lora_options(spec, base))
    except ValueError as e:
        raise ConfigError(f"config.model: {e}") from None
