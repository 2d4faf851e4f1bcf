"""The paged sampler's page accounting (pacs_jax/sampling/paged.py): every page comes back, each
prompt is stored once for its n samples, and a row waits for pages rather than overwrite another's.
Its tokens against the continuous and static samplers (1 device and the 2x2x2 mesh):
tests/test_sampling_continuous.py; its attention: tests/test_paged_attention.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import sampling
from pacs_jax.models.qwen import KVCache
from pacs_jax.sampling import paged
from pacs_jax.sampling.settings import row_pages
from test_sampling_continuous import hf, load, prompts  # noqa: F401 (fixtures)


def _sample(model, prompts, budgets, *, slots, stops=(), page_size=None, pages=None, n=2):
    tokens, mask = sampling.left_pad(prompts, 8, 16)
    graphdef, state = nnx.split(model)
    settings = sampling.SamplingSettings(max_new_tokens=12, n=n, stop_token_ids=stops, slots=slots,
                                         page_size=page_size, pages=pages)
    rows = np.repeat(np.asarray(budgets + [1] * (8 - len(budgets))), n)
    return jax.device_get(sampling.sample(graphdef, state, tokens, mask, settings, jax.random.key(0), rows))


@pytest.mark.slow(seconds=60)
def test_a_row_waits_for_pages_and_every_page_comes_back(hf, prompts):
    """Greedy, 3 slots, 5-token pages (dividing neither the budgets nor the 16-token prompts), the
    prompts' lengths 7, 13, 2, 10, 5 (partly filled last prompt pages), a stop at prompt 3's first
    token and a budget of 1, in a pool of one row's worst case (3 pages): each row needs all 3
    (ceil((len mod 5 + budget - 1) / 5)), so a row waits until the one running returns its pages and
    the rows that decode run one after another although 3 slots could hold them (the call's decode
    steps are exactly the sum of theirs); the tokens are those of one slot per row, and every page
    is free at the end (the default pool, every slot's longest row at once: the token-for-token
    test of tests/test_sampling_continuous.py)."""
    model = load(hf, None)
    budgets, n = [12, 9, 1, 12, 12], 2
    static = _sample(model, prompts, budgets, slots=None, n=n)
    stop = int(static.tokens[3 * n, 0])  # prompt 3's greedy first token: its rows end at token 0
    static = _sample(model, prompts, budgets, slots=None, stops=(stop,), n=n)
    assert row_pages(5, 12) == 3
    out = _sample(model, prompts, budgets, slots=3, stops=(stop,), page_size=5, pages=3, n=n)
    assert int(out.decode_steps) == np.maximum(static.lengths - 1, 0).sum()
    np.testing.assert_array_equal(out.tokens, static.tokens)
    np.testing.assert_array_equal(out.lengths, static.lengths)
    np.testing.assert_allclose(out.logprobs, static.logprobs, rtol=1e-5, atol=1e-5)
    assert int(out.free_pages) == 3
    assert static.stopped[3 * n:4 * n].all() and (static.lengths[2 * n:3 * n] == 1).all()


def test_the_pool_holds_each_prompt_once_compact_and_the_response_pages_after():
    """The prefill's left-padded K/V of P prompts -> P x ceil(T / s) prompt pages holding each
    prompt's real tokens from position 0 (whatever n is), then the response pages and the scratch page."""
    L, P, K, T, Dh, s, pages = 2, 3, 2, 7, 4, 3, 5
    k = jax.random.normal(jax.random.key(0), (L, P, K, T, Dh))
    real = np.zeros((P, T), bool)
    real[0, 2:], real[1, :], real[2, 6:] = True, True, True  # 5, 7 and 1 real tokens, left-padded
    pool = paged._compact_pool(KVCache(k, -k), jnp.asarray(real), s, pages)
    assert pool.k.shape == (K, L, P * 3 + pages + 1, s, Dh)
    for p in range(P):
        count = real[p].sum()
        stored = np.asarray(pool.k)[:, :, p * 3:p * 3 + 3].reshape(K, L, 3 * s, Dh)[:, :, :count]
        np.testing.assert_array_equal(stored, np.asarray(k)[:, p][:, :, real[p]].swapaxes(0, 1))
    np.testing.assert_array_equal(np.asarray(pool.v), -np.asarray(pool.k))
    assert not np.asarray(pool.k)[:, :, P * 3:].any()


def test_a_pool_smaller_than_one_row_is_refused(hf, prompts):
    with pytest.raises(ValueError, match=r"pages=2: a queue's pool must hold one row's response pages, 3 of 5"):
        _sample(load(hf, None), prompts, [2], slots=2, page_size=5, pages=2)
