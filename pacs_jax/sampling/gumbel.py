"""The sampler's Gumbel noise, bit for bit as ``jax.random.gumbel`` draws it, in uint32 array operations
that a Pallas GPU kernel runs as well as XLA does (sampling/fused_selection_gpu.py draws it per tile).

``jax.random.gumbel(key, (V,), jnp.float32)`` under JAX's partitionable Threefry (``jax_threefry_partitionable``,
the default) draws element i from the 20-round Threefry-2x32 hash of the counter (0, i) under the key's
two words (k0, k1): the xor of the hash's two output words is 32 random bits, their top 23 the mantissa of
a uniform u in [tiny, 1) (``jax.random.uniform``'s construction, tiny the smallest normal float32), and
the noise is -log(-log(u)). ``noise`` computes that for any keys and counters broadcasting together, so a
kernel tile of rows and vocabulary entries gets the same numbers as the whole row drawn at once.

Threefry-2x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): 20 rounds of
add, rotate and xor, its rotation constants and key schedule parity from the paper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # rounds of even and odd groups of four
_PARITY = np.uint32(0x1BD11BDA)
_ONE_BITS = np.uint32(0x3F800000)  # float32 1.0
_TINY = np.float32(np.finfo(np.float32).tiny)


def _rotate_left(x: jax.Array, r: int) -> jax.Array:
    return lax.shift_left(x, np.uint32(r)) | lax.shift_right_logical(x, np.uint32(32 - r))


def threefry2x32(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32, 20 rounds: key words k0, k1 and counter words x0, x1 (uint32 arrays that broadcast
    together) -> the two output words (uint32, the broadcast shape)."""
    keys = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0, x1 = x0 + keys[0], x1 + keys[1]
    for group in range(5):
        for r in _ROTATIONS[group % 2]:
            x0 = x0 + x1
            x1 = x0 ^ _rotate_left(x1, r)
        x0 = x0 + keys[(group + 1) % 3]
        x1 = x1 + keys[(group + 2) % 3] + np.uint32(group + 1)
    return x0, x1


def noise(k0: jax.Array, k1: jax.Array, counter: jax.Array) -> jax.Array:
    """Gumbel noise float32 of key words k0, k1 and counters (uint32 arrays broadcasting together: e.g.
    k0, k1 [B, 1] and counter [1, V] give [B, V]); element (b, i) equals
    ``jax.random.gumbel(key_b, (V,))[i]`` for counter i < 2**32."""
    y0, y1 = threefry2x32(k0, k1, jnp.zeros_like(counter), counter)
    bits = y0 ^ y1
    uniform = lax.bitcast_convert_type(lax.shift_right_logical(bits, np.uint32(9)) | _ONE_BITS, jnp.float32) - 1.0
    uniform = jnp.maximum(_TINY, uniform * (np.float32(1.0) - _TINY) + _TINY)
    return -jnp.log(-jnp.log(uniform))


def key_words(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Typed Threefry keys [B] (the sampler's row keys) -> their two words [B] uint32 each."""
    data = jax.random.key_data(keys)
    return data[..., 0], data[..., 1]
