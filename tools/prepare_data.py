"""Convert a dataset into our jsonl (one Problem per line: data_source, problem, ground_truth, index, extra).

    python tools/prepare_data.py --input data/deepscaler_subset --output workdir/deepscaler.jsonl --allow_skips
    python tools/prepare_data.py --input tfds:gsm8k:train --output workdir/gsm8k_train.jsonl
    python tools/prepare_data.py --hf openai/gsm8k --hf_config main --split test --format gsm8k --output gsm8k.jsonl
    python tools/prepare_data.py deepscaler [--out data/deepscaler]     # the paper's full training set

--input is a .jsonl / .json / .parquet file, a folder of them, or tfds:NAME[:SPLIT]; --format picks
the field map (default: from the folder or file name, see pacs_jax/data/fields.py). --hf reads a
Hugging Face dataset by name with the `datasets` library (needs network access). Malformed rows stop
the conversion with their file and line, or with --allow_skips are skipped and counted. The output
is written to a temporary file beside --output and renamed at the end.

`deepscaler` downloads the full DeepScaleR-Preview training set (agentica-org/DeepScaleR-Preview-Dataset,
40,315 rows, of which 6 have no answer and are skipped: 40,309 problems) from the Hugging Face hub
with urllib, checks its rows and fields, and writes OUT/deepscaler.json (the hub's file) and
OUT/train.jsonl (ours; configs/paper.py trains on data/deepscaler/train.jsonl). --url reads another
copy (https://, or file:// for a local file); the hub's address follows $HF_ENDPOINT. See
pacs_jax/data/deepscaler.py.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pacs_jax.data import FORMATS, Problem, ReadStats, convert_rows, deepscaler, load_problems  # noqa: E402
from pacs_jax.files import atomic_write  # noqa: E402


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


def parse_deepscaler_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prepare_data.py deepscaler", description=deepscaler.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=REPO / deepscaler.DEFAULT_OUT,
                        help=f"folder to write {deepscaler.RAW_FILE} and {deepscaler.TRAIN_FILE} into "
                             f"(default: {deepscaler.DEFAULT_OUT} of the repository, where configs/paper.py reads it)")
    parser.add_argument("--url", default=None,
                        help=f"where to read the JSON list from (default: {deepscaler.hub_url()})")
    parser.add_argument("--expected_rows", type=int, default=deepscaler.EXPECTED_ROWS,
                        help=f"rows the file must have (default {deepscaler.EXPECTED_ROWS}; 0: any number)")
    parser.add_argument("--strict", action="store_true", help="refuse a row with a null or empty answer "
                                                              "instead of skipping and counting it")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server (default 60)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT/train.jsonl if it exists")
    return parser.parse_args(argv)


def main_deepscaler(argv: Sequence[str]) -> None:
    args = parse_deepscaler_args(argv)
    try:
        done = deepscaler.prepare(args.out, url=args.url, expected_rows=args.expected_rows or None,
                                  strict=args.strict, overwrite=args.overwrite, timeout=args.timeout,
                                  progress=not args.no_progress)
    except deepscaler.DownloadError as error:
        raise SystemExit(f"prepare_data deepscaler: {error}\n  (is the Hugging Face hub reachable from here? Set "
                         "HF_ENDPOINT to a mirror, or download the file elsewhere and pass --url file:///PATH)")
    except (FileExistsError, deepscaler.DataError) as error:
        raise SystemExit(f"prepare_data deepscaler: {error}")
    print(f"{done.raw}: {done.rows} rows, sha256 {done.sha256}")
    print(f"{done.train}: {done.stats.rows} problems written, {done.stats.skipped} malformed rows skipped")
    for message in done.stats.first_errors:
        print(f"  skipped: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["deepscaler"]:
        return main_deepscaler(argv[1:])
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
