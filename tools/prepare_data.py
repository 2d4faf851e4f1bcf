"""Convert a dataset into our jsonl (one Problem per line: data_source, problem, ground_truth, index, extra).

    python tools/prepare_data.py --input data/deepscaler_subset --output workdir/deepscaler.jsonl --allow_skips
    python tools/prepare_data.py --input tfds:gsm8k:train --output workdir/gsm8k_train.jsonl
    python tools/prepare_data.py --hf openai/gsm8k --hf_config main --split test --format gsm8k --output gsm8k.jsonl

--input is a .jsonl / .json / .parquet file, a folder of them, or tfds:NAME[:SPLIT]; --format picks
the field map (default: from the folder or file name, see pacs_jax/data/fields.py). --hf reads a
Hugging Face dataset by name with the `datasets` library (needs network access). Malformed rows stop
the conversion with their file and line, or with --allow_skips are skipped and counted. The output
is written to a temporary file beside --output and renamed at the end.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

from pacs_jax.data import FORMATS, Problem, ReadStats, convert_rows, load_problems
from pacs_jax.files import atomic_write


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="file, folder of files, or tfds:NAME[:SPLIT]")
    source.add_argument("--hf", help="Hugging Face dataset name, e.g. openai/gsm8k")
    parser.add_argument("--hf_config", default=None, help="configuration of the --hf dataset, e.g. main")
    parser.add_argument("--split", default="train", help="split of the --hf dataset (default: train)")
    parser.add_argument("--format", default="auto", choices=["auto", *sorted(FORMATS)],
                        help="field map of the input (auto: from its name or fields; required with --hf)")
    parser.add_argument("--data_source", default=None, help="data_source of every row (default: the format name)")
    parser.add_argument("--output", required=True, type=pathlib.Path, help="jsonl file to write")
    parser.add_argument("--allow_skips", action="store_true", help="skip and count malformed rows instead of failing")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    args = parser.parse_args(argv)
    if args.output.exists() and not args.overwrite:
        parser.error(f"--output {args.output}: exists (pass --overwrite to replace it)")
    if args.hf and args.format == "auto":
        parser.error("--hf needs --format (the field map of that dataset)")
    return args


def read_hf(name: str, config: str | None, split: str, format: str, data_source: str | None,
            on_error: str) -> tuple[list[Problem], ReadStats]:
    try:
        import datasets
    except ImportError as error:
        raise SystemExit(f"--hf needs the `datasets` package (pip install datasets): {error}") from None
    rows = datasets.load_dataset(name, config, split=split)
    located = ((f"hf:{name}:{split} row {i}", row) for i, row in enumerate(rows))
    return convert_rows(located, format, data_source or format, on_error)


def write_jsonl(problems: Sequence[Problem], output: pathlib.Path) -> None:
    atomic_write(output, lambda f: f.writelines(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in problems))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    on_error = "skip" if args.allow_skips else "raise"
    if args.hf:
        problems, stats = read_hf(args.hf, args.hf_config, args.split, args.format, args.data_source, on_error)
    else:
        problems, stats = load_problems(args.input, format=args.format, data_source=args.data_source,
                                        on_error=on_error)
    write_jsonl(problems, args.output)
    print(f"{args.output}: {stats.rows} problems written, {stats.skipped} malformed rows skipped")
    for message in stats.first_errors:
        print(f"  skipped: {message}", file=sys.stderr)


if __name__ == "__main__":
    main()
