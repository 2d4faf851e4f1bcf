"""The sampler's decode loop run in chunks (pacs_jax/sampling/engine.py ``sample``: a program of up to
``chunk_steps`` decode steps at a time, the host reading the call's progress between two).

References: the same call in one chunk (``chunk_steps`` beyond its decode steps) for the results,
bit for bit, on one device and with a queue per batch shard, through the narrowing tail and the
paged store; the results themselves for the last progress read (rows, tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import models, sampling, sharding
from pacs_jax.sampling.engine import DecodeProgress
from pacs_jax.sharding import make_mesh

CFG = models.QwenConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
PROMPT_LENGTHS = (7, 13, 2)  # and one batch-padding prompt: 4 positions
BUDGETS = (20, 3, 14, 1)  # per prompt; the padding prompt's rows hold no sample


def _call(mesh_shape, settings, chunk_steps, reads):
    """One sampler call of 3 prompts (+ 1 padding) x n=3 at ``chunk_steps``; ``reads`` gets every
    progress the host read."""
    rng = np.random.default_rng(2)
    tokens = np.zeros((4, 16), np.int32)
    mask = np.zeros((4, 16), np.int32)
    for i, length in enumerate(PROMPT_LENGTHS):  # left-padded
        tokens[i, 16 - length:] = rng.integers(1, CFG.vocab_size, size=length)
        mask[i, 16 - length:] = 1
    with jax.set_mesh(make_mesh(*mesh_shape)) if mesh_shape else contextlib.nullcontext():
        graphdef, state = nnx.split(models.init_random(CFG, seed=3))
        placed = sharding.placement(("batch", "length"), tokens.shape)
        settings = dataclasses.replace(settings, chunk_steps=chunk_steps)
        out = sampling.sample(graphdef, state, jax.device_put(tokens, placed), jax.device_put(mask, placed), settings,
                              jax.random.key(5), np.repeat(BUDGETS, 3),
                              wait=lambda progress, last: reads.append(DecodeProgress.read(progress)))
        return jax.tree.map(np.asarray, out)


# the slots: 4 on one device (widths 4, 3, 2), 8 over the 4 batch shards (2 a queue, narrowing to 1)
@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("mesh_shape, page_size, slots", [(None, None, 4), ((2, 2, 2), 4, 8)], ids=["1dev", "2x2x2-paged"])
def test_chunks_of_any_size_give_the_one_chunk_results_bit_for_bit(mesh_shape, page_size, slots):
    """A chunk of 1 decode step stops inside each width's loop and between the widths of the
    narrowing tail (widths 4, 3, 2 on one device; 2 then 1 in each of the 4 batch shards' queues):
    tokens, log-probs, lengths, stop flags and the step counts equal one chunk's exactly. The host
    reads a chunk's progress while the next one runs: rows done never fall, and the last read is
    the results' (9 rows with a sample, their tokens); at one step a chunk, the chunk of the last
    decode step says the call is done."""
    settings = sampling.SamplingSettings(max_new_tokens=20, n=3, temperature=1.0, top_p=0.9, slots=slots, tail_slots=2,
                                         stop_token_ids=(5, 17), page_size=page_size, pages=None)
    whole_reads = []
    whole = _call(mesh_shape, settings, 1000, whole_reads)
    assert len(whole_reads) == 1 and whole_reads[0].done  # one chunk ran it all (the second, queued, is not read)
    assert whole.decode_steps > 5
    reads = []
    chunked = _call(mesh_shape, settings, 1, reads)
    for name, value in whole._asdict().items():
        np.testing.assert_array_equal(getattr(chunked, name), value, err_msg=name)
    assert len(reads) == int(whole.decode_steps)  # the last step's chunk says done
    assert [r.done for r in reads] == [False] * (len(reads) - 1) + [True]
    done = [r.rows_done for r in reads]
    assert done == sorted(done) and done[0] < 9 and reads[-1].rows_done == reads[-1].rows == 9
    assert reads[-1].tokens == int(whole.lengths.sum())
