"""The Qwen2 / Qwen2.5 / Qwen3 decoder in Flax NNX, top to bottom.

Shapes: B batch, T query length, S key length (= T without a cache, the cache length with one),
D hidden, H query heads, K key/value heads, Dh head dim, F MLP width, V vocabulary, L layers.

Every parameter is an ``nnx.Param`` with ``logical_axes`` metadata (see pacs_jax/sharding.py).
Parameters are stored in ``config.param_dtype`` and cast to ``config.dtype`` for compute; norms,
softmax and logits run in float32.

The decoder stack is one ``jax.lax.scan`` over layers: every per-layer parameter is stacked along a
leading "layers" axis ([L, ...]), so the program (and its compile time) does not grow with depth (a
Qwen3-MoE with dense layers among its sparse ones: a stack and a scan a run of one kind, ``layer_stacks``).
Training applies the remat policy (``config.remat``) to the scanned body; prefill and decode never
do (remat belongs to the gradient computation). The KV cache is stacked the same way, [L, B, K, S, Dh],
and carried through the scan so each layer writes its new keys in place. The sampler's decode layout
(sampling/engine.py) may hold the layers' parameters a buffer a layer instead (``unstack_layers``):
the cached forward (prefill, decode) then runs the layers unrolled, each reading its own buffers in
place, where XLA:GPU copies a scan's slice of a stack out for each gemm inside a decode loop.

Attention (pacs_jax/models/attention.py) never builds a [B, H, T, T] buffer: causal blockwise
attention over the call's own tokens in training and prefill (a call with a cache starts at slot 0:
prefill), and, in decode, attention over the filled slots of the cache only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.models.attention import attention, decode_attention, resolve_impl
from pacs_jax.models.config import QwenConfig, layer_stacks
from pacs_jax.models import kernels
from pacs_jax.models.moe import MoE, load_balance_loss
from pacs_jax.models.params import SavedParam, make_param
from pacs_jax.models.paged_attention import PageView, paged_decode_attention, write as write_pages
from pacs_jax.sharding import constrain, platform

_REMAT_POLICIES = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class KVCache(NamedTuple):
    """Key/value buffers of all layers, each [L, B, K, S, Dh] in the compute dtype: slots and head dim
    innermost, so TPU tiles them without padding a size-1 head axis (a head sharded over "tensor")."""

    k: jax.Array
    v: jax.Array


CACHE_AXES = ("layers", "batch", "act_kv_heads", "cache_length", None)


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) * scale, computed in float32: [..., N] -> [..., N]."""

    def __init__(self, size: int, eps: float, param_dtype, logical_axis: str, rngs: nnx.Rngs,
                 layers: int | None = None, kind: type[nnx.Param] = nnx.Param):
        self.eps = eps
        self.scale = make_param(rngs, (size,), (logical_axis,), param_dtype, init="ones", layers=layers, kind=kind)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (rotate-half form): x [B, T, N, Dh], positions [B, T] -> [B, T, N, Dh]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Adapter(nnx.Module):
    """A LoRA adapter of one linear layer (models/lora.py): x [..., in...] -> scale (x A) B [..., out...],
    A [in..., r] and B [r, out...] (stacked: [L, ...]), logical axes those of the layer's kernel on its in
    and out dims; scale = alpha / r."""

    def __init__(self, cfg: QwenConfig, in_dims: tuple[tuple[int, str], ...], out_dims: tuple[tuple[int, str], ...],
                 rngs: nnx.Rngs, layers: int | None):
        r, pd = cfg.lora_rank, cfg.param_dtype
        (in_shape, in_axes), (out_shape, out_axes) = zip(*in_dims), zip(*out_dims)
        param = functools.partial(make_param, rngs, dtype=pd, layers=layers, kind=nnx.LoRAParam)
        self.a = param((*in_shape, r), (*in_axes, None), init="lora_a", lora_factor="a")
        self.b = param((r, *out_shape), (None, *out_axes), init="zeros", lora_factor="b")
        self.scale = cfg.lora_alpha / r
        letters = "ijk"[:len(in_shape)], "opq"[:len(out_shape)]
        self.specs = (f"...{letters[0]},{letters[0]}r->...r", f"...r,r{letters[1]}->...{letters[1]}")

    def __call__(self, x: jax.Array) -> jax.Array:
        down = constrain(_dot_rounded(self.specs[0], x, self.a[...]), ("batch", "length", None))  # [B, T, r]
        return _dot_rounded(self.specs[1], down, self.b[...]) * jnp.asarray(self.scale, x.dtype)


def param_kind(cfg: QwenConfig, module: str) -> type[nnx.Param]:
    """The variable type of module ``module``'s parameters (config.SAVED_MODULES' names): ``SavedParam`` when a
    LoRA run trains it whole (QwenConfig ``saved_modules``), else ``nnx.Param``."""
    return SavedParam if module in cfg.saved_modules else nnx.Param


def adapter(cfg: QwenConfig, name: str, in_dims, out_dims, rngs: nnx.Rngs, layers: int | None) -> Adapter | None:
    """The adapter of module ``name`` (PEFT's name: "q_proj", ...) when cfg targets it, else None."""
    return Adapter(cfg, in_dims, out_dims, rngs, layers) if name in cfg.lora_targets else None


class Attention(nnx.Module):
    """Grouped-query attention with rotary embeddings (+ q/k biases or q/k RMSNorm per head)."""

    def __init__(self, cfg: QwenConfig, rngs: nnx.Rngs, layers: int | None = None):
        D, H, K, Dh, pd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.param_dtype
        self.cfg = cfg
        param = functools.partial(make_param, rngs, dtype=pd, layers=layers)
        self.q_kernel = param((D, H, Dh), ("embed", "heads", "head_dim"))
        self.k_kernel = param((D, K, Dh), ("embed", "kv_heads", "head_dim"))
        self.v_kernel = param((D, K, Dh), ("embed", "kv_heads", "head_dim"))
        self.o_kernel = param((H, Dh, D), ("heads", "head_dim", "embed"))
        embed, heads, kv = ((D, "embed"),), ((H, "heads"), (Dh, "head_dim")), ((K, "kv_heads"), (Dh, "head_dim"))
        self.q_lora = adapter(cfg, "q_proj", embed, heads, rngs, layers)
        self.k_lora = adapter(cfg, "k_proj", embed, kv, rngs, layers)
        self.v_lora = adapter(cfg, "v_proj", embed, kv, rngs, layers)
        self.o_lora = adapter(cfg, "o_proj", heads, embed, rngs, layers)
        if cfg.attention_bias:
            self.q_bias = param((H, Dh), ("heads", "head_dim"), init="zeros")
            self.k_bias = param((K, Dh), ("kv_heads", "head_dim"), init="zeros")
            self.v_bias = param((K, Dh), ("kv_heads", "head_dim"), init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps, pd, "head_dim", rngs, layers, param_kind(cfg, "q_norm"))
            self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps, pd, "head_dim", rngs, layers, param_kind(cfg, "k_norm"))

    def _project(self, x, kernel, bias_name, lora: Adapter | None):
        out = _dot_rounded("btd,dnh->btnh", x, kernel[...])
        if lora is not None:
            out = out + lora(x)
        if self.cfg.attention_bias:
            out = out + getattr(self, bias_name)[...].astype(x.dtype)
        return out

    def __call__(self, x, positions, kv_valid, cache, cache_index, segment_ids=None):
        """x [B, T, D], positions [B, T], kv_valid [B, S] bool (S = T without a cache); segment_ids
        None or [B, T] int32 (packed rows, no cache: attention within a segment only).

        cache: None, or (k, v, layer): the stacked caches [L, B, K, S, Dh] and this layer's index;
        the call's keys go into slots cache_index .. cache_index + T - 1 of row ``layer``; in decode
        (T = 1) cache_index may be [B], each row's own slot, and the caches may hold more than B rows
        (a sampler's narrowed decode batch): the call's rows are their first B. Paged decode (T = 1,
        cache_index a ``PageView``): the caches are the page pools [K, L, N, s, Dh]
        (models/paged_attention.py) and kv_valid is not read.
        Returns (out [B, T, D], the updated (k, v) caches, or None without a cache).
        """
        cfg = self.cfg
        q = self._project(x, self.q_kernel, "q_bias", self.q_lora)  # [B, T, H, Dh]
        k = self._project(x, self.k_kernel, "k_bias", self.k_lora)  # [B, T, K, Dh]
        v = self._project(x, self.v_kernel, "v_bias", self.v_lora)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary(q, positions, cfg.rope_theta)
        k = rotary(k, positions, cfg.rope_theta)
        q = constrain(q, ("batch", "length", "act_heads", None))
        new_cache = None
        decode = cache is not None and q.shape[1] == 1
        paged = isinstance(cache_index, PageView)
        if paged:  # paged decode: this token into its page, then attention over the live pages
            k_pool, v_pool, layer = cache
            new_cache = tuple(write_pages(pool, y.astype(pool.dtype), layer, cache_index)
                              for pool, y in ((k_pool, k), (v_pool, v)))
            choice = kernels.paged_decode(resolve_impl(cfg.attention, platform()), head_dim=q.shape[-1],
                                          page_size=k_pool.shape[3], dtype=q.dtype)
            out = paged_decode_attention(q, *new_cache, layer, cache_index, impl=choice.impl)
        elif cache is not None:
            k_cache, v_cache, layer = cache
            write = _write_rows if decode else _write_prefill
            k_cache = write(k_cache, k.astype(k_cache.dtype), layer, cache_index)
            v_cache = write(v_cache, v.astype(v_cache.dtype), layer, cache_index)
            new_cache = (constrain(k_cache, CACHE_AXES), constrain(v_cache, CACHE_AXES))
        if decode and not paged:  # the filled slots of this layer's cache, up to each row's own; its first B rows
            layer_kv = [jax.lax.dynamic_index_in_dim(c, layer, keepdims=False)[:q.shape[0]].astype(q.dtype)
                        for c in new_cache]
            out = decode_attention(q, *layer_kv, kv_valid, cache_index + 1, block_size=cfg.attention_block_size)
        elif not decode:  # training, log-probs, prefill (from slot 0): the call's own tokens, causal
            out = attention(q, k, v, kv_valid[:, :q.shape[1]], segment_ids=segment_ids,
                            impl=resolve_impl(cfg.attention, platform()),
                            block_size=cfg.attention_block_size)  # [B, T, H, Dh]
        attended = out
        out = _dot_rounded("btnh,nhd->btd", attended, self.o_kernel[...])
        if self.o_lora is not None:
            out = out + self.o_lora(attended)
        return out, new_cache


def _write_prefill(cache: jax.Array, x: jax.Array, layer: jax.Array, start) -> jax.Array:
    """cache [L, B, K, S, Dh] <- x [B, T, K, Dh] at layer ``layer``, slots start .. start + T - 1."""
    return jax.lax.dynamic_update_slice(cache, jnp.swapaxes(x, 1, 2)[None], (layer, 0, 0, start, 0))


def _write_rows(cache: jax.Array, x: jax.Array, layer: jax.Array, slots) -> jax.Array:
    """cache [L, B, K, S, Dh] <- x [B, 1, K, Dh] at layer ``layer``, row b at slot slots[b] ([] or [B]
    int32: each row of a continuous-batching sampler writes at its own slot). One scatter, in place
    in the decode loop (slots are in range: the sampler never writes past S)."""
    rows = jnp.arange(x.shape[0])
    slots = jnp.broadcast_to(jnp.asarray(slots, jnp.int32), rows.shape)
    return cache.at[layer, rows, :, slots].set(x[:, 0], mode="promise_in_bounds")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _dot_rounded(spec: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``einsum(spec, x, kernel cast to x's dtype)`` accumulated in float32 and returned in x's dtype;
    ``kernel`` is the parameter as stored (the float32 master under mixed precision). Off the CPU a dot
    of x's dtype, so the gemm writes that dtype and the remat policy saves it so (a float32 dot rounded
    after it is written, and saved, in float32: XLA may keep the excess precision). On CPU the float32
    dot rounded, XLA:CPU's fast path (bf16 x bf16 -> f32; the same values but for the summation order).
    Its derivative (``_dot_rounded_jvp``) is float32 dots rounded after, the kernel's taken against the
    stored parameter itself: its gradient is the float32 dot's output, never rounded to x's dtype, so
    the sums of its shards across devices are float32 on every target (cast outside, the gradient of
    the bfloat16 copy was bfloat16, and XLA:TPU summed the shards before casting it back)."""
    return _rounded(spec, x, kernel)


def _rounded(spec: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``_dot_rounded``'s value (a plain function: its dot is traced where the remat policy sees it)."""
    preferred = jnp.float32 if platform() == "cpu" else x.dtype
    return jnp.einsum(spec, x, kernel.astype(x.dtype), preferred_element_type=preferred).astype(x.dtype)


@_dot_rounded.defjvp
def _dot_rounded_jvp(spec: str, primals, tangents):
    """The primal as ``_dot_rounded`` computes it (its dot is what the remat policy sees and saves); the
    tangent float32 dots rounded after, the kernel's tangent in the stored parameter's dtype (their
    transposes: the gradients' float32 dots, the kernel's kept in its own dtype)."""
    (x, kernel), (dx, dkernel) = primals, tangents
    out = _rounded(spec, x, kernel)
    dot = functools.partial(jnp.einsum, spec, preferred_element_type=jnp.float32)
    return out, (dot(dx, kernel.astype(x.dtype)) + _mixed_dot(spec, x, dkernel)).astype(x.dtype)


def _mixed_dot(spec: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``einsum(spec, x, kernel)`` in float32 without casting either operand to the other's dtype (a
    bfloat16 x against a float32 kernel: ``jnp.einsum`` would promote x), so that its transpose with
    respect to ``kernel`` returns ``kernel``'s dtype straight from the dot."""
    return jnp.einsum(spec, x, kernel, preferred_element_type=jnp.float32, _dot_general=_dot_general_mixed)


def _dot_general_mixed(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), [B, T, D] -> [B, T, D]."""

    def __init__(self, cfg: QwenConfig, rngs: nnx.Rngs, layers: int | None = None):
        D, F, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        param = functools.partial(make_param, rngs, dtype=pd, layers=layers)
        self.gate_kernel = param((D, F), ("embed", "mlp"))
        self.up_kernel = param((D, F), ("embed", "mlp"))
        self.down_kernel = param((F, D), ("mlp", "embed"))
        embed, mlp = ((D, "embed"),), ((F, "mlp"),)
        self.gate_lora = adapter(cfg, "gate_proj", embed, mlp, rngs, layers)
        self.up_lora = adapter(cfg, "up_proj", embed, mlp, rngs, layers)
        self.down_lora = adapter(cfg, "down_proj", mlp, embed, rngs, layers)

    def _linear(self, spec: str, x, kernel, lora: Adapter | None):
        out = _dot_rounded(spec, x, kernel[...])
        return out if lora is None else out + lora(x)

    def __call__(self, x):
        # gate and up rounded to the compute dtype, SwiGLU in float32 (vLLM's silu_and_mul; transformers
        # in bfloat16 rounds them too): their gemms write [B, T, F] in bfloat16, not float32 (issue 52)
        gate = self._linear("...d,df->...f", x, self.gate_kernel, self.gate_lora)
        up = self._linear("...d,df->...f", x, self.up_kernel, self.up_lora)
        h = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
        h = constrain(h.astype(x.dtype), ("batch", "length", "act_mlp"))
        return self._linear("...f,fd->...d", h, self.down_kernel, self.down_lora)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)) (a SwiGLU MLP, or with ``sparse`` a
    Qwen3-MoE sparse block: models/moe.py).

    Built with ``layers=L`` it holds the stacked parameters of L layers ([L, ...] each); the
    scanned stack (``Qwen.forward``) runs it on one layer's slice at a time.
    """

    def __init__(self, cfg: QwenConfig, rngs: nnx.Rngs, layers: int | None = None, sparse: bool = False):
        norm = functools.partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, "norm", rngs, layers)
        self.input_norm = norm(param_kind(cfg, "input_norm"))
        self.attn = Attention(cfg, rngs, layers)
        self.post_attn_norm = norm(param_kind(cfg, "post_attn_norm"))
        self.mlp = MoE(cfg, rngs, layers) if sparse else MLP(cfg, rngs, layers)

    def __call__(self, x, positions, kv_valid, cache, cache_index, segment_ids=None, routed=None, balance=False):
        """The layer on x [B, T, D] (the attention's arguments: ``Attention.__call__``); routed None or
        [B, T, k] int, the experts to replay (a sparse layer). Returns (x [B, T, D], the updated cache,
        the experts its router chose for each token [B, T, k] int32, None in a dense layer), and with ``balance``
        (a sparse layer without a cache: kv_valid [B, T] marks the real tokens) its router's load-balancing sums
        [2, E] (``moe.load_balance_sums``) last."""
        attn_out, cache = self.attn(self.input_norm(x), positions, kv_valid, cache, cache_index, segment_ids)
        x = x + attn_out
        if cache is not None and x.shape[1] == 1 and resolve_impl(self.attn.cfg.attention) == "cudnn":
            # a GPU decode step: the residual written once; XLA:GPU summed the o gemm's split-K partials
            # in both its readers (0.13 GB a step on issue 52's H200 run; XLA:TPU fuses it better without)
            x = jax.lax.optimization_barrier(x)
        sums = None
        if isinstance(self.mlp, MoE) and balance:
            mlp_out, experts, sums = self.mlp(self.post_attn_norm(x), routed, with_experts=True, balance_mask=kv_valid)
        elif isinstance(self.mlp, MoE):
            mlp_out, experts = self.mlp(self.post_attn_norm(x), routed, with_experts=True)
        else:
            mlp_out, experts = self.mlp(self.post_attn_norm(x)), None
        out = constrain(x + mlp_out, ("batch", "length", "act_embed")), cache, experts
        return (*out, sums) if balance else out


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def unstack_layers(state: nnx.State, place=lambda x, logical_axes: x) -> nnx.State:
    """A model's state with every stacked layer parameter ([L, ...], its first logical axis "layers")
    held as a tuple of L arrays [...], one buffer a layer; ``place(x, logical_axes)`` places each (a
    sharding constraint). The sampler's decode layout (sampling/engine.py): ``Qwen.forward`` with a
    cache then runs the layers one by one, each gemm reading its layer's buffer in place, where a
    layer scan's slice of the stack is copied out on XLA:GPU inside a decode loop (issue 52)."""
    def unstack(var: nnx.Variable) -> nnx.Variable:
        axes = getattr(var, "logical_axes", None)
        if not axes or axes[0] != "layers":
            return var
        x = var.get_value()
        return var.replace(value=tuple(place(x[layer], axes[1:]) for layer in range(x.shape[0])))

    return jax.tree.map(unstack, state, is_leaf=_is_variable)


def is_unstacked(layer_params: nnx.State) -> bool:
    """Whether a layer stack's parameters are held per layer (``unstack_layers``)."""
    variables = jax.tree.leaves(layer_params, is_leaf=_is_variable)
    return bool(variables) and isinstance(variables[0].get_value(), tuple)


def layer_slice(layer_params: nnx.State, layer: int) -> nnx.State:
    """Layer ``layer``'s parameters of an unstacked layer stack (``unstack_layers``): its own buffers."""
    return jax.tree.map(lambda var: var.replace(value=var.get_value()[layer]), layer_params, is_leaf=_is_variable)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """[B, T] 0/1 mask -> [B, T] int32 positions: 0, 1, ... over the real tokens (pads get 0)."""
    mask = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


class Qwen(nnx.Module):
    """Qwen causal LM. ``model(tokens, attention_mask)`` -> logits [B, T, V] (float32)."""

    def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = make_param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype,
                                    kind=param_kind(cfg, "embedding"))
        for name, sparse, _, count in layer_stacks(cfg):  # stacked: [L, ...] params (one stack but for mixed kinds)
            setattr(self, name, DecoderLayer(cfg, rngs, layers=count, sparse=sparse))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, "norm", rngs,
                                  kind=param_kind(cfg, "final_norm"))
        if not cfg.tie_word_embeddings:
            self.lm_head = make_param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype,
                                      kind=param_kind(cfg, "lm_head"))

    def lm_head_kernel(self) -> jax.Array:
        """The output projection [D, V] (the embedding transposed when tied), in param dtype."""
        head, vocab_major = self.output_head()
        return head.T if vocab_major else head

    def output_head(self) -> tuple[jax.Array, bool]:
        """The output projection as it is held, in param dtype, and whether it is vocabulary-major: the
        embedding [V, D] when tied (True), else the head [D, V] (False)."""
        if self.cfg.tie_word_embeddings:
            return self.embedding[...], True
        return self.lm_head[...], False

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, T, D] -> logits [B, T, V] in float32."""
        kernel = self.lm_head_kernel().astype(hidden.dtype)
        out = jnp.einsum("btd,dv->btv", hidden, kernel, preferred_element_type=jnp.float32)
        return constrain(out, ("batch", "length", "act_vocab"))

    def forward(self, tokens, positions, kv_valid, cache: KVCache | None = None, cache_index=0, segment_ids=None, *,
                routed: jax.Array | None = None, with_routing: bool = False, with_balance: bool = False):
        """The decoder stack: tokens [B, T] int -> (final-normed hidden [B, T, D], updated cache), and with
        ``with_routing`` the experts its routers chose for every token in every sparse layer, [B, T, L, k] int32
        (a model with experts), and with ``with_balance`` (no cache) the routers' load-balancing loss over the real
        tokens (kv_valid), transformers' ``load_balancing_loss_func`` (``moe.load_balance_loss``), float32 [], last.

        positions [B, T] int; kv_valid [B, S] bool marks keys that may be attended to (S = T without
        a cache); segment_ids None or [B, T] int32: packed rows (without a cache), a token attends
        only within its segment; the tokens are written into cache slots cache_index .. cache_index + T - 1. A call
        with T > 1 tokens and a cache is a prefill: it must start at cache_index 0. A decode call
        (T = 1) may give cache_index as [B] int32, each row's own slot (continuous batching), and a
        cache of more than B rows, of which it reads and writes the first B (a narrowed decode batch).
        A paged decode call gives a ``PagedKVCache`` and cache_index a ``PageView`` (kv_valid None).
        routed: None, or [B, T, L, k] int, the experts each token uses in each sparse layer (routing replay,
        models/moe.py; a model with experts), their gate weights from this model's own router; L counts
        the sparse layers only, as the record ``with_routing`` returns.

        The layers run as one ``lax.scan`` over the stacked parameters (a scan a stack, ``layer_stacks``, when
        dense layers sit among sparse ones; unrolled over their per-layer buffers when the decode layout holds
        them so, ``unstack_layers``); without a cache (the gradient path) its body is rematerialised per
        ``config.remat``.
        """
        cfg = self.cfg
        if with_balance and cache is not None:
            raise ValueError("the load-balancing loss (with_balance) is of a forward pass without a cache")
        if (routed is not None or with_routing or with_balance) and not cfg.num_experts:
            raise ValueError("routing replay, routing records and the load-balancing loss need a model with experts "
                             "(num_experts > 0)")
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(jnp.dtype(cfg.dtype))
        x = constrain(x, ("batch", "length", "act_embed"))
        by_layer = None if routed is None else jnp.moveaxis(routed, 2, 0)  # [L sparse, B, T, k]
        caches = None if cache is None else (cache.k, cache.v)
        sparse_done, records, sums = 0, [], []
        for name, sparse, first, count in layer_stacks(cfg):
            replay = None if by_layer is None or not sparse else by_layer[sparse_done:sparse_done + count]
            x, caches, experts, balance = self._stack(getattr(self, name), x, positions, kv_valid, caches, cache_index,
                                                      segment_ids, replay, with_routing and sparse, first, count,
                                                      with_balance and sparse)
            if sparse:
                sparse_done += count
                records.append(experts)
                sums.append(balance)
        out = (self.final_norm(x), None if cache is None else type(cache)(*caches))
        if with_routing:
            out += (jnp.moveaxis(jnp.concatenate(records, axis=0), 0, 2),)  # [B, T, L sparse, k]
        if with_balance:
            out += (load_balance_loss(jnp.concatenate(sums, axis=0), jnp.sum(kv_valid.astype(jnp.float32))),)
        return out

    def _stack(self, stack: DecoderLayer, x, positions, kv_valid, caches, cache_index, segment_ids, routed,
               with_routing: bool, first: int, count: int, with_balance: bool = False):
        """One stack of ``count`` layers (from layer ``first``) on x [B, T, D] -> (x, the updated (k, v) caches
        [L, ...] or None, the experts its routers chose [count, B, T, k] with ``with_routing``, else None, its
        routers' load-balancing sums [count, 2, E] with ``with_balance`` (no cache), else None); routed: None or
        [count, B, T, k], the experts to replay. A scan over the stacked parameters (unrolled
        over their per-layer buffers in the decode layout); without a cache, its body rematerialised per
        ``config.remat``."""
        cfg = self.cfg
        layer_def, layer_params = nnx.split(stack)
        if caches is None:
            def body(x, xs):
                params, replay = xs
                x, _, experts, *sums = nnx.merge(layer_def, params)(x, positions, kv_valid, None, cache_index,
                                                                    segment_ids, replay, with_balance)
                return x, (experts if with_routing else None, sums[0] if with_balance else None)

            if cfg.remat != "none":
                body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
            x, (experts, sums) = jax.lax.scan(body, x, (layer_params, routed))
            return x, None, experts, sums

        def cached_body(carry, xs):
            x, k_cache, v_cache = carry
            params, layer, replay = xs
            x, (k_cache, v_cache), experts = nnx.merge(layer_def, params)(
                x, positions, kv_valid, (k_cache, v_cache, layer), cache_index, None, replay)
            return (x, k_cache, v_cache), experts if with_routing else None

        carry = (x, *caches)
        if is_unstacked(layer_params):  # the decode layout: layer l's own buffers, read in place
            per_layer = []
            for i in range(count):
                replay = None if routed is None else routed[i]
                carry, experts = cached_body(carry, (layer_slice(layer_params, i), first + i, replay))
                per_layer.append(experts)
            experts = jnp.stack(per_layer) if with_routing else None
        else:
            layers = first + jnp.arange(count, dtype=jnp.int32)
            carry, experts = jax.lax.scan(cached_body, carry, (layer_params, layers, routed))
        return carry[0], carry[1:], experts, None

    def __call__(self, tokens: jax.Array, attention_mask: jax.Array | None = None, *,
                 segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                 return_hidden: bool = False, routed: jax.Array | None = None, with_routing: bool = False,
                 with_balance: bool = False):
        """tokens [B, T] int, attention_mask [B, T] (1 = real token; left or right padding).

        Packed rows (several sequences in a row, rl/packing.py) give instead segment_ids [B, T]
        int32 (0 on padding, one id per sequence) and positions [B, T] (each token's position in
        its own sequence): a token then attends only within its sequence, at its own positions.
        Returns logits [B, T, V] in float32, or the final-normed hidden states [B, T, D] in the
        compute dtype when ``return_hidden`` (for the fused log-prob loss); with ``with_routing``,
        (that, the experts used [B, T, L, k] int32). routed: None or [B, T, L, k], the experts to
        replay (``forward``). With ``with_balance``, the routers' load-balancing loss over the real tokens last
        (``forward``).
        """
        kwargs = dict(routed=routed, with_routing=with_routing, with_balance=with_balance)
        if segment_ids is not None:
            out = self.forward(tokens, positions, segment_ids > 0, segment_ids=segment_ids, **kwargs)
        else:
            if attention_mask is None:
                attention_mask = jnp.ones(tokens.shape, jnp.int32)
            out = self.forward(tokens, positions_from_mask(attention_mask), attention_mask.astype(bool), **kwargs)
        hidden = out[0] if return_hidden else self.logits(out[0])
        return (hidden, *out[2:]) if with_routing or with_balance else hidden

    def init_cache(self, batch_size: int, cache_length: int) -> KVCache:
        """Zeroed KV cache, [L, B, K, S, Dh] each, in the compute dtype (sharded on the mesh in context)."""
        cfg = self.cfg
        shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cache_length, cfg.head_dim)

        def zeros():
            return constrain(jnp.zeros(shape, jnp.dtype(cfg.dtype)), CACHE_AXES)

        return KVCache(zeros(), zeros())
