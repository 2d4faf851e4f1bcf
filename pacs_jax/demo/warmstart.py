"""Supervised warm-start of the demo: teach the tiny policy the \\boxed{} answer format.

Teacher-forced next-token cross-entropy on the response tokens only (prompt tokens are context).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pacs_jax.demo.task import CharTokenizer, Problem


def sft_arrays(problems: list[Problem], tokenizer: CharTokenizer, length: int) -> dict[str, np.ndarray]:
    """Right-padded prompt+solution+eos sequences.

    Returns tokens [B, T] int32, attention_mask [B, T] int32 and loss_mask [B, T] float32, where
    loss_mask[b, t] = 1 when token t + 1 is a response token (the target of position t).
    """
    B = len(problems)
    tokens = np.zeros((B, length), np.int32)
    attention = np.zeros((B, length), np.int32)
    loss_mask = np.zeros((B, length), np.float32)
    for i, p in enumerate(problems):
        prompt = tokenizer.encode(p.prompt)
        response = tokenizer.encode(p.solution) + [tokenizer.eos_id]
        seq = prompt + response
        if len(seq) > length:
            raise ValueError(f"demo.warmstart_seq_len={length} is shorter than a problem ({len(seq)} tokens)")
        tokens[i, :len(seq)] = seq
        attention[i, :len(seq)] = 1
        loss_mask[i, len(prompt) - 1:len(seq) - 1] = 1.0
    return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask}


def response_nll(model, tokens: jax.Array, attention_mask: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Per-sequence negative log-likelihood of the response tokens: [B]."""
    logits = model(tokens, attention_mask)[:, :-1]  # [B, T-1, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -(target_logp * loss_mask[:, :-1]).sum(-1)


def make_sft_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation):
    """A jitted (params, opt_state, batch) -> (params, opt_state, loss) step; state buffers donated."""

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        nll = response_nll(model, batch["tokens"], batch["attention_mask"], batch["loss_mask"])
        return nll.sum() / jnp.maximum(batch["loss_mask"].sum(), 1.0)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
