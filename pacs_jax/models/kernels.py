"""Which kernel each attention op runs: the shapes and dtypes every kernel takes, in one place, the
choice made once at trace time from them, and a record of what was chosen.

Ops: "attention" (training, log-probs and prefill over padded rows), "packed attention" (training and
log-probs over packed rows: segment ids), "paged decode" (the paged sampler's decode step), "token
selection" (the decode step's LM head and token selection), "moe gemm" (a mixture-of-experts layer's grouped
matmul, models/moe.py), "moe dispatch" (where that layer sorts its tokens by expert).

A kernel that does not take a shape is not called: the op runs the XLA path, and the choice says why
(``KernelChoice.reason``), so a config never meets a kernel's lowering error at step 1. Every choice
is recorded (``chosen``): tools/plan_memory.py prints them after compiling, the trainer logs them
once after its programs are compiled (training/loop.py).

What each kernel takes (docs/design.md section 4.4):

* cuDNN flash attention (GPU, ``jax.nn.dot_product_attention``): bfloat16 / float16 operands (a
  float32 model would be computed in bfloat16: it runs the XLA path, at float32), head size a
  multiple of 8 and at most 256 (Hopper); no segment ids.
* Our block-sparse Pallas (Triton) flash-attention kernel for packed rows on GPU
  (``models/packed_attention_gpu.py``, called by models/attention.py ``_packed_gpu_attention``, which
  pads the head size to a power of 2 p): Triton's dots need p >= 16 and, with 64 x 64 blocks and
  float32 accumulators [64, p] in registers, p <= 128 (every Qwen2.5 / Qwen3 model has 128);
  bfloat16, float16 or float32 (dots at JAX's default precision, as the XLA path's); any B, T, H, K.
* Splash attention (TPU): any head size and length (the sequence is padded to 128 lanes).
* The TPU paged-attention kernel (``pallas.ops.tpu.paged_attention``): head size a multiple of 128
  (the lane width of its blocks), a compute block dividing the table width (always found: 1 divides).
* Our GPU paged kernel (``models/paged_attention_gpu.py``): head size a power of 2 >= 16, page size a
  power of 2, float32 / bfloat16 / float16; any table width.
* Our fused GPU LM head and token selection (``sampling/fused_selection_gpu.py``): vocabulary and
  hidden size multiples of 16, float32 / bfloat16 / float16, no top_k (top_p < 1 takes the logits'
  path at run time).
"""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp

from pacs_jax.models import paged_attention_gpu

_LOG = logging.getLogger(__name__)
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_CUDNN_MAX_HEAD = 256  # Hopper; 128 on earlier GPUs
_PACKED_GPU_DTYPES = ("bfloat16", "float16", "float32")
_PACKED_GPU_HEAD_DIMS = (16, 128)  # the head size, padded to a power of 2 for the kernel, must fall in here
_TPU_LANES = 128


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """op: which attention op; impl: what it runs; reason: why not the platform's kernel ("" if it
    runs it or the config asked for the XLA path)."""

    op: str
    impl: str
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.op}: {self.impl}" + (f" (not the kernel: {self.reason})" if self.reason else "")


_CHOSEN: dict[KernelChoice, None] = {}  # in order of first choice


def _record(choice: KernelChoice) -> KernelChoice:
    """Keep ``choice``; the first time, log it (a fallback to the XLA path as a warning)."""
    if choice not in _CHOSEN:
        _CHOSEN[choice] = None
        (_LOG.warning if choice.reason else _LOG.info)("kernel %s", choice)
    return choice


def chosen() -> tuple[KernelChoice, ...]:
    """Every distinct choice made in this process, in order."""
    return tuple(_CHOSEN)


def cudnn_unsupported(head_dim: int, dtype) -> str | None:
    """None when cuDNN flash attention takes these operands, else why not."""
    if jnp.dtype(dtype) not in _HALF:
        return f"cuDNN computes bfloat16 / float16, the model is {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > _CUDNN_MAX_HEAD:
        return f"head size {head_dim} (cuDNN takes a multiple of 8, at most {_CUDNN_MAX_HEAD})"
    return None


def packed_gpu_unsupported(head_dim: int, dtype) -> str | None:
    """None when the packed GPU kernel takes heads of ``head_dim`` in ``dtype``, else why not."""
    if jnp.dtype(dtype).name not in _PACKED_GPU_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (the kernel takes {', '.join(_PACKED_GPU_DTYPES)})"
    padded = 1 << max(0, head_dim - 1).bit_length()
    low, high = _PACKED_GPU_HEAD_DIMS
    if not low <= padded <= high:
        return f"head_dim {head_dim} (the kernel takes {low // 2 + 1}..{high}: padded to a power of 2 in {low}..{high})"
    return None


def attention(impl: str, *, head_dim: int, dtype, packed: bool) -> KernelChoice:
    """The kernel of a (resolved) ``model.attention`` impl for these operands: padded rows "cudnn" or
    "splash", packed rows "packed_gpu" (beside cuDNN: its masks through ``jax.nn`` take no segment
    ids) or "splash", each when it takes them, else "xla"."""
    op = "packed attention" if packed else "attention"
    if impl != "cudnn":
        return _record(KernelChoice(op, impl))
    reason = packed_gpu_unsupported(head_dim, dtype) if packed else cudnn_unsupported(head_dim, dtype)
    return _record(KernelChoice(op, "xla" if reason else ("packed_gpu" if packed else "cudnn"), reason or ""))


def token_selection(impl: str, unsupported: str | None) -> KernelChoice:
    """The decode step's LM head and token selection beside a (resolved) ``model.attention`` impl:
    "gpu" (our fused Pallas kernel, sampling/fused_selection_gpu.py) beside cuDNN unless
    ``unsupported`` says why not (its shapes and dtype, or a top_k), else "xla" (the head's logits;
    recorded only beside cuDNN, where it is a choice)."""
    if impl != "cudnn":
        return KernelChoice("token selection", "xla")
    return _record(KernelChoice("token selection", "xla" if unsupported else "gpu", unsupported or ""))


def paged_decode(impl: str, *, head_dim: int, page_size: int, dtype) -> KernelChoice:
    """The paged decode path beside a (resolved) ``model.attention`` impl: "tpu" beside splash, "gpu"
    (our Pallas kernel) beside cuDNN, each when it takes the shapes, else "xla"."""
    paged = {"splash": "tpu", "cudnn": "gpu"}.get(impl, "xla")
    reason = ""
    if paged == "tpu" and head_dim % _TPU_LANES:
        reason = f"head size {head_dim} (the TPU kernel takes a multiple of {_TPU_LANES})"
    elif paged == "gpu":
        reason = paged_attention_gpu.unsupported(head_dim, page_size, dtype) or ""
    return _record(KernelChoice("paged decode", "xla" if reason else paged, reason))


def moe_gemm(platform: str, dtype) -> KernelChoice:
    """A mixture-of-experts layer's grouped matmul (models/moe.py) on ``platform`` for operands of ``dtype``
    (the compute dtype). TPU: ``jax.lax.ragged_dot``, which XLA:TPU lowers to its grouped kernel (a group's rows
    only: 0.62 TFLOP for Qwen3-30B-A3B's 65,536 token-slots, docs/measurements.md section 8.4). GPU: tokamax's
    Mosaic GPU kernel (models/moe_gemm_gpu.py; decision 0010) for bfloat16 / float16 operands, where XLA:GPU's
    ragged_dot computes every group densely (79.2 TFLOP for the same); a float32 model, or tokamax not installed,
    takes that ragged_dot, and the choice says why. The CPU: ragged_dot, the reference."""
    if platform != "gpu":
        return _record(KernelChoice("moe gemm", "ragged_dot"))
    from pacs_jax.models import moe_gemm_gpu

    dense = "XLA:GPU computes every expert's group densely (num_experts x the FLOPs)"
    if jnp.dtype(dtype) not in _HALF:
        reason = f"{jnp.dtype(dtype).name} operands (tokamax's mosaic_gpu kernel takes bfloat16 / float16); {dense}"
    elif not moe_gemm_gpu.installed():
        reason = f"tokamax is not installed (pip install tokamax==0.0.17); {dense}"
    else:
        return _record(KernelChoice("moe gemm", "tokamax mosaic_gpu"))
    return _record(KernelChoice("moe gemm", "ragged_dot", reason))


def moe_dispatch(tokens: int, shards: int, axes: tuple[str, ...], ep: tuple[str, ...] = (),
                 experts: int = 0, queued: bool = False) -> KernelChoice:
    """Where a mixture-of-experts layer sorts its ``tokens`` token-expert slots (models/moe.py ``local_dispatch``):
    each of the ``shards`` batch shards (mesh ``axes``) its own, or, when the tokens do not divide over them, all
    of them in one sort, which GSPMD gathers to every device (a v5p-64 prefill of 1024 prompts: 114.6 GiB against
    27.0 per shard, docs/measurements.md 8c): that fallback is named with its reason. ``ep``: the mesh axes the
    ``experts`` a device holds are split over (expert parallelism: the shards of those axes exchange tokens, not
    weights), named on the line. ``queued``: inside a program already split by batch shard (the sampler's queues,
    one a shard), whose tokens are its shard's own."""
    if shards > 1 and tokens % shards:
        return _record(KernelChoice("moe dispatch", "one global sort", f"{tokens} tokens do not divide over the "
                                    f"{shards} batch shards ({' x '.join(axes)}): every slot gathered to every device"))
    impl = "per batch shard" if shards > 1 else "per batch shard (its queue's)" if queued else "one sort"
    if ep:
        impl += f", experts over {' x '.join(ep)} ({experts} a device: tokens all-gathered, sums reduce-scattered)"
    return _record(KernelChoice("moe dispatch", impl))
