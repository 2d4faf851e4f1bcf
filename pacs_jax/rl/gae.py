"""Generalised advantage estimation for PPO with a critic (verl 0.3.1's ``compute_gae_advantage_return``).

Shapes: B responses, T response tokens (right-padded; ``response_mask`` [B, T] is 1 on the response).

With the verifiable reward y_i on the last token of response i (``last_token_rewards``), the
critic's values V_it and
  delta_it = r_it + gamma V_i,t+1 - V_it          (V beyond the response is 0)
  A_it     = delta_it + gamma lam A_i,t+1
  returns  = A + V
the advantages are then whitened over every response token of the batch (mean 0, variance 1 with
the unbiased token variance, as verl's ``masked_whiten``); the returns are not. Values are first
multiplied by ``value_mask`` (default the response mask), so padding never leaks into the
recursion. verl's critic hands GAE its values times its own mask, the response and the slot after it
(``rl.critic.value_mask``): then V_i,n (n the response's length) is the value of the state after the
response, delta_i,n = -V_i,n, and its return is 0. With lam = 1 that value cancels out of every
advantage and return of the response; with lam < 1 it enters them through gamma (1 - lam) V_i,n.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WHITEN_EPS = 1e-8


def last_token_rewards(rewards: jax.Array, response_mask: jax.Array) -> jax.Array:
    """rewards [B] -> token rewards [B, T]: each reward on its response's last token, 0 elsewhere."""
    mask = response_mask.astype(jnp.float32)
    last = jnp.sum(mask, axis=-1).astype(jnp.int32) - 1  # [B]; -1 for an empty response: no reward token
    positions = jnp.arange(mask.shape[-1])[None, :]
    return jnp.where(positions == last[:, None], rewards.astype(jnp.float32)[:, None], 0.0)


def masked_whiten(x: jax.Array, mask: jax.Array) -> jax.Array:
    """(x - mean) / sqrt(var + 1e-8) with the mean and unbiased variance over the masked entries; x, mask [B, T]."""
    mask = mask.astype(jnp.float32)
    count = jnp.sum(mask)
    mean = jnp.sum(x * mask) / count
    variance = jnp.sum(jnp.square(x - mean) * mask) / (count - 1.0)
    return (x - mean) * jax.lax.rsqrt(variance + WHITEN_EPS)


def compute_gae(token_rewards: jax.Array, values: jax.Array, response_mask: jax.Array, gamma: float,
                lam: float, *, value_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(whitened advantages [B, T], returns [B, T]) from token rewards, values and the mask, all [B, T].

    ``value_mask`` [B, T]: where the values count (default ``response_mask``; the trainer passes
    verl's critic mask). The whitening is over ``response_mask``. No gradient flows (advantages and
    returns are targets). The batch must hold at least two response tokens (the whitening's
    unbiased variance).
    """
    if not token_rewards.shape == values.shape == response_mask.shape or token_rewards.ndim != 2:
        raise ValueError(f"token_rewards, values and response_mask must all be [B, T], got {token_rewards.shape}, "
                         f"{values.shape} and {response_mask.shape}")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma={gamma} and lam={lam} must lie in [0, 1]")
    mask = response_mask.astype(jnp.float32)
    rewards = jax.lax.stop_gradient(token_rewards.astype(jnp.float32))
    if value_mask is not None and value_mask.shape != response_mask.shape:
        raise ValueError(f"value_mask must be response_mask's [B, T]={response_mask.shape}, got {value_mask.shape}")
    values = jax.lax.stop_gradient(values.astype(jnp.float32)) * (mask if value_mask is None
                                                                  else value_mask.astype(jnp.float32))
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values  # [B, T]

    def backward(carry, delta_t):  # one step of A_t = delta_t + gamma lam A_{t+1}, from the last token back
        advantage = delta_t + gamma * lam * carry
        return advantage, advantage

    _, reversed_advantages = jax.lax.scan(backward, jnp.zeros(deltas.shape[0], jnp.float32), deltas.T[::-1])
    advantages = reversed_advantages[::-1].T
    returns = advantages + values
    return masked_whiten(advantages, mask), returns
