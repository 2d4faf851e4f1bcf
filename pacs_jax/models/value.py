"""The critic of PPO: a Qwen backbone with a scalar value head (verl's critic: the HF model as a token
classifier with one label).

Shapes: B batch, T tokens, D hidden, P prompt length, R response length.

    critic = value_model_from_actor(actor)                        # the actor's weights, copied, same shardings
    values = critic(input_ids, attention_mask)                    # [B, T] float32
    v = response_values(critic, input_ids, attention_mask, R)     # [B, R]: the value before response token t

The backbone is a ``Qwen`` without an output projection (its config says tied embeddings, so no
``lm_head`` is allocated; the critic never computes logits). The head is v_t = h_t . w + b on the
final-normed hidden state h_t, in float32; w starts at normal(0, 0.02) and b at 0, as transformers
initialises a token-classification head. The parameters carry the actor's logical axes, so the
critic is sharded exactly like the actor (the head's w over "embed", like every embed dim).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.models.config import QwenConfig
from pacs_jax.models.loading import abstract_model, dotted, random_param
from pacs_jax.models.params import make_param
from pacs_jax.models.qwen import Qwen


class ValueModel(nnx.Module):
    """Qwen backbone + scalar head: ``critic(tokens, attention_mask)`` -> values [B, T] float32."""

    def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.backbone = Qwen(cfg.replace(tie_word_embeddings=True), rngs=rngs)
        self.value_kernel = make_param(rngs, (cfg.hidden_size,), ("embed",), cfg.param_dtype)
        self.value_bias = make_param(rngs, (), (), cfg.param_dtype, init="zeros")

    def __call__(self, tokens: jax.Array, attention_mask: jax.Array | None = None, *,
                 segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
        """tokens, attention_mask [B, T] -> values [B, T] float32 (one per position); packed rows give
        segment_ids and positions [B, T] instead of the mask (``Qwen.__call__``)."""
        hidden = self.backbone(tokens, attention_mask, segment_ids=segment_ids, positions=positions,
                               return_hidden=True)  # [B, T, D]
        values = jnp.einsum("btd,d->bt", hidden.astype(jnp.float32), self.value_kernel[...].astype(jnp.float32))
        return values + self.value_bias[...].astype(jnp.float32)


def response_values(critic: ValueModel, input_ids: jax.Array, attention_mask: jax.Array,
                    response_length: int) -> jax.Array:
    """Values of the response tokens: input_ids, attention_mask [B, P + R] -> [B, R], value t read at
    position P - 1 + t (the state in which response token t is chosen, as the log-probs)."""
    prompt_length = input_ids.shape[1] - response_length
    return critic(input_ids, attention_mask)[:, prompt_length - 1:-1]


def value_model_from_actor(actor: Qwen, seed: int = 0) -> ValueModel:
    """A critic whose backbone is a copy of ``actor``'s parameters (embedding, layers, final norm; not
    its output projection) in the same shardings, and whose head is freshly initialised.

    The copies own their buffers: donating the critic's parameters to an update never invalidates
    the actor's.
    """
    graphdef, abstract = abstract_model(actor.cfg, cls=ValueModel)
    actor_params = {dotted(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(actor, nnx.Param))}
    key = jax.random.key(seed)
    items = []
    for i, (path, var) in enumerate(nnx.to_flat_state(abstract)):
        if path[0] == "backbone":
            source = actor_params[dotted(path[1:])]
            value = jax.device_put(source, var.get_value().sharding, may_alias=False)
        else:
            value = random_param(var, jax.random.fold_in(key, i))
        items.append((path, var.replace(value=value)))
    return nnx.merge(graphdef, nnx.from_flat_state(items))
