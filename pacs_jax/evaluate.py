"""Evaluation CLI: pass@k of a checkpoint on the evaluation sets of a config (docs/design.md section 7.5).

    python -m pacs_jax.evaluate --config=configs/eval.py --checkpoint=DIR [--config.eval.final.n=16 --config.eval.sets=math_500]

DIR is an HF model folder, a pacs_jax checkpoint, or a training workdir (its newest
``checkpoints/<step>``, else its ``hf_export``; a line says which: pacs_jax/evaluation/target.py). A
checkpoint in a workdir is evaluated as it was trained: the tokenizer is ``config.data.tokenizer``, else
the model folder's tokenizer files, else the run's ``data.tokenizer`` from the workdir's config.json (the
demo's "char"); the prompts carry the run's ``data.instruction``; ``--config.eval.sets=held_out`` is the
run's held-out problems. E.g. the demo's model:

    python -m pacs_jax.evaluate --config=configs/eval.py --checkpoint=workdir/demo --config.eval.sets=held_out \
        --config.eval.max_new_tokens=12 --config.model.dtype=float32

The config is the training schema (configs/base.py): the sets and their settings are ``eval``'s (the
final settings, ``eval.final``), the CLI's own fields ``evaluate``'s. It writes, in
``config.evaluate.output_dir`` (default ``WORKDIR/eval/evaluate_step_<N>`` or ``.../evaluate_hf_export``
for a workdir's model, else ``DIR/eval``), the files of pacs_jax/evaluation/outputs.py
(eval_samples.jsonl, eval_metrics.json, pass_at_k.png). Relative set paths (``eval.data_dir`` "data") are
read from the working directory, else from the repository root. DIR may be on ``gs://``: what the
evaluation reads of it (the model's files, a workdir's config.json and newest step's parameters) is
copied to the host's cache first (data/remote.py), and the outputs' default folder is the same place
on the store (``gs://.../eval/evaluate_step_<N>``); data.tokenizer and ``config.evaluate.output_dir``
may be on ``gs://`` too. The maths, the runner and the
outputs are in pacs_jax/evaluation/. Before the sets or the tokenizer are read, DIR's model folder
is checked (its config and weight headers: checkpoints.check_model_dir), then every set's prompts
against the model (token ids within its vocabulary, the longest plus max_new_tokens within its
context). The result is printed as a table; third-party INFO logs are off unless --verbosity=0
(pacs_jax/console.py). Flag, usage and data errors print one line and exit with status 78
(pacs_jax/errors.py).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

import jax
from absl import app, flags
from etils import epath
from ml_collections import config_flags

from pacs_jax import checkpoints, console
from pacs_jax.data import paths, remote
from pacs_jax.data import (CHAR_TOKENIZER, INSTRUCTION, CharTokenizer, build_prompts, load_tokenizer,
                           render_prompt, training_problems)
from pacs_jax.errors import UsageError, run_cli
from pacs_jax.evaluation import EvalSet, EvalSettings, evaluate_per_set, load_eval_sets, write_outputs
from pacs_jax.evaluation.target import Target
from pacs_jax.evaluation.target import resolve as resolve_target
from pacs_jax.rewards import RewardPool, reward_for
from pacs_jax.sharding import make_mesh
from pacs_jax.training.spec import EvalSpec

HELD_OUT = "held_out"  # config.eval.sets: the training run's held-out problems (its workdir's config.json)


def run(config, checkpoint: str | pathlib.Path) -> dict[str, dict[str, float]]:
    """Evaluate ``checkpoint`` (an HF folder, a pacs_jax checkpoint or a training workdir:
    evaluation/target.py) as ``config`` (configs/eval.py) says; write the outputs; return the metrics."""
    ec, cli = config.eval, config.evaluate
    if ec.final.greedy:
        raise UsageError("config.eval.final.greedy: the evaluation CLI samples at eval.final's settings only; for "
                         "greedy decoding set eval.final.temperature=0 and eval.final.n=1")
    spec = EvalSpec.from_config(ec)  # its values, checked
    target = resolve_target(_local_checkpoint(checkpoint))
    if target.note:
        print(f"pacs_jax.evaluate: {target.note}", flush=True)
    try:  # before the sets, the tokenizer and the held-out split are looked for: a folder that is no model says so
        model_config = checkpoints.check_model_dir(target.model_dir)
    except checkpoints.ModelFolderError as e:
        raise UsageError(f"--checkpoint: {e}") from None
    training = target.training_config
    default = target.default_output_dir()  # a gs:// checkpoint's: the same place on the store, not in its copy
    output_dir = epath.Path(cli.output_dir or remote.store_path(default) or default)
    names = spec.sets
    files = [n for n in names if n != HELD_OUT]
    eval_sets = load_eval_sets(files, spec.set_files, spec.data_dir, spec.max_problems,
                               config.reward.mode) if files else []
    if HELD_OUT in names:
        eval_sets.append(_held_out_set(training, checkpoint, spec.max_problems))
    tokenizer, tokenizer_source = _tokenizer(config, target)
    if tokenizer_source:
        print(f"pacs_jax.evaluate: tokenizer {tokenizer_source}", flush=True)
    # the prompt the model was trained on: the run's data.instruction (the demo's is ""), else the paper's
    instruction = training["data"].get("instruction", INSTRUCTION) if training else INSTRUCTION
    if isinstance(tokenizer, CharTokenizer):
        _check_char_tokenizer(tokenizer, eval_sets, instruction)
    _check_prompts(config, eval_sets, tokenizer, instruction, model_config)
    # the evaluation's one mesh over every device, set as the context for everything below (config.mesh's data,
    # fsdp, tensor and device order: mesh.rollout_devices is a training run's; use_mesh False: one device)
    m = config.mesh
    mesh = (make_mesh(m.data, m.fsdp, m.tensor, device_order=tuple(m.device_order)) if cli.use_mesh
            else make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    with jax.set_mesh(mesh), RewardPool(config.reward.workers or None, item_timeout=config.reward.item_timeout) as pool:
        model = checkpoints.from_pretrained(target.model_dir, dtype=config.model.dtype)
        rows, metrics = evaluate_per_set(
            model, tokenizer, eval_sets, spec.per_set_settings,
            EvalSettings(spec.final.n, spec.final.temperature, spec.final.top_p, spec.max_new_tokens),
            top_k=cli.top_k, seed=config.seed,
            stop_token_ids=tuple(cli.stop_token_ids), batch_size=spec.batch_size,
            **spec.sampler.call_settings(), instruction=instruction,
            max_prompt_length=cli.max_prompt_length, reward_pool=pool, progress=cli.progress)
    write_outputs(output_dir, rows, metrics)
    print(metrics_table(metrics), flush=True)
    for eval_set in eval_sets:
        evaluated = sum(row["data_source"] == eval_set.name for row in rows)
        if evaluated < len(eval_set.problems):
            print(f"pacs_jax.evaluate: {eval_set.name}: {len(eval_set.problems) - evaluated} of "
                  f"{len(eval_set.problems)} prompts exceed evaluate.max_prompt_length={cli.max_prompt_length} and "
                  "were not evaluated", flush=True)
    print(f"pacs_jax.evaluate: wrote {output_dir} (eval_samples.jsonl, eval_metrics.json, pass_at_k.png)", flush=True)
    return metrics


def metrics_table(metrics: dict[str, dict[str, float]]) -> str:
    """The metrics as a table for a person: a row per set, a column per metric (pass@k by k, then
    mean@n), empty where a set has none (each set's k go up to its own n)."""
    columns = sorted({name for values in metrics.values() for name in values},
                     key=lambda name: (name.startswith("mean@"), int(name.split("@")[1])))
    width = max([len("set")] + [len(name) for name in metrics])
    lines = ["  ".join([f"{'set':<{width}}", *(f"{c:>8}" for c in columns)])]
    for name, values in metrics.items():
        lines.append("  ".join([f"{name:<{width}}", *(f"{values[c]:>8.4f}" if c in values else " " * 8
                                                       for c in columns)]))
    return "\n".join(lines)


def _check_prompts(config, eval_sets, tokenizer, instruction: str, model_config) -> None:
    """Each set's prompts, tokenized as the evaluation will, against the model (found before it loads,
    naming the field): their token ids within its vocabulary (a tokenizer of another model otherwise),
    and the longest evaluated prompt (at most evaluate.max_prompt_length tokens) plus the set's
    max_new_tokens (eval.max_new_tokens, or its eval.final.per_set entry's) within its context
    (max_position_embeddings)."""
    ec, limit, context = config.eval, config.evaluate.max_prompt_length, model_config.max_position_embeddings
    for eval_set in eval_sets:
        kept, _ = build_prompts(eval_set.problems, tokenizer, limit, instruction)
        largest = max((max(e.prompt_ids, default=0) for e in kept), default=0)
        if largest >= model_config.vocab_size:
            raise UsageError(f"config.data.tokenizer: the prompts of set {eval_set.name!r} hold token id {largest}, outside "
                             f"the model's vocabulary of {model_config.vocab_size}: the tokenizer is not the model's "
                             "(leave data.tokenizer empty for the model folder's own)")
        longest = max((len(e.prompt_ids) for e in kept), default=0)
        own = eval_set.name in ec.final.per_set
        field = f"eval.final.per_set.{eval_set.name}.max_new_tokens" if own else "eval.max_new_tokens"
        new_tokens = ec.final.per_set[eval_set.name].max_new_tokens if own else ec.max_new_tokens
        if longest + new_tokens > context:
            raise UsageError(f"config.{field}: {new_tokens} with the longest prompt of set {eval_set.name!r} ({longest} "
                             f"tokens) is {longest + new_tokens}, beyond the model's context of {context} "
                             f"(max_position_embeddings): set it to at most {max(context - longest, 0)}")


NOT_EVALUATED = ("opt_state", "critic_params", "critic_opt_state", "eval")  # a step's or workdir's parts left out


def _newest_step(folder) -> str | None:
    """The largest numeric name among ``folder``'s entries (a trainer's checkpoint root), or None."""
    steps = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
    return str(max(steps)) if steps else None


def _local_checkpoint(checkpoint: str) -> str:
    """``--checkpoint`` itself when local; on ``gs://``, a local copy (data/remote.py) of what the evaluation
    reads: an HF folder or a model checkpoint whole; a trainer's checkpoint root, a step of it or a
    workdir with only the newest (or the named) step's parameters and the config files (no optimizer
    state, no older steps, no evaluation outputs; a workdir's hf_export only when it has no checkpoint)."""
    if not paths.is_remote(checkpoint):
        return checkpoint
    source = paths.path(checkpoint)
    if not source.exists():
        raise UsageError(f"--checkpoint={checkpoint}: {paths.missing(checkpoint)}")
    step = None
    if source.name.isdigit() and (source.parent / checkpoints.MODEL_CONFIG_FILE).is_file():  # <root>/<step>
        source, step = source.parent, source.name
    in_root, in_workdir = step or _newest_step(source), _newest_step(source / "checkpoints")

    def keep(relative: str) -> bool:
        parts = relative.split("/")
        if parts[-1] in NOT_EVALUATED:
            return False
        if in_root and parts[0].isdigit():
            return parts[0] == in_root
        if in_workdir and parts[0] == "checkpoints" and len(parts) > 1 and parts[1].isdigit():
            return parts[1] == in_workdir
        return not (in_workdir and parts[0] == "hf_export")

    local = remote.local_folder(str(source), keep=keep)
    print(f"pacs_jax.evaluate: --checkpoint={checkpoint} read from its copy in {local}", flush=True)
    return str(pathlib.Path(local) / step) if step else local


def _tokenizer(config, target: Target):
    """(tokenizer, where it came from or "" for the model folder's own files): ``config.data.tokenizer``, else
    the tokenizer files in the model folder, else the training run's ``data.tokenizer`` (the run's
    config.json in its workdir; the demo's "char" tokenizer has no files)."""
    if config.data.tokenizer:
        return load_tokenizer(config.data.tokenizer), ""
    if (target.model_dir / "tokenizer_config.json").is_file():
        return load_tokenizer(target.model_dir), ""
    folder = target.recorded_tokenizer()  # "char", a folder (local or gs://), or None
    recorded = (target.training_config or {}).get("data", {}).get("tokenizer")
    if folder == CHAR_TOKENIZER:
        return load_tokenizer(CHAR_TOKENIZER), f'"{CHAR_TOKENIZER}" (the training run\'s data.tokenizer)'
    if folder is not None:
        if (paths.path(folder) / "tokenizer_config.json").is_file():
            return load_tokenizer(folder), f"{folder} (the training run's data.tokenizer)"
        raise UsageError(f"{target.model_dir}: no tokenizer files (tokenizer_config.json), and the training run's "
                         f"data.tokenizer {recorded!r} has none either; pass --config.data.tokenizer=DIR")
    raise UsageError(f"{target.model_dir}: no tokenizer files (tokenizer_config.json); pass --config.data.tokenizer=DIR")


def _held_out_set(training: dict | None, checkpoint, max_problems: int) -> EvalSet:
    """The training run's held-out problems (data.held_out_problems; the demo's "held_out" set), rebuilt
    from its recorded config as the trainer split them, scored by its reward."""
    if training is None:
        raise UsageError(f"config.eval.sets: {HELD_OUT!r} is the held-out split of a training run, but --checkpoint="
                         f"{checkpoint} is in no training workdir (no config.json of a run beside checkpoints/)")
    if not training["data"].get("held_out_problems"):
        raise UsageError(f"config.eval.sets: {HELD_OUT!r}: the training run set no problems aside "
                         "(data.held_out_problems is 0)")
    _, _, held_out, _ = training_problems(training["data"], seed=training["seed"])
    problems = [dataclasses.replace(p, data_source=HELD_OUT) for p in held_out]
    problems = problems[:max_problems] if max_problems > 0 else problems
    reward = training.get("reward", {})
    return EvalSet(HELD_OUT, problems, reward_for(reward.get("name", "math"), reward.get("mode", "strict")))


def _check_char_tokenizer(tokenizer: CharTokenizer, eval_sets, instruction: str) -> None:
    """The character tokenizer knows the demo's alphabet only: a set with other characters (MATH-500's
    LaTeX) is refused before the model loads, naming the set, the problem and the characters."""
    for eval_set in eval_sets:
        for problem in eval_set.problems:
            text = render_prompt(tokenizer, problem.problem, instruction)
            unknown = sorted(set(text) - set(tokenizer.stoi))
            if unknown:
                raise UsageError(
                    f"evaluation set {eval_set.name!r}: problem {problem.index} has characters {unknown} that the "
                    f"character tokenizer (data.tokenizer \"{CHAR_TOKENIZER}\", the demo's) cannot encode; a demo "
                    f"model is evaluated on its own task: --config.eval.sets={HELD_OUT}")


def _cli() -> None:
    """Flags are defined here, not at import, so importing this module (tests call ``run``) defines none."""
    config_flag = config_flags.DEFINE_config_file("config", None, "evaluation config file (configs/eval.py)")
    checkpoint_flag = flags.DEFINE_string("checkpoint", None, "HF model folder, pacs_jax checkpoint folder, or a "
                                                              "training workdir (its newest checkpoint)")
    flags.mark_flags_as_required(["config", "checkpoint"])

    def main(argv: Sequence[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        console.setup()  # Orbax's INFO lines off unless --verbosity; plain progress lines in a log file
        run(config_flag.value, checkpoint_flag.value)

    run_cli("pacs_jax.evaluate", main, prepare=paths.config_file_args)  # flag, usage, data errors: one line, status 78


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    _cli()
