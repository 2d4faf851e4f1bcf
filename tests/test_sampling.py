"""The KV-cache sampler against Hugging Face ``transformers`` (PyTorch CPU) on random Qwen2 / Qwen3 models.

References nobody here wrote: ``generate(do_sample=False)`` for greedy paths and stop handling, and
full (uncached) forward passes of the PyTorch model for log-probs and top-k / top-p sets. Model
weights are drawn with std 0.2 so that greedy paths do not hinge on near-ties.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from pacs_jax import checkpoints, models, sampling
from pacs_jax import hlo as pacs_hlo
from pacs_jax.sampling import engine
from pacs_jax.sharding import make_mesh

NEW_TOKENS = 48
VOCAB = 160  # differs from the MLP width (128) so HLO shapes of logits are unambiguous
PROMPT_LENGTHS = (7, 13, 2, 10, 5)  # 5 prompts -> a batch bucket of 8: padding rows are exercised
MESHES = {"1dev": None, "2x2x2": (2, 2, 2), "8x1x1": (8, 1, 1), "1x1x8": (1, 1, 8)}


def save_random_hf(path, kind: str, vocab: int, seed: int):
    """A random Qwen2 / Qwen3 PyTorch model (linear weights ~ N(0, 0.2), norms 1) saved to ``path``."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=10000.0, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=False, **common))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    model.eval().save_pretrained(path)
    return model


def left_padded_torch(prompts):
    length = max(map(len, prompts))
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, length - len(prompt):] = torch.tensor(prompt)
        mask[i, length - len(prompt):] = 1
    return ids, mask


def hf_greedy(hf_model, prompts, new_tokens, eos=None):
    """transformers greedy generate with left padding: (new ids [B, new_tokens], per-step logits [B, new, V])."""
    ids, mask = left_padded_torch(prompts)
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0, eos_token_id=eos, return_dict_in_generate=True,
                                output_logits=True)
    return out.sequences[:, ids.shape[1]:].numpy(), torch.stack(out.logits, 1).double().numpy()


def hf_log_softmax(hf_model, prompt, response, temperature):
    """float64 log_softmax(logits / T) at each response position from one full (uncached) forward: [len, V]."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = hf_model(input_ids=ids).logits[0].double().numpy()
    logits = logits[len(prompt) - 1: len(prompt) - 1 + len(response)] / temperature
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def log_softmax(x):
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """kind -> (HF dir, PyTorch model): Qwen2 (tied, biases) and Qwen3 (qk-norm, head_dim 16)."""
    out = {}
    for seed, kind in enumerate(("qwen2", "qwen3")):
        path = tmp_path_factory.mktemp(kind)
        out[kind] = (path, save_random_hf(path, kind, vocab=VOCAB, seed=seed))
    return out


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, VOCAB, size=length).tolist() for length in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(hf, prompts):
    """kind -> HF greedy (tokens [5, NEW_TOKENS], logits [5, NEW_TOKENS, V])."""
    return {kind: hf_greedy(model, prompts, NEW_TOKENS) for kind, (_, model) in hf.items()}


_loaded = {}
_meshes = {}


def on_mesh(mesh_name):
    """The context a model loaded for ``mesh_name`` is loaded and called in: its mesh set (one mesh
    object per shape), or none for the single device."""
    shape = MESHES[mesh_name]
    if shape is None:
        return contextlib.nullcontext()
    if shape not in _meshes:
        _meshes[shape] = make_mesh(*shape)
    return jax.set_mesh(_meshes[shape])


def load(hf, kind, mesh_name):
    """The model of ``kind`` on the mesh ``mesh_name`` (cached); call it inside ``on_mesh(mesh_name)``."""
    key = (kind, mesh_name)
    if key not in _loaded:
        with on_mesh(mesh_name):
            _loaded[key] = checkpoints.from_pretrained(hf[kind][0])
    return _loaded[key]


# ------------------------------------------------------------------------------------ greedy = HF
@pytest.mark.parametrize("kind,mesh_name", [("qwen2", "1dev"), ("qwen2", "2x2x2"), ("qwen2", "8x1x1"),
                                            ("qwen2", "1x1x8"), ("qwen3", "1dev"), ("qwen3", "2x2x2")])
def test_greedy_equals_transformers(hf, prompts, reference, kind, mesh_name):
    ref_tokens, ref_logits = reference[kind]
    with on_mesh(mesh_name):
        out = sampling.generate(load(hf, kind, mesh_name), prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=())
    assert len(out.tokens) == len(prompts)
    for row in range(len(prompts)):
        np.testing.assert_array_equal(out.tokens[row], ref_tokens[row], err_msg=f"row {row}")
        # greedy log-probs: log_softmax of the logits transformers computed at each step (T = 1)
        expected = np.take_along_axis(log_softmax(ref_logits[row]), ref_tokens[row][:, None], -1)[:, 0]
        np.testing.assert_allclose(out.logprobs[row], expected, atol=1e-4)
    assert out.finish_reason == ["length"] * len(prompts)


def test_stop_ids_match_transformers_and_pad_after(hf, prompts, reference):
    """Two stop ids chosen so some rows stop and some run to the budget; HF decides where each stops."""
    ref_tokens, _ = reference["qwen2"]
    stop_a = int(ref_tokens[0][5])
    candidates = [int(t) for t in ref_tokens[1][10:]]
    stop_b = next(t for t in candidates if any(stop_a not in r and t not in r for r in ref_tokens[2:].tolist()))
    stops = (stop_a, stop_b)
    hf_tokens, _ = hf_greedy(hf["qwen2"][1], prompts, NEW_TOKENS, eos=list(stops))

    model = load(hf, "qwen2", "1dev")
    tokens, mask = sampling.left_pad(prompts, 8, 64)
    graphdef, state = nnx.split(model)
    settings = sampling.SamplingSettings(max_new_tokens=NEW_TOKENS, stop_token_ids=stops)
    arrays = jax.device_get(sampling.sample(graphdef, state, tokens, mask, settings, jax.random.key(0)))
    reasons = []
    for row in range(len(prompts)):
        hits = [i for i, t in enumerate(hf_tokens[row]) if t in stops]
        end = hits[0] + 1 if hits else NEW_TOKENS
        reasons.append("stop" if hits else "length")
        length = int(arrays.lengths[row])
        assert length == end, f"row {row}"
        np.testing.assert_array_equal(arrays.tokens[row, :end], hf_tokens[row, :end])
        np.testing.assert_array_equal(arrays.response_mask[row], np.arange(NEW_TOKENS) < end)
        assert (arrays.tokens[row, end:] == sampling.PAD_ID).all() and (arrays.logprobs[row, end:] == 0).all()
        assert bool(arrays.stopped[row]) == bool(hits)
    assert set(reasons) == {"stop", "length"}
    assert (arrays.lengths[len(prompts):] == 0).all() and (arrays.response_mask[len(prompts):] == 0).all()

    out = sampling.generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=stops)
    assert out.finish_reason == reasons
    assert [len(t) for t in out.tokens] == arrays.lengths[:len(prompts)].tolist()
    assert all(t[-1] in stops for t, r in zip(out.tokens, reasons) if r == "stop")


def test_right_padded_arrays_give_the_same_greedy_tokens(hf, prompts, reference):
    """The trainer's entry on arrays: right padding (gaps in the cache) decodes like left padding."""
    ref_tokens, _ = reference["qwen2"]
    tokens = np.zeros((8, 64), np.int32)
    mask = np.zeros((8, 64), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)], mask[row, :len(prompt)] = prompt, 1
    graphdef, state = nnx.split(load(hf, "qwen2", "1dev"))
    settings = sampling.SamplingSettings(max_new_tokens=NEW_TOKENS)
    arrays = jax.device_get(sampling.sample(graphdef, state, tokens, mask, settings, jax.random.key(0)))
    np.testing.assert_array_equal(arrays.tokens[:len(prompts)], ref_tokens)
    assert int(arrays.prefill_tokens) == sum(map(len, prompts))


# ------------------------------------------------------------------------------------ n samples, log-probs
def test_n_samples_share_one_prefill(hf, prompts, reference):
    model = load(hf, "qwen2", "1dev")
    ref_tokens, _ = reference["qwen2"]
    greedy = sampling.generate(model, prompts[:2], max_new_tokens=16, n=4, stop_token_ids=())
    assert greedy.prefill_tokens == sum(map(len, prompts[:2]))  # not 4x: one prefill per prompt
    for i in range(2):
        for j in range(4):
            np.testing.assert_array_equal(greedy.tokens[i * 4 + j], ref_tokens[i][:16])

    sampled = sampling.generate(model, prompts[:2], max_new_tokens=16, n=4, temperature=1.0,
                                stop_token_ids=(), seed=3)
    assert sampled.prefill_tokens == sum(map(len, prompts[:2]))
    for i in range(2):
        group = {tuple(t) for t in sampled.tokens[i * 4:(i + 1) * 4]}
        assert len(group) > 1, f"the 4 samples of prompt {i} are identical at temperature 1"
    again = sampling.generate(model, prompts[:2], max_new_tokens=16, n=4, temperature=1.0,
                              stop_token_ids=(), seed=3)
    other = sampling.generate(model, prompts[:2], max_new_tokens=16, n=4, temperature=1.0,
                              stop_token_ids=(), seed=4)
    assert again.tokens == sampled.tokens and other.tokens != sampled.tokens


def test_compiled_rollout_prefills_prompts_not_samples():
    """The compiled rollout's matmuls: the prefill runs on the P x T prompt tokens and the decode on
    B = P x n rows of one token; no matmul sees the prompts repeated n times ([P n, T] or P n T rows)."""
    cfg = models.QwenConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    graphdef, state = nnx.split(models.init_random(cfg, seed=0))
    P, T, n = 3, 13, 5
    prompts = jax.ShapeDtypeStruct((P, T), jnp.int32)
    compiled = engine.lower_sample(graphdef, state, prompts, prompts,
                                    sampling.SamplingSettings(n=n, max_new_tokens=7)).compile()
    dots = [tuple(int(d) for d in dims.split(","))
            for dims in re.findall(r"= \w+\[([\d,]+)\]\{[^}]*\} dot\(", compiled.as_text())]
    assert (P * T, cfg.intermediate_size) in dots  # the prefill's MLP: every prompt token once
    assert (P * n, cfg.intermediate_size) in dots  # the decode's MLP: one token per sample
    for shape in dots:
        assert P * n * T not in shape and not {P * n, T} <= set(shape), shape


def test_logprobs_equal_full_forward(hf, prompts):
    """Sampled at T = 0.7 with stop ids: log-probs = log_softmax(logits / 0.7) of an uncached forward."""
    model, hf_model = load(hf, "qwen2", "1dev"), hf["qwen2"][1]
    stops = (5, 17, 99)
    out = sampling.generate(model, prompts[:2], max_new_tokens=16, n=4, temperature=0.7,
                            stop_token_ids=stops, seed=1)
    for row, (tokens, logprobs) in enumerate(zip(out.tokens, out.logprobs)):
        expected = hf_log_softmax(hf_model, prompts[row // 4], tokens, 0.7)
        np.testing.assert_allclose(logprobs, expected[np.arange(len(tokens)), tokens], atol=1e-4)
        hits = [i for i, t in enumerate(tokens) if t in stops]
        assert hits in ([], [len(tokens) - 1])
        assert out.finish_reason[row] == ("stop" if hits else "length")


def test_sampling_on_a_mesh_equals_one_device(hf, prompts):
    """Random bits do not depend on the sharding, so a (2,2,2) mesh draws the same samples."""
    kwargs = dict(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, stop_token_ids=(), seed=7)
    one = sampling.generate(load(hf, "qwen2", "1dev"), prompts, **kwargs)
    with on_mesh("2x2x2"):
        mesh = sampling.generate(load(hf, "qwen2", "2x2x2"), prompts, **kwargs)
    assert mesh.tokens == one.tokens
    np.testing.assert_allclose(np.concatenate(mesh.logprobs), np.concatenate(one.logprobs), atol=1e-5)


# ------------------------------------------------------------------------------------ compilation facts
def test_similar_prompts_do_not_recompile(hf, prompts):
    model = load(hf, "qwen2", "1dev")
    sampling.generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=())
    sampling.generate(model, prompts[:2], max_new_tokens=16, n=4, temperature=1.0, stop_token_ids=())
    before = sampling.compile_count()
    rng = np.random.default_rng(1)
    new_prompts = [rng.integers(1, VOCAB, size=length).tolist() for length in (30, 61, 44, 9, 12, 50, 33)]
    sampling.generate(model, new_prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=(3, 4))
    sampling.generate(model, new_prompts, max_new_tokens=NEW_TOKENS, temperature=0.6, top_p=0.95, seed=2)
    sampling.generate(model, new_prompts[:2], max_new_tokens=16, n=4, temperature=0.6, top_p=0.8,
                      stop_token_ids=(7,), seed=11)
    assert sampling.compile_count() == before
    sampling.generate(model, [[1] * 65], max_new_tokens=NEW_TOKENS, stop_token_ids=())  # next length bucket
    assert sampling.compile_count() == before + 1


@pytest.mark.parametrize("slots, tail_slots", [(None, None), (3, None), (6, 1)])
def test_compiled_program_keeps_cache_in_place_and_prefill_logits_small(hf, slots, tail_slots):
    """HLO facts: the [L, C, K, S, Dh] decode cache is never copied (decode steps scatter each slot's
    new K/V into it, refills update a slot's prompt part, a narrowing moves running rows within it),
    the prefill has no [P, T, V] logits, and token 0 of the P x n rows is selected from [P, V]
    logits, never [P n, V]."""
    graphdef, state = nnx.split(load(hf, "qwen2", "1dev"))
    P, T, n, N, V = 2, 64, 4, 16, VOCAB
    C = P * n if slots is None else slots
    prompts = jax.ShapeDtypeStruct((P, T), jnp.int32)
    settings = sampling.SamplingSettings(n=n, max_new_tokens=N, temperature=1.0, slots=slots, tail_slots=tail_slots)
    hlo = engine.lower_sample(graphdef, state, prompts, prompts, settings).compile().as_text()
    L = graphdef_layers(state)
    cache_shape = re.escape(f"f32[{L},{C},2,{T + N},8]")
    comps = pacs_hlo.computations(hlo)
    loops = pacs_hlo.loop_computations(hlo)
    # each slot's new K/V and a refilled slot's prompt K/V written in place inside the decode loops: a scatter and
    # dynamic-update-slices (XLA:CPU's fusion emitters)
    write = rf"= {cache_shape}\S* (scatter|dynamic-update-slice)\("
    writes = [w for name in loops for w in re.findall(write, comps[name])]
    assert len(writes) >= 2 and "dynamic-update-slice" in writes, writes
    for name in loops:  # a copy inside a loop would run every decode step
        assert not re.search(rf"= {cache_shape}\S* copy\(", comps[name]), name
    assert f"f32[{P},{T},{V}]" not in hlo
    if C != P * n:  # token 0 from [P, V] logits: no [P n, V] buffer (with one slot per row, decode has one)
        assert f"f32[{P * n},{V}]" not in hlo
    assert re.search(rf"f32\[{C},(1,)?{V}\]", hlo)  # the decode logits, to show the pattern works
    if tail_slots:  # and those of the narrowest decode batch: its own loop
        assert re.search(rf"f32\[{tail_slots},(1,)?{V}\]", hlo)


def graphdef_layers(state) -> int:
    """The number of decoder layers of a model state (the leading axis of its stacked parameters)."""
    return state["layers"]["mlp"]["up_kernel"].get_value().shape[0]


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[]), "prompts"),
    (dict(prompts=[[1, 2], []]), r"prompts\[1\] is empty"),
    (dict(prompts=[[1, VOCAB]]), r"prompts\[0\]\[1\]"),
    (dict(prompts=[[1] * 15], max_cache_length=20), r"prompts\[0\].*max_cache_length"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(n=0), "n=0"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=500), "top_k"),
    (dict(stop_token_ids=(3, VOCAB)), r"stop_token_ids\[1\]"),
    (dict(seed=1.5), "seed"),
])
def test_bad_input_raises_naming_the_argument(hf, kwargs, match):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sampling.generate(load(hf, "qwen2", "1dev"), args.pop("prompts"), **args)
