"""The full DeepScaleR-Preview training set: download it from the Hugging Face hub, check it, convert it.

    python tools/prepare_data.py deepscaler --out data/deepscaler   # -> data/deepscaler/train.jsonl

The hub's dataset ``agentica-org/DeepScaleR-Preview-Dataset`` is one JSON list (``deepscaler.json``)
of 40,315 {problem, answer, solution} objects: AIME 1983-2023, AMC, Omni-MATH and STILL problems,
the training set of the PACS paper (configs/paper.py points at ``DEFAULT_TRAIN_FILE``). The
repository ships two of its sources (``data/deepscaler_subset``), which the tests train on.

``prepare`` downloads the file (``urllib``: no ``datasets`` package needed; the endpoint honours
``HF_ENDPOINT`` like huggingface_hub does) into a temporary file beside the output, checks that it
is a JSON list of ``expected_rows`` objects each with the fields problem, answer and solution,
renames it to ``OUT/deepscaler.json``, then writes our jsonl (``Problem.to_json`` rows, data_source
"deepscaler", the solution kept in ``extra``) to ``OUT/train.jsonl`` through a temporary file too.
Rows whose answer is null or empty are skipped and counted (or refused with ``strict``), as the
readers do (data/fields.py). Nothing is left half-written: a failed download or check removes its
temporary file and leaves OUT as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable

from pacs_jax.data.fields import ReadStats, convert_rows
from pacs_jax.data.records import DataError
from pacs_jax.files import atomic_write, publish_mode

HF_REPO = "agentica-org/DeepScaleR-Preview-Dataset"
HF_FILE = "deepscaler.json"
EXPECTED_ROWS = 40315  # the dataset card's and the DeepScaleR blog's count of problem-answer pairs
FIELDS = ("problem", "answer", "solution")
DEFAULT_OUT = "data/deepscaler"  # relative to the repository root, like the paper configs' paths
RAW_FILE = HF_FILE
TRAIN_FILE = "train.jsonl"
DEFAULT_TRAIN_FILE = f"{DEFAULT_OUT}/{TRAIN_FILE}"
SUBSET_FILES = ("data/deepscaler_subset/math.json", "data/deepscaler_subset/aime.json")


class DownloadError(RuntimeError):
    """The file could not be fetched; the message names the URL."""


def hub_url(endpoint: str | None = None) -> str:
    """The hub's resolve URL of the dataset's JSON file (``endpoint`` or $HF_ENDPOINT or huggingface.co)."""
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    return f"{endpoint}/datasets/{HF_REPO}/resolve/main/{HF_FILE}"


def prepare_command(out: str | pathlib.Path = DEFAULT_OUT) -> str:
    """The command that makes ``out``/train.jsonl."""
    return f"python tools/prepare_data.py deepscaler --out {out}"


def missing_file_hint(path: str | pathlib.Path) -> str:
    """For a training file that does not exist: how to make it, when it is this tool's output
    (``.../deepscaler/train.jsonl``); else ""."""
    path = pathlib.PurePath(path)
    if path.name != TRAIN_FILE or path.parent.name != pathlib.PurePath(DEFAULT_OUT).name:
        return ""
    return (f"; it is the full DeepScaleR-Preview training set, made by `{prepare_command(path.parent)}` "
            f"(downloads {HF_REPO} from the Hugging Face hub), or train on the subset in the repository: "
            f"--config.data.train_files=\"{SUBSET_FILES}\"")


@dataclasses.dataclass(frozen=True)
class Prepared:
    raw: pathlib.Path  # the downloaded file, as the hub serves it
    train: pathlib.Path  # our jsonl
    rows: int  # rows of the downloaded file
    sha256: str  # of the downloaded file
    stats: ReadStats  # problems written, malformed rows skipped


def download(url: str, dest: pathlib.Path, *, timeout: float = 60.0, progress: bool = True) -> str:
    """Stream ``url`` into ``dest`` (a progress bar on stderr); returns the sha256 of the bytes.
    Raises ``DownloadError`` naming the URL when it cannot be fetched whole."""
    from tqdm import tqdm

    request = urllib.request.Request(url, headers={"User-Agent": "pacs_jax/prepare_data"})
    digest, received = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = int(response.headers.get("Content-Length") or 0)
            with open(dest, "wb") as f, tqdm(total=length or None, unit="B", unit_scale=True, unit_divisor=1024,
                                             desc=f"downloading {url.rsplit('/', 1)[-1]}",
                                             disable=not progress) as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
    except urllib.error.HTTPError as error:
        raise DownloadError(f"cannot download {url}: HTTP {error.code} {error.reason}") from error
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        raise DownloadError(f"cannot download {url}: {reason}") from error
    if length and received != length:
        raise DownloadError(f"cannot download {url}: got {received} of its {length} bytes")
    return digest.hexdigest()


def check_rows(path: pathlib.Path, source: str, expected_rows: int | None) -> list[dict]:
    """The rows of the downloaded file: a JSON list of objects with ``FIELDS``, ``expected_rows`` of
    them (None: any number). Raises ``DataError`` naming ``source`` and the first offending item."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{source}: not a JSON file ({error})") from None
    if not isinstance(rows, list):
        raise DataError(f"{source}: expected a JSON list of {{{', '.join(FIELDS)}}} objects, got a "
                        f"{type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{source}: item {i} is a {type(row).__name__}, not an object")
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise DataError(f"{source}: item {i} has no field {', '.join(map(repr, missing))} "
                            f"(expected {', '.join(FIELDS)}; it has {', '.join(map(repr, row))})")
    if expected_rows is not None and len(rows) != expected_rows:
        raise DataError(f"{source}: {len(rows)} rows, expected {expected_rows} (pass --expected_rows "
                        f"{len(rows)} if the dataset has changed, or --expected_rows 0 for any number)")
    return rows


def prepare(out: str | pathlib.Path = DEFAULT_OUT, *, url: str | None = None, expected_rows: int | None = EXPECTED_ROWS,
            strict: bool = False, overwrite: bool = False, timeout: float = 60.0, progress: bool = True,
            log: Callable[[str], None] = print) -> Prepared:
    """Download (``url``, default ``hub_url()``), check and convert the full set into ``out``."""
    url = url or hub_url()
    out = pathlib.Path(out)
    raw, train = out / RAW_FILE, out / TRAIN_FILE
    if train.exists() and not overwrite:
        raise FileExistsError(f"{train}: exists (pass --overwrite to replace it)")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{RAW_FILE}.", suffix=".partial")
    os.close(fd)
    tmp = pathlib.Path(tmp)
    try:
        log(f"downloading {url}")
        sha256 = download(url, tmp, timeout=timeout, progress=progress)
        rows = check_rows(tmp, url, expected_rows)
        problems, stats = convert_rows(((f"{url} item {i}", row) for i, row in enumerate(rows)), "deepscaler",
                                       "deepscaler", on_error="raise" if strict else "skip")
        publish_mode(tmp)  # mkstemp's 0600 -> what open() gives
        os.replace(tmp, raw)
    except BaseException:
        tmp.unlink(missing_ok=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    atomic_write(train, lambda f: f.writelines(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in problems))
    return Prepared(raw=raw, train=train, rows=len(rows), sha256=sha256, stats=stats)
