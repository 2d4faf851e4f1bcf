"""Token selection: drawn frequencies, top-k / top-p sets and log-probs against float64 references.

References: a PyTorch ``transformers`` Qwen2 with a 32-token vocabulary (its full forward logits,
taken to float64), a chi-square test, and float64 NumPy top-k / top-p sets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pacs_jax import checkpoints, sampling
from test_sampling import hf_log_softmax, save_random_hf

VOCAB = 32
PROMPTS = [[3, 14, 15, 9, 26, 5], [27, 18, 28]]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(our model, PyTorch model) of a random Qwen2 with a 32-token vocabulary."""
    path = tmp_path_factory.mktemp("qwen2_v32")
    hf_model = save_random_hf(path, "qwen2", vocab=VOCAB, seed=5)
    return checkpoints.from_pretrained(path), hf_model


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; bins with expected count < 5 are pooled into one."""
    expected = probs * counts.sum()
    small_bins = expected < 5
    observed, expected = counts[~small_bins], expected[~small_bins]
    if small_bins.any():
        observed = np.append(observed, counts[small_bins].sum())
        expected = np.append(expected, probs[small_bins].sum() * counts.sum())
    statistic = float(np.sum((observed - expected) ** 2 / expected))
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_first_token_frequencies_match_softmax(small):
    model, hf_model = small
    draws, temperature = 20_000, 0.8
    out = sampling.generate(model, PROMPTS[:1], max_new_tokens=1, n=draws, temperature=temperature,
                            stop_token_ids=(), seed=0, length_multiple=8)
    counts = np.bincount([t[0] for t in out.tokens], minlength=VOCAB)
    assert counts.sum() == draws
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor(PROMPTS[:1])).logits[0, -1].double().numpy()
    assert chi_square_pvalue(counts, softmax(logits / temperature)) > 1e-3
    # the test has power: the same draws reject the untempered distribution
    assert chi_square_pvalue(counts, softmax(logits)) < 1e-6


def sampled_ranks(hf_model, out, n, temperature):
    """Per sampled token: (rank by logit, its probability mass before it under softmax(logits / T),
    our log-prob minus the float64 full-vocabulary log_softmax(logits / T))."""
    ranks, mass_before, logprob_error = [], [], []
    for row, (tokens, logprobs) in enumerate(zip(out.tokens, out.logprobs)):
        log_probs = hf_log_softmax(hf_model, PROMPTS[row // n], tokens, temperature)  # [len, V]
        for position, token in enumerate(tokens):
            order = np.argsort(-log_probs[position], kind="stable")
            rank = int(np.nonzero(order == token)[0][0])
            ranks.append(rank)
            mass_before.append(float(np.exp(log_probs[position][order[:rank]]).sum()))
            logprob_error.append(abs(logprobs[position] - log_probs[position, token]))
    return np.array(ranks), np.array(mass_before), np.array(logprob_error)


def test_top_k_samples_stay_in_the_top_k(small):
    model, hf_model = small
    n, temperature = 8, 1.5
    out = sampling.generate(model, PROMPTS, max_new_tokens=12, n=n, temperature=temperature, top_k=3,
                            stop_token_ids=(), seed=1)
    ranks, _, logprob_error = sampled_ranks(hf_model, out, n, temperature)
    assert ranks.max() < 3
    assert set(ranks.tolist()) == {0, 1, 2}  # the whole set is used, not just the argmax
    assert logprob_error.max() <= 1e-4  # log-probs are over the full vocabulary, not renormalised


def test_top_p_samples_stay_in_the_nucleus(small):
    model, hf_model = small
    n, temperature, top_p = 8, 1.0, 0.6
    out = sampling.generate(model, PROMPTS, max_new_tokens=12, n=n, temperature=temperature, top_p=top_p,
                            stop_token_ids=(), seed=2)
    ranks, mass_before, logprob_error = sampled_ranks(hf_model, out, n, temperature)
    assert mass_before.max() < top_p + 1e-5  # each token is inside the smallest set reaching top_p
    assert ranks.max() >= 1  # not degenerate: tokens beyond the argmax are drawn
    assert logprob_error.max() <= 1e-4


@pytest.mark.parametrize("top_k,top_p", [(0, 0.3), (10, None), (10, 0.7), (1, 0.9), (0, 1e-6)])
def test_restrict_to_top_keeps_the_reference_set(top_k, top_p):
    """restrict_to_top vs a float64 NumPy reference: top-k first, then top-p renormalised over it."""
    logits = np.asarray(jax.random.normal(jax.random.key(top_k), (6, 50), jnp.float32)) * 2.0
    kept = np.isfinite(np.asarray(jax.jit(sampling.restrict_to_top, static_argnums=(1, 2))(
        jnp.asarray(logits), top_k, top_p)))
    for row in range(logits.shape[0]):
        order = np.argsort(-logits[row].astype(np.float64))
        allowed = order[:top_k] if top_k else order
        if top_p is not None:
            probs = softmax(logits[row][allowed].astype(np.float64))
            before = np.cumsum(probs) - probs
            allowed = allowed[before < top_p]
        assert set(np.nonzero(kept[row])[0].tolist()) == set(allowed.tolist()), f"row {row}"


def test_first_argmax_is_numpy_argmax_with_ties():
    x = np.asarray(jax.random.randint(jax.random.key(0), (64, 300), 0, 7), np.float32)  # many ties
    x[3] = -np.inf
    got = np.asarray(jax.jit(sampling.first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
