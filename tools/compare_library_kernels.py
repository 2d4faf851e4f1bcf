"""Our kernels against what JAX and tokamax now ship, on the compiled program (compile-only, no chip).

For each case it compiles a forward + backward program for one device of the target and prints one
table row per implementation: the kernels the compiled HLO calls (custom-call targets, with Pallas
kernel names), XLA's FLOPs and bytes accessed (``cost_analysis()``), the temporary buffer
(``memory_analysis()``) and the compile time, or the lowering error. XLA counts a custom call (a
Pallas, Triton, Mosaic or cuDNN kernel) as its operands and outputs in bytes and no FLOPs, so for
kernels these columns say what surrounds the kernel, not the kernel's own work: the "kernels" column
is the comparison that matters there (which kernel runs, and whether it lowers at all).

Cases (``--case``, default all of the target's):

* ``attention``: training attention, causal, bfloat16, Qwen2.5-7B heads (28 query heads, 4 K/V heads,
  head size 128), ``--batch`` rows of ``--tokens`` tokens; padded rows (per-row lengths) and packed
  rows (``--sequences`` per row, segment ids). Ours is ``pacs_jax.models.attention.attention`` with the
  platform's impl (cuDNN / our packed Triton kernel on GPU, splash on TPU); tokamax's are its
  ``dot_product_attention`` implementations, packed rows as a per-query key start with the causal mask
  (``Mask(k_start=..., is_causal=True)``, which its public API does not expose: it takes a dense mask).
* ``ragged_dot``: a mixture-of-experts grouped matmul (Qwen3-30B-A3B: hidden 2048, expert intermediate
  768, 128 experts, top 8) over ``--moe-tokens`` tokens: ``jax.lax.ragged_dot`` against tokamax's.

Usage: a virtualenv that reads the test environment's packages and adds JAX's CUDA plugin and tokamax
(docs/design.md section 4.4b has the figures)::

    python3.12 -m venv /tmp/venv-tk
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.12/site-packages')" \
        > /tmp/venv-tk/lib/python3.12/site-packages/main_venv.pth
    /tmp/venv-tk/bin/pip install --no-deps -r requirements-gpu-compile.txt tokamax==0.0.17 qwix==0.1.8 \
        einshape==1.0 immutabledict==4.3.1 jaxtyping==0.3.11 wadler-lindig==0.1.8 xprof==2.24.2 fire==0.7.1 \
        termcolor==3.3.0 six==1.17.0
    /tmp/venv-tk/bin/python tools/compare_library_kernels.py --target=h200
    /tmp/venv-tk/bin/python tools/compare_library_kernels.py --target=v5p --case=ragged_dot

GPU and TPU compiles run in separate processes (one ``--target`` a run).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
import warnings

TARGETS = {"h200": "h200x1", "v5p": "v5p-8"}
CASES = ("attention", "ragged_dot")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=sorted(TARGETS), required=True)
    p.add_argument("--case", choices=CASES + ("all",), default="all")
    p.add_argument("--only", default="", help="comma-separated substrings: run only the rows whose name has one")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--sequences", type=int, default=4, help="sequences packed into each row")
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--moe-tokens", type=int, default=8192)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--forward-only", action="store_true", help="compile the forward pass only")
    p.add_argument("--verbose", action="store_true", help="print each error's traceback")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Reading a compiled program


def _kernels(hlo: str) -> str:
    """The custom calls of a compiled program's HLO text, 'target[:kernel name] xN', one per kind."""
    found: dict[str, int] = {}
    for line in hlo.splitlines():
        m = re.search(r'custom_call_target="([^"]+)"', line)
        if not m:
            continue
        target = m.group(1)
        # A Triton call's name (Pallas ``name=``) closes its backend config: name = "...".
        names = re.findall(r'[\s,{]name\s*=\s*\\?"([A-Za-z0-9_.$-]+)', line)
        label = target.replace("__gpu$xla.gpu.", "").replace("__cudnn$", "cudnn:")
        if names and "cudnn" not in target:
            label += f":{names[-1]}"
        elif target == "tpu_custom_call":  # a Mosaic TPU kernel: its instruction's name says which
            instr = re.match(r"\s*(?:ROOT\s+)?%?([\w-]+?)(?:\.\d+)*\s*=", line)
            label += f":{instr.group(1)}" if instr else ""
        found[label] = found.get(label, 0) + 1
    fusions = len(re.findall(r"^\s*\S+ = \S+ fusion\(", hlo, re.M))
    gemms = len(re.findall(r'custom_call_target="__cublas', hlo))
    parts = [f"{k} x{n}" for k, n in found.items() if not k.startswith("__cublas")]
    if gemms:
        parts.append(f"cublas x{gemms}")
    if not parts:
        dots = len(re.findall(r" dot\(", hlo)) + len(re.findall(r"convolution\(", hlo))
        parts.append(f"XLA only ({dots} dots, {fusions} fusions)")
    return "; ".join(parts)


def _costs(compiled) -> tuple[float, float, float, float, float]:
    """XLA's FLOPs and bytes (``cost_analysis()``, None for a compile-only GPU), pacs_jax.hlo_cost's
    (each loop counted its trips; a loop whose trips only the device knows, once), temp bytes."""
    from pacs_jax import hlo_cost

    nan = float("nan")
    xla = compiled.cost_analysis() or {}
    if isinstance(xla, (list, tuple)):
        xla = xla[0] if xla else {}
    ours = hlo_cost.program_cost(compiled.as_text(), trips=lambda loop: 1.0)
    mem = compiled.memory_analysis()
    temp = float(getattr(mem, "temp_size_in_bytes", nan)) if mem is not None else nan
    return (float(xla.get("flops", nan)), float(xla.get("bytes accessed", nan)), ours.flops, ours.bytes, temp)


def _fmt(x: float, unit: str) -> str:
    if x != x:
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{suffix}{unit}"
    return f"{x:.0f}{unit}"


def _error_line(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return " | ".join(_error_line(x) for x in e.exceptions)
    text = f"{type(e).__name__}: {e}".strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0]
    # Triton / Mosaic errors put the useful line after a generic first one.
    extra = next((ln for ln in lines[1:] if re.search(r"error|unsupported|not supported|must", ln, re.I)), "")
    return (head + (" ... " + extra if extra and extra not in head else ""))[:400]


class Table:
    def __init__(self, title: str, useful_flops: dict[str, float], device):
        self.title, self.useful, self.rows, self.device = title, useful_flops, [], device

    def compile(self, name: str, fn, args, verbose: bool) -> None:
        import jax

        start = time.time()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with jax.set_mesh(jax.sharding.Mesh([self.device], ("d",))):
                    compiled = jax.jit(fn).lower(*args).compile()
            costs = _costs(compiled)
            deprecated = sorted({"Pallas Triton backend deprecated" if "Triton backend" in str(w.message)
                                 else str(w.message).split(".")[0][:60] for w in caught
                                 if issubclass(w.category, DeprecationWarning) and "allas" in str(w.message)})
            kernels = _kernels(compiled.as_text()) + (" [deprecation: " + "; ".join(deprecated) + "]"
                                                      if deprecated else "")
            self.rows.append((name, kernels, *costs, time.time() - start, None))
        except Exception as e:  # a lowering or compile error is a result here
            if verbose:
                traceback.print_exc()
            self.rows.append((name, "", *(float("nan"),) * 5, time.time() - start, _error_line(e)))
        print(f"  compiled {name} ({time.time() - start:.0f}s)", file=sys.stderr, flush=True)

    def print(self) -> None:
        print(f"\n{self.title}")
        for label, flops in self.useful.items():
            print(f"  {label}: {_fmt(flops, 'FLOP')}")
        head = ("implementation", "XLA FLOPs", "XLA bytes", "hlo FLOPs", "hlo bytes", "temp", "compile",
                "kernels (custom calls) / error")
        width = max([len(r[0]) for r in self.rows] + [len(head[0])])
        print(f"  {head[0]:<{width}}" + "".join(f" {h:>10}" for h in head[1:7]) + f"  {head[7]}")
        for name, kernels, xf, xb, hf, hb, temp, seconds, error in self.rows:
            cells = (_fmt(xf, ""), _fmt(xb, "B"), _fmt(hf, ""), _fmt(hb, "B"), _fmt(temp, "B"), _fmt(seconds, "s"))
            print(f"  {name:<{width}}" + "".join(f" {c:>10}" for c in cells) + "  "
                  + (f"ERROR {error}" if error else kernels))


# ---------------------------------------------------------------------------------------------
# Target set-up


def _setup(target: str):
    """One compile-only device of the target (pacs_jax.topologies) and tokamax told it compiles for it
    (its device checks read the default device, which is this host's CPU)."""
    # The CUDA plugin checks its libraries against a driver this host lacks when JAX first lists its
    # backends (a crash, for a TPU compile too, without this).
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from pacs_jax import topologies

    device = topologies.abstract_devices(TARGETS[target])[0]
    import jax

    from absl import flags
    from tokamax._src import gpu_utils

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])
    flags.FLAGS.tokamax_cross_compile = True
    if target == "h200":
        gpu_utils._compute_capability = lambda device=None: 9.0  # H200: sm_90
    return device, jax


def _spec(jax, device, shape, dtype):
    mesh = jax.sharding.Mesh([device], ("d",))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


# ---------------------------------------------------------------------------------------------
# Case: training attention


def _attention(args, target, device, jax) -> Table:
    import jax.numpy as jnp

    from pacs_jax.models.attention import attention
    import tokamax
    from tokamax._src.ops.attention import api as tk_api, base as tk_base

    B, T, H, K, Dh, S = args.batch, args.tokens, args.heads, args.kv_heads, args.head_dim, args.sequences
    bf16 = jnp.bfloat16
    qs, kvs = _spec(jax, device, (B, T, H, Dh), bf16), _spec(jax, device, (B, T, K, Dh), bf16)
    rows = _spec(jax, device, (B, T), jnp.int32)  # padded: lengths come from kv_valid; packed: segment ids
    lens = _spec(jax, device, (B,), jnp.int32)
    per_pair = 4 * Dh * H * B * (1 if args.forward_only else 3.5)  # 2 dots fwd, 5 bwd (fa2), 2 FLOPs a MAC
    seq = T // S
    table = Table(f"attention fwd{'' if args.forward_only else '+bwd'}, bf16, causal: B={B} T={T} H={H} K={K} "
                  f"Dh={Dh}; packed rows: {S} sequences of {seq} a row ({target})",
                  {"useful FLOPs, causal full rows": per_pair * T * (T + 1) / 2,
                   "useful FLOPs, packed rows": per_pair * S * seq * (seq + 1) / 2}, device)

    def grad_of(f):
        def loss(q, k, v, *rest):
            return jnp.sum(f(q, k, v, *rest).astype(jnp.float32))
        if args.forward_only:
            return lambda *a: f(*a)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))

    ours = "cudnn" if target == "h200" else "splash"

    def ours_padded(q, k, v, ids):
        return attention(q, k, v, ids > 0, impl=ours)

    def ours_packed(q, k, v, ids):
        return attention(q, k, v, ids > 0, segment_ids=ids, impl=ours)

    def seg_start(ids):
        """[B, T] segment ids (each sequence one run) -> [B, T] index of each token's sequence start."""
        pos = jnp.arange(ids.shape[1])
        new = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
        return jax.lax.cummax(jnp.where(new, pos, 0), axis=1)

    def tk_padded(impl):
        def f(q, k, v, lengths):
            return tokamax.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                                 key_value_seq_lengths=lengths, implementation=impl)
        return f

    def tk_packed(name):
        impl = tk_api.IMPLEMENTATIONS[name]

        def f(q, k, v, ids):
            mask = tk_base.Mask(None, is_causal=True, k_start=seg_start(ids)[:, None, :])
            return impl(q, k, v, mask=mask, logits_scale=tk_base.AUTO, precision=None)
        return f

    def tk_dense_mask(impl):  # packed rows through tokamax's public API: a dense [B, 1, T, T] mask
        def f(q, k, v, ids):
            mask = (ids[:, None, :, None] == ids[:, None, None, :]) & (ids[:, None, None, :] > 0)
            return tokamax.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)
        return f

    impls = ["mosaic_gpu", "triton", "cudnn", "xla_chunked"] if target == "h200" else ["mosaic_tpu", "xla_chunked"]
    packed_name = "packed_gpu" if target == "h200" else "splash"
    cases = [(f"ours {ours} padded", ours_padded, rows), (f"ours {packed_name} packed", ours_packed, rows)]
    known = [n for n in impls if n in tk_api.IMPLEMENTATIONS]
    cases += [(f"tokamax {n} padded", tk_padded([tk_api.IMPLEMENTATIONS[n]]), lens) for n in known]
    cases += [(f"tokamax {n} packed k_start", tk_packed(n), rows) for n in known]
    if known:
        cases.append((f"tokamax {known[0]} packed dense mask", tk_dense_mask([tk_api.IMPLEMENTATIONS[known[0]]]), rows))
    for name, f, extra in cases:
        if _wanted(args, name):
            table.compile(name, grad_of(f), (qs, kvs, kvs, extra), args.verbose)
    return table


# ---------------------------------------------------------------------------------------------
# Case: MoE grouped matmul


def _ragged_dot(args, target, device, jax) -> Table:
    import jax.numpy as jnp

    import tokamax
    from tokamax._src.ops.ragged_dot import api as tk_api

    M, G, Kd, N = args.moe_tokens * args.top_k, args.experts, args.hidden, args.intermediate
    bf16 = jnp.bfloat16
    lhs, rhs = _spec(jax, device, (M, Kd), bf16), _spec(jax, device, (G, Kd, N), bf16)
    sizes = _spec(jax, device, (G,), jnp.int32)
    useful = 2 * M * Kd * N * (1 if args.forward_only else 3)
    table = Table(f"ragged_dot fwd{'' if args.forward_only else '+bwd'}, bf16: lhs [{M}, {Kd}] x rhs [{G}, {Kd}, {N}] "
                  f"({args.moe_tokens} tokens x top-{args.top_k}, {G} experts; {target})",
                  {"useful FLOPs (every row multiplies by its expert only)": useful,
                   "dense FLOPs (every row by every expert)": useful * G}, device)

    def grad_of(f):
        if args.forward_only:
            return f
        return jax.value_and_grad(lambda a, b, s: jnp.sum(f(a, b, s).astype(jnp.float32)), argnums=(0, 1))

    cases = [("jax.lax.ragged_dot", lambda a, b, s: jax.lax.ragged_dot(a, b, s))]
    names = ["mosaic_gpu", "triton", "xla"] if target == "h200" else ["mosaic_tpu", "mosaic_tpu_v2", "xla"]
    for name in names:
        impl = tk_api.IMPLEMENTATIONS.get(name)
        if impl is None:
            table.rows.append((f"tokamax {name}", "", *(float("nan"),) * 6, _why_missing(name)))
            continue
        cases.append((f"tokamax {name}", lambda a, b, s, impl=impl: tokamax.ragged_dot(
            a, b, s, implementation=[impl], bypass_device_check=True)))
    for name, f in cases:
        if _wanted(args, name):
            table.compile(name, grad_of(f), (lhs, rhs, sizes), args.verbose)
    return table


def _why_missing(name: str) -> str:
    """Why tokamax registered no ragged_dot implementation ``name`` (its module failed to import)."""
    import importlib

    try:
        importlib.import_module(f"tokamax._src.ops.ragged_dot.{name}")
    except Exception as e:  # noqa: BLE001  (the reason is the result)
        return f"not registered: importing it fails with {type(e).__name__}: {e}"
    return "not registered by tokamax.ragged_dot"


def _wanted(args, name: str) -> bool:
    return not args.only or any(s and s in name for s in args.only.split(","))


def main(argv=None) -> None:
    args = _parse(argv)
    device, jax = _setup(args.target)
    print(f"jax {jax.__version__}; target {args.target} ({TARGETS[args.target]}, one device: {device.device_kind})")
    for case in CASES if args.case == "all" else (args.case,):
        table = {"attention": _attention, "ragged_dot": _ragged_dot}[case](args, args.target, device, jax)
        table.print()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
