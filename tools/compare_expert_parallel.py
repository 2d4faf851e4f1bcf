"""A mixture-of-experts layer with and without expert parallelism, on the compiled program (compile-only, no chip).

Compiles the gradient of one Qwen3-MoE sparse block (models/moe.py; default Qwen3-30B-A3B's: hidden 2048, 128
experts of 768, 8 a token, bfloat16) for a slice (``--topology``, default a v5p-64 at the paper's mesh (1, 8, 4)),
``--tokens-per-shard`` tokens a batch shard (data x fsdp; its tensor devices share them), twice: every expert's weights gathered to each batch shard (the default),
and ``model.expert_parallel`` (the experts split over fsdp, tokens exchanged). Prints a row each: the dispatch the
kernels line names, the collectives' output bytes a device by kind, the temporary bytes a device
(``memory_analysis()``) and XLA's FLOPs (``cost_analysis()``: a ragged_dot's every row, so the worst case of a
dropless layer, not what a grouped kernel computes).

    python tools/compare_expert_parallel.py                 # Qwen3-30B-A3B's block on a v5p-64 (about 1 CPU minute)
    python tools/compare_expert_parallel.py --tokens-per-shard=8192
    python tools/compare_expert_parallel.py --topology=h200x8 --mesh=1,2,4   # with the GPU-compile venv

docs/design.md 4.8 and docs/measurements.md 8c have the figures.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

from pacs_jax import topologies

# a collective's result: an array, or a tuple (combined collectives; an async "-start"'s (operands, result))
_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(-start)?\(")
_ARRAY = re.compile(r"[a-z]+\d*\[[\d,]*\]")


def _result_bytes(shape: str, started: bool) -> float:
    """The bytes a collective delivers: its result array, every array of a combined collective's tuple, or the last
    element of an async start's (operands, result) tuple."""
    from pacs_jax.hlo_cost import array_bytes

    arrays = _ARRAY.findall(shape)
    if started and shape.startswith("(") and len(arrays) > 1:
        inner = shape[1:-1]
        last = inner[inner.rfind("(") + 1:] if inner.rstrip().endswith(")") else arrays[-1]
        return sum(array_bytes(a) for a in _ARRAY.findall(last))
    return sum(array_bytes(a) for a in arrays)


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5p-64", help="a name pacs_jax.topologies knows (v5p-64, h200x8, ...)")
    parser.add_argument("--mesh", default="1,8,4", help="data,fsdp,tensor (default the paper's qwen3_30b_a3b mesh)")
    parser.add_argument("--tokens-per-shard", type=int, default=2048, help="tokens a batch shard (data x fsdp)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--experts-per-token", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=768)
    return parser.parse_args(argv)


def compiled(args, expert_parallel: bool, devices) -> dict:
    """The block's gradient compiled on the mesh, with or without expert parallelism: its figures a device."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from pacs_jax import sharding
    from pacs_jax.models import kernels
    from pacs_jax.models.config import QwenConfig
    from pacs_jax.models.loading import abstract_model
    from pacs_jax.models.moe import MoE

    data, fsdp, tensor = (int(x) for x in args.mesh.split(","))
    cfg = QwenConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                     num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                     num_experts=args.experts, num_experts_per_tok=args.experts_per_token,
                     moe_intermediate_size=args.expert_width, dtype="bfloat16", expert_parallel=expert_parallel)
    mesh = sharding.make_mesh(data, fsdp, tensor, devices=devices[:data * fsdp * tensor])
    tokens = args.tokens_per_shard * data * fsdp
    kernels._CHOSEN.clear()
    with jax.set_mesh(mesh), sharding.tracing_device(mesh):
        graphdef, params = abstract_model(cfg, MoE)
        shape = (tokens, 1, args.hidden)
        x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding.batch_sharding(shape, mesh))

        def loss(params, x):
            return jnp.sum(nnx.merge(graphdef, params)(x).astype(jnp.float32) ** 2)

        program = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    moved = collections.Counter()
    for match in _COLLECTIVE.finditer(program.as_text()):
        moved[match.group(2)] += _result_bytes(match.group(1), bool(match.group(3)))
    dispatch = [c.impl for c in kernels.chosen() if c.op == "moe dispatch"]
    return dict(dispatch=dispatch[0] if dispatch else "", moved=moved,
                temp=program.memory_analysis().temp_size_in_bytes, flops=program.cost_analysis().get("flops", 0.0))


def main(argv=None) -> None:
    args = _args(sys.argv[1:] if argv is None else argv)
    devices = topologies.abstract_devices(args.topology)
    print(f"Qwen3-MoE block gradient (hidden {args.hidden}, {args.experts} experts of {args.expert_width}, "
          f"{args.experts_per_token} a token, bfloat16), {args.tokens_per_shard} tokens a batch shard, {args.topology} "
          f"mesh ({args.mesh}); MiB a device")
    rows = {ep: compiled(args, ep, devices) for ep in (False, True)}
    kinds = sorted({k for row in rows.values() for k in row["moved"]})
    print(f"{'expert_parallel':16s} {'collectives':>11s} " + " ".join(f"{k:>14s}" for k in kinds)
          + f" {'temp':>9s} {'TFLOP':>7s}  dispatch")
    for ep, row in rows.items():
        mib = {k: row["moved"][k] / 2**20 for k in kinds}
        print(f"{str(ep):16s} {sum(mib.values()):11.2f} " + " ".join(f"{mib[k]:14.2f}" for k in kinds)
              + f" {row['temp'] / 2**20:9.2f} {row['flops'] / 1e12:7.3f}  {row['dispatch']}")


if __name__ == "__main__":
    main()
