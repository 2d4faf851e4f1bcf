"""Local copies of ``gs://`` folders, for the readers that take local files only.

    folder = local_folder("gs://bucket/models/Qwen2.5-3B")   # ~/.cache/pacs_jax/remote/gs/bucket/models/Qwen2.5-3B
    AutoTokenizer.from_pretrained(folder)
    store_path(f"{folder}/eval")                            # "gs://bucket/models/Qwen2.5-3B/eval"

transformers' tokenizers and the HF weights loader (models/loading.py) open files by local path. A
``gs://`` model or tokenizer folder is copied once into the cache (``$PACS_JAX_CACHE``, else
``~/.cache/pacs_jax``; under ``remote/<scheme>/<bucket>/<key>``) and read from there. The copy is
written to a temporary folder beside it and renamed into place, so a reader never sees half a copy
and processes of one host that copy at once keep one whole copy. ``MANIFEST`` inside records
each file's size: a later call copies again only when the store's listing differs. Local paths are
returned as they are (``paths.resolve``). Orbax checkpoints on ``gs://`` are not copied: Orbax reads
the store itself.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable

from etils import epath

from pacs_jax.data import paths

CACHE_ENV = "PACS_JAX_CACHE"
MANIFEST = ".pacs_jax_manifest.json"


def cache_root() -> pathlib.Path:
    """``$PACS_JAX_CACHE``, else ``~/.cache/pacs_jax``."""
    return pathlib.Path(os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "pacs_jax")


def _listing(folder: epath.Path, keep: Callable[[str], bool]) -> dict[str, int]:
    """{relative path: size in bytes} of the files under ``folder`` whose relative path ``keep`` accepts
    (a folder is entered when ``keep`` accepts its path)."""
    files: dict[str, int] = {}
    pending = [(folder, "")]
    while pending:
        current, prefix = pending.pop()
        for child in current.iterdir():
            relative = f"{prefix}{child.name}"
            if not keep(relative):
                continue
            if child.is_dir():
                pending.append((child, relative + "/"))
            else:
                files[relative] = child.stat().length
    return files


def local_folder(folder: str | os.PathLike, *, keep: Callable[[str], bool] = lambda relative: True
                 ) -> str | os.PathLike:
    """A local folder with the files of ``folder``: ``folder`` itself (``paths.resolve``d) when it is local,
    else its copy in the cache (see the module docstring). keep(relative path): which files and
    subfolders to copy (default: all). Raises ``FileNotFoundError`` naming ``folder`` when the store
    has no such folder."""
    if not paths.is_remote(folder):
        return paths.resolve(folder)
    source = epath.Path(folder)
    if not source.is_dir():
        raise FileNotFoundError(paths.missing(folder))
    scheme, _, key = str(folder).partition("://")
    target = cache_root() / "remote" / scheme / key.strip("/")
    files = _listing(source, keep)
    manifest = {"source": str(folder), "files": files}
    try:
        if json.loads((target / MANIFEST).read_text()) == manifest:
            return str(target)
    except (OSError, ValueError):
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        for relative in files:
            (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
            with (source / relative).open("rb") as src, open(tmp / relative, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        old = target.parent / f".{target.name}.old.{os.getpid()}"
        if target.exists():  # an older copy (the store's files changed): replaced whole
            target.rename(old)
        try:
            tmp.rename(target)
        except OSError:  # another process of this host put its whole copy there first
            if not target.is_dir():
                raise
    finally:
        for leftover in (tmp, target.parent / f".{target.name}.old.{os.getpid()}"):
            shutil.rmtree(leftover, ignore_errors=True)
    return str(target)


def store_path(local: str | os.PathLike) -> str | None:
    """The store path that ``local``, a path inside a copy ``local_folder`` made, stands for
    (``<cache>/remote/gs/bucket/key/x`` -> ``gs://bucket/key/x``: the cache mirrors the store's layout),
    or None when ``local`` is not inside the cache's copies."""
    copies = cache_root() / "remote"
    try:
        scheme, *key = pathlib.Path(local).relative_to(copies).parts
    except ValueError:
        return None
    return f"{scheme}://{'/'.join(key)}" if key else None
