"""The check before anything runs (docs/design.md section 3.0); every error names its field.

Unknown keys are refused by ml_collections itself (configs are locked; ``--config.train.stepz=1``
fails naming the key); ``validate_config`` checks values, how they fit together, the model folder
(config and weight headers, ``checkpoints.check_model_dir``) and every length against the model's
context; ``check_inputs`` (the trainer, before its workdir exists) also reads the training data and the
evaluation sets as the run will; ``check_for_slice`` (tools/plan_memory.py, pacs_jax/check_config.py for
launch/tpu_pod.sh) runs it for a slice's devices on a machine that may lack the workers' files. Relative
data paths are looked for as the readers look for them (data/paths.py: the working directory, then the
repository); ``gs://`` paths (model.path, data.tokenizer, data files, the evaluation sets' folder) in
the store.
"""

from __future__ import annotations

import contextvars

import jax
import ml_collections

from pacs_jax import checkpoints
from pacs_jax.data import deepscaler, paths
from pacs_jax.data.fields import FORMATS
from pacs_jax.data.prompts import CHAR_TOKENIZER, MODEL_TOKENIZER, TokenizerChoiceError, load_tokenizer, run_tokenizer
from pacs_jax.data.readers import split_format
from pacs_jax.data.records import DataError
from pacs_jax.data.sources import SOURCES, training_problems
from pacs_jax.errors import PermanentError
from pacs_jax.evaluation.runner import load_eval_sets
from pacs_jax.models.config import ATTENTION_IMPLS, PRESETS, REMAT_POLICIES, SUPPORTED_MODEL_TYPES
from pacs_jax.rewards import REWARD_MODES, REWARDS
from pacs_jax.rl.objectives import OBJECTIVES, OptionError, options_for
from pacs_jax.rl.packing import pass_rows, pass_slots, shards_for
from pacs_jax.rl.policy_gradient import LOSS_AGG_MODES, LOSS_SCALES
from pacs_jax.sampling.settings import SAMPLERS, row_pages
from pacs_jax.sharding import mesh_shape
from pacs_jax.training.model_spec import model_config
from pacs_jax.training.optim import SCHEDULES


# The architecture fields of config.model that a model of the config's own needs (> 0).
ARCHITECTURE_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "rope_theta")


class ConfigError(PermanentError, ValueError):
    """A config value is wrong; the message starts with the field's dotted name (or, for a resume
    that does not fit its workdir, the workdir). Permanent: the CLIs exit with status 78."""


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config.{field}: {message}")


def _check_buckets(buckets, field: str, largest: int, largest_field: str, allow_empty: bool) -> None:
    buckets = tuple(buckets)
    if allow_empty and not buckets:
        return
    _require(bool(buckets) and all(isinstance(b, int) and b >= 1 for b in buckets), field,
             f"must be a non-empty tuple of positive integers, got {buckets!r}")
    _require(list(buckets) == sorted(set(buckets)), field, f"must be strictly increasing, got {buckets!r}")
    _require(buckets[-1] == largest, field, f"the largest bucket ({buckets[-1]}) must equal {largest_field}={largest}")


def validate_config(config: ml_collections.ConfigDict, device_count: int | None = None) -> None:
    """Check ``config`` against the devices there are, or ``device_count`` of them (it builds nothing:
    ``sharding.config_mesh`` then makes its mesh). Objective facts come from the registry,
    rl/objectives.py."""
    devices = device_count or jax.device_count()
    tc, rc, oc = config.train, config.rollout, config.optim
    for field in ("steps", "prompts_per_step", "mini_batches", "micro_batches"):
        _require(isinstance(tc[field], int) and tc[field] >= 1, f"train.{field}", f"must be an integer >= 1, got {tc[field]!r}")
    for field in ("checkpoint_every", "keep_checkpoints"):
        _require(isinstance(tc[field], int) and tc[field] >= 0, f"train.{field}", f"must be an integer >= 0, got {tc[field]!r}")
    _require(isinstance(tc.progress_seconds, (int, float)) and tc.progress_seconds >= 0, "train.progress_seconds",
             f"must be a number of seconds >= 0, got {tc.progress_seconds!r}")
    _check_eval(config)

    objective = config.algorithm.objective
    _require(objective in OBJECTIVES, "algorithm.objective", f"{objective!r} is not one of {sorted(OBJECTIVES)}")
    spec = OBJECTIVES[objective]
    _check_other_objectives(config.algorithm)
    options = options_for(config.algorithm)
    try:
        spec.check_options(options)
    except OptionError as e:
        raise ConfigError(f"config.algorithm.{objective}.{e.option}: objective {objective!r}: {e}") from e
    _require(isinstance(rc.n, int) and rc.n >= spec.min_group_size, "rollout.n",
             f"{objective} compares the responses of a prompt and needs n >= {spec.min_group_size}, got {rc.n!r}")
    _require(rc.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {rc.max_new_tokens}")
    _require(rc.temperature > 0, "rollout.temperature", f"RL samples need temperature > 0, got {rc.temperature}")
    _require(0 < rc.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {rc.top_p}")
    _require(all(isinstance(t, int) and t >= 0 for t in rc.stop_token_ids), "rollout.stop_token_ids",
             f"must be token ids (integers >= 0), got {rc.stop_token_ids!r}")

    _check_buckets(config.data.prompt_buckets, "data.prompt_buckets", config.data.max_prompt_length,
                   "data.max_prompt_length", allow_empty=False)
    _check_buckets(rc.response_buckets, "rollout.response_buckets", rc.max_new_tokens, "rollout.max_new_tokens",
                   allow_empty=True)
    _require(rc.max_logprob_diff >= 0, "rollout.max_logprob_diff",
             f"must be >= 0 (0: report the sampler / pi_old mismatch only), got {rc.max_logprob_diff}")
    _require(rc.sampler in SAMPLERS, "rollout.sampler", f"{rc.sampler!r} is not one of {SAMPLERS}")
    _require(isinstance(rc.micro_batches, int) and rc.micro_batches >= 1 and tc.prompts_per_step % rc.micro_batches == 0,
             "rollout.micro_batches", f"{rc.micro_batches!r} must be an integer >= 1 dividing "
                                      f"train.prompts_per_step={tc.prompts_per_step}")
    responses = tc.prompts_per_step * rc.n
    _require(isinstance(tc.logprob_micro_batches, int) and tc.logprob_micro_batches >= 0
             and responses % max(tc.logprob_micro_batches, 1) == 0, "train.logprob_micro_batches",
             f"{tc.logprob_micro_batches!r} must be 0 (= mini_batches x micro_batches) or an integer dividing the "
             f"{responses} responses of a step")
    _require(isinstance(tc.packing, bool), "train.packing", f"must be True or False, got {tc.packing!r}")
    longest = max(config.data.prompt_buckets) + rc.max_new_tokens
    _require(isinstance(tc.packed_length, int) and (tc.packed_length == 0 or tc.packed_length >= longest),
             "train.packed_length", f"{tc.packed_length!r} must be 0 (= the largest prompt bucket + "
                                    f"rollout.max_new_tokens) or at least that, {longest}, so that every sequence fits a row")
    _require(isinstance(tc.packed_rows, int) and tc.packed_rows >= 0, "train.packed_rows",
             f"must be 0 (a quarter of a padded micro-batch's rows) or a positive integer, got {tc.packed_rows!r}")
    _require(tc.prompts_per_step % tc.mini_batches == 0, "train.mini_batches",
             f"{tc.mini_batches} does not divide train.prompts_per_step={tc.prompts_per_step} "
             "(mini-batches hold whole prompt groups)")
    per_mini = tc.prompts_per_step // tc.mini_batches
    _require(per_mini % tc.micro_batches == 0, "train.micro_batches",
             f"{tc.micro_batches} does not divide the {per_mini} prompts of a mini-batch")
    micro_rows = per_mini // tc.micro_batches * rc.n
    if options.get("loss_scale") == "verl":
        _check_verl_micro_batch(options.get("verl_micro_batch_size"), micro_rows, f"algorithm.{objective}")
    if config.algorithm.objective == "ppo":
        _check_critic(config.critic, micro_rows)

    _require(oc.lr > 0, "optim.lr", f"must be > 0, got {oc.lr}")
    _require(oc.schedule in SCHEDULES, "optim.schedule", f"{oc.schedule!r} is not one of {SCHEDULES}")
    _require(oc.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 = none), got {oc.grad_clip}")
    _require(config.reward.name in REWARDS, "reward.name", f"{config.reward.name!r} is not one of {sorted(REWARDS)}")
    _require(config.reward.item_timeout > 0, "reward.item_timeout", "must be > 0")
    _require(config.reward.mode in REWARD_MODES, "reward.mode", f"{config.reward.mode!r} is not one of {REWARD_MODES}")
    _require(0.0 <= config.reward.max_unscored_fraction <= 1.0, "reward.max_unscored_fraction",
             f"must be in [0, 1], got {config.reward.max_unscored_fraction}")

    m = config.model
    _require(m.remat in REMAT_POLICIES, "model.remat", f"{m.remat!r} is not one of {REMAT_POLICIES}")
    for field in ("dtype", "param_dtype"):
        _require(m[field] in ("float32", "bfloat16", "float16"), f"model.{field}", f"{m[field]!r} is not a float dtype")
    if m.path and not _elsewhere(m.path, "model.path"):
        _require(paths.path(m.path).exists(), "model.path", paths.missing(m.path))
    elif m.preset:
        _require(m.preset in PRESETS, "model.preset",
                 f"{m.preset!r} is not one of {sorted(PRESETS)} (or set model.path to an HF dir / checkpoint, "
                 "or leave both empty for the architecture fields of config.model)")
    _require(m.attention in ATTENTION_IMPLS, "model.attention", f"{m.attention!r} is not one of {ATTENTION_IMPLS}")
    _require(isinstance(m.attention_block_size, int) and m.attention_block_size >= 1, "model.attention_block_size",
             f"must be an integer >= 1, got {m.attention_block_size!r}")
    if not (m.path or m.preset):  # a model of the config's own (configs/base.py): every architecture field named
        _require(m.model_type in SUPPORTED_MODEL_TYPES, "model.model_type",
                 f"{m.model_type!r} is not one of {SUPPORTED_MODEL_TYPES} (or set model.path or model.preset)")
        for field in ARCHITECTURE_SIZES:
            _require(m[field] > 0, f"model.{field}", f"must be > 0 without model.path or model.preset, got {m[field]!r}")

    _check_data(config.data)
    _check_warmstart(config.warmstart, config.data)
    _check_model_source(m)
    _check_tokenizer(config.data, m)
    _check_context(config)

    mc = config.mesh
    try:
        data, fsdp, tensor = mesh_shape(mc.data, mc.fsdp, mc.tensor, devices)
        if tuple(mc.device_order) and sorted(mc.device_order) != list(range(devices)):
            raise ValueError(f"mesh.device_order={tuple(mc.device_order)}: must list each of the positions "
                             f"0..{devices - 1} of the devices once")
    except ValueError as e:
        raise ConfigError(f"config.{e}") from e
    batch_shards = data * fsdp
    rows = tc.prompts_per_step * rc.n // tc.mini_batches // tc.micro_batches
    _require(rows % batch_shards == 0, "train.prompts_per_step",
             f"a micro-batch of {rows} responses (prompts_per_step x rollout.n / mini_batches / micro_batches) "
             f"is not divisible by the mesh's data x fsdp = {batch_shards}")
    if tc.packing:  # every packed pass holds a prompt group (train.packed_rows), as the step's programs plan them
        packed_layouts(config, batch_shards, critic=config.algorithm.objective == "ppo")
    _require(isinstance(rc.page_size, int) and rc.page_size >= 1, "rollout.page_size",
             f"must be an integer >= 1 (tokens a K/V page), got {rc.page_size!r}")
    _require(isinstance(rc.pages, int) and (rc.pages == 0 or rc.pages >= row_pages(rc.page_size, rc.max_new_tokens)),
             "rollout.pages", f"must be 0 (every slot's longest response) or hold one response's "
             f"{row_pages(rc.page_size, rc.max_new_tokens)} pages (rollout.max_new_tokens / page_size), got {rc.pages!r}")
    _check_slots(rc, "rollout")
    if rc.sampler != "static":
        slots = sampler_slots(config)
        _require(slots % batch_shards == 0, "rollout.slots",
                 f"{rc.slots}, capped at a sampler call's {slots} responses (prompts_per_step / "
                 f"rollout.micro_batches x rollout.n), must be a multiple of the mesh's data x fsdp = {batch_shards} "
                 "(one queue per batch shard)")
    _check_tensor_axis(config, tensor)


def check_inputs(config: ml_collections.ConfigDict, device_count: int | None = None) -> None:
    """``validate_config``, then every input a run reads, read as the run reads it, before anything is
    built: the training problems (each file parsed, each row with its format's fields, enough of them
    for the held-out and warm-start splits, one step's prompts and one warm-start batch) and the
    evaluation sets' files. The
    trainer runs it before it creates its workdir; every failure is one line naming the field or file
    (``ConfigError``, ``DataError``: permanent, status 78). ``device_count``: as ``validate_config``."""
    validate_config(config, device_count)
    dc, prompts = config.data, config.train.prompts_per_step
    absent = dc.source == "files" and any([_elsewhere(split_format(f)[0], f"data.train_files[{i}]")  # each noted
                                           for i, f in enumerate(dc.train_files)])
    if not absent:
        try:
            train, warm, _, counts = training_problems(dc, seed=config.seed)
        except DataError as e:
            raise ConfigError(f"config.data.train_files: {e}") from None
        _require(len(train) >= prompts, "train.prompts_per_step",
                 f"{prompts} is more than the {len(train)} problems RL samples from ({counts['rows']} read, "
                 f"{counts['held_out']} held out, {counts['warmstart']} for the warm-start only): a step takes "
                 f"{prompts} distinct prompts; lower it or the splits, or add problems")
        wc = config.warmstart
        warm_count, whose = (len(warm), "data.warmstart_problems") if warm else (
            len(train), "RL's, data.warmstart_problems being 0")
        _require(not wc.steps or warm_count >= wc.batch_size, "warmstart.batch_size",
                 f"{wc.batch_size} is more than the {warm_count} problems the warm-start trains on ({whose}): a "
                 "warm-start step takes that many distinct prompts; lower it, or set more problems aside")
    ec = config.eval
    for name in (n.strip() for n in ec.sets.split(",") if n.strip() not in ("", "held_out")):
        spec = ec.set_files[name]
        if not spec.startswith("tfds:") and not _elsewhere(paths.join(ec.data_dir, spec), f"eval.set_files.{name}"):
            try:
                load_eval_sets([name], dict(ec.set_files), ec.data_dir)
            except DataError as e:
                raise ConfigError(f"config.eval.set_files.{name}: {e}") from None


def check_for_slice(config: ml_collections.ConfigDict, device_count: int) -> list[str]:
    """``check_inputs`` on the machine that launches a run on a slice of ``device_count`` devices
    (launch/tpu_pod.sh, through pacs_jax/check_config.py): the mesh against the slice, and a local path
    that is not on this machine (model.path, data.tokenizer, data files on the workers' disks) left
    unchecked; what is there (``gs://`` paths included) is read as the trainer reads it. Returns the
    paths left unchecked ("field=path"), which the trainer checks on the workers."""
    skipped: list[str] = []
    token = _ON_WORKERS.set(skipped)
    try:
        check_inputs(config, device_count)
    finally:
        _ON_WORKERS.reset(token)
    return list(dict.fromkeys(skipped))


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


def _check_other_objectives(algorithm: ml_collections.ConfigDict) -> None:
    """Refuse an option set in the namespace of an objective that does not run (it would be dropped):
    every namespace but ``algorithm.objective``'s holds the registry's defaults."""
    chosen = algorithm.objective
    for name, spec in OBJECTIVES.items():
        for option, default in spec.defaults.items():
            value = algorithm[name][option]
            if name == chosen or value == default:
                continue
            instead = (f"set algorithm.{chosen}.{option}" if option in OBJECTIVES[chosen].defaults
                       else f"{chosen!r} takes no option {option!r}")
            raise ConfigError(f"config.algorithm.{name}.{option}: {value!r} is set, but algorithm.objective is "
                              f"{chosen!r}, which does not read algorithm.{name} ({instead})")


def _check_data(dc: ml_collections.ConfigDict) -> None:
    """The data section's values; a files field (train_files, format) set for the generated task, which
    does not read it, is refused naming the source: it would be dropped silently."""
    _require(dc.source in SOURCES, "data.source", f"{dc.source!r} is not one of {SOURCES}")
    _require(dc.format == "auto" or dc.format in FORMATS, "data.format",
             f"{dc.format!r} is not 'auto' nor one of {sorted(FORMATS)}")
    if dc.source == "files":
        files = list(dc.train_files)
        _require(bool(files), "data.train_files", "no training files given (data.source is \"files\")")
        for i, f in enumerate(files):
            path, _ = split_format(f)
            if not path.startswith("tfds:") and not _elsewhere(path, f"data.train_files[{i}]"):
                _require(paths.path(path).exists(), f"data.train_files[{i}]",
                         paths.missing(path, deepscaler.missing_file_hint(path)))
    else:
        for field, unset in (("train_files", ()), ("format", "auto")):
            value = tuple(dc[field]) if field == "train_files" else dc[field]
            _require(value == unset, f"data.{field}",
                     f"{value!r} is set, but data.source is {dc.source!r}, which does not read it (it generates its "
                     "problems): set data.source=files to train on files, or leave it unset")
        for field in ("problems", "max_operand"):
            value = dc.arithmetic[field]
            _require(isinstance(value, int) and value >= 1, f"data.arithmetic.{field}",
                     f"must be an integer >= 1, got {value!r}")
    for field in ("held_out_problems", "warmstart_problems"):
        _require(isinstance(dc[field], int) and dc[field] >= 0, f"data.{field}", f"must be an integer >= 0, got {dc[field]!r}")
    if dc.source == "arithmetic":
        _require(dc.warmstart_problems < dc.arithmetic.problems, "data.warmstart_problems",
                 f"{dc.warmstart_problems} leaves RL none of the {dc.arithmetic.problems} training problems "
                 "(data.arithmetic.problems counts the warm-start's too)")
    _require(dc.tokenizer in (CHAR_TOKENIZER, MODEL_TOKENIZER) or _elsewhere(dc.tokenizer, "data.tokenizer")
             or paths.path(dc.tokenizer).is_dir(),
             "data.tokenizer", f"tokenizer directory {dc.tokenizer!r} does not exist (or \"{CHAR_TOKENIZER}\", or "
             f"\"\" for model.path's own)")
    _require(isinstance(dc.tokenizer_force, bool), "data.tokenizer_force",
             f"must be True or False, got {dc.tokenizer_force!r}")


def _check_tokenizer(dc: ml_collections.ConfigDict, m: ml_collections.ConfigDict) -> None:
    """The run's tokenizer (data/prompts.py run_tokenizer): "" needs model.path with tokenizer files, and
    a folder of another model family than model.path's is refused unless data.tokenizer_force. A folder
    the user named (data.tokenizer, or model.path's own files) is loaded as the run loads it: files
    that do not make a tokenizer (vocab.json without merges.txt) are refused naming the folder."""
    if _elsewhere(m.path, "model.path") or (dc.tokenizer not in (CHAR_TOKENIZER, MODEL_TOKENIZER)
                                            and _elsewhere(dc.tokenizer, "data.tokenizer")):
        return
    try:
        folder = run_tokenizer(dc, m.path)
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


def _check_model_source(m: ml_collections.ConfigDict) -> None:
    """``model.random_init`` trains a ``model.preset`` from random weights only when asked to by name: a
    forgotten ``model.path`` must not cost a slice-day on a random 7B. Architecture fields with no
    preset (the demo, the tests' shrunk paper configs, which name every field of their tiny model)
    initialise at random. Then model.path's folder: its config and weights (``_check_model_folder``), before
    the tokenizer is looked for in it."""
    _require(isinstance(m.random_init, bool), "model.random_init", f"must be True or False, got {m.random_init!r}")
    _require(not (m.random_init and m.path), "model.random_init",
             f"True, but model.path={m.path!r} is set too: one or the other")
    _require(bool(m.path) or not m.preset or m.random_init, "model.path",
             f"not set: the {m.preset} preset would train from random weights; pass the released model's folder "
             f"(--config.model.path=DIR with config.json and safetensors, or a pacs_jax checkpoint), or "
             f"--config.model.random_init=True to train it from random weights on purpose")
    if m.path and not _elsewhere(m.path, "model.path"):
        _check_model_folder(m.path, "model.path")


def _check_warmstart(wc: ml_collections.ConfigDict, dc: ml_collections.ConfigDict) -> None:
    for field in ("steps", "check_every", "probe_problems"):
        _require(isinstance(wc[field], int) and wc[field] >= 0, f"warmstart.{field}",
                 f"must be an integer >= 0, got {wc[field]!r}")
    if not wc.steps:
        _require(not dc.warmstart_problems, "data.warmstart_problems",
                 f"sets {dc.warmstart_problems} problems aside for a warm-start, but warmstart.steps is 0 "
                 "(set data.warmstart_problems=0 to give them to RL)")
        return
    _require(isinstance(wc.batch_size, int) and wc.batch_size >= 1, "warmstart.batch_size",
             f"must be an integer >= 1, got {wc.batch_size!r}")
    _require(wc.lr > 0, "warmstart.lr", f"must be > 0, got {wc.lr}")
    _require(isinstance(wc.max_response_tokens, int) and wc.max_response_tokens >= 2, "warmstart.max_response_tokens",
             f"must be an integer >= 2 (the answer and eos), got {wc.max_response_tokens!r}")
    _require(0.0 <= wc.target_accuracy <= 1.0, "warmstart.target_accuracy",
             f"must be in [0, 1] (0: run every step), got {wc.target_accuracy}")
    if wc.target_accuracy > 0:
        _require(wc.check_every >= 1 and wc.probe_problems >= 1, "warmstart.check_every",
                 "warmstart.check_every and warmstart.probe_problems must be >= 1 with a target_accuracy")
    try:
        wc.response.format(answer="0")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"config.warmstart.response: {wc.response!r} must be a str.format template with the "
                          f"one field {{answer}} ({e!r})") from None
    if dc.source == "arithmetic" and dc.tokenizer == CHAR_TOKENIZER:  # the longest target is known now
        longest = len(wc.response.format(answer=str(2 * dc.arithmetic.max_operand))) + 1  # + eos
        _require(longest <= wc.max_response_tokens, "warmstart.max_response_tokens",
                 f"{wc.max_response_tokens} is shorter than the longest target response ({longest} tokens)")


def _check_eval(config: ml_collections.ConfigDict) -> None:
    """The training run's evaluation: its sets (held_out needs held-out problems, the others an entry
    of eval.set_files whose file exists), then ``check_eval_settings``."""
    ec = config.eval
    for name in (n.strip() for n in ec.sets.split(",") if n.strip()):
        if name == "held_out":
            _require(config.data.held_out_problems > 0, "eval.sets",
                     "\"held_out\" needs data.held_out_problems > 0")
            continue
        _require(name in ec.set_files, "eval.sets", f"{name!r} has no entry in eval.set_files (or \"held_out\")")
        spec = ec.set_files[name]
        path = paths.join(ec.data_dir, spec)
        if not spec.startswith("tfds:") and not _elsewhere(path, f"eval.set_files.{name}"):
            _require(paths.path(path).exists(), f"eval.set_files.{name}", paths.missing(path))
    check_eval_settings(config)


def check_eval_settings(config: ml_collections.ConfigDict) -> None:
    """The eval section's sampling settings (the training run's and the evaluation CLI's, which checks
    its sets as it reads them): sizes, the sampler's slots, the periodic and final settings and the
    per-set entries."""
    ec = config.eval
    for field in ("max_new_tokens", "batch_size"):
        _require(isinstance(ec[field], int) and ec[field] >= 1, f"eval.{field}", f"must be an integer >= 1, got {ec[field]!r}")
    _require(isinstance(ec.page_size, int) and ec.page_size >= 1, "eval.page_size",
             f"must be an integer >= 1 (tokens a K/V page), got {ec.page_size!r}")
    _require(isinstance(ec.pages, int) and ec.pages >= 0, "eval.pages",
             f"must be an integer >= 0 (0: every slot's longest response), got {ec.pages!r}")
    _check_slots(ec, "eval")
    _require(isinstance(ec.periodic.every, int) and ec.periodic.every >= 0, "eval.periodic.every",
             f"must be an integer >= 0 (0: none), got {ec.periodic.every!r}")
    for section in ("periodic", "final"):
        settings = ec[section]
        _require(isinstance(settings.n, int) and settings.n >= 1, f"eval.{section}.n",
                 f"must be an integer >= 1, got {settings.n!r}")
        _require(settings.temperature >= 0, f"eval.{section}.temperature", f"must be >= 0 (0: greedy), got "
                                                                          f"{settings.temperature}")
        _require(settings.temperature > 0 or settings.n == 1, f"eval.{section}.n",
                 f"greedy decoding (temperature 0) gives one response per problem, got n={settings.n}")
        _require(0 < settings.top_p <= 1, f"eval.{section}.top_p", f"must be in (0, 1], got {settings.top_p}")
    for name, settings in ec.final.per_set.items():  # a set not in eval.sets is not evaluated: its entry waits
        field = f"eval.final.per_set.{name}"
        _require(name in ec.set_files or name == "held_out", field,
                 f"{name!r} names no evaluation set (eval.set_files: {sorted(ec.set_files)}, or \"held_out\")")
        _require(sorted(settings) == ["max_new_tokens", "n", "temperature", "top_p"], field,
                 f"must give n, temperature, top_p and max_new_tokens, got {sorted(settings)}")
        _require(isinstance(settings.n, int) and settings.n >= 1, f"{field}.n", f"must be an integer >= 1, got "
                                                                                 f"{settings.n!r}")
        _require(settings.temperature > 0 or settings.n == 1, f"{field}.n",
                 f"greedy decoding (temperature 0) gives one response per problem, got n={settings.n}")
        _require(0 < settings.top_p <= 1, f"{field}.top_p", f"must be in (0, 1], got {settings.top_p}")
        _require(isinstance(settings.max_new_tokens, int) and settings.max_new_tokens >= 1,
                 f"{field}.max_new_tokens", f"must be an integer >= 1, got {settings.max_new_tokens!r}")


def _check_slots(section: ml_collections.ConfigDict, name: str) -> None:
    """A sampler section's (``rollout``, ``eval``) sampler, slots and tail_slots, against each other:
    tail_slots narrows the continuous and paged samplers' slots, so it is at most slots, and the static sampler
    (a slot per response, no narrowing) takes none."""
    _require(section.sampler in SAMPLERS, f"{name}.sampler", f"{section.sampler!r} is not one of {SAMPLERS}")
    _require(isinstance(section.slots, int) and section.slots >= 1, f"{name}.slots",
             f"must be an integer >= 1 (decode slots per sampler call), got {section.slots!r}")
    tail = section.tail_slots
    _require(isinstance(tail, int) and tail >= 0, f"{name}.tail_slots",
             f"must be an integer >= 0 (0: the decode batch never narrows), got {tail!r}")
    _require(not tail or section.sampler != "static", f"{name}.tail_slots",
             f"{tail}, but {name}.sampler is {section.sampler!r}, which gives every response its own slot and never "
             f"narrows: set {name}.tail_slots=0, or {name}.sampler=continuous (or paged)")
    _require(tail <= section.slots, f"{name}.tail_slots",
             f"{tail} is more than {name}.slots={section.slots}: the decode batch narrows from slots down to "
             f"tail_slots; set it to at most {section.slots} (0: no narrowing)")


def _check_model_folder(path: str, field: str) -> None:
    """The model folder ``field`` names (model.path, critic.path): ``checkpoints.check_model_dir`` (config,
    weights and their shapes, read without loading them)."""
    try:
        checkpoints.check_model_dir(paths.resolve(path))
    except checkpoints.ModelFolderError as e:
        raise ConfigError(f"config.{field}: {e}") from None


def _model_if_readable(config: ml_collections.ConfigDict):
    """The model's QwenConfig (``model_config``), or None when it has none yet or its source does not
    read: that source is checked, and named, by _check_model_source."""
    try:
        return model_config(config)
    except (OSError, ValueError):
        return None


def _check_context(config: ml_collections.ConfigDict) -> None:
    """Every length a run samples or trains against the model's context (max_position_embeddings of
    model.path's config.json, the preset, or the default of a model of the config's own): a prompt of
    data.max_prompt_length tokens plus rollout.max_new_tokens, warmstart.max_response_tokens (with a
    warm-start) and, when eval.sets names sets, eval.max_new_tokens and their eval.final.per_set entries' must fit, or the sampler's KV cache
    (and the rotary positions) would run past it."""
    cfg = _model_if_readable(config)
    if cfg is None:
        return
    context, prompt = cfg.max_position_embeddings, config.data.max_prompt_length
    lengths = [("rollout.max_new_tokens", config.rollout.max_new_tokens)]
    evaluated = [n.strip() for n in config.eval.sets.split(",") if n.strip()]
    if evaluated:
        lengths.append(("eval.max_new_tokens", config.eval.max_new_tokens))
    lengths += [(f"eval.final.per_set.{name}.max_new_tokens", settings.max_new_tokens)
                for name, settings in config.eval.final.per_set.items() if name in evaluated]
    if config.warmstart.steps:
        lengths.append(("warmstart.max_response_tokens", config.warmstart.max_response_tokens))
    for field, length in lengths:
        _require(prompt + length <= context, field,
                 f"{length} with data.max_prompt_length={prompt} is {prompt + length} tokens, beyond the model's "
                 f"context of {context} (max_position_embeddings): set it to at most {max(context - prompt, 0)}")


def _check_verl_micro_batch(size, micro_rows: int, section: str) -> None:
    _require(isinstance(size, int) and size >= 1 and micro_rows % size == 0, f"{section}.verl_micro_batch_size",
             f"{size!r} must be an integer >= 1 dividing the {micro_rows} responses of an update micro-batch "
             "(train.prompts_per_step x rollout.n / train.mini_batches / train.micro_batches)")


def _check_critic(cc: ml_collections.ConfigDict, micro_rows: int) -> None:
    """PPO's critic section (configs/base.py)."""
    _require(cc.lr > 0, "critic.lr", f"must be > 0, got {cc.lr}")
    _require(cc.grad_clip >= 0, "critic.grad_clip", f"must be >= 0 (0 = none), got {cc.grad_clip}")
    _require(cc.weight_decay >= 0, "critic.weight_decay", f"must be >= 0, got {cc.weight_decay}")
    _require(cc.clip_range_value > 0, "critic.clip_range_value", f"must be > 0, got {cc.clip_range_value}")
    for field in ("gamma", "lam"):
        _require(0.0 <= cc[field] <= 1.0, f"critic.{field}", f"must be in [0, 1], got {cc[field]}")
    _require(cc.loss_agg_mode == "actor" or cc.loss_agg_mode in LOSS_AGG_MODES, "critic.loss_agg_mode",
             f"{cc.loss_agg_mode!r} is neither 'actor' (the actor's) nor one of {LOSS_AGG_MODES}")
    _require(cc.loss_scale in LOSS_SCALES, "critic.loss_scale", f"{cc.loss_scale!r} is not one of {LOSS_SCALES}")
    if cc.loss_scale == "verl":
        _check_verl_micro_batch(cc.verl_micro_batch_size, micro_rows, "critic")
    if cc.path and not _elsewhere(cc.path, "critic.path"):
        _require(paths.path(cc.path).exists(), "critic.path", paths.missing(cc.path))
        _check_model_folder(cc.path, "critic.path")


def _check_tensor_axis(config: ml_collections.ConfigDict, tensor: int) -> None:
    """Refuse a tensor axis that does not divide the model's query heads or MLP width (the model
    would otherwise waste a factor of the axis in memory; sharding.MUST_DIVIDE). Memory itself is
    checked on the compiled programs before step 1 (training/memory_check.py)."""
    cfg = _model_if_readable(config)
    if cfg is None:
        return
    for field in ("num_attention_heads", "intermediate_size"):
        _require(getattr(cfg, field) % tensor == 0, "mesh.tensor",
                 f"{tensor} does not divide the model's {field} ({getattr(cfg, field)}); choose a tensor axis "
                 f"that divides it")


def sampler_tail_slots(config: ml_collections.ConfigDict) -> int | None:
    """The narrowest decode batch of a training sampler call (``rollout.tail_slots`` capped at its
    slots); None without narrowing (tail_slots 0, or the static sampler)."""
    slots = sampler_slots(config)
    return None if slots is None or not config.rollout.tail_slots else min(config.rollout.tail_slots, slots)


def sampler_pages(config: ml_collections.ConfigDict) -> dict[str, int | None]:
    """The training sampler's ``SamplingSettings`` page_size and pages: both None but for the paged
    sampler (``rollout.page_size``; ``rollout.pages``, 0: None, every slot's longest response)."""
    rc = config.rollout
    if rc.sampler != "paged":
        return dict(page_size=None, pages=None)
    return dict(page_size=rc.page_size, pages=rc.pages or None)


def sampler_slots(config: ml_collections.ConfigDict) -> int | None:
    """The decode slots of a training sampler call: ``rollout.slots`` capped at the call's responses
    (continuous, paged); None (one slot per response) for the static sampler."""
    rc = config.rollout
    if rc.sampler == "static":
        return None
    return min(rc.slots, config.train.prompts_per_step // rc.micro_batches * rc.n)


def logprob_micro_batches(config: ml_collections.ConfigDict) -> int:
    """Forward passes of the pi_old pass and of PPO's values pass (``train.logprob_micro_batches``;
    0: one per update micro-batch, ``mini_batches x micro_batches``)."""
    tc = config.train
    return tc.logprob_micro_batches or tc.mini_batches * tc.micro_batches


def packed_layouts(config: ml_collections.ConfigDict, batch_shards: int, *, critic: bool) -> dict[str, dict]:
    """Each packed pass's layout (rl/packing.py ``plan_packing``'s arguments past the lengths and
    widths) on a mesh whose batch axes make ``batch_shards``: the pi_old pass (also PPO's values), the
    actor's update and, with ``critic``, PPO's critic update, each in passes of ``train.packed_rows``
    rows a shard (0: ``rl.packing.pass_rows``, a quarter of a padded micro-batch's) and at most
    ``rl.packing.pass_slots`` passes a mini-batch."""
    tc, rc = config.train, config.rollout
    B = tc.prompts_per_step * rc.n
    W = max(config.data.prompt_buckets) + rc.max_new_tokens
    Lp = tc.packed_length or W

    def layout(mini_batches: int, micro_batches: int, unit: int) -> dict:
        S = shards_for(B // mini_batches // micro_batches, batch_shards)
        rows = tc.packed_rows or pass_rows(B // (mini_batches * micro_batches * S), W, Lp, unit=unit, shards=S)
        if S * rows * (Lp // W) < unit:
            raise ConfigError(f"config.train.packed_rows: {rows} rows a pass on each of {S} batch shards cannot hold a "
                              f"prompt group's {unit} sequences of up to {W} tokens; set it to 0 or at least "
                              f"{-(-unit // (S * (Lp // W)))}")
        return dict(mini_batches=mini_batches, unit=unit, shards=S, rows=rows,
                    passes=pass_slots(B // mini_batches, W, Lp, unit=unit, shards=S, rows=rows))

    layouts = {"logprob": layout(1, logprob_micro_batches(config), 1)}
    if critic:
        layouts["critic"] = layout(tc.mini_batches, tc.micro_batches, 1)
    layouts["update"] = layout(tc.mini_batches, tc.micro_batches, rc.n)
    return layouts
