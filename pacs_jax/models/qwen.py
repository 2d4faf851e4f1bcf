"""The Qwen2 / Qwen2.5 / Qwen3 decoder in Flax NNX, top to bottom.

Shapes: B batch, T query length, S key length (= T without a cache, the cache length with one),
D hidden, H query heads, K key/value heads, Dh head dim, F MLP width, V vocabulary, L layers.

Every parameter is an ``nnx.Param`` with ``logical_axes`` metadata (see pacs_jax/sharding.py).
Parameters are stored in ``config.param_dtype`` and cast to ``config.dtype`` for compute; norms,
softmax and logits run in float32.

One attention code path serves training (no cache), prefill and decode: keys live in "slots"
0..S-1, query t of a call sits in slot ``cache_index + t``, and a key is visible when it is valid
(``kv_valid``) and its slot is not after the query's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.models.config import QwenConfig
from pacs_jax.sharding import MeshRules, constrain

_REMAT_POLICIES = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class KVCache(NamedTuple):
    """Per-layer key/value buffers, each [B, S, K, Dh] in the compute dtype."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def _param(rngs: nnx.Rngs, shape, logical_axes, dtype, init="normal") -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = 0.02 * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, logical_axes=tuple(logical_axes))


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) * scale, computed in float32: [..., N] -> [..., N]."""

    def __init__(self, size: int, eps: float, param_dtype, logical_axis: str, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = _param(rngs, (size,), (logical_axis,), param_dtype, init="ones")

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


class Attention(nnx.Module):
    """Grouped-query attention with rotary embeddings (+ q/k biases or q/k RMSNorm per head)."""

    def __init__(self, cfg: QwenConfig, rules: MeshRules | None, rngs: nnx.Rngs):
        D, H, K, Dh, pd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.param_dtype
        self.cfg, self.rules = cfg, rules
        self.q_kernel = _param(rngs, (D, H, Dh), ("embed", "heads", "head_dim"), pd)
        self.k_kernel = _param(rngs, (D, K, Dh), ("embed", "kv_heads", "head_dim"), pd)
        self.v_kernel = _param(rngs, (D, K, Dh), ("embed", "kv_heads", "head_dim"), pd)
        self.o_kernel = _param(rngs, (H, Dh, D), ("heads", "head_dim", "embed"), pd)
        if cfg.attention_bias:
            self.q_bias = _param(rngs, (H, Dh), ("heads", "head_dim"), pd, init="zeros")
            self.k_bias = _param(rngs, (K, Dh), ("kv_heads", "head_dim"), pd, init="zeros")
            self.v_bias = _param(rngs, (K, Dh), ("kv_heads", "head_dim"), pd, init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps, pd, "head_dim", rngs)
            self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps, pd, "head_dim", rngs)

    def _project(self, x, kernel, bias_name):
        out = jnp.einsum("btd,dnh->btnh", x, kernel[...].astype(x.dtype),
                         preferred_element_type=jnp.float32).astype(x.dtype)
        if self.cfg.attention_bias:
            out = out + getattr(self, bias_name)[...].astype(x.dtype)
        return out

    def __call__(self, x, positions, kv_valid, cache_kv, cache_index):
        """x [B, T, D], positions [B, T], kv_valid [B, S] bool, cache_kv ([B, S, K, Dh] x2) or None.

        Returns (out [B, T, D], (k, v) written into the cache, or None without a cache).
        """
        cfg = self.cfg
        q = self._project(x, self.q_kernel, "q_bias")  # [B, T, H, Dh]
        k = self._project(x, self.k_kernel, "k_bias")  # [B, T, K, Dh]
        v = self._project(x, self.v_kernel, "v_bias")
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary(q, positions, cfg.rope_theta)
        k = rotary(k, positions, cfg.rope_theta)
        q = constrain(q, self.rules, ("batch", "length", "act_heads", None))
        if cache_kv is not None:
            k = jax.lax.dynamic_update_slice(cache_kv[0], k.astype(cache_kv[0].dtype), (0, cache_index, 0, 0))
            v = jax.lax.dynamic_update_slice(cache_kv[1], v.astype(cache_kv[1].dtype), (0, cache_index, 0, 0))
            k = constrain(k, self.rules, ("batch", "cache_length", "act_kv_heads", None))
            v = constrain(v, self.rules, ("batch", "cache_length", "act_kv_heads", None))
        T, S = q.shape[1], k.shape[1]
        q_slots = cache_index + jnp.arange(T)
        visible = kv_valid[:, None, :] & (jnp.arange(S)[None, None, :] <= q_slots[None, :, None])
        out = jax.nn.dot_product_attention(
            q, k.astype(q.dtype), v.astype(q.dtype), mask=visible[:, None, :, :],
            scale=cfg.head_dim ** -0.5)  # [B, T, H, Dh]
        out = jnp.einsum("btnh,nhd->btd", out, self.o_kernel[...].astype(x.dtype),
                         preferred_element_type=jnp.float32).astype(x.dtype)
        return out, ((k, v) if cache_kv is not None else None)


def _matmul_f32(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel accumulated and returned in float32 (bf16 x bf16 -> f32 is also the fast CPU path)."""
    return jnp.matmul(x, kernel, preferred_element_type=jnp.float32)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), [B, T, D] -> [B, T, D]."""

    def __init__(self, cfg: QwenConfig, rules: MeshRules | None, rngs: nnx.Rngs):
        D, F, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.rules = rules
        self.gate_kernel = _param(rngs, (D, F), ("embed", "mlp"), pd)
        self.up_kernel = _param(rngs, (D, F), ("embed", "mlp"), pd)
        self.down_kernel = _param(rngs, (F, D), ("mlp", "embed"), pd)

    def __call__(self, x):
        gate = _matmul_f32(x, self.gate_kernel[...].astype(x.dtype))
        up = _matmul_f32(x, self.up_kernel[...].astype(x.dtype))
        h = constrain((jax.nn.silu(gate) * up).astype(x.dtype), self.rules, ("batch", "length", "act_mlp"))
        return _matmul_f32(h, self.down_kernel[...].astype(x.dtype)).astype(x.dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: QwenConfig, rules: MeshRules | None, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, "norm", rngs)
        self.attn = Attention(cfg, rules, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, "norm", rngs)
        self.mlp = MLP(cfg, rules, rngs)
        self.rules = rules

    def __call__(self, x, positions, kv_valid, cache_kv, cache_index):
        attn_out, cache_kv = self.attn(self.input_norm(x), positions, kv_valid, cache_kv, cache_index)
        x = x + attn_out
        x = x + self.mlp(self.post_attn_norm(x))
        return constrain(x, self.rules, ("batch", "length", "act_embed")), cache_kv


def _run_layer(layer: DecoderLayer, x, positions, kv_valid, cache_kv, cache_index):
    return layer(x, positions, kv_valid, cache_kv, cache_index)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """[B, T] 0/1 mask -> [B, T] int32 positions: 0, 1, ... over the real tokens (pads get 0)."""
    mask = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


class Qwen(nnx.Module):
    """Qwen causal LM. ``model(tokens, attention_mask)`` -> logits [B, T, V] (float32)."""

    def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, rules: MeshRules | None = None):
        self.cfg, self.rules = cfg, rules
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, rules, rngs) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, "norm", rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)

    def lm_head_kernel(self) -> jax.Array:
        """The output projection [D, V] (the embedding transposed when tied), in param dtype."""
        if self.cfg.tie_word_embeddings:
            return self.embedding[...].T
        return self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, T, D] -> logits [B, T, V] in float32."""
        kernel = self.lm_head_kernel().astype(hidden.dtype)
        out = jnp.einsum("btd,dv->btv", hidden, kernel, preferred_element_type=jnp.float32)
        return constrain(out, self.rules, ("batch", "length", "act_vocab"))

    def forward(self, tokens, positions, kv_valid, cache: KVCache | None = None, cache_index=0):
        """The decoder stack: tokens [B, T] int -> (final-normed hidden [B, T, D], updated cache).

        positions [B, T] int; kv_valid [B, S] bool marks keys that may be attended to (S = T without
        a cache); the tokens are written into cache slots cache_index .. cache_index + T - 1.
        """
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(dtype)
        x = constrain(x, self.rules, ("batch", "length", "act_embed"))
        run = _run_layer
        if cfg.remat != "none":
            run = nnx.remat(_run_layer, policy=_REMAT_POLICIES[cfg.remat])
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            cache_kv = None if cache is None else (cache.k[i], cache.v[i])
            x, cache_kv = run(layer, x, positions, kv_valid, cache_kv, cache_index)
            if cache is not None:
                new_k.append(cache_kv[0])
                new_v.append(cache_kv[1])
        hidden = self.final_norm(x)
        return hidden, (None if cache is None else KVCache(tuple(new_k), tuple(new_v)))

    def __call__(self, tokens: jax.Array, attention_mask: jax.Array | None = None, *,
                 return_hidden: bool = False) -> jax.Array:
        """tokens [B, T] int, attention_mask [B, T] (1 = real token; left or right padding).

        Returns logits [B, T, V] in float32, or the final-normed hidden states [B, T, D] in the
        compute dtype when ``return_hidden`` (for the fused log-prob loss).
        """
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, jnp.int32)
        hidden, _ = self.forward(tokens, positions_from_mask(attention_mask), attention_mask.astype(bool))
        return hidden if return_hidden else self.logits(hidden)

    def init_cache(self, batch_size: int, cache_length: int) -> KVCache:
        """Zeroed KV cache, L x [B, S, K, Dh] in the compute dtype (sharded when a mesh is used)."""
        cfg = self.cfg
        shape = (batch_size, cache_length, cfg.num_key_value_heads, cfg.head_dim)

        def zeros():
            z = jnp.zeros(shape, jnp.dtype(cfg.dtype))
            return constrain(z, self.rules, ("batch", "cache_length", "act_kv_heads", None))

        return KVCache(tuple(zeros() for _ in self.layers), tuple(zeros() for _ in self.layers))
