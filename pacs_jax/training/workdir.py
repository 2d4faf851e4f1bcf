"""A run's workdir: the recorded config, the checks a resume makes, the wall-time record
(docs/design.md section 3.7); its lock is training/workdir_lock.py's.

- ``check_resume``: before anything is written, a workdir with checkpoints is refused (one
  ``ConfigError`` naming every differing field) when this config's model shapes (the architecture
  fields, the vocabulary), model.path, objective, critic, gradient clipping (on or off) or carry-over
  (on or off: the checkpoint's data state is read) differ from the checkpoints' run (a resume
  trains the checkpoint's weights: another model.path's would be loaded and discarded, and config.json
  would name a model the run never trained), or when
  ``train.steps`` is below the checkpoint's step; ``check_export_folder``: so is a workdir whose
  ``hf_export`` holds files the run's export would delete (the evaluation CLI's ``eval/`` results),
  rather than failing with a traceback after the last step. ``config.json`` (``write_config``) is the record
  of the run that wrote the checkpoints, so it is written only after that check (a resume's, only once its
  checkpoint has restored: training/run.py): the config, with the options the objective runs with and
  the architecture of the model the run builds.
- ``SessionClock``: ``<workdir>/sessions.json`` records every session's wall time, so that
  summary.json's ``wall_seconds`` covers all of them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time

import jax
import ml_collections
from etils import epath

from pacs_jax.checkpoints import MODEL_CONFIG_FILE, read_meta
from pacs_jax.distributed import from_process_zero
from pacs_jax.files import atomic_write_text, is_remote
from pacs_jax.models.config import QwenConfig
from pacs_jax.models.hf_weights import NotAnExportError, check_export_target
from pacs_jax.models.lora_targets import resolve_parameters as resolve_lora_parameters
from pacs_jax.rl.objectives import options_for
from pacs_jax.training.engine.carry_over import is_carry_over_state
from pacs_jax.training.spec import ConfigError, RunSpec, module_names, rollout_tail_slots, run_algorithm
from pacs_jax.training.workdir_lock import agree

CONFIG_FILE = "config.json"
SESSIONS_FILE = "sessions.json"
# QwenConfig fields that decide the parameters' names and shapes.
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias")
# The architecture fields of config.model, recorded in config.json as the run's model has them.
ARCHITECTURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "tie_word_embeddings")


def checkpoint_steps(workdir: epath.Path) -> list[int]:
    """The steps of ``workdir/checkpoints`` (finished ones: Orbax renames a step's folder to its number)."""
    root = workdir / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


def _recorded(config_json: epath.Path, section: str, field: str):
    """``section.field`` of the config.json a run recorded, or None (no file, no such field)."""
    try:
        return json.loads(config_json.read_text())[section][field]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _experts_adapted(target_parameters) -> list[str] | object:
    """The experts' weights ``model.target_parameters`` names, PEFT's full names in their order (the spelling aside:
    "down_proj" or "mlp.experts.down_proj", a list or names with commas); a value that names none, as it is."""
    try:
        return list(resolve_lora_parameters(target_parameters))
    except (ValueError, TypeError):
        return target_parameters


def _plain_value(value):
    """A config value as config.json and the spec compare: lists as tuples."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _same_model_path(recorded: str, configured: str) -> bool:
    """Whether model.path ``configured`` names the model of ``recorded`` (config.json's): the same
    text, or the same local folder (a relative path read from the current directory)."""
    if recorded.rstrip("/") == configured.rstrip("/"):
        return True
    local = recorded and configured and not is_remote(recorded) and not is_remote(configured)
    return bool(local) and os.path.realpath(recorded) == os.path.realpath(configured)


def _carry_over_saved(root: epath.Path, steps: list[int]) -> bool | None:
    """Whether the data state of the newest of ``steps`` under ``root`` whose meta item reads is carry-over's
    (None: none reads; the restore then says which are damaged)."""
    for step in reversed(steps):
        try:
            return is_carry_over_state(read_meta(root, step)["data_state"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def check_resume(spec: RunSpec, workdir: str | os.PathLike, model_cfg: QwenConfig | None) -> int:
    """The latest checkpoint step of ``workdir`` (0: none), after checking that the run of ``spec`` can resume it.

    model_cfg: the model this config builds (None: unknown before loading it; the shapes are then
    not compared). Raises ``ConfigError`` naming every field that differs from the checkpoints' run
    (shape fields of the model, model.path as configured: ``spec``'s, not a local copy of a ``gs://``
    folder; algorithm.objective, the critic, train.prompts_per_step: the data iterator's saved
    position counts batches of that size; optim.grad_clip and PPO's critic.grad_clip on one side only:
    clipping has an optimizer state of its own; rollout.carry_over, against the kind of data state the
    newest readable checkpoint holds: carry-over's and a plain source's do not restore into each other,
    while one step off's is a plain cursor) and when ``train.steps`` is below the checkpoint's step.
    Reads only, and only on process 0 (a checkpoint's meta item may be megabytes of carry-over's rows):
    its step and its refusal hold for every process (``distributed.from_process_zero``), so that a read
    failing on one host alone does not make the processes decide differently.
    """
    latest, refusal = 0, None
    if jax.process_index() == 0:
        try:
            latest = _resumable_step(spec, epath.Path(workdir), model_cfg)
        except ConfigError as e:
            refusal = str(e)
    latest, refusal = from_process_zero([latest, refusal])
    if refusal is not None:
        raise ConfigError(refusal)
    return latest


def _resumable_step(spec: RunSpec, workdir: epath.Path, model_cfg: QwenConfig | None) -> int:
    """``check_resume``'s step and checks, on the process that runs it."""
    steps = checkpoint_steps(workdir)
    if not steps:
        return 0
    latest = steps[-1]
    root = workdir / "checkpoints"
    differs = []
    stored_model = root / MODEL_CONFIG_FILE
    if model_cfg is not None and stored_model.is_file():
        try:
            stored = json.loads(stored_model.read_text())
            stored.pop("pacs_jax", None)
            stored_cfg = QwenConfig.from_hf_dict(stored, source=str(stored_model))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{stored_model}: unreadable ({e}); cannot check that this config fits the "
                              f"checkpoints") from None
        for field in SHAPE_FIELDS:
            old, new = getattr(stored_cfg, field), getattr(model_cfg, field)
            if old != new:
                differs.append(f"model.{field} (checkpoint {old!r}, this config {new!r})")
    old_path = _recorded(workdir / CONFIG_FILE, "model", "path")
    if isinstance(old_path, str) and not _same_model_path(old_path, spec.model.path):
        differs.append(f"model.path (checkpoint run {old_path!r}, this config {spec.model.path!r}: a resume trains "
                       f"the checkpoint's weights, not this model's)")
    objective = spec.algorithm.objective
    old_objective = _recorded(workdir / CONFIG_FILE, "algorithm", "objective")
    if old_objective is not None and old_objective != objective:
        differs.append(f"algorithm.objective (checkpoint {old_objective!r}, this config {objective!r})")
    # the data iterator's saved position counts batches of the recorded size
    old_prompts = _recorded(workdir / CONFIG_FILE, "train", "prompts_per_step")
    if old_prompts is not None and old_prompts != spec.train.prompts_per_step:
        differs.append(f"train.prompts_per_step (checkpoint {old_prompts!r}, this config "
                       f"{spec.train.prompts_per_step!r}: the data position counts batches of the checkpoint's)")
    old_lora_rank = _recorded(workdir / CONFIG_FILE, "model", "lora_rank") or 0
    has_critic = (root / str(latest) / "critic_params").is_dir()
    if has_critic and objective != "ppo":
        differs.append(f"the critic (the checkpoint has a PPO critic; objective {objective!r} has none)")
    elif not has_critic and objective == "ppo":
        differs.append("the critic (the checkpoint has no PPO critic; objective 'ppo' needs one)")
    # clipping adds a state to the optimizer's: on one side only, the saved one cannot be restored
    clipped = [("optim", spec.optim.grad_clip)]
    if has_critic and spec.critic is not None:
        clipped.append(("critic", spec.critic.grad_clip))
    for section, grad_clip in clipped:
        old_clip = _recorded(workdir / CONFIG_FILE, section, "grad_clip")
        if isinstance(old_clip, (int, float)) and (old_clip > 0) != (grad_clip > 0):
            differs.append(f"{section}.grad_clip (checkpoint {old_clip!r}, this config {grad_clip!r}: clipping on one "
                           f"side only, so the saved optimizer state has another structure)")
    # LoRA: the checkpoints hold adapters of the recorded rank and targets (or every weight without them)
    for field, new in (("lora_rank", spec.model.lora_rank), ("lora_alpha", spec.model.lora_alpha),
                       ("target_modules", spec.model.target_modules),
                       ("target_parameters", spec.model.target_parameters),
                       ("modules_to_save", spec.model.modules_to_save)):
        old = _recorded(workdir / CONFIG_FILE, "model", field)
        if field != "lora_rank" and not (spec.model.lora_rank and old_lora_rank):
            continue
        if field == "modules_to_save" and old is not None:
            old = module_names(old)  # as written: a list, or names with commas
        if field == "target_parameters":  # the experts' weights they name (a run before the field named none)
            old, new = _experts_adapted(old or ()), _experts_adapted(new)
        if old is not None and _plain_value(old) != _plain_value(new):
            differs.append(f"model.{field} (checkpoint {old!r}, this config {new!r}: "
                           + ("the checkpoints hold the adapters alone, trained on their run's base)"
                              if old_lora_rank else "the checkpoints hold every weight, without adapters)"))
    saved_carry_over = _carry_over_saved(root, steps)
    if saved_carry_over is not None and saved_carry_over != spec.rollout.carry_over:
        differs.append(f"rollout.carry_over (checkpoint {saved_carry_over}, this config {spec.rollout.carry_over}: "
                       + ("the checkpoint's data state is carry-over's queue and rows in flight, which a plain prompt "
                          "source cannot take)" if saved_carry_over else
                          "the checkpoint's data state is a plain prompt source's cursor, with no carry-over queue)"))
    if differs:
        raise ConfigError(
            f"{workdir}: cannot resume the checkpoints in {root} (latest step {latest}) with this config: it "
            f"differs from their run in {len(differs)} field(s): " + "; ".join(differs)
            + f". Resume with that run's settings ({workdir / CONFIG_FILE}) or use another --workdir")
    if spec.train.steps < latest:
        raise ConfigError(
            f"config.train.steps: {spec.train.steps} is below the step of the checkpoint in {root} "
            f"({latest}): nothing to train (a checkpoint is never rolled back). Set train.steps above {latest} to "
            f"train further, or use another --workdir")
    return latest


EXPORT_FOLDER = "hf_export"  # the run's HF export of its final model, replaced at every run's end
PEFT_FOLDER = "peft_adapter"  # with LoRA: its adapters as a PEFT folder, replaced at every run's end


def check_export_folder(workdir: str | os.PathLike) -> None:
    """Refuse, before anything is written, a workdir whose ``EXPORT_FOLDER`` (or ``PEFT_FOLDER``) the run's
    export at its end would not replace (``hf_weights.check_export_target``: files the export did not write,
    such as the evaluation CLI's ``eval/``, or a folder that is no export): a ``ConfigError`` naming the
    folder and those files. Every process reads it; process 0's verdict holds for all (``agree``)."""
    refusal, folder = None, epath.Path(workdir) / EXPORT_FOLDER
    for name, what in ((EXPORT_FOLDER, "HF export"), (PEFT_FOLDER, "PEFT adapter folder")):
        folder = epath.Path(workdir) / name
        try:
            check_export_target(folder, overwrite=True, instead=f"move it out of {epath.Path(workdir)} (the run "
                                                                f"replaces {name} with its {what} when it ends)")
        except NotAnExportError as e:
            refusal = str(e)
            break
    if not agree(refusal is None):
        raise ConfigError(refusal or f"{folder}: refused by process 0 (its error line says why)")


def recorded_config(config: ml_collections.ConfigDict, model_cfg: QwenConfig | None) -> dict:
    """What config.json records of a run: ``config``, with ``algorithm`` the objective and the options
    it runs with (``options``; the other objectives' namespaces left out), the rollout correction's
    fields as it runs (a preset's filled in; carry-over's default) when it is on, dynamic sampling's when on,
    ``rollout.tail_slots`` as it runs (None resolved for the mode: ``spec.rollout_tail_slots``), and ``model``'s
    architecture fields those of ``model_cfg``, the model the run builds (None: unknown, the fields as configured)."""
    record = json.loads(config.to_json_best_effort())
    record["rollout"]["tail_slots"] = rollout_tail_slots(config.rollout)
    record["algorithm"] = {"objective": config.algorithm.objective, "options": options_for(config.algorithm)}
    algorithm = run_algorithm(config)
    correction = algorithm.rollout_correction
    if correction.enabled or correction.bypass_mode:
        record["algorithm"]["rollout_correction"] = dataclasses.asdict(correction)
    if algorithm.filter_groups.enable:
        record["algorithm"]["filter_groups"] = dataclasses.asdict(algorithm.filter_groups)
    if model_cfg is not None:
        record["model"].update({field: getattr(model_cfg, field) for field in ARCHITECTURE_FIELDS})
    return record


def write_config(config: ml_collections.ConfigDict, workdir: str | os.PathLike, model_cfg: QwenConfig | None) -> None:
    """``workdir/config.json``: ``recorded_config`` (process 0; after ``check_resume``)."""
    if jax.process_index() == 0:
        atomic_write_text(epath.Path(workdir) / CONFIG_FILE, json.dumps(recorded_config(config, model_cfg), indent=2))


def finished_summary(workdir: str | os.PathLike, step: int) -> dict | None:
    """``workdir/summary.json`` when it is the summary of a run finished at ``step``, else None."""
    path = epath.Path(workdir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("final_step") == step else None


# ------------------------------------------------------------------------------------------ wall time
class SessionClock:
    """The wall time of this session and the earlier ones, kept in ``workdir/sessions.json``.

    ``update()`` rewrites the file with this session's seconds so far (at most every ``every``
    seconds unless ``force``): a session killed with SIGKILL counts up to its last update.
    Process 0 writes; every process reads.
    """

    def __init__(self, workdir: str | os.PathLike, *, every: float = 30.0):
        self.path = epath.Path(workdir) / SESSIONS_FILE
        self.every = every
        self.t0 = time.perf_counter()
        self.started = datetime.datetime.now().isoformat(timespec="seconds")
        self.earlier: list[dict] = []
        try:
            earlier = json.loads(self.path.read_text()).get("sessions", [])
            self.earlier = [s for s in earlier if isinstance(s, dict) and isinstance(s.get("seconds"), (int, float))]
        except (OSError, ValueError, AttributeError):
            pass
        self._written = -float("inf")

    @property
    def session_seconds(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def total_seconds(self) -> float:
        return sum(s["seconds"] for s in self.earlier) + self.session_seconds

    def update(self, *, force: bool = False) -> None:
        if jax.process_index() != 0 or (not force and time.perf_counter() - self._written < self.every):
            return
        self._written = time.perf_counter()
        sessions = [*self.earlier, {"started": self.started, "seconds": self.session_seconds}]
        atomic_write_text(self.path, json.dumps({"sessions": sessions}, indent=2))
