"""The run's typed spec (docs/design.md section 3.0): the locked config read once, at the edge.

    spec = RunSpec.from_config(config)                  # train.py, evaluate.py, check_config, the tools
    spec.rollout.sampler.call_settings(responses)       # a section, with what is derived from it
    dataclasses.replace(spec, train=dataclasses.replace(spec.train, packed_rows=8))   # a tool's edit

The config schema has one source, configs/base.py (every field, its default and its comment): a
section's dataclass declares the fields it reads, with no defaults, and takes every value from the
config (tests/test_config_schema.py holds the two to each other).

Each section is a frozen dataclass that checks its own values in ``__post_init__``; ``RunSpec`` checks
how the sections fit together (divisibility, the mesh against the devices, the packed layouts, the
sampler's slots and pages) and derives what more than one module needs (micro-batch rows, the packed
length and layouts, the sampler's slots, tail and pages, the eval sets' names, the updates of the
run, the critic's aggregation). Every error is ``ConfigError`` naming the dotted field and the fix:
``config.a.b: what is wrong: the fix`` (status 78). What reads files (the model folder, the tokenizer,
the data rows, the evaluation sets) is training/config_check.py's, on a built spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pacs_jax.data.fields import FORMATS
from pacs_jax.data.prompts import CHAR_TOKENIZER
from pacs_jax.data.sources import SOURCES
from pacs_jax.errors import PermanentError, did_you_mean
from pacs_jax.evaluation.runner import EvalSettings
from pacs_jax.models.lora_targets import resolve_parameters as resolve_lora_parameters
from pacs_jax.models.lora_targets import resolve_targets as resolve_lora_targets
from pacs_jax.models.config import ATTENTION_IMPLS, PRESETS, REMAT_POLICIES, SUPPORTED_MODEL_TYPES, saved_kinds
from pacs_jax.models.moe import ROUTER_REPLAY_MODES
from pacs_jax.rewards import REWARD_MODES, REWARDS
from pacs_jax.rl import filter_groups, rollout_correction
from pacs_jax.rl.bypass import REINFORCE_ESTIMATORS
from pacs_jax.rl.kl import KL_LOSS_TYPES
from pacs_jax.rl.loss_and_grad import KLLoss
from pacs_jax.rl.objectives import OBJECTIVES, OptionError
from pacs_jax.rl.packing import pass_rows, pass_slots, shards_for
from pacs_jax.rl.policy_gradient import LOSS_AGG_MODES, LOSS_SCALES
from pacs_jax.sampling.carry_over import queue_count
from pacs_jax.sampling.settings import CARRY_OVER_ORDERS, SAMPLERS, row_pages
from pacs_jax.sharding import mesh_shape
from pacs_jax.training.passes import PassLayout, Passes

SCHEDULES = ("constant", "cosine", "linear")  # optim.schedule (training/learner/optim.py)

# The architecture fields of config.model that a model of the config's own needs (> 0).
ARCHITECTURE_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "rope_theta")


class ConfigError(PermanentError, ValueError):
    """A config value is wrong; the message starts with the field's dotted name (or, for a resume
    that does not fit its workdir, the workdir). Permanent: the CLIs exit with status 78."""


def require(ok: bool, field: str, message: str) -> None:
    """Raise ``ConfigError("config.<field>: <message>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"config.{field}: {message}")


def require_choice(value, choices, field: str, *, note: str = "", also: tuple = ()) -> None:
    """Raise ``ConfigError("config.<field>: 'v' is not one of <choices><note>; did you mean 'w'?")`` unless
    ``value`` is one of ``choices`` (a tuple, shown as it is, or a mapping, its keys shown sorted) or of
    ``also`` (values taken beside them, which ``note`` names)."""
    if value in choices or value in also:
        return
    shown = sorted(choices) if isinstance(choices, dict) else choices
    raise ConfigError(f"config.{field}: {value!r} is not one of {shown}{note}{did_you_mean(value, choices)}")


def _plain(value):
    """A ConfigDict value as a spec holds it: tuples for sequences, dicts for sections."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _fields(cls, section, **given) -> dict[str, Any]:
    """``cls``'s fields read from the config ``section`` (those not ``given``)."""
    return {**{f.name: _plain(section[f.name]) for f in dataclasses.fields(cls) if f.name not in given}, **given}


def _check_buckets(buckets: tuple, field: str, largest: int, largest_field: str, allow_empty: bool) -> None:
    if allow_empty and not buckets:
        return
    require(bool(buckets) and all(isinstance(b, int) and b >= 1 for b in buckets), field,
            f"must be a non-empty tuple of positive integers, got {buckets!r}")
    require(list(buckets) == sorted(set(buckets)), field, f"must be strictly increasing, got {buckets!r}")
    require(buckets[-1] == largest, field, f"the largest bucket ({buckets[-1]}) must equal {largest_field}={largest}")


def _int_at_least(value, low: int, field: str, what: str = "") -> None:
    require(isinstance(value, int) and value >= low, field, f"must be an integer >= {low}{what}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """``config.train``: the step's sizes, packing, checkpoints and progress lines."""

    steps: int
    prompts_per_step: int
    mini_batches: int
    micro_batches: int
    logprob_micro_batches: int
    packing: bool
    packed_length: int
    packed_rows: int
    precompile: bool
    checkpoint_every: int
    keep_checkpoints: int
    progress_seconds: float
    off_policy_steps: int
    router_replay: str
    router_aux_loss_coef: float

    def __post_init__(self):
        require_choice(self.router_replay, ROUTER_REPLAY_MODES, "train.router_replay")
        require(isinstance(self.router_aux_loss_coef, (int, float)) and not isinstance(self.router_aux_loss_coef, bool)
                and self.router_aux_loss_coef >= 0, "train.router_aux_loss_coef",
                f"must be a number >= 0 (0: no load-balancing loss), got {self.router_aux_loss_coef!r}")
        require(self.off_policy_steps in (0, 1) and isinstance(self.off_policy_steps, int), "train.off_policy_steps",
                f"must be 0 (synchronous) or 1 (one step off), got {self.off_policy_steps!r}")
        for field in ("steps", "prompts_per_step", "mini_batches", "micro_batches"):
            _int_at_least(getattr(self, field), 1, f"train.{field}")
        for field in ("checkpoint_every", "keep_checkpoints"):
            _int_at_least(getattr(self, field), 0, f"train.{field}")
        require(isinstance(self.progress_seconds, (int, float)) and self.progress_seconds >= 0, "train.progress_seconds",
                f"must be a number of seconds >= 0, got {self.progress_seconds!r}")
        require(isinstance(self.packing, bool), "train.packing", f"must be True or False, got {self.packing!r}")
        require(isinstance(self.packed_rows, int) and self.packed_rows >= 0, "train.packed_rows",
                f"must be 0 (a quarter of a padded micro-batch's rows) or a positive integer, got {self.packed_rows!r}")


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """The sampler of a section (``rollout``, ``eval``: its ``field``, for messages): its kind, decode
    slots, narrowing tail and K/V pages. tail_slots narrows the continuous and paged samplers' slots,
    so it is at most slots, and the static sampler (a slot per response, no narrowing) takes none."""

    field: str
    sampler: str
    slots: int
    tail_slots: int
    page_size: int
    pages: int

    @classmethod
    def from_config(cls, section, field: str, **given) -> SamplerSpec:
        """The sampler fields of ``section`` (those not ``given``)."""
        return cls(**_fields(cls, section, field=field, **given))

    def __post_init__(self):
        name = self.field
        require(isinstance(self.page_size, int) and self.page_size >= 1, f"{name}.page_size",
                f"must be an integer >= 1 (tokens a K/V page), got {self.page_size!r}")
        require_choice(self.sampler, SAMPLERS, f"{name}.sampler")
        require(isinstance(self.slots, int) and self.slots >= 1, f"{name}.slots",
                f"must be an integer >= 1 (decode slots per sampler call), got {self.slots!r}")
        tail = self.tail_slots
        require(isinstance(tail, int) and tail >= 0, f"{name}.tail_slots",
                f"must be an integer >= 0 (0: the decode batch never narrows), got {tail!r}")
        require(not tail or self.sampler != "static", f"{name}.tail_slots",
                f"{tail}, but {name}.sampler is {self.sampler!r}, which gives every response its own slot and never "
                f"narrows: set {name}.tail_slots=0, or {name}.sampler=continuous (or paged)")
        require(tail <= self.slots, f"{name}.tail_slots",
                f"{tail} is more than {name}.slots={self.slots}: the decode batch narrows from slots down to "
                f"tail_slots; set it to at most {self.slots} (0: no narrowing)")

    def call_slots(self, responses: int | None = None) -> int | None:
        """The decode slots of a call of ``responses`` rows (None: uncapped): ``slots`` capped at them
        (continuous, paged); None (one slot per response) for the static sampler."""
        if self.sampler == "static":
            return None
        return self.slots if responses is None else min(self.slots, responses)

    def call_settings(self, responses: int | None = None) -> dict[str, int | None]:
        """``SamplingSettings``' slots, tail_slots, page_size and pages for a call of ``responses`` rows:
        slots as ``call_slots``; tail_slots None without narrowing, else at most the slots; page_size
        and pages None but for the paged sampler (pages 0: None, every slot's longest response)."""
        slots = self.call_slots(responses)
        paged = self.sampler == "paged"
        return dict(slots=slots, tail_slots=None if slots is None or not self.tail_slots else min(self.tail_slots, slots),
                    page_size=self.page_size if paged else None, pages=(self.pages or None) if paged else None)


# rollout.tail_slots None on a synchronous call of the paged or continuous sampler: its tail narrows to slots / this.
# Below that a decode step's cost is mostly the weights' HBM reads, so narrower widths save little, and each width
# is one more compiled decode loop.
TAIL_SLOTS_DIVISOR = 8


def rollout_tail_slots(section) -> int:
    """``config.rollout.tail_slots`` as a run reads it: as set, or for None (the paper configs') the mode's:
    0 where a call has no tail to narrow (``carry_over``: a call ends once it has its groups, before its
    tail; the static sampler: a slot a response), else ``slots // TAIL_SLOTS_DIVISOR``. A value set with
    carry-over is refused by ``RolloutSpec`` (it would be dropped)."""
    tail, slots = section.tail_slots, section.slots
    if tail is not None:
        return tail
    if section.carry_over or section.sampler == "static" or not isinstance(slots, int):
        return 0  # an invalid slots is refused by SamplerSpec
    return slots // TAIL_SLOTS_DIVISOR


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """``config.rollout``: RL's sampling (its sampler section: ``sampler``)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    response_buckets: tuple[int, ...]
    micro_batches: int
    max_logprob_diff: float
    sampler: SamplerSpec
    carry_over: bool
    max_staleness: int
    carry_over_order: str

    @classmethod
    def from_config(cls, section) -> RolloutSpec:
        """``section``, its tail_slots as the run reads it (``rollout_tail_slots``)."""
        sampler = SamplerSpec.from_config(section, "rollout", tail_slots=rollout_tail_slots(section))
        return cls(**_fields(cls, section, sampler=sampler))

    def __post_init__(self):
        require(self.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        require(self.temperature > 0, "rollout.temperature", f"RL samples need temperature > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "rollout.stop_token_ids",
                f"must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        _check_buckets(self.response_buckets, "rollout.response_buckets", self.max_new_tokens,
                       "rollout.max_new_tokens", allow_empty=True)
        require(self.max_logprob_diff >= 0, "rollout.max_logprob_diff",
                f"must be >= 0 (0: report the sampler / pi_old mismatch only), got {self.max_logprob_diff}")
        require(isinstance(self.carry_over, bool), "rollout.carry_over", f"must be True or False, got {self.carry_over!r}")
        _int_at_least(self.max_staleness, 0, "rollout.max_staleness")
        require(self.carry_over_order in CARRY_OVER_ORDERS, "rollout.carry_over_order",
                f"must be one of {', '.join(map(repr, CARRY_OVER_ORDERS))}, got {self.carry_over_order!r}"
                f"{did_you_mean(self.carry_over_order, CARRY_OVER_ORDERS)}")
        if self.carry_over:
            require(self.sampler.sampler == "paged", "rollout.carry_over",
                    f"carries responses over in the paged sampler's pages; rollout.sampler is {self.sampler.sampler!r}: "
                    "set rollout.sampler=paged")
            require(self.micro_batches == 1, "rollout.carry_over",
                    f"runs one sampler call a step; set rollout.micro_batches=1 (it is {self.micro_batches})")
            require(self.sampler.tail_slots == 0, "rollout.carry_over",
                    f"a call ends before its tail, so it never narrows: set rollout.tail_slots=0, or None (the "
                    f"mode's, as the paper configs leave it; it is {self.sampler.tail_slots})")
        pages, longest = self.sampler.pages, row_pages(self.sampler.page_size, self.max_new_tokens)
        require(isinstance(pages, int) and (pages == 0 or pages >= longest), "rollout.pages",
                f"must be 0 (every slot's longest response) or hold one response's {longest} pages "
                f"(rollout.max_new_tokens / page_size), got {pages!r}")

    @property
    def buckets(self) -> tuple[int, ...]:
        """The response buckets (``response_buckets``; none: one, ``max_new_tokens``)."""
        return self.response_buckets or (self.max_new_tokens,)


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionSpec:
    """``config.algorithm.rollout_correction`` (verl's fields, rl/rollout_correction.py), a preset's fields
    under those set (left at the schema's defaults); every value checked. ``enabled``: weights or
    rejection are on."""

    rollout_is: str | None
    rollout_is_threshold: float | str
    rollout_is_batch_normalize: bool
    rollout_rs: str | None
    rollout_rs_threshold: float | str | None
    bypass_mode: bool
    loss_type: str

    @classmethod
    def from_config(cls, section) -> RolloutCorrectionSpec:
        fields = _fields(cls, section)
        preset = section.preset
        if preset:
            from configs import base  # the schema's defaults: a field still at its default takes the preset's

            require_choice(preset, rollout_correction.PRESETS, "algorithm.rollout_correction.preset")
            unset = _fields(cls, base.get_config().algorithm.rollout_correction)
            fields.update({k: v for k, v in rollout_correction.PRESETS[preset].items() if fields[k] == unset[k]})
        return cls(**fields)

    def __post_init__(self):
        field = "algorithm.rollout_correction."
        require_choice(self.rollout_is, rollout_correction.ROLLOUT_IS_LEVELS, field + "rollout_is",
                       note=" (or None: no weights)", also=(None,))
        try:
            if self.rollout_is is not None:
                rollout_correction.parse_is_threshold(self.rollout_is_threshold)
            if self.rollout_rs is not None:
                rollout_correction.parse_rs_thresholds(rollout_correction.parse_rs_options(self.rollout_rs),
                                                       self.rollout_rs_threshold)
        except ValueError as e:
            raise ConfigError(f"config.{field}{e}") from None
        require(isinstance(self.rollout_is_batch_normalize, bool), field + "rollout_is_batch_normalize",
                f"must be True or False, got {self.rollout_is_batch_normalize!r}")
        require_choice(self.loss_type, rollout_correction.BYPASS_LOSS_TYPES, field + "loss_type")
        require(isinstance(self.bypass_mode, bool), field + "bypass_mode", f"must be True or False, got {self.bypass_mode!r}")

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    def options(self) -> dict[str, Any]:
        """The keywords of ``rl.correction_and_rejection_mask``."""
        return dict(rollout_is=self.rollout_is, rollout_is_threshold=self.rollout_is_threshold,
                    rollout_is_batch_normalize=self.rollout_is_batch_normalize, rollout_rs=self.rollout_rs,
                    rollout_rs_threshold=self.rollout_rs_threshold)


@dataclasses.dataclass(frozen=True)
class FilterGroupsSpec:
    """``config.algorithm.filter_groups``: DAPO's dynamic sampling (verl's fields, rl/filter_groups.py)."""

    enable: bool
    metric: str
    max_num_gen_batches: int

    @classmethod
    def disabled(cls) -> FilterGroupsSpec:
        """Dynamic sampling off (its other fields are not read)."""
        return cls(enable=False, metric=filter_groups.FILTER_METRICS[0], max_num_gen_batches=0)

    def __post_init__(self):
        field = "algorithm.filter_groups."
        require(isinstance(self.enable, bool), field + "enable", f"must be True or False, got {self.enable!r}")
        require_choice(self.metric, filter_groups.FILTER_METRICS, field + "metric")
        _int_at_least(self.max_num_gen_batches, 0, field + "max_num_gen_batches", " (0: no limit)")


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """``config.algorithm``: the objective and the options it runs with (its namespace, resolved), and
    the rollout correction (``correction_by_default``: the run's default for stale rows, ``run_algorithm``,
    not the config's)."""

    objective: str
    options: dict[str, Any]
    rollout_correction: RolloutCorrectionSpec
    filter_groups: FilterGroupsSpec
    correction_by_default: bool
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str

    @classmethod
    def from_config(cls, section) -> AlgorithmSpec:
        """The objective of ``section``; an option set in the namespace of an objective that does not
        run is refused (it would be dropped): every other namespace holds the registry's defaults."""
        chosen = section.objective
        require_choice(chosen, OBJECTIVES, "algorithm.objective")
        for name, spec in OBJECTIVES.items():
            for option, default in spec.defaults.items():
                value = section[name][option]
                if name == chosen or value == default:
                    continue
                instead = (f"set algorithm.{chosen}.{option}" if option in OBJECTIVES[chosen].defaults
                           else f"{chosen!r} takes no option {option!r}")
                raise ConfigError(f"config.algorithm.{name}.{option}: {value!r} is set, but algorithm.objective is "
                                  f"{chosen!r}, which does not read algorithm.{name} ({instead})")
        return cls(objective=chosen, options=dict(section[chosen]),
                   rollout_correction=RolloutCorrectionSpec.from_config(section.rollout_correction),
                   filter_groups=FilterGroupsSpec(**_fields(FilterGroupsSpec, section.filter_groups)),
                   correction_by_default=False, use_kl_loss=section.use_kl_loss, kl_loss_coef=section.kl_loss_coef,
                   kl_loss_type=section.kl_loss_type)

    def __post_init__(self):
        try:
            OBJECTIVES[self.objective].check_options(self.options)
        except OptionError as e:
            raise ConfigError(f"config.algorithm.{self.objective}.{e.option}: objective {self.objective!r}: {e}") from e

        require(isinstance(self.use_kl_loss, bool), "algorithm.use_kl_loss",
                f"must be True or False, got {self.use_kl_loss!r}")
        require_choice(self.kl_loss_type, KL_LOSS_TYPES, "algorithm.kl_loss_type", note=(
            " ('full', verl's per-vocabulary KL, raises NotImplementedError in verl 0.9.1's kl_penalty: not built)"
            if self.kl_loss_type == "full" else ""))
        require(self.kl_loss_coef >= 0, "algorithm.kl_loss_coef", f"must be >= 0, got {self.kl_loss_coef}")
        correction = self.rollout_correction
        if correction.bypass_mode and correction.loss_type == "reinforce":
            require(self.objective in (*REINFORCE_ESTIMATORS, "ppo"), "algorithm.rollout_correction.loss_type",
                    f"'reinforce' replaces a policy-gradient loss by REINFORCE; objective {self.objective!r} has none "
                    f"(use 'ppo_clip': the objective itself with pi_old = the sampler's)")

    @property
    def min_group_size(self) -> int:
        return OBJECTIVES[self.objective].min_group_size

    @property
    def kl_loss(self) -> KLLoss | None:
        """The KL loss to the reference model, or None (``use_kl_loss`` off)."""
        return KLLoss(self.kl_loss_type, self.kl_loss_coef) if self.use_kl_loss else None


def run_algorithm(config) -> AlgorithmSpec:
    """``config.algorithm`` as a run reads it: with ``rollout.carry_over`` or ``train.off_policy_steps`` and no
    rollout correction set, the stale tokens are weighed by token TIS at 2.0 (issue 50; decoupled: pi_old is
    the learner's recompute)."""
    algorithm = AlgorithmSpec.from_config(config.algorithm)
    correction = algorithm.rollout_correction
    if (config.rollout.carry_over or config.train.off_policy_steps) and not correction.enabled:
        algorithm = dataclasses.replace(algorithm, rollout_correction=dataclasses.replace(
            correction, rollout_is="token", rollout_is_threshold=2.0), correction_by_default=True)
    return algorithm


@dataclasses.dataclass(frozen=True)
class CriticSpec:
    """``config.critic``: PPO's critic (read only when the objective is "ppo")."""

    path: str
    lr: float
    b1: float
    b2: float
    weight_decay: float
    grad_clip: float
    clip_range_value: float
    gamma: float
    lam: float
    loss_agg_mode: str
    loss_scale: str
    verl_micro_batch_size: int

    def __post_init__(self):
        require(self.lr > 0, "critic.lr", f"must be > 0, got {self.lr}")
        require(self.grad_clip >= 0, "critic.grad_clip", f"must be >= 0 (0 = none), got {self.grad_clip}")
        require(self.weight_decay >= 0, "critic.weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(self.clip_range_value > 0, "critic.clip_range_value", f"must be > 0, got {self.clip_range_value}")
        for field in ("gamma", "lam"):
            value = getattr(self, field)
            require(0.0 <= value <= 1.0, f"critic.{field}", f"must be in [0, 1], got {value}")
        require(self.loss_agg_mode == "actor" or self.loss_agg_mode in LOSS_AGG_MODES, "critic.loss_agg_mode",
                f"{self.loss_agg_mode!r} is neither 'actor' (the actor's) nor one of {LOSS_AGG_MODES}"
                f"{did_you_mean(self.loss_agg_mode, ('actor', *LOSS_AGG_MODES))}")
        require_choice(self.loss_scale, LOSS_SCALES, "critic.loss_scale")


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """``config.optim``: the actor's AdamW and its schedule."""

    lr: float
    b1: float
    b2: float
    weight_decay: float
    schedule: str
    warmup_steps: int
    grad_clip: float

    def __post_init__(self):
        require(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        require_choice(self.schedule, SCHEDULES, "optim.schedule")
        require(self.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 = none), got {self.grad_clip}")


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """``config.reward``: the reward function and its scoring pool's limits."""

    name: str
    mode: str
    item_timeout: float
    workers: int
    deadline: float
    max_unscored_fraction: float

    def __post_init__(self):
        require_choice(self.name, REWARDS, "reward.name")
        require(self.item_timeout > 0, "reward.item_timeout", "must be > 0")
        require_choice(self.mode, REWARD_MODES, "reward.mode")
        require(0.0 <= self.max_unscored_fraction <= 1.0, "reward.max_unscored_fraction",
                f"must be in [0, 1], got {self.max_unscored_fraction}")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``config.model``: where the model comes from (path, preset, or its own architecture fields) and
    how it runs. ``model.random_init`` trains a ``model.preset`` from random weights only when asked
    to by name: a forgotten ``model.path`` must not cost a slice-day on a random 7B."""

    path: str
    preset: str
    random_init: bool
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    tie_word_embeddings: bool
    vocab_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    dtype: str
    param_dtype: str
    remat: str
    attention: str
    attention_block_size: int
    expert_parallel: bool
    lora_rank: int
    lora_alpha: float
    target_modules: str | tuple[str, ...]
    target_parameters: str | tuple[str, ...]
    modules_to_save: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "modules_to_save", module_names(self.modules_to_save))
        require(isinstance(self.lora_rank, int) and not isinstance(self.lora_rank, bool) and self.lora_rank >= 0,
                "model.lora_rank", f"must be an integer >= 0 (0: full fine-tuning), got {self.lora_rank!r}")
        if self.lora_rank:
            require(isinstance(self.lora_alpha, (int, float)) and self.lora_alpha > 0, "model.lora_alpha",
                    f"must be > 0 (the adapters' scale is lora_alpha / lora_rank), got {self.lora_alpha!r}")
            self.lora_targets  # noqa: B018 (the check)
        if self.target_parameters:
            require(bool(self.lora_rank), "model.target_parameters",
                    f"{list(module_names(self.target_parameters))} names the experts' weights LoRA's adapters train, and model.lora_rank "
                    "is 0 (full fine-tuning trains every weight): set model.lora_rank, or leave it empty")
        if self.modules_to_save:
            require(bool(self.lora_rank), "model.modules_to_save",
                    f"{list(self.modules_to_save)} trains modules whole beside LoRA's adapters, and model.lora_rank "
                    "is 0 (full fine-tuning trains every module): set model.lora_rank, or leave it empty")
            require(all(isinstance(n, str) and n for n in self.modules_to_save), "model.modules_to_save",
                    f"must be module names (PEFT's), got {self.modules_to_save!r}")
            try:  # names no Qwen has (this model's own architecture is checked where it is known: QwenConfig)
                saved_kinds(self.modules_to_save, tied=False, qk_norm=True)
            except ValueError as e:
                raise ConfigError(f"config.model.{e}") from None
        require_choice(self.remat, REMAT_POLICIES, "model.remat")
        for field in ("dtype", "param_dtype"):
            value = getattr(self, field)
            require(value in ("float32", "bfloat16", "float16"), f"model.{field}", f"{value!r} is not a float dtype")
        if not self.path and self.preset:
            require_choice(self.preset, PRESETS, "model.preset", note=" (or set model.path to an HF dir / checkpoint, "
                           "or leave both empty for the architecture fields of config.model)")
        require_choice(self.attention, ATTENTION_IMPLS, "model.attention")
        _int_at_least(self.attention_block_size, 1, "model.attention_block_size")
        require(isinstance(self.expert_parallel, bool), "model.expert_parallel",
                f"must be True or False, got {self.expert_parallel!r}")
        if not (self.path or self.preset):  # a model of the config's own (configs/base.py): every architecture field
            require_choice(self.model_type, SUPPORTED_MODEL_TYPES, "model.model_type",
                           note=" (or set model.path or model.preset)")
            moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
            for field in ARCHITECTURE_SIZES + (moe if self.model_type == "qwen3_moe" else ()):
                value = getattr(self, field)
                require(value > 0, f"model.{field}", f"must be > 0 without model.path or model.preset, got {value!r}")
            if self.model_type == "qwen3_moe":
                require(self.num_experts_per_tok <= self.num_experts, "model.num_experts_per_tok",
                        f"{self.num_experts_per_tok} is above model.num_experts ({self.num_experts})")
            else:
                require(self.num_experts == 0, "model.num_experts",
                        f"{self.num_experts}, but model.model_type={self.model_type!r}: experts are qwen3_moe's")
        require(isinstance(self.random_init, bool), "model.random_init",
                f"must be True or False, got {self.random_init!r}")
        require(not (self.random_init and self.path), "model.random_init",
                f"True, but model.path={self.path!r} is set too: one or the other")

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The modules LoRA adapts (models/lora_targets.py ``resolve_targets`` of ``target_modules``), then the
        experts' parameters (``resolve_parameters`` of ``target_parameters``); () without LoRA."""
        if not self.lora_rank:
            return ()
        try:
            modules = resolve_lora_targets(self.target_modules)
        except ValueError as e:
            raise ConfigError(f"config.model.target_modules: {e}") from None
        try:
            return modules + resolve_lora_parameters(self.target_parameters)
        except ValueError as e:
            raise ConfigError(f"config.model.target_parameters: {e}") from None

    def check_source(self) -> None:
        """A preset trains from random weights only with ``random_init``: else ``model.path`` is missing
        (checked with the files a spec names, training/config_check.py ``check_spec``)."""
        require(bool(self.path) or not self.preset or self.random_init, "model.path",
                f"not set: the {self.preset} preset would train from random weights; pass the released model's folder "
                f"(--config.model.path=DIR with config.json and safetensors, or a pacs_jax checkpoint), or "
                f"--config.model.random_init=True to train it from random weights on purpose")


def module_names(value) -> tuple[str, ...]:
    """``model.modules_to_save`` as the spec holds it: a list of names, or names with commas ("embed_tokens,norm",
    as a command line gives them), as a tuple."""
    return tuple(n for n in value.split(",") if n) if isinstance(value, str) else tuple(value)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """``config.mesh``: the (data, fsdp, tensor) sizes (one may be -1), the devices' order, and the devices
    of the rollout engine's own mesh (``rollout_devices``; 0: the roles share every device)."""

    data: int
    fsdp: int
    tensor: int
    device_order: tuple[int, ...]
    rollout_devices: int

    def __post_init__(self):
        _int_at_least(self.rollout_devices, 0, "mesh.rollout_devices")
        require(not (self.rollout_devices and self.device_order), "mesh.device_order",
                "orders the devices of one mesh; with mesh.rollout_devices the rollout engine takes the first "
                f"{self.rollout_devices} of jax.devices() and the learner the rest: leave it ()")

    def shape(self, devices: int) -> tuple[int, int, int]:
        """(data, fsdp, tensor) of the learner's mesh on ``devices`` devices (``sharding.mesh_shape``, on
        those ``rollout_devices`` leaves), refused naming the field."""
        if self.rollout_devices:
            require(self.rollout_devices < devices, "mesh.rollout_devices",
                    f"{self.rollout_devices} leaves none of the {devices} devices to the learner")
        learner = devices - self.rollout_devices
        try:
            shape = mesh_shape(self.data, self.fsdp, self.tensor, learner)
            if self.device_order and sorted(self.device_order) != list(range(learner)):
                raise ValueError(f"mesh.device_order={self.device_order}: must list each of the positions "
                                 f"0..{learner - 1} of the devices once")
        except ValueError as e:
            hint = f" (the {learner} devices mesh.rollout_devices leaves the learner)" if self.rollout_devices else ""
            raise ConfigError(f"config.{e}{hint}") from e
        return shape

    def rollout_shape(self, devices: int) -> tuple[int, int, int] | None:
        """(data, fsdp, tensor) of the rollout engine's mesh: its ``rollout_devices`` over data, the
        learner's tensor axis kept (the sampler's layout splits the weights over "tensor" only); None
        when the roles share the devices."""
        if not self.rollout_devices:
            return None
        tensor = self.shape(devices)[2]
        require(self.rollout_devices % tensor == 0, "mesh.rollout_devices",
                f"{self.rollout_devices} is not a multiple of the learner's tensor axis ({tensor}), which the rollout "
                "engine's mesh keeps")
        return self.rollout_devices // tensor, 1, tensor


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
    problems: int
    max_operand: int


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """``config.data``: the training problems' source, the splits, the tokenizer and the prompts. A
    files field (train_files, format) set for the generated task, which does not read it, is refused
    naming the source: it would be dropped silently."""

    source: str
    train_files: tuple[str, ...]
    format: str
    arithmetic: ArithmeticSpec
    held_out_problems: int
    warmstart_problems: int
    tokenizer: str
    tokenizer_force: bool
    instruction: str
    max_prompt_length: int
    prompt_buckets: tuple[int, ...]
    shuffle_seed: int
    allow_skips: bool

    @classmethod
    def from_config(cls, section) -> DataSpec:
        return cls(**_fields(cls, section, arithmetic=ArithmeticSpec(**section.arithmetic)))

    def __post_init__(self):
        _check_buckets(self.prompt_buckets, "data.prompt_buckets", self.max_prompt_length, "data.max_prompt_length",
                       allow_empty=False)
        require_choice(self.source, SOURCES, "data.source")
        require(self.format == "auto" or self.format in FORMATS, "data.format",
                f"{self.format!r} is not 'auto' nor one of {sorted(FORMATS)}"
                f"{did_you_mean(self.format, ('auto', *FORMATS))}")
        if self.source == "files":
            require(bool(self.train_files), "data.train_files", "no training files given (data.source is \"files\")")
        else:
            for field, unset in (("train_files", ()), ("format", "auto")):
                value = getattr(self, field)
                require(value == unset, f"data.{field}",
                        f"{value!r} is set, but data.source is {self.source!r}, which does not read it (it generates "
                        "its problems): set data.source=files to train on files, or leave it unset")
            for field in ("problems", "max_operand"):
                _int_at_least(getattr(self.arithmetic, field), 1, f"data.arithmetic.{field}")
        for field in ("held_out_problems", "warmstart_problems"):
            _int_at_least(getattr(self, field), 0, f"data.{field}")
        if self.source == "arithmetic":
            require(self.warmstart_problems < self.arithmetic.problems, "data.warmstart_problems",
                    f"{self.warmstart_problems} leaves RL none of the {self.arithmetic.problems} training problems "
                    "(data.arithmetic.problems counts the warm-start's too)")
        require(isinstance(self.tokenizer_force, bool), "data.tokenizer_force",
                f"must be True or False, got {self.tokenizer_force!r}")


@dataclasses.dataclass(frozen=True)
class WarmstartSpec:
    """``config.warmstart``: the supervised phase before RL (0 steps: none; its other fields unread)."""

    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    response: str
    max_response_tokens: int
    target_accuracy: float
    check_every: int
    probe_problems: int

    def __post_init__(self):
        for field in ("steps", "check_every", "probe_problems"):
            _int_at_least(getattr(self, field), 0, f"warmstart.{field}")
        if not self.steps:
            return
        _int_at_least(self.batch_size, 1, "warmstart.batch_size")
        require(self.lr > 0, "warmstart.lr", f"must be > 0, got {self.lr}")
        _int_at_least(self.max_response_tokens, 2, "warmstart.max_response_tokens", " (the answer and eos)")
        require(0.0 <= self.target_accuracy <= 1.0, "warmstart.target_accuracy",
                f"must be in [0, 1] (0: run every step), got {self.target_accuracy}")
        if self.target_accuracy > 0:
            require(self.check_every >= 1 and self.probe_problems >= 1, "warmstart.check_every",
                    "warmstart.check_every and warmstart.probe_problems must be >= 1 with a target_accuracy")
        try:
            self.response.format(answer="0")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"config.warmstart.response: {self.response!r} must be a str.format template with the "
                              f"one field {{answer}} ({e!r})") from None


@dataclasses.dataclass(frozen=True)
class EvalSettingsSpec:
    """One evaluation's sampling (``eval.periodic``, ``eval.final``, an ``eval.final.per_set`` entry:
    ``field``, for messages); max_new_tokens: a per-set entry's, None for periodic and final
    (``eval.max_new_tokens``)."""

    field: str
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int | None

    def __post_init__(self):
        field = self.field
        _int_at_least(self.n, 1, f"{field}.n")
        require(self.temperature >= 0, f"{field}.temperature", f"must be >= 0 (0: greedy), got {self.temperature}")
        require(self.temperature > 0 or self.n == 1, f"{field}.n",
                f"greedy decoding (temperature 0) gives one response per problem, got n={self.n}")
        require(0 < self.top_p <= 1, f"{field}.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None:
            _int_at_least(self.max_new_tokens, 1, f"{field}.max_new_tokens")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """``config.eval``: the sets, their sampler and the periodic, final and per-set settings (the
    training run's and the evaluation CLI's). A per-set entry for a set not in ``sets`` waits."""

    sets: tuple[str, ...]
    set_files: dict[str, str]
    data_dir: str
    max_new_tokens: int
    max_problems: int
    batch_size: int
    sampler: SamplerSpec
    before_rl: bool
    every: int
    periodic: EvalSettingsSpec
    final: EvalSettingsSpec
    greedy: bool
    per_set: dict[str, EvalSettingsSpec]

    @classmethod
    def from_config(cls, ec) -> EvalSpec:
        """The eval section of a config; its settings are checked in the order the sections are read."""
        names = ec.sets.split(",") if isinstance(ec.sets, str) else ec.sets
        names = tuple(n.strip() for n in names if n.strip())
        for field in ("max_new_tokens", "batch_size"):
            _int_at_least(ec[field], 1, f"eval.{field}")
        sampler = SamplerSpec.from_config(ec, "eval")
        require(isinstance(ec.pages, int) and ec.pages >= 0, "eval.pages",
                f"must be an integer >= 0 (0: every slot's longest response), got {ec.pages!r}")
        _int_at_least(ec.periodic.every, 0, "eval.periodic.every", " (0: none)")
        periodic, final = ({f: ec[section][f] for f in ("n", "temperature", "top_p")} for section in ("periodic", "final"))
        per_set = {}
        for name, settings in ec.final.per_set.items():
            field = f"eval.final.per_set.{name}"
            require(name in ec.set_files or name == "held_out", field,
                    f"{name!r} names no evaluation set (eval.set_files: {sorted(ec.set_files)}, or \"held_out\")")
            require(sorted(settings) == ["max_new_tokens", "n", "temperature", "top_p"], field,
                    f"must give n, temperature, top_p and max_new_tokens, got {sorted(settings)}")
            per_set[name] = EvalSettingsSpec(field, **settings)
        return cls(sets=names, set_files=dict(ec.set_files), data_dir=ec.data_dir, max_new_tokens=ec.max_new_tokens,
                   max_problems=ec.max_problems, batch_size=ec.batch_size, sampler=sampler, before_rl=ec.before_rl,
                   every=ec.periodic.every, periodic=EvalSettingsSpec("eval.periodic", **periodic, max_new_tokens=None),
                   final=EvalSettingsSpec("eval.final", **final, max_new_tokens=None), greedy=ec.final.greedy,
                   per_set=per_set)

    @property
    def per_set_settings(self) -> dict[str, EvalSettings]:
        """The per-set entries as the evaluation runner takes them (``evaluate_per_set``'s settings)."""
        return {name: EvalSettings(s.n, float(s.temperature), float(s.top_p), s.max_new_tokens)
                for name, s in self.per_set.items()}

    @property
    def evaluated_per_set(self) -> dict[str, EvalSettingsSpec]:
        """The per-set entries of the sets evaluated (``sets``)."""
        return {name: s for name, s in self.per_set.items() if name in self.sets}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A training run: every section, checked against the others and the ``devices`` it runs on
    (None: not yet known, ``unplaced``).

    critic: None unless the objective is "ppo" (the section is read only then)."""

    seed: int
    workdir: str
    devices: int | None
    model: ModelSpec
    mesh: MeshSpec
    data: DataSpec
    warmstart: WarmstartSpec
    rollout: RolloutSpec
    algorithm: AlgorithmSpec
    critic: CriticSpec | None
    optim: OptimSpec
    train: TrainSpec
    reward: RewardSpec
    eval: EvalSpec

    @classmethod
    def from_config(cls, config, device_count: int | None = None) -> RunSpec:
        """The spec of a locked training ``config`` on ``device_count`` devices (None: those there are),
        each section checked as it is read (``ConfigError`` naming the field)."""
        import jax

        return cls.unplaced(config).on_devices(device_count or jax.device_count())

    @classmethod
    def unplaced(cls, config) -> RunSpec:
        """``from_config`` before the devices are known (``devices`` None): every check but the mesh's
        and what the mesh must divide (``on_devices``)."""
        train = TrainSpec(**_fields(TrainSpec, config.train))
        ev = EvalSpec.from_config(config.eval)
        algorithm = run_algorithm(config)
        rollout = RolloutSpec.from_config(config.rollout)
        critic = CriticSpec(**_fields(CriticSpec, config.critic)) if algorithm.objective == "ppo" else None
        optim = OptimSpec(**_fields(OptimSpec, config.optim))
        reward = RewardSpec(**_fields(RewardSpec, config.reward))
        model = ModelSpec(**_fields(ModelSpec, config.model))
        data = DataSpec.from_config(config.data)
        warmstart = WarmstartSpec(**_fields(WarmstartSpec, config.warmstart))
        return cls(seed=config.seed, workdir=config.workdir, devices=None, model=model,
                   mesh=MeshSpec(**_fields(MeshSpec, config.mesh)), data=data, warmstart=warmstart, rollout=rollout,
                   algorithm=algorithm, critic=critic, optim=optim, train=train, reward=reward, eval=ev)

    def on_devices(self, devices: int) -> RunSpec:
        """This spec on ``devices`` devices: the mesh checked against them, and the batch shards it makes
        against the micro-batches, the packed passes and the sampler's slots. A mesh refused with
        ``mesh.rollout_devices`` set names the largest number of them that works."""
        try:
            return dataclasses.replace(self, devices=devices)
        except ConfigError as e:
            if not self.mesh.rollout_devices or not str(e).startswith("config.mesh"):
                raise
            largest = self.largest_rollout_devices(devices)
            hint = (f"the largest mesh.rollout_devices that works here is {largest} (the learner's mesh on the other "
                    f"{devices - largest} of the {devices} devices)" if largest else
                    f"no mesh.rollout_devices above 0 works on {devices} devices with the other values as they are")
            raise ConfigError(f"{e}; {hint}") from None

    def largest_rollout_devices(self, devices: int) -> int:
        """The most of ``devices`` devices that ``mesh.rollout_devices`` can give the rollout engine with every
        other value as it is (the learner's mesh on the rest, each batch and the sampler's slots divided
        over both); 0 when no number does."""
        for split in range(devices - 1, 0, -1):
            try:
                dataclasses.replace(self, mesh=dataclasses.replace(self.mesh, rollout_devices=split), devices=devices)
            except ConfigError:
                continue
            return split
        return 0

    def __post_init__(self):
        """How the sections fit together."""
        tc, rc = self.train, self.rollout
        for name in self.eval.sets:
            require(name == "held_out" or name in self.eval.set_files, "eval.sets",
                    f"{name!r} has no entry in eval.set_files (or \"held_out\")")
        require("held_out" not in self.eval.sets or self.data.held_out_problems > 0, "eval.sets",
                "\"held_out\" needs data.held_out_problems > 0")
        objective = self.algorithm.objective
        require(isinstance(rc.n, int) and rc.n >= self.algorithm.min_group_size, "rollout.n",
                f"{objective} compares the responses of a prompt and needs n >= {self.algorithm.min_group_size}, "
                f"got {rc.n!r}")
        require(isinstance(rc.micro_batches, int) and rc.micro_batches >= 1
                and tc.prompts_per_step % rc.micro_batches == 0, "rollout.micro_batches",
                f"{rc.micro_batches!r} must be an integer >= 1 dividing train.prompts_per_step={tc.prompts_per_step}")
        require(isinstance(tc.logprob_micro_batches, int) and tc.logprob_micro_batches >= 0
                and self.responses % max(tc.logprob_micro_batches, 1) == 0, "train.logprob_micro_batches",
                f"{tc.logprob_micro_batches!r} must be 0 (= mini_batches x micro_batches) or an integer dividing the "
                f"{self.responses} responses of a step")
        require(isinstance(tc.packed_length, int) and (tc.packed_length == 0 or tc.packed_length >= self.row_width),
                "train.packed_length", f"{tc.packed_length!r} must be 0 (= the largest prompt bucket + "
                f"rollout.max_new_tokens) or at least that, {self.row_width}, so that every sequence fits a row")
        require(tc.prompts_per_step % tc.mini_batches == 0, "train.mini_batches",
                f"{tc.mini_batches} does not divide train.prompts_per_step={tc.prompts_per_step} "
                "(mini-batches hold whole prompt groups)")
        per_mini = tc.prompts_per_step // tc.mini_batches
        require(per_mini % tc.micro_batches == 0, "train.micro_batches",
                f"{tc.micro_batches} does not divide the {per_mini} prompts of a mini-batch")
        if tc.off_policy_steps:
            require(not rc.carry_over, "train.off_policy_steps",
                    "one step off with rollout.carry_over=True is not built yet; turn one of them off")
            require(rc.max_logprob_diff == 0, "rollout.max_logprob_diff",
                    f"{rc.max_logprob_diff:g} with train.off_policy_steps=1: the sampler's weights are a step behind "
                    "pi_old's by design, so the two differ; set it to 0 (the rollout_logprob_diff metrics still report "
                    "the gap)")
        require(not self.mesh.rollout_devices or tc.off_policy_steps, "mesh.rollout_devices",
                f"{self.mesh.rollout_devices} gives the rollout engine devices of its own, which only one step off "
                "keeps busy: set train.off_policy_steps=1, or mesh.rollout_devices=0")
        require(not (self.algorithm.rollout_correction.bypass_mode and rc.max_logprob_diff > 0),
                "algorithm.rollout_correction.bypass_mode", f"bypass mode computes no pi_old, so "
                f"rollout.max_logprob_diff={rc.max_logprob_diff:g} has nothing to compare the sampler with: set it "
                "to 0 (the loss's rollout_corr/ metrics report the gap to pi_theta)")
        if self.algorithm.options.get("loss_scale") == "verl":
            self._check_verl_micro_batch(self.algorithm.options.get("verl_micro_batch_size"), f"algorithm.{objective}")
        if self.critic is not None and self.critic.loss_scale == "verl":
            self._check_verl_micro_batch(self.critic.verl_micro_batch_size, "critic")
        require(not (self.model.lora_rank and self.critic is not None), "model.lora_rank",
                f"{self.model.lora_rank} with algorithm.objective 'ppo': PPO's critic is a full copy of the actor's "
                "backbone, trained at full rank beside adapters it would not know; LoRA serves every other objective")
        replay = tc.router_replay
        require(replay == "disabled" or not self.algorithm.rollout_correction.bypass_mode, "train.router_replay",
                f"{replay!r} records pi_old's routing, and bypass mode (algorithm.rollout_correction.bypass_mode) "
                "computes no pi_old; turn one of them off")
        self._check_warmstart_data()
        if self.devices is None:
            return
        self.mesh.rollout_shape(self.devices)  # the engine's own mesh, if any, fits its devices
        batch_shards = self.batch_shards
        require(self.micro_rows % batch_shards == 0, "train.prompts_per_step",
                f"a micro-batch of {self.micro_rows} responses (prompts_per_step x rollout.n / mini_batches / "
                f"micro_batches) is not divisible by the mesh's data x fsdp = {batch_shards}")
        if tc.packing:  # every packed pass holds a prompt group (train.packed_rows), as the step's programs plan them
            self.packed_layouts(batch_shards, critic=self.critic is not None)
        if rc.sampler.sampler != "static":
            slots, engine_shards = self.sampler_slots, self.rollout_batch_shards
            require(slots % engine_shards == 0, "rollout.slots",
                    f"{rc.sampler.slots}, capped at a sampler call's {slots} responses (prompts_per_step / "
                    f"rollout.micro_batches x rollout.n), must be a multiple of the rollout engine's data x fsdp = "
                    f"{engine_shards} (one queue per batch shard)")
        if rc.carry_over and rc.sampler.pages:  # carry-over's queues (one a batch shard) split the pool between them
            queues = queue_count(2 * tc.prompts_per_step, self.sampler_slots, tc.prompts_per_step,
                                 self.rollout_batch_shards)
            longest = row_pages(rc.sampler.page_size, rc.max_new_tokens)
            require(rc.sampler.pages // queues >= longest, "rollout.pages",
                    f"{rc.sampler.pages}, split over carry-over's {queues} queues (one a batch shard of the mesh's "
                    f"data x fsdp), leaves a queue {rc.sampler.pages // queues}, less than one response's {longest} "
                    f"pages: set it to at least {queues * longest}, or 0 (every slot's longest response)")

    def _check_verl_micro_batch(self, size, section: str) -> None:
        require(isinstance(size, int) and size >= 1 and self.micro_rows % size == 0, f"{section}.verl_micro_batch_size",
                f"{size!r} must be an integer >= 1 dividing the {self.micro_rows} responses of an update micro-batch "
                "(train.prompts_per_step x rollout.n / train.mini_batches / train.micro_batches)")

    def _check_warmstart_data(self) -> None:
        """The warm-start's problems against its steps, and (the generated task with the char tokenizer:
        the longest target is known now) its response length against the longest answer."""
        wc, dc = self.warmstart, self.data
        if not wc.steps:
            require(not dc.warmstart_problems, "data.warmstart_problems",
                    f"sets {dc.warmstart_problems} problems aside for a warm-start, but warmstart.steps is 0 "
                    "(set data.warmstart_problems=0 to give them to RL)")
            return
        if dc.source == "arithmetic" and dc.tokenizer == CHAR_TOKENIZER:
            longest = len(wc.response.format(answer=str(2 * dc.arithmetic.max_operand))) + 1  # + eos
            require(longest <= wc.max_response_tokens, "warmstart.max_response_tokens",
                    f"{wc.max_response_tokens} is shorter than the longest target response ({longest} tokens)")

    def check_context(self, context: int) -> None:
        """Every length the run samples or trains against the model's ``context`` (max_position_embeddings):
        a prompt of data.max_prompt_length tokens plus rollout.max_new_tokens, warmstart.max_response_tokens
        (with a warm-start) and, when eval.sets names sets, eval.max_new_tokens and their
        eval.final.per_set entries' must fit, or the sampler's KV cache (and the rotary positions) would run
        past it."""
        prompt = self.data.max_prompt_length
        lengths = [("rollout.max_new_tokens", self.rollout.max_new_tokens)]
        if self.eval.sets:
            lengths.append(("eval.max_new_tokens", self.eval.max_new_tokens))
        lengths += [(f"{s.field}.max_new_tokens", s.max_new_tokens) for s in self.eval.evaluated_per_set.values()]
        if self.warmstart.steps:
            lengths.append(("warmstart.max_response_tokens", self.warmstart.max_response_tokens))
        for field, length in lengths:
            require(prompt + length <= context, field,
                    f"{length} with data.max_prompt_length={prompt} is {prompt + length} tokens, beyond the model's "
                    f"context of {context} (max_position_embeddings): set it to at most {max(context - prompt, 0)}")

    def measures_routing(self, num_experts: int) -> bool:
        """Whether the sampler records each token's experts and each step reports how far the learner's routers
        differ from them (``routing_mismatch_tokens`` / ``_decisions``) on a model with ``num_experts``: with
        ``train.router_replay`` R3, which replays the record, and "disabled" and R2, which measure it without (R2's
        update replays pi_old's own choice; our metric: verl 0.9.1 reports rollout load balance, rollout/moe/*_vio,
        not this difference); not in bypass mode without R3 (which computes no pi_old). With carry-over a carried
        row's record is of the calls that decoded it (sampling/carry_over.py)."""
        return num_experts > 0 and (self.train.router_replay == "R3" or not self.algorithm.rollout_correction.bypass_mode)

    def check_router_replay(self, model_cfg) -> None:
        """Refuse routing replay (``train.router_replay``) or a load-balancing loss (``train.router_aux_loss_coef``)
        on a model (``model_cfg``, a QwenConfig) without experts."""
        require(self.train.router_replay == "disabled" or model_cfg.num_experts > 0, "train.router_replay",
                f"{self.train.router_replay!r} replays the experts of a mixture-of-experts model, and the model "
                f"({model_cfg.model_type}) has none; set it to 'disabled'")
        require(not self.train.router_aux_loss_coef or model_cfg.num_experts > 0, "train.router_aux_loss_coef",
                f"{self.train.router_aux_loss_coef} weighs the routers' load-balancing loss of a mixture-of-experts "
                f"model, and the model ({model_cfg.model_type}) has none; set it to 0")

    def check_tensor_axis(self, model_cfg) -> None:
        """Refuse a tensor axis that does not divide the model's (``model_cfg``, a QwenConfig) query heads,
        MLP width or experts' width, or an fsdp axis that does not divide its experts (the expert-parallel axis,
        models/moe.py ``local_dispatch``) (the model would otherwise waste a factor of the axis in memory;
        sharding.MUST_DIVIDE). Memory itself is checked on the compiled programs before step 1
        (training/memory_check.py)."""
        _, fsdp, tensor = self.mesh_shape
        if self.model.expert_parallel:
            require(model_cfg.num_experts > 0, "model.expert_parallel",
                    f"True splits a mixture-of-experts model's experts, and the model ({model_cfg.model_type}) has none")
            require(model_cfg.num_experts % fsdp == 0, "mesh.fsdp",
                    f"{fsdp} does not divide the model's num_experts ({model_cfg.num_experts}): model.expert_parallel "
                    "splits the experts over the fsdp axis; choose an fsdp axis that divides them")
        for field in ("num_attention_heads", "intermediate_size") + (
                ("moe_intermediate_size",) if model_cfg.num_experts else ()):
            require(getattr(model_cfg, field) % tensor == 0, "mesh.tensor",
                    f"{tensor} does not divide the model's {field} ({getattr(model_cfg, field)}); choose a tensor "
                    f"axis that divides it")

    # ------------------------------------------------------------------------ derived values
    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """(data, fsdp, tensor) on the spec's devices."""
        return self.mesh.shape(self.devices)

    @property
    def batch_shards(self) -> int:
        """The mesh's data x fsdp: the shards of a batch."""
        data, fsdp, _ = self.mesh_shape
        return data * fsdp

    @property
    def rollout_batch_shards(self) -> int:
        """The rollout engine's batch shards: its own mesh's (``mesh.rollout_devices``), else the mesh's."""
        shape = self.mesh.rollout_shape(self.devices)
        return self.batch_shards if shape is None else shape[0] * shape[1]

    @property
    def responses(self) -> int:
        """Responses of a step: prompts_per_step x rollout.n."""
        return self.train.prompts_per_step * self.rollout.n

    @property
    def micro_rows(self) -> int:
        """Responses of an update micro-batch: prompts_per_step x n / mini_batches / micro_batches."""
        return self.responses // self.train.mini_batches // self.train.micro_batches

    @property
    def row_width(self) -> int:
        """The longest sequence: the largest prompt bucket + rollout.max_new_tokens."""
        return max(self.data.prompt_buckets) + self.rollout.max_new_tokens

    @property
    def packed_length(self) -> int:
        """Tokens a packed row (``train.packed_length``; 0: ``row_width``)."""
        return self.train.packed_length or self.row_width

    @property
    def logprob_micro_batches(self) -> int:
        """Forward passes of the pi_old pass and of PPO's values pass (``train.logprob_micro_batches``;
        0: one per update micro-batch, ``mini_batches x micro_batches``)."""
        tc = self.train
        return tc.logprob_micro_batches or tc.mini_batches * tc.micro_batches

    @property
    def total_updates(self) -> int:
        """Optimizer steps of the run: train.steps x train.mini_batches."""
        return self.train.steps * self.train.mini_batches

    @property
    def call_responses(self) -> int:
        """Responses of one training sampler call: prompts_per_step / rollout.micro_batches x n."""
        return self.train.prompts_per_step // self.rollout.micro_batches * self.rollout.n

    @property
    def sampler_slots(self) -> int | None:
        """The decode slots of a training sampler call (``SamplerSpec.call_slots``)."""
        return self.rollout.sampler.call_slots(self.call_responses)

    @property
    def critic_loss_agg(self) -> tuple[str, int | None]:
        """The critic's (loss_agg_mode, norm_length): ``critic.loss_agg_mode`` "actor" takes the actor's
        (objective "ppo"'s options, ``algorithm.ppo``), as verl's critic does
        (``critic.loss_agg_mode: ${actor_rollout_ref.actor.loss_agg_mode}``); a mode names its own. The
        L_max of seq-mean-token-sum-norm is always the actor's ``norm_length`` (verl divides both losses by
        the same padded response width)."""
        actor, mode = self.algorithm.options, self.critic.loss_agg_mode
        return (actor["loss_agg_mode"] if mode == "actor" else mode), actor["norm_length"]

    def packed_layouts(self, batch_shards: int, *, critic: bool) -> Passes[PassLayout]:
        """Each packed pass's layout (rl/packing.py ``plan_packing``'s arguments past the lengths and
        widths) on a mesh whose batch axes make ``batch_shards``: the pi_old pass (also PPO's values), the
        actor's update and, with ``critic``, PPO's critic update, each in passes of ``train.packed_rows`` rows a
        shard (0: ``rl.packing.pass_rows``, a quarter of a padded micro-batch's) and at most
        ``rl.packing.pass_slots`` passes a mini-batch."""
        tc, B, W, Lp = self.train, self.responses, self.row_width, self.packed_length

        def layout(mini_batches: int, micro_batches: int, unit: int) -> PassLayout:
            S = shards_for(B // mini_batches // micro_batches, batch_shards)
            rows = tc.packed_rows or pass_rows(B // (mini_batches * micro_batches * S), W, Lp, unit=unit, shards=S)
            if S * rows * (Lp // W) < unit:
                raise ConfigError(f"config.train.packed_rows: {rows} rows a pass on each of {S} batch shards cannot "
                                  f"hold a prompt group's {unit} sequences of up to {W} tokens; set it to 0 or at "
                                  f"least {-(-unit // (S * (Lp // W)))}")
            return PassLayout(mini_batches=mini_batches, unit=unit, shards=S, rows=rows,
                              passes=pass_slots(B // mini_batches, W, Lp, unit=unit, shards=S, rows=rows))

        logprob = layout(1, self.logprob_micro_batches, 1)
        critic_layout = layout(tc.mini_batches, tc.micro_batches, 1) if critic else None
        update = layout(tc.mini_batches, tc.micro_batches, self.rollout.n)
        return Passes(logprob, update, critic_layout)
