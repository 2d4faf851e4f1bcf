"""Qwen3-MoE's sparse block: a float32 router, the top-k experts a token, dropless dispatch through a
grouped matmul, and the routing it took (or was told to replay).

Shapes: N tokens (the caller's [..., D] flattened), D hidden, E experts, I an expert's SwiGLU width,
k experts a token (``num_experts_per_tok``), M = N k token-expert slots.

Per token, as transformers' ``Qwen3MoeSparseMoeBlock``: probabilities p = softmax(x W_router) over the E
experts (float32), the k largest chosen, their weights p renormalised to sum 1 when ``norm_topk_prob``;
each chosen expert's SwiGLU down(silu(gate(x)) * up(x)) weighted and summed. No capacity, no dropped
token, no noise.

Dispatch: the M slots sorted by expert (stable), each expert's rows one group of a grouped matmul
(models/kernels.py ``moe_gemm`` records the choice and its reason: ``jax.lax.ragged_dot``, XLA's grouped kernel on
TPU, the reference on the CPU; tokamax's Mosaic GPU kernel on a GPU, models/moe_gemm_gpu.py), the outputs put back
in slot order and summed over k in float32. Expert parallelism (``local_dispatch``): the experts split over
"fsdp", each device applies its own to its data shard's tokens, gathered, and hands the sums back to theirs.

Routing replay (R3): given ``routed`` [N, k], the experts a token uses are those, not the top k of this
router, with the weights read from this router's own probabilities at them (so gradients reach the
router); renormalised as the native routing is.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.models import kernels, moe_gemm_gpu
from pacs_jax.models.config import QwenConfig
from pacs_jax.models.params import make_param
from jax.sharding import PartitionSpec

from pacs_jax.sharding import current_rules, platform


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")  # train.router_replay: verl's router_replay.mode


def routing_dtype(num_experts: int) -> jnp.dtype:
    """The dtype of a routing record (the experts of every token in every layer): uint8 up to 256 experts
    (Qwen3-30B-A3B's 48 layers x 8: 384 bytes a token), int16 past."""
    return jnp.dtype(jnp.uint8 if num_experts <= 256 else jnp.int16)


def routing_shape(cfg: QwenConfig) -> tuple[int, int]:
    """A token's routing record: (sparse layers, experts a token), [L, k] (a model's dense layers route nothing)."""
    return sum(map(cfg.sparse_layer, range(cfg.num_hidden_layers))), cfg.num_experts_per_tok


def route(logits: jax.Array, k: int, norm_topk_prob: bool,
          routed: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] float32 -> (weights [N, k] float32, experts [N, k] int32): the top k of
    softmax(logits) (ties to the lower expert), or the experts ``routed`` [N, k] when given (replay),
    their probabilities renormalised to sum 1 when ``norm_topk_prob``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if routed is None:
        weights, experts = jax.lax.top_k(probs, k)
    else:
        experts = routed
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def load_balance_sums(logits: jax.Array, chosen: jax.Array, mask: jax.Array) -> jax.Array:
    """A layer's share of transformers' ``load_balancing_loss_func``: router logits [N, E], the router's own top k
    [N, k] int32 and mask [N] (1 on the real tokens) -> [2, E] float32: the real tokens routed to each expert (no
    gradient) and their summed softmax probabilities (whose gradient reaches the router). ``load_balance_loss``
    turns the layers' sums into the loss."""
    mask = mask.astype(jnp.float32)
    routed = jnp.sum(jax.nn.one_hot(chosen, logits.shape[-1], dtype=jnp.float32), axis=1)   # [N, E]: 0 or 1
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.stack([jax.lax.stop_gradient(mask @ routed), mask @ probs])


def load_balance_loss(sums: jax.Array, tokens: jax.Array) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` (Switch Transformer's, eqs. 4-6, pooled over the sparse layers as
    HF pools them): sums [L, 2, E] (``load_balance_sums`` of L sparse layers), tokens [] the real tokens ->
    E sum_e f_e P_e, f_e the share of the L x tokens (token, layer) pairs that routed to expert e (summing to k),
    P_e the mean probability of e over them (k when the experts share the tokens evenly). float32 []."""
    pairs = sums.shape[0] * jnp.maximum(tokens.astype(jnp.float32), 1.0)
    total = jnp.sum(sums, axis=0) / pairs  # [2, E]
    return sums.shape[-1] * jnp.sum(total[0] * total[1])


class LowRank(NamedTuple):
    """One experts' weight's LoRA pair: A [E, in, r], B [E, r, out...] (each expert's own)."""

    a: jax.Array
    b: jax.Array


class ExpertLoRA(NamedTuple):
    """The experts' adapters a sparse block runs with (``ExpertAdapter``'s arrays): the fused gate and up
    projection's (B [E, r, I, 2]) and the down projection's (B [E, r, D]), None where not adapted."""

    gate_up: LowRank | None = None
    down: LowRank | None = None


def grouped_swiglu(x: jax.Array, experts: jax.Array, gates: jax.Array, gate: jax.Array, up: jax.Array,
                   down: jax.Array, adapters: ExpertLoRA | None = None, first: jax.Array | int = 0,
                   scale: float = 1.0) -> jax.Array:
    """The gated sum of each token's expert SwiGLUs over the experts held here: x [N, D] (compute dtype),
    experts [N, k] int32 (0 .. E - 1), gates [N, k] float32; gate / up [E_h, D, I], down [E_h, I, D] (cast to x's
    dtype): the E_h experts ``first`` .. ``first`` + E_h - 1 (``first`` the int 0 when all E are held here, an int32
    [] array when this device holds a share) -> [N, D] float32,
    sum_j gates[n, j] down(silu(gate x[n]) * up x[n]) of expert experts[n, j] over the slots (n, j) whose expert
    is held here (the others add 0: another device holds theirs, ``local_dispatch``).

    ``adapters``: the experts' LoRA (``ExpertLoRA``: gate_up A [E_h, D, r], B [E_h, r, I, 2]; down A [E_h, I, r],
    B [E_h, r, D]), either or both: a projection's output gains ``scale`` (h A) B of the
    row's expert, two more grouped matmuls each (PEFT's ParamWrapper computes h (W + scale A B), the same sum).

    The slots are sorted by expert for the grouped matmul (``kernels.moe_gemm``: tokamax's on a GPU, whose products
    come back in the compute dtype; ``jax.lax.ragged_dot`` in float32 elsewhere), the slots of experts held
    elsewhere after the last group, and put back in slot order after. With experts held elsewhere, the rows past the
    last group (no group's: tokamax's kernel takes group sizes summing to M) are zeroed before each product, so that
    nothing a kernel leaves there, forward or backward, reaches a token or its gradient."""
    choice = kernels.moe_gemm(platform(), x.dtype)
    n, k = experts.shape
    held = gate.shape[0]
    local = experts - first
    here = (local >= 0) & (local < held)                            # [N, k]
    flat = jnp.where(here, local, held).reshape(-1)                 # held elsewhere: one bucket past the last
    order = jnp.argsort(flat, stable=True)                          # [M] slots grouped by expert
    group_sizes = jnp.bincount(flat, length=held + 1)[:held].astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)                          # [M, D]
    if isinstance(first, int):  # every expert held here: the groups cover every row
        def owned(a):
            return a
    else:
        grouped = jnp.arange(flat.shape[0]) < jnp.sum(group_sizes)  # [M]: the rows of this device's experts

        def owned(a):
            return jnp.where(grouped[:, None], a, jnp.zeros((), a.dtype))
    rows = owned(rows)
    if choice.impl == "tokamax mosaic_gpu":
        dot = functools.partial(moe_gemm_gpu.ragged_dot, group_sizes=group_sizes)
    else:
        dot = functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes, preferred_element_type=jnp.float32)
    adapters = adapters or ExpertLoRA()

    def low_rank(h, pair: LowRank):  # scale (h A) B of each row's expert, [M, ...out] in x's dtype, as the dense Adapter's
        a, b = pair
        narrow = owned(dot(h, a.astype(x.dtype)).astype(x.dtype))   # [M, r]
        wide = dot(narrow, b.reshape(b.shape[0], b.shape[1], -1).astype(x.dtype)).astype(x.dtype)
        return (wide * jnp.asarray(scale, x.dtype)).reshape(h.shape[0], *b.shape[2:])

    g = dot(rows, gate.astype(x.dtype))
    u = dot(rows, up.astype(x.dtype))
    if adapters.gate_up is not None:  # added in float32 before the rounding
        lora = low_rank(rows, adapters.gate_up)                            # [M, I, 2]
        g, u = g.astype(jnp.float32) + lora[..., 0], u.astype(jnp.float32) + lora[..., 1]
    g, u = g.astype(x.dtype), u.astype(x.dtype)
    # SwiGLU in float32, rounded to the compute dtype (as the dense MLP)
    h = owned((jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype))
    out = dot(h, down.astype(x.dtype)).astype(jnp.float32)          # [M, D], sorted
    if adapters.down is not None:
        out = out + low_rank(h, adapters.down)
    slots = jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(n, k, -1)
    # rows past the last group are no group's: whatever a kernel leaves there is dropped, not weighted by 0
    slots = jnp.where(here[..., None], slots, 0.0)
    return jnp.einsum("nkd,nk->nd", slots, gates)


def local_dispatch(fn, expert_parallel: bool = False):
    """``fn(x [N, D], experts [N, k], gates [N, k], gate, up, down, adapters, first) -> [N, D]`` (``grouped_swiglu``,
    ``adapters`` the experts' LoRA or None, split as their weights) run on each
    batch shard's own tokens: under ``shard_map`` manual over the batch axes of the mesh in context (those not manual
    already: the sampler's queues), the tokens split. Left to GSPMD, the sort of the slots gathered every token to
    every device (a v5p-64 prefill of 1024 prompts needed 114.6 GiB). Without such axes, or tokens they do not
    divide, ``fn`` itself, every expert held.

    The experts: with ``expert_parallel`` (``model.expert_parallel``), split over the mesh axes of the "experts" rule
    (sharding.LOGICAL_RULES: "fsdp") when those split the tokens too: each device holds E / F experts whole, the
    tokens of the other shards of those axes are all-gathered to it, it computes its experts' slots of all of them,
    and the partial sums are reduce-scattered back to each token's shard. Its buffers are sized for the worst case
    of a dropless layer, every gathered slot routed to this device's experts: [F N k, D] where the experts' own
    rows are N k / F on average (the compiled FLOPs count them all, docs/design.md 4.8). Otherwise every shard holds
    every expert (gathered, as FSDP gathers a dense layer's weights). Their width is split over "tensor": manual
    over that axis too whenever the tokens are split (and under tokamax's GPU kernel always), each device's slice of
    gate / up [E, D, I / t] and down [E, I / t, D], its partial sums added over the axis once a token's k slots are
    summed (and reduce-scattered): left to GSPMD, the down projection's [slots, D] partials were all-reduced
    (Qwen3-30B-A3B's gradient on a v5p-64: 833 against 609 MiB a device), and under tokamax's Pallas call, which
    GSPMD cannot split, the weights were gathered whole to every device and their gradients came back whole."""
    rules = current_rules()
    mesh = rules.mesh
    manual = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual}
    axes = tuple(a for a in rules.batch_axes() if a not in manual)
    shards = math.prod(mesh.shape[a] for a in axes)
    width = tuple(a for a in dict(rules.rules)["expert_mlp"] if a not in manual and mesh.shape[a] > 1)
    over = tuple(a for a in dict(rules.rules)["experts"] if a not in manual and mesh.shape[a] > 1) \
        if expert_parallel else ()

    def run(x, experts, gates, gate, up, down, adapters=None):
        tokens = axes if axes and not x.shape[0] % shards else ()
        ep = over if over and set(over) <= set(tokens) else ()
        kernels.moe_dispatch(x.shape[0], shards, axes, ep, gate.shape[0] // math.prod(mesh.shape[a] for a in ep),
                             queued=any(a in manual for a in rules.batch_axes()))
        split = width if tokens or kernels.moe_gemm(platform(), x.dtype).impl == "tokamax mosaic_gpu" else ()
        if not tokens and not split:
            return fn(x, experts, gates, gate, up, down, adapters)
        rows, t, e = PartitionSpec(tokens or None), (width or None) if split else None, ep or None

        def body(x, experts, gates, gate, up, down, adapters):
            first = 0
            if ep:  # the tokens of every shard over the experts' axes, each device's experts applied to them
                x, experts, gates = (jax.lax.all_gather(a, ep, axis=0, tiled=True) for a in (x, experts, gates))
                first = jax.lax.axis_index(ep) * gate.shape[0]
            out = fn(x, experts, gates, gate, up, down, adapters, first)  # [N, D] (the gathered N), partial over its width
            if ep:
                out = jax.lax.psum_scatter(out, ep, scatter_dimension=0, tiled=True)  # each shard's own tokens
            return jax.lax.psum(out, t) if split else out

        # the adapters as their weights: gate_up's B [E, r, I, 2] split on I, down's A [E, I, r] on I (its (h A)
        # partial over the width, summed with the rest by the psum), the other factors whole
        adapted = adapters or ExpertLoRA()
        lora = ExpertLoRA(
            gate_up=None if adapted.gate_up is None else LowRank(PartitionSpec(e, None, None), PartitionSpec(e, None, t, None)),
            down=None if adapted.down is None else LowRank(PartitionSpec(e, t, None), PartitionSpec(e, None, None)))
        specs = (rows, rows, rows, PartitionSpec(e, None, t), PartitionSpec(e, None, t), PartitionSpec(e, t, None),
                 lora)
        # manual over the mesh's axes of size 1 too: left auto, JAX 0.12 put a sharding annotation inside the
        # reduction of the input's cotangent psum over "tensor" (bfloat16), which XLA:CPU's all-reduce promotion
        # aborts on ("Invalid binary instruction opcode copy"); a size-1 axis splits nothing either way
        single = {a for a in mesh.axis_names if mesh.shape[a] == 1 and a not in manual}
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=rows,
                             axis_names=set(tokens) | set(width if split else ()) | single, check_vma=False)(
            x, experts, gates, gate, up, down, adapted)

    return run


class ExpertAdapter(nnx.Module):
    """A LoRA adapter of one of the experts' weights (models/lora.py; PEFT's ``target_parameters``): each expert's
    own A [E, in, r] and B [E, r, out...] (stacked: [L, ...]), logical axes those of the weight on their shared
    dims (r is not split), applied inside the grouped matmuls (``grouped_swiglu``'s ``adapters``); scale
    alpha / r. A starts uniform in +-1 / sqrt(in) (PEFT's per-expert fan-in), B at 0."""

    def __init__(self, cfg: QwenConfig, experts: str | None, in_dim: tuple[int, str], out_dims, rngs: nnx.Rngs,
                 layers: int | None):
        r, E = cfg.lora_rank, cfg.num_experts
        out_shape, out_axes = zip(*out_dims)
        param = functools.partial(make_param, rngs, dtype=cfg.param_dtype, layers=layers, kind=nnx.LoRAParam)
        self.a = param((E, in_dim[0], r), (experts, in_dim[1], None), init="expert_lora_a", lora_factor="a")
        self.b = param((E, r, *out_shape), (experts, None, *out_axes), init="zeros", lora_factor="b")


def expert_adapter(cfg: QwenConfig, parameter: str, experts: str | None, in_dim, out_dims, rngs: nnx.Rngs,
                   layers: int | None) -> ExpertAdapter | None:
    """The adapter of the experts' ``parameter`` (config.LORA_EXPERT_PARAMETERS' name) when cfg targets it, else None."""
    return ExpertAdapter(cfg, experts, in_dim, out_dims, rngs, layers) if parameter in cfg.lora_targets else None


class MoE(nnx.Module):
    """The sparse block of a Qwen3-MoE layer: [..., D] -> [..., D] (and the experts used, [..., k] int32).

    Parameters (stacked [L, ...] when built with ``layers=L``): ``router_kernel`` [D, E],
    ``gate_kernel`` / ``up_kernel`` [E, D, I], ``down_kernel`` [E, I, D] (HF's ``mlp.gate.weight`` and
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``, transposed); with LoRA on the experts (``lora_targets``
    "mlp.experts.gate_up_proj", "mlp.experts.down_proj"), ``gate_up_lora`` (A [E, D, r], B [E, r, I, 2]: column i of
    the gate's and of the up projection's side by side, so that B's [I, 2] flattens with I split over "tensor" as
    the weights' and the decode layout's GSPMD program gathers none of it; transformers fuses them [gate; up]) and
    ``down_lora`` (A [E, I, r], B [E, r, D])."""

    def __init__(self, cfg: QwenConfig, rngs: nnx.Rngs, layers: int | None = None):
        D, E, I, pd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.param_dtype
        param = functools.partial(make_param, rngs, dtype=pd, layers=layers)
        self.cfg = cfg
        experts = "experts" if cfg.expert_parallel else None  # split over fsdp, or each expert's input over it
        self.router_kernel = param((D, E), ("embed", None))
        self.gate_kernel = param((E, D, I), (experts, "embed", "expert_mlp"))
        self.up_kernel = param((E, D, I), (experts, "embed", "expert_mlp"))
        self.down_kernel = param((E, I, D), (experts, "expert_mlp", "embed"))
        self.gate_up_lora = expert_adapter(cfg, "mlp.experts.gate_up_proj", experts, (D, "embed"),
                                           ((I, "expert_mlp"), (2, None)), rngs, layers)
        self.down_lora = expert_adapter(cfg, "mlp.experts.down_proj", experts, (I, "expert_mlp"), ((D, "embed"),),
                                        rngs, layers)

    def __call__(self, x: jax.Array, routed: jax.Array | None = None, with_experts: bool = False,
                 balance_mask: jax.Array | None = None):
        """x [..., D] in the compute dtype; ``routed`` None or [..., k] int (the experts to replay) -> the
        block's output [..., D] in x's dtype, and with ``with_experts`` the experts this router chooses, its
        own top k [..., k] int32 (those it ran on unless ``routed``: a routing record is the router's choice).
        With ``balance_mask`` [...] (1 on the real tokens), also its router's load-balancing sums over them
        (``load_balance_sums``), last."""
        cfg = self.cfg
        k = cfg.num_experts_per_tok
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        logits = jnp.einsum("nd,de->ne", flat.astype(jnp.float32), self.router_kernel[...].astype(jnp.float32))
        replay = None if routed is None else routed.reshape(-1, k)
        weights, experts = route(logits, k, cfg.norm_topk_prob, replay)
        pair = lambda adapter: None if adapter is None else LowRank(adapter.a[...], adapter.b[...])  # noqa: E731
        adapted = self.gate_up_lora is not None or self.down_lora is not None
        adapters = ExpertLoRA(pair(self.gate_up_lora), pair(self.down_lora)) if adapted else None
        swiglu = functools.partial(grouped_swiglu, scale=cfg.lora_alpha / cfg.lora_rank) if adapters else grouped_swiglu
        out = local_dispatch(swiglu, cfg.expert_parallel)(flat, experts, weights, self.gate_kernel[...],
                                                          self.up_kernel[...], self.down_kernel[...], adapters)
        out = out.astype(x.dtype).reshape(*lead, -1)
        if not with_experts and balance_mask is None:
            return out
        chosen = experts if replay is None else route(logits, k, cfg.norm_topk_prob)[1]  # the router's own top k
        outs = (out,) + ((jax.lax.stop_gradient(chosen).reshape(*lead, k),) if with_experts else ())
        if balance_mask is not None:
            outs += (load_balance_sums(logits, chosen, balance_mask.reshape(-1)),)
        return outs
