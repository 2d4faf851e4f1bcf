"""Hugging Face <-> pacs_jax parameter mapping, and reading / writing HF weight files.

Our parameters are addressed by dotted paths (``layers.attn.q_kernel``: the decoder's parameters are
stacked over layers, [L, ...]). Each layer's slice maps to one HF tensor
(``model.layers.3.self_attn.q_proj.weight``) through a pair of reshapes / transposes:
HF stores Linear weights as [out, in]; we store kernels as [in, ...out] with heads split out
([D, H, Dh] for q/k/v, [H, Dh, D] for o) so that each dim can carry a logical axis name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator

import numpy as np
from etils import epath
from safetensors import safe_open
from safetensors.numpy import save_file

from pacs_jax.files import is_remote, publish_mode
from pacs_jax.models.config import QwenConfig, layer_stacks

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


Index = tuple[slice, ...]  # one slice per dim, with integer start and stop


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one of our parameters is stored in an HF checkpoint.

    A stacked decoder parameter ([L, ...], path ``layers.*``, or ``layers_1.*`` ... for the later stacks of a
    model with dense layers among sparse ones) is L HF tensors, one per layer: ``hf_name`` then holds a
    ``{layer}`` field, ``layers`` the HF layer index of each row of the stack, and the conversions apply to one
    layer. A mixture-of-experts
    layer's expert parameter ([L, E, ...]) is L E HF tensors: ``hf_name`` holds an ``{expert}`` field too
    (``num_experts`` set) and the conversions apply to one expert of one layer.
    to_ours / to_hf: convert an array (or, for to_ours, the HF block ``hf_index`` names);
    hf_index: the block of the HF tensor that holds a block of ours; hf_shape: ours -> HF shape.
    """

    hf_name: str
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    hf_index: Callable[[Index], Index]
    hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    layers: tuple[int, ...] | None = None
    num_experts: int | None = None

    def _tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(HF name, the index of its slice in our array: (), (row,) or (row, expert)) of each HF tensor."""
        if self.layers is None:
            yield self.hf_name, ()
        elif self.num_experts is None:
            for row, layer in enumerate(self.layers):
                yield self.hf_name.format(layer=layer), (row,)
        else:
            for row, layer in enumerate(self.layers):
                for expert in range(self.num_experts):
                    yield self.hf_name.format(layer=layer, expert=expert), (row, expert)

    def hf_tensors(self, ours: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, HF array) pairs of our array (one per layer when stacked, one per layer and expert
        for an expert parameter)."""
        for name, index in self._tensors():
            yield name, self.to_hf(ours[index])

    def hf_shapes(self, shape: tuple[int, ...]) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(HF name, HF shape) of each HF tensor of our parameter of ``shape``."""
        for name, index in self._tensors():
            yield name, tuple(self.hf_shape(tuple(shape[len(index):])))


def _same(hf_name: str) -> TensorMap:
    return TensorMap(hf_name, _identity, _identity, _identity, _identity)


def _transposed(hf_name: str) -> TensorMap:
    """HF [out, in] <-> ours [in, out]."""
    return TensorMap(hf_name, np.transpose, np.transpose, lambda i: i[::-1], lambda s: s[::-1])


def _identity(x):
    return x


def _head_block(heads: slice, dh: int) -> slice:
    return slice(heads.start * dh, heads.stop * dh)


def _heads_in(hf_name: str, dh: int) -> TensorMap:
    """HF [N*Dh, D] <-> ours [D, N, Dh] (a block of ours takes whole heads)."""
    return TensorMap(hf_name, lambda w: w.T.reshape(w.shape[1], -1, dh), lambda w: w.reshape(w.shape[0], -1).T,
                     lambda i: (_head_block(i[1], dh), i[0]), lambda s: (s[1] * s[2], s[0]))


def _heads_bias(hf_name: str, dh: int) -> TensorMap:
    """HF [N*Dh] <-> ours [N, Dh]."""
    return TensorMap(hf_name, lambda b: b.reshape(-1, dh), lambda b: b.reshape(-1),
                     lambda i: (_head_block(i[0], dh),), lambda s: (s[0] * s[1],))


def _heads_out(hf_name: str, dh: int) -> TensorMap:
    """HF [D, H*Dh] <-> ours [H, Dh, D]."""
    return TensorMap(hf_name, lambda w: w.T.reshape(-1, dh, w.shape[0]), lambda w: w.reshape(-1, w.shape[-1]).T,
                     lambda i: (i[2], _head_block(i[0], dh)), lambda s: (s[2], s[0] * s[1]))


def weight_map(cfg: QwenConfig) -> dict[str, TensorMap]:
    """Our dotted parameter path -> TensorMap, for every parameter of ``Qwen(cfg)``."""
    out: dict[str, TensorMap] = {"embedding": _same("model.embed_tokens.weight"),
                                 "final_norm.scale": _same("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = _transposed("lm_head.weight")
    for stack, sparse, first, count in layer_stacks(cfg):
        out.update(_stack_map(cfg, stack, sparse, tuple(range(first, first + count))))
    return out


def _stack_map(cfg: QwenConfig, stack: str, sparse: bool, layers: tuple[int, ...]) -> dict[str, TensorMap]:
    """The TensorMaps of one stack of decoder layers (``qwen.layer_stacks``: attribute ``stack``, a sparse
    block's parameters or a dense MLP's), its rows HF's ``layers``."""
    dh, out = cfg.head_dim, {}

    def layer(ours: str, tmap: TensorMap) -> None:
        out[f"{stack}.{ours}"] = dataclasses.replace(tmap, hf_name=f"model.layers.{{layer}}.{tmap.hf_name}",
                                                     layers=layers)

    for name in ("q", "k", "v"):
        layer(f"attn.{name}_kernel", _heads_in(f"self_attn.{name}_proj.weight", dh))
        if cfg.attention_bias:
            layer(f"attn.{name}_bias", _heads_bias(f"self_attn.{name}_proj.bias", dh))
    layer("attn.o_kernel", _heads_out("self_attn.o_proj.weight", dh))
    if cfg.qk_norm:
        layer("attn.q_norm.scale", _same("self_attn.q_norm.weight"))
        layer("attn.k_norm.scale", _same("self_attn.k_norm.weight"))
    if sparse:  # a Qwen3-MoE sparse block (models/moe.py)
        layer("mlp.router_kernel", _transposed("mlp.gate.weight"))
        for name in ("gate", "up", "down"):
            layer(f"mlp.{name}_kernel", dataclasses.replace(
                _transposed(f"mlp.experts.{{expert}}.{name}_proj.weight"), num_experts=cfg.num_experts))
    else:
        for name in ("gate", "up", "down"):
            layer(f"mlp.{name}_kernel", _transposed(f"mlp.{name}_proj.weight"))
    layer("input_norm.scale", _same("input_layernorm.weight"))
    layer("post_attn_norm.scale", _same("post_attention_layernorm.weight"))
    return out


# ---------------------------------------------------------------------------------------- reading
class HFWeightReader:
    """Reads HF tensors, or blocks of them (only those bytes), from model.safetensors or an index + shards."""

    def __init__(self, hf_dir: str | pathlib.Path):
        self.dir = pathlib.Path(hf_dir)
        index = self.dir / SAFE_INDEX
        if index.is_file():
            try:
                self.files = {k: self.dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a valid safetensors index ({e})") from e
        elif (self.dir / SAFE_SINGLE).is_file():
            with safe_open(self.dir / SAFE_SINGLE, framework="numpy") as f:
                self.files = {k: self.dir / SAFE_SINGLE for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir}: neither {SAFE_SINGLE} nor {SAFE_INDEX} found")
        for path in sorted(set(self.files.values())):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard file listed in {index.name} is missing")

    def _file(self, hf_name: str) -> pathlib.Path:
        if hf_name not in self.files:
            raise KeyError(f"{self.dir}: tensor {hf_name!r} not found in the checkpoint")
        return self.files[hf_name]

    def shape(self, hf_name: str) -> tuple[int, ...]:
        with safe_open(self._file(hf_name), framework="numpy") as f:
            return tuple(f.get_slice(hf_name).get_shape())

    def read(self, hf_name: str, index: Index | None = None) -> np.ndarray:
        """The tensor, or its block ``index``."""
        with safe_open(self._file(hf_name), framework="numpy") as f:
            return f.get_tensor(hf_name) if index is None else f.get_slice(hf_name)[index]


def safetensors_header(path: epath.Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a safetensors file, from its header alone (8 bytes of length, then JSON;
    local or on a store). Raises ``ValueError`` naming the file (by its name: the caller names the
    folder) when the header is unreadable or the file is shorter than the tensors the header places in
    it (a copy cut short)."""
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length < 100 * 2**20:
            raise ValueError(f"{path.name}: not a safetensors file (no header)")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise ValueError(f"{path.name}: not a safetensors file (its header is not JSON)") from None
    try:
        header.pop("__metadata__", None)
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0) + 8 + length
        shapes = {name: tuple(int(n) for n in t["shape"]) for name, t in header.items()}
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise ValueError(f"{path.name}: not a safetensors file (its header lists no tensors' offsets and "
                         "shapes)") from None
    stat = path.stat()  # epath's StatResult (length) or os.stat_result (st_size)
    size = stat.length if hasattr(stat, "length") else stat.st_size
    if size < end:
        raise ValueError(f"{path.name}: holds {size} bytes of the {end} its header describes (a copy cut short?)")
    return shapes


def hf_weight_shapes(hf_dir: epath.Path, *, read_headers: bool = True) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of the safetensors weights in ``hf_dir`` (model.safetensors, or the shards
    model.safetensors.index.json lists), read from the files' headers only; with ``read_headers``
    False (a folder on a store), {name: ()} (shape unknown) from the index after checking each shard
    exists, {} for a single file. Raises
    ``FileNotFoundError`` / ``ValueError`` naming the missing or unreadable file."""
    index = hf_dir / SAFE_INDEX
    if index.is_file():
        try:
            files = {k: hf_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index.name}: not a safetensors index (no weight_map: {e!r})") from None
    elif (hf_dir / SAFE_SINGLE).is_file():
        if not read_headers:
            return {}
        return safetensors_header(hf_dir / SAFE_SINGLE)
    else:
        bins = sorted(p.name for p in hf_dir.iterdir() if p.name.startswith("pytorch_model") and p.suffix == ".bin")
        raise FileNotFoundError(
            f"no weights: neither {SAFE_SINGLE} nor {SAFE_INDEX}"
            + (f" (it holds {', '.join(bins[:3])}: PyTorch weights, which are not read; save them as safetensors)"
               if bins else ""))
    shapes: dict[str, tuple[int, ...] | None] = {}
    for shard in sorted(set(files.values())):
        if not shard.is_file():
            raise FileNotFoundError(f"{shard.name} (a shard {SAFE_INDEX} lists) is missing")
        if read_headers:
            shapes.update(safetensors_header(shard))
    return shapes if read_headers else dict.fromkeys(files, ())


def _read_one(reader: HFWeightReader, hf_name: str, tmap: TensorMap, path: str, shape: tuple[int, ...],
              index: Index) -> np.ndarray:
    """Block ``index`` of one (per-layer) parameter of ``shape`` from the HF tensor ``hf_name``."""
    source = reader.files.get(hf_name, reader.dir)
    found, needed = reader.shape(hf_name), tuple(tmap.hf_shape(tuple(shape)))
    if found != needed:
        raise ValueError(f"{source}: tensor {hf_name!r} has shape {found}; parameter {path} of shape "
                         f"{tuple(shape)} (ours, from the config) needs {needed}")
    block = tuple(s.stop - s.start for s in index)
    value = tmap.to_ours(reader.read(hf_name, None if block == tuple(shape) else tmap.hf_index(index)))
    if value.shape != block:
        raise ValueError(f"{source}: block {index} of {hf_name!r} converts to {value.shape}, not {block}")
    return value


def read_param(reader: HFWeightReader, path: str, tmap: TensorMap, expected_shape: tuple[int, ...],
               dtype=None, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """One of our parameters from the HF files (stacked over layers when it is), or only its block
    ``index`` (the part a device holds: only those bytes are read), checked against ``expected_shape``."""
    shape = tuple(expected_shape)
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index or (slice(None),) * len(shape), shape))
    if tmap.layers is None:
        return _finish(_read_one(reader, tmap.hf_name, tmap, path, shape, index), dtype)
    stack, _, rest = path.partition(".")
    where = lambda row: f"{stack}[{row}].{rest}"  # noqa: E731  (our row, named as the path of its stack)
    if tmap.num_experts is None:
        value = np.stack([_read_one(reader, tmap.hf_name.format(layer=tmap.layers[i]), tmap, where(i), shape[1:],
                                    index[1:])
                          for i in range(index[0].start, index[0].stop)])
    else:
        value = np.stack([np.stack([_read_one(reader, tmap.hf_name.format(layer=tmap.layers[i], expert=e), tmap,
                                              where(i) + f"[expert {e}]", shape[2:], index[2:])
                                    for e in range(index[1].start, index[1].stop)])
                          for i in range(index[0].start, index[0].stop)])
    return _finish(value, dtype)


def _finish(value: np.ndarray, dtype) -> np.ndarray:
    """A parameter read, contiguous, in ``dtype`` (None: as stored)."""
    return np.ascontiguousarray(value if dtype is None else value.astype(dtype, copy=False))


# ---------------------------------------------------------------------------------------- writing
def _shards(tensors: Iterator[tuple[str, np.ndarray]], max_shard_bytes: int) -> Iterator[dict[str, np.ndarray]]:
    shard, size = {}, 0
    for name, array in tensors:
        if shard and size + array.nbytes > max_shard_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = array
        size += array.nbytes
    if shard:
        yield shard


def _save_bin(shard: dict[str, np.ndarray], path: pathlib.Path) -> None:
    try:
        import torch
    except ImportError as e:
        raise ImportError("--format bin needs PyTorch (pip install torch)") from e
    out = {}
    for name, array in shard.items():
        array = np.require(array, requirements=["C", "W"])  # torch wants writable memory (copies if not)
        if array.dtype.name == "bfloat16":
            out[name] = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(array)
    torch.save(out, path)


# What a training workdir, a checkpoint folder or a pacs_jax model checkpoint holds, and an HF export
# never does: named when a folder holding them is refused.
WORKDIR_MARKERS = ("checkpoints", "metrics.jsonl", "summary.json", "warmstart.json", "tensorboard", "hf_export",
                   "curves.png", "model_config.json", "params", "_CHECKPOINT_METADATA")
# What other programs write into an export (python -m pacs_jax.evaluate --checkpoint=EXPORT writes EXPORT/eval):
# not a sign of a workdir, but not the export's either, so an overwrite refuses it, naming it
EXPORT_SUBFOLDERS = ("eval",)
EXPORT_MARKER = "pacs_jax_export.json"  # written into every export: {"files": [...]}, what an overwrite may replace
NO_TOKENIZER_NOTE = "README.md"  # written into an export without tokenizer files: that it has none, and why


def no_tokenizer_line(out_dir: str | os.PathLike, why: str) -> str:
    """The line an exporter prints when ``write_hf_dir`` wrote no tokenizer files into ``out_dir``."""
    return f"the HF export {out_dir} has no Hugging Face tokenizer ({why}); its {NO_TOKENIZER_NOTE} says so"


def _no_tokenizer_note(why: str) -> str:
    """``NO_TOKENIZER_NOTE``'s text: transformers' AutoTokenizer loads an empty tokenizer from such a folder
    (no error), so the folder says it has none, why, and what to use."""
    return ("# A pacs_jax export without a tokenizer\n\n"
            f"This folder holds a model (config.json and its weights) but no Hugging Face tokenizer: {why}.\n\n"
            "`transformers.AutoTokenizer.from_pretrained` on this folder loads an empty tokenizer (or fails): "
            "do not encode text with it.\n")


class NotAnExportError(FileExistsError):
    """The folder an export would replace is not a previous HF export; the message names it and why."""


def _listing(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")


def check_export_target(out_dir: str | os.PathLike, *, overwrite: bool,
                        instead: str = "choose another output folder") -> None:
    """Refuse to write an HF export over anything but nothing, an empty folder or (with ``overwrite``)
    an export this code wrote: a folder with ``EXPORT_MARKER`` that holds only the files it lists.
    Anything else, a downloaded HF model, a training workdir or a checkpoint included, is refused naming
    what it holds, before anything is read or written; so is an export holding files it did not write
    (the evaluation CLI's ``eval/`` results), naming them: replacing the folder would delete them.

    Used by ``write_hf_dir`` (``tools/export_hf.py`` and the trainer's workdir/hf_export), so that an
    ``--out`` pointing at a folder of someone's files is never deleted.
    Raises ``NotAnExportError`` (a ``FileExistsError``) with one line naming ``out_dir``, a local folder
    or one on a store (``gs://``), ending with what to do: move the files out, or ``instead`` (the
    trainer, whose export folder is fixed, says what it is).
    """
    local = not is_remote(out_dir)
    out_dir = pathlib.Path(out_dir) if local else epath.Path(out_dir)
    if not out_dir.exists() and not (local and out_dir.is_symlink()):
        return
    if not out_dir.is_dir():
        raise NotAnExportError(f"{out_dir}: exists and is not a folder; not replacing it with an HF export")
    entries = sorted(out_dir.iterdir())
    if not entries:
        return
    if not overwrite:
        raise FileExistsError(f"{out_dir}: exists and is not empty (pass overwrite=True / --overwrite)")
    if local and out_dir.is_symlink():
        raise NotAnExportError(f"{out_dir}: is a symbolic link; not replacing it with an HF export")
    names = [e.name for e in entries]
    workdir_like = [e.name for e in entries if e.name in WORKDIR_MARKERS
                    or (e.is_dir() and e.name not in EXPORT_SUBFOLDERS)]
    if workdir_like:
        raise NotAnExportError(
            f"{out_dir}: not a previous HF export (it holds {', '.join(workdir_like[:4])}"
            f"{', ...' if len(workdir_like) > 4 else ''}: a training workdir or checkpoint?); "
            f"not replacing it: {instead}")
    if EXPORT_MARKER not in names:
        raise NotAnExportError(
            f"{out_dir}: not an export pacs_jax wrote (no {EXPORT_MARKER}; it holds {_listing(names)}); "
            f"not replacing it: {instead}, or empty it first")
    try:
        written = set(json.loads((out_dir / EXPORT_MARKER).read_text())["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise NotAnExportError(f"{out_dir}: {EXPORT_MARKER} is unreadable ({e!r}); not replacing the folder: "
                               f"{instead}, or empty it first") from None
    others = [f"{e.name}/" if e.is_dir() else e.name for e in entries if e.name not in written | {EXPORT_MARKER}]
    if others:
        raise NotAnExportError(
            f"{out_dir}: holds {_listing(others)}, which pacs_jax's export did not write ({EXPORT_MARKER} lists "
            f"the files it wrote); not replacing the folder, which would delete them: move them out, or {instead}")


def write_hf_dir(out_dir: str | os.PathLike, cfg: QwenConfig, tensors: Iterator[tuple[str, np.ndarray]], *,
                 fmt: str = "safetensors", max_shard_bytes: int = 4 * 1024**3,
                 tokenizer_dir: str | pathlib.Path | None = None, overwrite: bool = False,
                 no_tokenizer: str = "no tokenizer folder was given to the export") -> pathlib.Path | epath.Path:
    """Write an HF model directory atomically: into a temp dir beside ``out_dir``, then rename.

    ``tensors`` yields (hf_name, array) pairs, consumed shard by shard. ``fmt`` is "safetensors"
    or "bin" (pytorch_model*.bin for older tooling). The tokenizer files of ``tokenizer_dir`` are
    copied; without one, ``NO_TOKENIZER_NOTE`` says the export has none, ``no_tokenizer`` saying why
    and what to use instead. A failure leaves nothing at ``out_dir``. An
    existing ``out_dir`` is replaced only with ``overwrite`` and only if it is a previous export
    (``check_export_target``; the export lists its files in ``EXPORT_MARKER``). The folder and its
    files get the modes ``mkdir()`` / ``open()`` give.

    ``out_dir`` on a store (``gs://...``): the export is written to a local temporary folder (as big
    as the model), then uploaded (``_upload``); returns ``out_dir`` as an ``epath.Path``.
    """
    if fmt not in ("safetensors", "bin"):
        raise ValueError(f"format={fmt!r}: expected 'safetensors' or 'bin'")
    if is_remote(out_dir):
        check_export_target(out_dir, overwrite=overwrite)
        with tempfile.TemporaryDirectory(prefix="pacs_jax_export.") as local:
            written = write_hf_dir(pathlib.Path(local) / "export", cfg, tensors, fmt=fmt,
                                   max_shard_bytes=max_shard_bytes, tokenizer_dir=tokenizer_dir,
                                   no_tokenizer=no_tokenizer)
            return _upload(written, epath.Path(out_dir), overwrite=overwrite)
    out_dir = pathlib.Path(out_dir)
    tmp = staging_folder(out_dir, overwrite=overwrite)
    try:
        single, index_name = (SAFE_SINGLE, SAFE_INDEX) if fmt == "safetensors" else (BIN_SINGLE, BIN_INDEX)
        stem, ext = single.rsplit(".", 1)
        written: list[tuple[str, list[str]]] = []
        total = 0
        for k, shard in enumerate(_shards(tensors, max_shard_bytes)):
            name = f"{stem}-{k + 1:05d}.{ext}"  # renamed once the shard count is known
            if fmt == "safetensors":
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
            else:
                _save_bin(shard, tmp / name)
            written.append((name, list(shard)))
            total += sum(a.nbytes for a in shard.values())
        if len(written) == 1:
            os.replace(tmp / written[0][0], tmp / single)
        else:
            weight_map = {}
            for k, (name, keys) in enumerate(written):
                final = f"{stem}-{k + 1:05d}-of-{len(written):05d}.{ext}"
                os.replace(tmp / name, tmp / final)
                weight_map.update({key: final for key in keys})
            (tmp / index_name).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        hf_config = cfg.to_hf_dict()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg.bos_token_id, "eos_token_id": hf_config["eos_token_id"]}, indent=2))
        if tokenizer_dir is not None:
            tokenizer_dir = pathlib.Path(tokenizer_dir)
            found = [f for f in TOKENIZER_FILES if (tokenizer_dir / f).is_file()]
            if not found:
                raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
            for f in found:
                shutil.copy2(tokenizer_dir / f, tmp / f)
        else:
            (tmp / NO_TOKENIZER_NOTE).write_text(_no_tokenizer_note(no_tokenizer))
        publish_export(tmp, out_dir, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def staging_folder(out_dir: pathlib.Path, *, overwrite: bool) -> pathlib.Path:
    """A fresh temporary folder beside ``out_dir`` to write an export into (``publish_export`` renames it),
    once ``out_dir`` is known to be replaceable (``check_export_target``)."""
    check_export_target(out_dir, overwrite=overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))


def publish_export(tmp: pathlib.Path, out_dir: pathlib.Path, *, overwrite: bool) -> None:
    """The export written in ``tmp`` (``staging_folder``) listed in its ``EXPORT_MARKER``, given the modes
    ``open()`` and ``mkdir()`` give, and renamed to ``out_dir`` (a previous export there replaced)."""
    (tmp / EXPORT_MARKER).write_text(json.dumps(
        {"written_by": "pacs_jax", "files": sorted(p.name for p in tmp.iterdir())}, indent=2))
    for path in tmp.iterdir():  # safetensors writes 0600 files, mkdtemp a 0700 folder
        publish_mode(path)
    publish_mode(tmp, directory=True)  # -> what open() and mkdir() give
    if out_dir.exists():
        check_export_target(out_dir, overwrite=overwrite)  # again: it may have changed while writing
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def _upload(export: pathlib.Path, out_dir: epath.Path, *, overwrite: bool) -> epath.Path:
    """Copy the local HF export ``export`` to ``out_dir`` on a store, replacing a previous export there.

    A store has no rename, so this is not atomic: a marker listing the previous export's files and this
    one's is uploaded first, then the weights, the other files and this export's own marker, then
    what a previous export holds that this one lacks is deleted. An upload cut short leaves a folder
    whose marker lists every file in it, which a rerun replaces (``check_export_target``).
    """
    check_export_target(out_dir, overwrite=overwrite)  # again: it may have changed while writing
    previous = {entry.name for entry in out_dir.iterdir()} if out_dir.exists() else set()
    files = sorted(export.iterdir(), key=lambda f: (f.name == EXPORT_MARKER, f.suffix not in (".safetensors", ".bin")))
    # first a marker listing the old files and the new (weights next, the export's own marker last): an upload
    # cut short leaves a folder a rerun recognises and replaces
    (out_dir / EXPORT_MARKER).write_text(json.dumps(
        {"written_by": "pacs_jax", "files": sorted((previous | {f.name for f in files}) - {EXPORT_MARKER})}, indent=2))
    for file in files:
        with open(file, "rb") as src, (out_dir / file.name).open("wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
    for name in previous - {file.name for file in files}:  # as a local export replaces the folder whole
        stale = out_dir / name
        if stale.is_dir():
            stale.rmtree()
        else:
            stale.unlink()
    return out_dir
