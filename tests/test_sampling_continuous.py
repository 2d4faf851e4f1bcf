"""The continuous-batching sampler (pacs_jax/sampling/engine.py): a fixed number of decode slots, a
slot whose row ends taking the next waiting row in the same decode step (its paged variant's page
accounting: tests/test_sampling_paged.py).

References: the static sampler (one slot per row) for scheduling independence, Hugging Face
``transformers`` greedy generate (PyTorch CPU) for the tokens, exact step counts derived from the
per-row budgets for the queue, and the compiled HLO for the decode layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pacs_jax import checkpoints, hlo, models, sampling, sharding
from pacs_jax.sampling import engine, seam
from pacs_jax.sharding import make_mesh
from test_sampling import VOCAB, hf_greedy, save_random_hf

PROMPT_LENGTHS = (7, 13, 2, 10, 5)  # 5 prompts -> 8 with batch padding
STOPS = (5, 17, 99, 42, 123, 7)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_continuous")
    return path, save_random_hf(path, "qwen2", vocab=VOCAB, seed=11)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(4)
    return [rng.integers(1, VOCAB, size=length).tolist() for length in PROMPT_LENGTHS]


_models = {}
_meshes = {}


def on_mesh(mesh_shape):
    """The context a model loaded for ``mesh_shape`` is loaded and called in: that mesh set (one mesh
    object per shape), or none for the single device (None)."""
    if mesh_shape is None:
        return contextlib.nullcontext()
    if mesh_shape not in _meshes:
        _meshes[mesh_shape] = make_mesh(*mesh_shape)
    return jax.set_mesh(_meshes[mesh_shape])


def load(hf, mesh_shape):
    """The model on a mesh of ``mesh_shape`` (cached); call it inside ``on_mesh(mesh_shape)``."""
    if mesh_shape not in _models:
        with on_mesh(mesh_shape):
            _models[mesh_shape] = checkpoints.from_pretrained(hf[0])
    return _models[mesh_shape]


SETTINGS = {
    "greedy_n1": dict(n=1),
    "sampled_n1": dict(n=1, temperature=0.8),
    "sampled_n8": dict(n=8, temperature=1.0, top_p=0.9, top_k=40),
}


@pytest.mark.slow(seconds=45)  # the first case's compilations: ~120 s
@pytest.mark.parametrize("case, mesh_shape", [(case, None) for case in sorted(SETTINGS)] + [("sampled_n8", (2, 2, 2))],
                         ids=[f"{case}-1dev" for case in sorted(SETTINGS)] + ["sampled_n8-2x2x2"])
def test_continuous_equals_static_token_for_token(hf, prompts, mesh_shape, case):
    """Rows of different lengths (stop ids) run in 3 slots (one queue on the mesh too: 3 is no multiple
    of its 4 batch shards), in 8 narrowing to 3 in the tail (one queue a shard on the mesh, 2 slots
    narrowing to 1), in 8 narrowing to 4 over a page pool of 4-token pages (the paged sampler: a
    pool a shard on the mesh, 2 slots narrowing to 1) and in one slot per row: the same tokens, finish reasons and log-probs (float32
    round-off), as on a CPU they must (on a GPU or TPU they may differ: docs/design.md 3.2); the same
    call again gives the same tokens. Every setting on one device; on the mesh the one that exercises every part (n 8,
    temperature, top-p, top-k), as the settings differ only in the selection, which is per row and
    the same code on both (each mesh shape compiles its own programs: 17 s a setting here)."""
    model = load(hf, mesh_shape)
    kwargs = dict(max_new_tokens=24, stop_token_ids=STOPS, seed=3, **SETTINGS[case])
    with on_mesh(mesh_shape):
        static = sampling.generate(model, prompts, **kwargs)
        lengths = {len(t) for t in static.tokens}
        assert len(lengths) > 1 and "stop" in static.finish_reason  # the schedule differs from the static one
        # 8 narrowing to 3: widths 8, 6, 4, 3, each a decode loop of its own to compile (narrowing to 1, the widths
        # 8, 6, 4, 3, 2, 1 made n 8's chunk program 4 times the 3-slot one's to compile; the narrowing queue test
        # below narrows to 1, and so does each queue on the mesh here)
        for slots, tail_slots, page_size in ((3, None, None), (8, 3, None), (8, 4, 4)):
            continuous = sampling.generate(model, prompts, slots=slots, tail_slots=tail_slots, page_size=page_size,
                                           **kwargs)
            assert continuous.tokens == static.tokens, (slots, page_size)
            assert continuous.finish_reason == static.finish_reason
            np.testing.assert_allclose(np.concatenate(continuous.logprobs), np.concatenate(static.logprobs),
                                       rtol=1e-5, atol=1e-5)
        assert sampling.generate(model, prompts, **kwargs).tokens == static.tokens  # the same call again


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)], ids=["1dev", "2x2x2"])
def test_greedy_continuous_and_paged_with_per_prompt_budgets_equal_transformers(hf, prompts, mesh_shape):
    """3 slots over contiguous cache rows (the rows queue), and 8 narrowing to 4 over a page pool of
    4-token pages (dividing neither the prompts nor the budgets): transformers' greedy tokens, each row
    cut at its own budget. The samplers are programs of the test above (the budgets, the stop ids, the
    temperature and top-p are their arguments): on one device its n 1 programs, on the mesh its n 8
    ones (top-k 40, which greedy ignores), each prompt's 8 rows greedy alike: none compiled again."""
    budgets = [23, 6, 19, 1, 13]
    reference, _ = hf_greedy(hf[1], prompts, 24)
    n, top_k = (1, 0) if mesh_shape is None else (8, SETTINGS["sampled_n8"]["top_k"])
    for slots, tail_slots, page_size in ((3, None, None), (8, 4, 4)):
        with on_mesh(mesh_shape):
            out = sampling.generate(load(hf, mesh_shape), prompts, max_new_tokens=24, n=n, top_k=top_k,
                                    stop_token_ids=(), slots=slots, tail_slots=tail_slots, budgets=budgets,
                                    page_size=page_size)
        for row, budget in enumerate(np.repeat(budgets, n)):
            assert out.tokens[row] == reference[row // n, :budget].tolist(), (page_size, row)
        assert out.finish_reason == ["length"] * len(prompts) * n


def _sample(model, prompts, budgets, n, slots, stops=(), tail_slots=None):
    tokens, mask = sampling.left_pad(prompts, 8, 16)
    graphdef, state = nnx.split(model)
    settings = sampling.SamplingSettings(max_new_tokens=12, n=n, stop_token_ids=stops, slots=slots,
                                         tail_slots=tail_slots)
    rows = np.repeat(np.asarray(budgets + [1] * (8 - len(budgets))), n)
    return jax.device_get(sampling.sample(graphdef, state, tokens, mask, settings, jax.random.key(0), rows))


def test_a_freed_slot_takes_the_next_row_in_the_same_step_and_the_queue_ends_exactly(hf, prompts):
    """Greedy, no stop ids, per-prompt budgets: one slot runs the rows back to back, so the decode
    steps are exactly sum(budget - 1) over the rows (token 0 comes from the prefill); every row of a
    real prompt gets exactly its budget (each (prompt, j) once), batch-padding rows stay empty, and a
    budget of 1 needs no decode step."""
    model = load(hf, None)
    budgets, n = [4, 1, 7, 2, 5], 2
    needed = n * sum(b - 1 for b in budgets)
    out = _sample(model, prompts, budgets, n, slots=1)
    assert int(out.decode_steps) == int(out.slot_steps) == needed
    assert sampling.slot_utilisation(out.lengths, int(out.slot_steps)) == 1.0
    np.testing.assert_array_equal(out.lengths, np.repeat(budgets + [0, 0, 0], n))
    assert not out.stopped.any()
    for row, length in enumerate(out.lengths):
        assert (out.tokens[row, length:] == sampling.PAD_ID).all()
    # 3 slots narrowing to 1 in the tail: the narrowing queue test's first program, compiled once for both
    three = _sample(model, prompts, budgets, n, slots=3, tail_slots=1)
    assert needed / 3 <= int(three.decode_steps) < needed  # the slots run side by side
    np.testing.assert_array_equal(three.tokens, out.tokens)


def _schedule(needs: list[int], widths: tuple[int, ...]) -> tuple[int, int]:
    """Reference schedule of one queue: rows needing ``needs`` decode steps each (in queue order), the
    first width refilled from the queue, each next width taking over once no row waits and the
    running rows fit it. Returns (decode steps, slot steps)."""
    queue, running, width, steps, slot_steps = [d for d in needs if d > 0], [], 0, 0, 0
    while queue or running:
        while len(running) < widths[width] and queue and width == 0:
            running.append(queue.pop(0))
        steps, slot_steps = steps + 1, slot_steps + widths[width]
        running = [d - 1 for d in running if d > 1]
        while not queue and width + 1 < len(widths) and len(running) <= widths[width + 1]:
            width += 1
    return steps, slot_steps


def test_the_decode_batch_narrows_in_the_tail():
    """The widths: the 2^k / 3 x 2^(k-1) ladder below the slots down to tail_slots."""
    assert engine.narrowing_widths(32, 1) == (32, 24, 16, 12, 8, 6, 4, 3, 2, 1)
    assert engine.narrowing_widths(512, 64) == (512, 384, 256, 192, 128, 96, 64)
    assert engine.narrowing_widths(5, 2) == (5, 4, 3, 2)
    assert engine.narrowing_widths(8, None) == engine.narrowing_widths(8, 8) == (8,)


@pytest.mark.parametrize("slots, tail_slots", [(3, 1), (6, 2)])
def test_a_narrowing_queue_decodes_only_its_running_rows_and_keeps_their_tokens(hf, prompts, slots, tail_slots):
    """Long-tailed budgets (one row of 12 among short ones): once no row waits, the decode batch
    narrows as rows end, so the call's slot steps (slots decoded a step, summed) are those of the
    reference schedule at the narrowing widths, fewer than slots x decode steps, and its rows keep
    the tokens, log-probs and lengths of one slot per row."""
    model = load(hf, None)
    budgets, n = [12, 2, 3, 5, 2], 2
    static = _sample(model, prompts, budgets, n, slots=None)
    out = _sample(model, prompts, budgets, n, slots=slots, tail_slots=tail_slots)
    np.testing.assert_array_equal(out.tokens, static.tokens)
    np.testing.assert_allclose(out.logprobs, static.logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.lengths, np.repeat(budgets + [0, 0, 0], n))
    needs = [b - 1 for b in np.repeat(budgets, n)]
    steps, slot_steps = _schedule(needs, engine.narrowing_widths(slots, tail_slots))
    assert (int(out.decode_steps), int(out.slot_steps)) == (steps, slot_steps)
    assert slot_steps < slots * steps
    assert sampling.slot_utilisation(out.lengths, int(out.slot_steps)) == sum(needs) / slot_steps


def test_a_stop_at_the_first_token_never_takes_a_slot(hf, prompts):
    model = load(hf, None)
    budgets, n = [4, 3, 7, 2, 5], 2
    first = _sample(model, prompts, budgets, n, slots=1).tokens[0, 0]  # prompt 0's greedy token 0
    out = _sample(model, prompts, budgets, n, slots=1, stops=(int(first),))
    stopped_at_once = (out.lengths == 1) & out.stopped
    assert stopped_at_once[:n].all()  # prompt 0's rows
    # the decode steps are those of the rows that did not stop at token 0
    assert int(out.decode_steps) == int(np.sum(np.maximum(out.lengths[~stopped_at_once] - 1, 0)))


@pytest.mark.parametrize("places", [(0, 1, 2, 3), (1, 2, 3, 6)], ids=["padding_last", "padding_between"])
def test_batch_padding_spreads_the_rows_over_the_shards(hf, prompts, places):
    """4 real prompts among 8 batch positions on the 2x2x2 mesh (4 batch shards, one slot each), all
    rows running to the same budget b: the 8 rows are spread 2 per shard, so the call takes exactly
    2 x (b - 1) decode steps (token 0 comes from the prefill); held where the padding put them, a
    shard would run 2 prompts' 4 rows (4 x (b - 1) steps) while another idled. The tokens are the
    1-device static sampler's (each row keyed by its prompt's place and its sample), the padding
    rows empty."""
    n, b, shards = 2, 7, 4
    tokens, mask = np.zeros((8, 16), np.int32), np.zeros((8, 16), np.int32)
    for place, prompt in zip(places, prompts):
        tokens[place, 16 - len(prompt):], mask[place, 16 - len(prompt):] = prompt, 1
    budgets = np.repeat(np.where(np.isin(np.arange(8), places), b, 1), n)
    settings = sampling.SamplingSettings(max_new_tokens=12, n=n, temperature=1.0)

    def run(mesh_shape, slots):
        graphdef, state = nnx.split(load(hf, mesh_shape))
        with on_mesh(mesh_shape):
            out = sampling.sample(graphdef, state, tokens, mask, dataclasses.replace(settings, slots=slots),
                                  jax.random.key(5), budgets)
        return jax.device_get(out)

    spread, static = run((2, 2, 2), shards), run(None, None)
    assert int(spread.decode_steps) == len(places) * n // shards * (b - 1)
    np.testing.assert_array_equal(spread.lengths, np.repeat(np.where(np.isin(np.arange(8), places), b, 0), n))
    np.testing.assert_array_equal(spread.tokens, static.tokens)
    np.testing.assert_allclose(spread.logprobs, static.logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(spread.response_mask, static.response_mask)


def test_spread_rows_covers_each_sample_once_and_is_the_identity_without_padding():
    source, first, count = jax.device_get(seam.spread_rows(jnp.ones(8, bool), 4))
    np.testing.assert_array_equal(source, np.arange(8))
    np.testing.assert_array_equal(first, np.zeros(8))
    np.testing.assert_array_equal(count, np.full(8, 4))
    source, first, count = jax.device_get(seam.spread_rows(jnp.asarray([0, 1, 0, 0, 1, 0, 1, 0], bool), 4))
    held = [(int(i), int(j)) for i, f, c in zip(source, first, count) for j in range(f, f + c)]
    assert sorted(held) == [(i, j) for i in (1, 4, 6) for j in range(4)]  # each (prompt, sample) once
    assert count.max() - count.min() <= 1  # 12 rows over 8 positions


def _parameter_gathers_in_loops(compiled_text: str, state) -> list[hlo.Instruction]:
    return hlo.gathers_of_shapes_in_loops(compiled_text, hlo.parameter_shapes(state))


# The contiguous sampler on the pure FSDP mesh, the paged one on the mixed mesh: the parameters' decode layout is
# the mesh's and the same for both samplers, whose decode loops differ in their caches only (the four pairs were
# four cases: each a sampler to compile, 8 % of the file's time)
@pytest.mark.parametrize("mesh_shape, page_size", [((1, 8, 1), None), ((2, 2, 2), 4)], ids=["1x8x1", "2x2x2-paged"])
def test_decode_loop_all_gathers_no_parameter(mesh_shape, page_size):
    """Compiled for an FSDP mesh, the sampler gathers the parameters once per call (the decode layout),
    never inside its decode loop; the check finds such gathers where they exist (a layer scan over
    FSDP-sharded weights). The paged sampler holds no [L, slots, K, prompt + max_new, Dh] cache at all,
    the contiguous one does."""
    cfg = models.QwenConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    mesh = make_mesh(*mesh_shape)
    with jax.set_mesh(mesh):
        model = models.init_random(cfg)
        graphdef, state = nnx.split(model)
        prompts = jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=sharding.placement(("batch", "length"), (8, 16)))
        settings = sampling.SamplingSettings(max_new_tokens=8, n=2, temperature=1.0, slots=8, tail_slots=1,
                                             page_size=page_size)
        text = engine.lower_sample(graphdef, state, prompts, prompts, settings).compile().as_text()
    assert hlo.loop_computations(text)
    assert _parameter_gathers_in_loops(text, state) == []
    contiguous_cache = re.search(r"\[2,\d+,\d,24,16\]", text)  # [L, slots, K / tensor, 16 + 8, Dh]
    assert (contiguous_cache is None) == (page_size is not None), contiguous_cache

    kernel = state["layers"]["mlp"]["up_kernel"].get_value()  # [L, D, F], D over fsdp
    replicated = NamedSharding(mesh, PartitionSpec())

    def scan_layers(x, kernel):  # each layer's weight gathered where it is used, as GSPMD decodes FSDP weights
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ jax.lax.with_sharding_constraint(w, replicated)[:, :48]),
                                          None), x, kernel)[0]

    x = jax.device_put(jnp.ones((8, 48)), replicated)
    control = jax.jit(scan_layers).lower(x, kernel).compile().as_text()
    assert _parameter_gathers_in_loops(control, state), "the check must see a gathered weight in a loop"


def test_slots_beyond_the_rows_are_refused(hf, prompts):
    model = load(hf, None)
    tokens, mask = sampling.left_pad(prompts, 8, 16)
    graphdef, state = nnx.split(model)
    settings = sampling.SamplingSettings(max_new_tokens=4, n=2, slots=17)
    with pytest.raises(ValueError, match="slots=17"):
        sampling.sample(graphdef, state, tokens, mask, settings, jax.random.key(0))
    with pytest.raises(ValueError, match="budgets"):
        sampling.sample(graphdef, state, tokens, mask, sampling.SamplingSettings(max_new_tokens=4, n=2),
                        jax.random.key(0), np.full(16, 5))
    with pytest.raises(ValueError, match="slots"):
        sampling.SamplingSettings(max_new_tokens=4, slots=0)
    for tail_slots, slots in ((0, 4), (5, 4), (2, None)):
        with pytest.raises(ValueError, match=f"tail_slots={tail_slots}"):
            sampling.SamplingSettings(max_new_tokens=4, slots=slots, tail_slots=tail_slots)
