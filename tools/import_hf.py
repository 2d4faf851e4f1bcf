"""Hugging Face Qwen directory -> pacs_jax Orbax checkpoint.

    python tools/import_hf.py --hf_dir ~/hf/Qwen2.5-0.5B --out ckpt/qwen2.5-0.5b

The checkpoint directory gets ``model_config.json`` and ``params/`` (see pacs_jax/checkpoints.py);
``checkpoints.from_pretrained(CKPT)`` and the trainer load it. Parameters keep the dtype the HF
directory declares unless ``--param_dtype`` says otherwise.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Sequence

import jax
from flax import nnx

from pacs_jax import checkpoints, models
from pacs_jax.sharding import make_mesh


def mesh_shape(text: str) -> tuple[int, int, int]:
    """'DATA,FSDP,TENSOR' (one may be -1) -> a tuple of three ints, for argparse."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: expected three comma-separated ints DATA,FSDP,TENSOR")
    return shape


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf_dir", required=True, type=pathlib.Path,
                        help="HF model directory: config.json + model.safetensors (or sharded safetensors + index)")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="checkpoint directory to create")
    parser.add_argument("--param_dtype", default="keep", choices=["keep", "float32", "bfloat16", "float16"],
                        help="storage dtype of the parameters; 'keep' (default) keeps the HF checkpoint's dtype")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="compute dtype recorded in model_config.json (default: float32)")
    parser.add_argument("--mesh", default=None, type=mesh_shape, metavar="DATA,FSDP,TENSOR",
                        help="load through a device mesh (e.g. 1,-1,1 for FSDP over all devices) so that no "
                             "device holds the whole model; default: the first device")
    args = parser.parse_args(argv)
    if not (args.hf_dir / "config.json").is_file():
        parser.error(f"--hf_dir {args.hf_dir}: no config.json there")
    if (args.out / checkpoints.PARAMS_ITEM).exists():
        parser.error(f"--out {args.out}: already holds a checkpoint ({checkpoints.PARAMS_ITEM}/ exists)")
    return args


def import_hf(hf_dir: pathlib.Path, out: pathlib.Path, *, param_dtype: str | None = None, dtype: str = "float32",
              mesh_shape: tuple[int, int, int] | None = None) -> models.Qwen:
    """Load ``hf_dir`` tensor by tensor and save it as a pacs_jax checkpoint at ``out``; returns the model."""
    mesh = make_mesh(*mesh_shape) if mesh_shape is not None else make_mesh(1, 1, 1, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = models.load_hf(hf_dir, dtype=dtype, param_dtype=param_dtype)
        checkpoints.save_model(model, out)
    return model


def main(argv: Sequence[str] | None = None) -> pathlib.Path:
    args = parse_args(argv)
    start = time.perf_counter()
    model = import_hf(args.hf_dir, args.out, param_dtype=None if args.param_dtype == "keep" else args.param_dtype,
                      dtype=args.dtype, mesh_shape=args.mesh)
    n_params = sum(a.size for a in checkpoints.flat_params(nnx.state(model, nnx.Param)).values())
    print(f"{args.hf_dir} -> {args.out}: {model.cfg.model_type}, {n_params / 1e6:.1f}M parameters in "
          f"{model.cfg.param_dtype}, {time.perf_counter() - start:.1f} s")
    return args.out


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    main(sys.argv[1:])
