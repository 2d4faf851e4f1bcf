"""pacs_jax Orbax checkpoint -> Hugging Face directory that transformers loads.

    python tools/export_hf.py --checkpoint ckpt/run1 --out hf/run1 --tokenizer ~/hf/Qwen2.5-0.5B

--checkpoint is a model checkpoint (model_config.json + params/) or a trainer checkpoint root (the
latest <step>/params is exported). The output holds config.json, generation_config.json, the
weights (model.safetensors, or shards + model.safetensors.index.json above --max_shard_size;
pytorch_model*.bin with --format bin) and the tokenizer files of --tokenizer. It is written to a
temporary directory beside --out and renamed at the end: a failed export leaves nothing at --out.
--overwrite replaces only a previous export (config.json and weights, nothing of a training workdir
or checkpoint): pointing --out at a workdir or its checkpoints/ is refused, naming the folder.
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

from pacs_jax import checkpoints, models
from pacs_jax.models.hf_weights import check_export_target

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
                        help="pacs_jax checkpoint directory (model dir or trainer root)")
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
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it is a previous HF export (a workdir or checkpoint never is)")
    args = parser.parse_args(argv)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())) and not args.overwrite:
        parser.error(f"--out {args.out}: exists and is not empty (pass --overwrite to replace it)")
    try:  # before loading the checkpoint: --overwrite replaces only a previous export, never a workdir
        check_export_target(args.out, overwrite=args.overwrite)
    except FileExistsError as e:
        parser.error(f"--out {e}")
    if args.tokenizer is not None and not args.tokenizer.is_dir():
        parser.error(f"--tokenizer {args.tokenizer}: not a directory")
    return args


def main(argv: Sequence[str] | None = None) -> pathlib.Path:
    args = parse_args(argv)
    start = time.perf_counter()
    model = checkpoints.load_model(args.checkpoint, param_dtype=None if args.param_dtype == "keep" else args.param_dtype)
    out = models.export_hf(model, args.out, fmt=args.format, max_shard_bytes=args.max_shard_size,
                           tokenizer_dir=args.tokenizer, overwrite=args.overwrite, progress=True)
    files = sorted(p.name for p in out.iterdir())
    print(f"{args.checkpoint} -> {out}: {model.cfg.model_type} in {model.cfg.param_dtype}, "
          f"{len(files)} files ({', '.join(files)}), {time.perf_counter() - start:.1f} s")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
