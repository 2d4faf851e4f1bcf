"""pacs_jax checkpoint -> Hugging Face directory that transformers loads (LoRA: a PEFT adapter folder that peft
loads onto the base model, or with --merged the model with the adapters merged).

    python tools/export_hf.py --checkpoint workdir/run1 --out hf/run1 --tokenizer ~/hf/Qwen2.5-0.5B

--checkpoint is what ``python -m pacs_jax.evaluate`` takes (pacs_jax/evaluation/target.py): a training
workdir (its newest checkpoints/<step>, else its hf_export), a trainer checkpoint root (its latest
<step>), one <step>, or a model checkpoint (model_config.json + params/); it is checked (its config,
and every parameter at its shape in the checkpoint's metadata) before anything loads. The output holds
config.json, generation_config.json, the weights (model.safetensors, or shards +
model.safetensors.index.json above --max_shard_size; pytorch_model*.bin with --format bin), the
tokenizer files (of --tokenizer, else the model folder's own, else, for a checkpoint in a training
workdir, the run's data.tokenizer; when there are none, a README.md in the export and a line say so, and
why: the demo's character tokenizer has no Hugging Face files, and transformers' AutoTokenizer would load
an empty one) and pacs_jax_export.json, the list of the files the export wrote. It is
written to a temporary directory beside --out and renamed at the end: a failed export leaves nothing
at --out. --overwrite replaces only a folder this tool (or the trainer's export) wrote, holding
nothing but the files its pacs_jax_export.json lists: a downloaded HF model, a workdir, an export
holding other files (the evaluation CLI's eval/ results) or anything else is refused, naming what it
holds. Errors in what was given (a folder that is no checkpoint, an
--out that may not be replaced) are one line and exit status 78 (pacs_jax/errors.py).
Parameters are loaded on one device; for models larger than one accelerator's memory, run on the
host CPU (JAX_PLATFORMS=cpu).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time
from collections.abc import Sequence

from pacs_jax import checkpoints, console, data, models
from pacs_jax.errors import UsageError, run_main
from pacs_jax.evaluation.target import Target
from pacs_jax.evaluation.target import resolve as resolve_target
from pacs_jax.data.char_tokenizer import NO_HF_TOKENIZER
from pacs_jax.models import lora
from pacs_jax.models.hf_weights import check_export_target, no_tokenizer_line
from pacs_jax.models.peft_export import export_peft

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'4GB' -> 4 * 10**9 bytes, '500MiB' -> 500 * 2**20, '1024' -> 1024 (transformers' convention)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size like 4GB, 500MB, 2GiB or a byte count")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return size


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=pathlib.Path,
                        help="a training workdir (its newest checkpoint), a trainer checkpoint root or step, or a "
                             "model checkpoint directory")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="HF directory to write")
    parser.add_argument("--tokenizer", type=pathlib.Path, default=None,
                        help="directory whose tokenizer files (tokenizer.json, vocab.json, merges.txt, "
                             "tokenizer_config.json, ...) are copied into --out")
    parser.add_argument("--format", default="safetensors", choices=["safetensors", "bin"],
                        help="weights as safetensors (default) or PyTorch pytorch_model*.bin for older tooling")
    parser.add_argument("--max_shard_size", default="4GB", type=parse_size,
                        help="largest weight file before splitting into shards + index (default: 4GB)")
    parser.add_argument("--param_dtype", default="keep", choices=["keep", "float32", "bfloat16", "float16"],
                        help="dtype of the exported weights; 'keep' (default) keeps the checkpoint's dtype")
    parser.add_argument("--merged", action="store_true",
                        help="a checkpoint of LoRA adapters (model.lora_rank > 0): write the model with the adapters "
                             "merged into its weights (an HF folder) instead of the PEFT adapter folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it is an export this tool wrote (pacs_jax_export.json lists its "
                             "files); anything else is refused")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple[pathlib.Path, pathlib.Path | None, str]:
    """Everything the export reads and replaces, before anything loads: --out (empty, or with
    --overwrite an export this tool wrote), --tokenizer (a folder), --checkpoint (resolved as the
    evaluation CLI resolves it; its config and parameter shapes read). Returns the model folder to
    load, the folder of the tokenizer files to copy and why there is none (``export_tokenizer``);
    raises ``UsageError`` naming the flag."""
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())) and not args.overwrite:
        raise UsageError(f"--out {args.out}: exists and is not empty (pass --overwrite to replace a previous export)")
    try:  # before loading the checkpoint: --overwrite replaces only a previous export, never a workdir
        check_export_target(args.out, overwrite=args.overwrite)
    except FileExistsError as e:
        raise UsageError(f"--out {e}") from None
    if args.tokenizer is not None and not args.tokenizer.is_dir():
        raise UsageError(f"--tokenizer {args.tokenizer}: not a directory")
    target = resolve_target(args.checkpoint)
    if target.note:  # a workdir: its newest checkpoint, else its export
        print(f"export_hf: {args.checkpoint} is a training workdir: exporting {target.model_dir}", flush=True)
    try:
        checkpoints.check_model_dir(target.model_dir)
    except checkpoints.ModelFolderError as e:
        raise UsageError(f"--checkpoint: {e}") from None
    return target.model_dir, *export_tokenizer(args.tokenizer, target)


def export_tokenizer(given: pathlib.Path | None, target: Target) -> tuple[pathlib.Path | None, str]:
    """(folder, "") with the folder whose tokenizer files the export copies: --tokenizer, else the model
    folder's own (an HF folder, the run's hf_export), else the training run's tokenizer for a checkpoint
    in a workdir (its config.json's data.tokenizer, as the evaluation CLI reads it; a ``gs://`` folder
    through its local copy). (None, why) when there is none (the demo's "char" tokenizer has no files:
    why names what to use instead)."""
    if given is not None:
        return given, ""
    if (target.model_dir / "tokenizer_config.json").is_file():
        return target.model_dir, ""
    recorded = target.recorded_tokenizer()
    if recorded is not None and recorded != data.CHAR_TOKENIZER:
        folder = data.local_folder(recorded)
        print(f"export_hf: tokenizer files from {folder} (the training run's data.tokenizer)", flush=True)
        return pathlib.Path(folder), ""
    if recorded == data.CHAR_TOKENIZER:
        return None, NO_HF_TOKENIZER
    return None, "the checkpoint has none and no training run records one: --tokenizer=DIR adds a tokenizer's files"


def main(argv: Sequence[str] | None = None) -> pathlib.Path:
    """Export; an error in what was given is one line on stderr and exit status 78."""
    args = parse_args(argv)
    return run_main("export_hf", _export, args)


def _export(args: argparse.Namespace) -> pathlib.Path:
    model_dir, tokenizer_dir, no_tokenizer = check_args(args)
    start = time.perf_counter()
    model = checkpoints.from_pretrained(model_dir, param_dtype=None if args.param_dtype == "keep" else args.param_dtype)
    if model.cfg.lora_rank and not args.merged:  # the adapters as PEFT loads them onto the base
        base = checkpoints.read_lora_base(checkpoints.find_params_dir(model_dir)[0])
        out = export_peft(model, args.out, base_model=base.model_path if base else "", overwrite=args.overwrite)
        print(f"{model_dir} -> {out}: LoRA rank {model.cfg.lora_rank} on {', '.join(model.cfg.lora_targets)} as a PEFT "
              f"adapter folder ({', '.join(sorted(p.name for p in out.iterdir()))}); --merged writes the merged model")
        return out
    if model.cfg.lora_rank:
        model = lora.merge(model)
    out = models.export_hf(model, args.out, fmt=args.format, max_shard_bytes=args.max_shard_size,
                           tokenizer_dir=tokenizer_dir, overwrite=args.overwrite, progress=True,
                           no_tokenizer=no_tokenizer)
    if tokenizer_dir is None:
        print(f"export_hf: {no_tokenizer_line(out, no_tokenizer)}", flush=True)
    files = sorted(p.name for p in out.iterdir())
    print(f"{model_dir} -> {out}: {model.cfg.model_type} in {model.cfg.param_dtype}, "
          f"{len(files)} files ({', '.join(files)}), {time.perf_counter() - start:.1f} s")
    return out


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    console.setup([])  # Orbax's INFO lines off; plain progress lines in a log file
    main(sys.argv[1:])
