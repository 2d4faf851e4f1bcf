"""The decode step's fused LM head and token selection (sampling/fused_selection_gpu.py, our Pallas GPU
kernel: Pallas interpret mode on CPU) against the XLA path (``selection.select_tokens`` on the head's
logits), and its Gumbel noise (sampling/gumbel.py) against ``jax.random.gumbel`` and Threefry's
published known-answer vectors. The kernel compiling for an H200: tests/test_gpu_compile.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import sharding
from pacs_jax.models import kernels
from pacs_jax.sampling import fused_selection_gpu, gumbel
from pacs_jax.sampling.selection import select_tokens


def test_threefry_matches_the_random123_known_answers():
    """Threefry-2x32, 20 rounds: the known-answer vectors of Random123 (Salmon et al. 2011)."""
    cases = [((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
             ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
             ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0))]
    for key, counter, expected in cases:
        words = [jnp.uint32(w) for w in key + counter]
        assert tuple(int(y) for y in gumbel.threefry2x32(*words)) == expected


def test_gumbel_noise_is_jax_random_gumbel_bit_for_bit_at_qwens_vocabulary():
    """The sampler's keys (fold_in of split keys), every counter of Qwen's 151,936 entries."""
    keys = jax.vmap(jax.random.fold_in)(jax.random.split(jax.random.key(7), 3), jnp.array([0, 5, 1023]))
    V = 151936
    expected = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    k0, k1 = gumbel.key_words(keys)
    got = gumbel.noise(k0[:, None], k1[:, None], jnp.arange(V, dtype=jnp.uint32)[None, :])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def _case(B: int, D: int, V: int, dtype, seed: int = 0):
    rs = np.random.RandomState(seed)
    hidden = jnp.asarray(rs.randn(B, D), dtype)
    head = jnp.asarray(rs.randn(V, D) * 0.3, dtype)  # [V, D]: a tied embedding
    keys = jax.vmap(jax.random.fold_in)(jax.random.split(jax.random.key(seed), B), jnp.arange(B))
    return hidden, head, keys


def _reference(hidden, head, keys, temperature):
    logits = jnp.einsum("bd,vd->bv", hidden, head, preferred_element_type=jnp.float32)
    return select_tokens(logits, keys, jnp.float32(temperature), jnp.float32(1.0), top_k=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("vocab_major", [True, False])
def test_kernel_equals_the_xla_path_in_interpret_mode(dtype, vocab_major):
    """Greedy, T = 1 and T = 0.7: the same tokens, the log-probs to float32 round-off. 21 rows (no
    multiple of the row block), 32 vocabulary blocks, the hidden size in 2 chunks."""
    hidden, head, keys = _case(21, 64, 4096, dtype)
    w = head if vocab_major else head.T
    run = jax.jit(lambda h, w, keys, t: fused_selection_gpu.select(h, w, keys, t, vocab_major=vocab_major,
                                                                   interpret=True))
    for temperature in (0.0, 1.0, 0.7):
        tokens, logp = run(hidden, w, keys, jnp.float32(temperature))
        ref_tokens, ref_logp = _reference(hidden, head, keys, temperature)
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens))
        np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_logp), rtol=0, atol=5e-6)
    greedy = run(hidden, w, keys, jnp.float32(0.0))[0]
    assert not np.array_equal(np.asarray(greedy), np.asarray(tokens))  # sampling is not the argmax


def test_ties_go_to_the_first_index_across_blocks():
    """Every logit equal (a zero head): greedy picks token 0, as the XLA path's first argmax."""
    hidden, head, keys = _case(4, 32, 512, jnp.float32)
    tokens, logp = jax.jit(lambda h, w, k: fused_selection_gpu.select(h, w, k, jnp.float32(0.0), vocab_major=True,
                                                                      interpret=True))(hidden, head * 0, keys)
    np.testing.assert_array_equal(np.asarray(tokens), 0)
    np.testing.assert_allclose(np.asarray(logp), -np.log(512), rtol=1e-6)


def test_a_vocabulary_split_over_the_tensor_axis_gives_the_unsplit_tokens():
    """On a 2 x 1 x 4 mesh (rows over data, the head's vocabulary over tensor): each device's kernel sees
    its shard, its indices and noise counters offset to the shard's first entry."""
    hidden, head, keys = _case(8, 32, 2048, jnp.bfloat16, seed=3)
    mesh = sharding.make_mesh(2, 1, 4)
    with jax.set_mesh(mesh):
        placed = (jax.device_put(hidden, NamedSharding(mesh, P("data"))),
                  jax.device_put(head, NamedSharding(mesh, P("tensor"))))
        run = jax.jit(lambda h, w, k: fused_selection_gpu.select(h, w, k, jnp.float32(1.0), vocab_major=True,
                                                                 interpret=True))
        tokens, logp = run(*placed, keys)
    ref_tokens, ref_logp = _reference(hidden, head, keys, 1.0)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_logp), rtol=0, atol=5e-6)


def test_the_choice_takes_the_kernel_beside_cudnn_only_where_it_takes_the_shapes():
    assert kernels.token_selection("cudnn", fused_selection_gpu.unsupported(151936, 1536, jnp.bfloat16)).impl == "gpu"
    assert kernels.token_selection("splash", None).impl == "xla"
    odd = kernels.token_selection("cudnn", fused_selection_gpu.unsupported(151665, 1536, jnp.bfloat16))
    assert odd.impl == "xla" and "vocabulary 151665" in odd.reason
    with pytest.raises(ValueError, match="fused_selection_gpu: dtype int8"):
        fused_selection_gpu.partials(jnp.zeros((4, 32), jnp.int8), jnp.zeros((64, 32), jnp.int8),
                                     jnp.zeros(4, jnp.uint32), jnp.zeros(4, jnp.uint32), 1.0, vocab_major=True)
