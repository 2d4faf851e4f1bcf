"""Carry-over rollouts (pacs_jax/sampling/carry_over.py): a sampler call ends once B groups are
complete, the rows still running go on in the next call with that call's weights; rows exported after
a call and resumed in a fresh sampler go on as in the one never stopped.

References: ``engine.sample`` of each call's prompts and key (weights unchanged between calls), the
sampler never stopped (a resume), a per-row decode with a contiguous cache that switches weights at
the tokens where the returned version array changes (weights changed every call), the budgets for
which generation is dropped, jax's compilation events, and ``engine.sample``'s slot utilisation on
the same length mix.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import models, sampling, sharding
from pacs_jax.models.qwen import KVCache, positions_from_mask
from pacs_jax.sampling import carry_over, seam
from pacs_jax.sampling.selection import Selection
from pacs_jax.sharding import make_mesh
from pacs_jax.training import compilations

CFG = models.QwenConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
P, T, N = 4, 8, 12
SETTINGS = sampling.SamplingSettings(max_new_tokens=N, n=2, temperature=1.0, top_p=0.9, stop_token_ids=(5, 17),
                                     slots=4, page_size=4, chunk_steps=3)
CALLS, DRAIN = 3, 4  # calls with prompts, then calls of batch padding only until every group is back


_MESHES = {}


def _on_mesh(mesh_shape):
    """The context of a run on a mesh of ``mesh_shape`` (one mesh object a shape), or one device (None)."""
    if mesh_shape is None:
        return contextlib.nullcontext()
    if mesh_shape not in _MESHES:
        _MESHES[mesh_shape] = make_mesh(*mesh_shape, devices=jax.devices()[:math.prod(mesh_shape)])
    return jax.set_mesh(_MESHES[mesh_shape])


@functools.cache
def _graphdef_and_params(seed: int, mesh_shape=None):
    with _on_mesh(mesh_shape):
        return nnx.split(models.init_random(CFG, seed=seed))


def _batch(call: int):
    """Call ``call``'s prompts [P, T] (left-padded, 2 .. T tokens; none after CALLS), budgets [P n], key."""
    tokens, mask = np.zeros((P, T), np.int32), np.zeros((P, T), np.int32)
    rng = np.random.default_rng(100 + call)
    if call < CALLS:
        for i, length in enumerate(rng.integers(2, T + 1, size=P)):
            tokens[i, T - length:] = rng.integers(1, CFG.vocab_size, size=length)
            mask[i, T - length:] = 1
    return tokens, mask, rng.integers(1, N + 1, size=P * SETTINGS.n).astype(np.int32), jax.random.key(call)


def _run(seeds, *, compiles=None, mesh_shape=None, resume_after=None, groups=3):
    """The schedule (CALLS + DRAIN calls, B = ``groups`` of P = 4 groups a call, max_staleness 2), call v with
    the weights of seed ``seeds[v]`` (on a mesh of ``mesh_shape``, the prompts split over its batch
    axes): {(version, prompt): its n rows (tokens, logprobs, versions, lengths, stopped)}, each call's
    ``CarryOverRows`` and the sampler. ``compiles`` gets the compilations of every call after the first.
    ``resume_after`` v: after call v the rows in flight are exported and the calls after it run in a
    fresh sampler that resumed them with the next call's weights (the export is the sampler's
    ``exported``)."""
    with _on_mesh(mesh_shape):
        return _schedule(seeds, compiles, mesh_shape, resume_after, groups)


def _new_sampler(graphdef, groups=3):
    return carry_over.CarryOverSampler(graphdef, SETTINGS, prompts=P, prompt_length=T, groups=groups, max_staleness=2)


def _schedule(seeds, compiles, mesh_shape, resume_after, groups_a_call):
    graphdef = _graphdef_and_params(seeds[0], mesh_shape)[0]
    sampler = _new_sampler(graphdef, groups_a_call)
    groups, calls = {}, []
    with compilations.built() as events:
        for v in range(CALLS + DRAIN):
            tokens, mask, budgets, key = _batch(v)
            params = _graphdef_and_params(seeds[v], mesh_shape)[1]
            placed = sharding.placement(("batch", "length"), tokens.shape)
            tokens, mask = jax.device_put(tokens, placed), jax.device_put(mask, placed)
            events.clear()
            out = jax.device_get(sampler.step(params, v, tokens, mask, key, budgets))
            if compiles is not None and v:
                compiles.append(len(events))
            calls.append(out)
            n = SETTINGS.n
            for k in np.flatnonzero(out.group_valid):
                rows = slice(k * n, k * n + n)
                key_ = (int(out.group_version[k]), int(out.group_prompt[k]))
                assert key_ not in groups, f"group {key_} returned twice"
                groups[key_] = (out.tokens[rows], out.logprobs[rows], out.versions[rows], out.lengths[rows],
                                out.stopped[rows])
            if v == resume_after:
                exported = sampler.export()
                sampler = _new_sampler(graphdef, groups_a_call)
                sampler.resume(_graphdef_and_params(seeds[v + 1], mesh_shape)[1], exported,
                               [_batch(version)[:2] for version in exported.generations])
                sampler.exported = exported
    return groups, calls, sampler


@pytest.mark.slow(seconds=120)
@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)], ids=["1dev", "2x2x2"])
def test_unchanged_weights_give_sample_rows_and_nothing_compiles_after_the_first_call(mesh_shape):
    """Weights unchanged between calls: every real prompt's group comes back once, none dropped, and
    its rows equal ``engine.sample``'s of its call's prompts and key (tokens, lengths, stop flags
    exactly; log-probs to float tolerance); rows ran across calls (carried_rows > 0); the calls
    after the first compile nothing. On the 2x2x2 mesh the carry-over runs one queue, GSPMD-split,
    and ``engine.sample`` a queue per batch shard (4 of 1 slot)."""
    compiles = []
    before = carry_over.compile_count()
    groups, calls, sampler = _run([3] * (CALLS + DRAIN), compiles=compiles, mesh_shape=mesh_shape)
    assert compiles == [0] * (CALLS + DRAIN - 1)
    assert carry_over.compile_count() - before <= 4  # init, insert, chunk, harvest: once each (0 if cached)
    assert not any(out.dropped.any() for out in calls)
    assert sum(int(out.carried_rows) for out in calls) > 0
    assert not calls[-1].carried_rows and not calls[-1].decode_steps  # drained: every slot idle, every page back
    decode_state = sampler._state.decode
    assert (np.asarray(decode_state.slots.row) == sampler.spec.rows).all()
    assert int(decode_state.kv.count) == sampler.spec.engine.pages
    assert sorted(groups) == [(v, p) for v in range(CALLS) for p in range(P)]
    graphdef, params = _graphdef_and_params(3, mesh_shape)
    n = SETTINGS.n
    for v in range(CALLS):
        tokens, mask, budgets, key = _batch(v)
        with _on_mesh(mesh_shape):
            ref = jax.device_get(sampling.sample(graphdef, params, tokens, mask, SETTINGS, key, budgets))
        for p in range(P):
            got_tokens, got_logprobs, got_versions, got_lengths, got_stopped = groups[v, p]
            rows = slice(p * n, p * n + n)
            np.testing.assert_array_equal(got_tokens, ref.tokens[rows], err_msg=f"{v, p}")
            np.testing.assert_array_equal(got_lengths, ref.lengths[rows])
            np.testing.assert_array_equal(got_stopped, ref.stopped[rows])
            np.testing.assert_allclose(got_logprobs, ref.logprobs[rows], rtol=1e-5, atol=1e-5)
            assert ((got_versions >= v) & (got_versions < CALLS + DRAIN))[ref.response_mask[rows] == 1].all()


@pytest.mark.slow(seconds=60)
@pytest.mark.parametrize("stop", [1, 2])
def test_rows_exported_and_resumed_in_a_fresh_engine_continue_as_the_engine_that_exported_them(stop, monkeypatch):
    """After call ``stop`` the rows in flight (their tokens, log-probs, versions, keys; some mid-response in a
    slot) are exported and resumed in a fresh sampler with the same weights, their K/V recomputed
    (prompts prefilled, each slot's tokens fed through the decode step's ``attend``, ``chunk_steps``
    positions a program): every group comes back as from the sampler never stopped, tokens, versions,
    lengths and stop flags exactly, and log-probs exactly too (on this CPU the recompute runs the decode
    step's arithmetic: the same K/V bit for bit). The export is small host arrays; dropping its tokens
    fails the comparison."""
    seeds = [3] * (CALLS + DRAIN)
    groups, _, _ = _run(seeds)
    reseat, chunks = carry_over.reseat_program, []
    monkeypatch.setattr(carry_over, "reseat_program", lambda *args, **kwargs: chunks.append(1) or reseat(*args, **kwargs))
    resumed, _, sampler = _run(seeds, resume_after=stop)
    exported = sampler.exported
    assert exported.version == stop and exported.generations
    Q, G = P * SETTINGS.n, sampler.spec.generations
    lengths = {version % G: rows.lengths for version, rows in zip(exported.generations, exported.rows)}
    assert any(lengths[row // Q][row % Q] >= 2 for row in exported.slots[exported.slots >= 0])  # mid-response
    fed = max(lengths[row // Q][row % Q] for row in exported.slots[exported.slots >= 0]) - 1  # positions to feed
    # a chunk a chunk_steps positions, and the one run_chunks queues after the last
    assert len(chunks) == max(-(-fed // SETTINGS.chunk_steps), 1) + 1, (len(chunks), fed)
    assert sorted(resumed) == sorted(groups) == [(v, p) for v in range(CALLS) for p in range(P)]
    for key, (tokens, logprobs, versions, lengths, stopped) in groups.items():
        got = resumed[key]
        np.testing.assert_array_equal(got[0], tokens, err_msg=f"{key}")
        np.testing.assert_array_equal(got[1], logprobs, err_msg=f"{key}")
        np.testing.assert_array_equal(got[2], versions, err_msg=f"{key}")
        np.testing.assert_array_equal(got[3], lengths, err_msg=f"{key}")
        np.testing.assert_array_equal(got[4], stopped, err_msg=f"{key}")


QUEUED = (2, 1, 2)  # data 2 x tensor 2: a queue per "data" shard once B divides (B = 2)


def _pool_shard(sampler, mesh_shape) -> tuple[int, ...]:
    """The page pool's shape on one device as the compiled init program gives it (compile-time)."""
    graphdef, params = _graphdef_and_params(3, mesh_shape)
    with _on_mesh(mesh_shape):
        prompts = jax.ShapeDtypeStruct((P, T), jnp.int32, sharding=sharding.placement(("batch", "length"), (P, T)))
        lowered = sampler.lower(params, prompts, prompts)
        pool = seam.abstract_results(lowered.init, lowered.init.compile()).decode.kv.k
    return pool.sharding.shard_shape(pool.shape)


@pytest.mark.slow(seconds=90)
def test_a_queue_per_batch_shard_gives_sample_rows_on_its_share_of_the_pool():
    """On a mesh of 2 "data" shards with B = 2 of P = 4 groups a call, carry-over runs a queue a shard
    (prompts 0-1 and 2-3 of each call, 2 of the 4 slots, half the response pages, 1 group a call
    each): every real prompt's group comes back once or is reported dropped once (by the batch index of
    its call's version); the returned rows equal ``engine.sample``'s of their call's prompts and key
    (tokens, lengths, stop flags exactly; log-probs to float tolerance); rows ran across calls; the
    calls after the first compile nothing; and the compiled pool on a device holds half the pages of
    the one-queue engine's on the same mesh (B = 3: one queue), their one spare page each aside."""
    compiles = []
    before = carry_over.compile_count()
    groups, calls, sampler = _run([3] * (CALLS + DRAIN), compiles=compiles, mesh_shape=QUEUED, groups=2)
    assert compiles == [0] * (CALLS + DRAIN - 1)
    assert carry_over.compile_count() - before <= 4
    assert sum(int(out.carried_rows) for out in calls) > 0
    assert all(int(out.group_valid.sum()) == 2 for out in calls[:CALLS])
    dropped = [(int(out.dropped_version), int(p)) for out in calls for p in np.flatnonzero(out.dropped)]
    assert sorted([*groups, *dropped]) == [(v, p) for v in range(CALLS) for p in range(P)]
    graphdef, params = _graphdef_and_params(3, QUEUED)
    n = SETTINGS.n
    for (v, p), (got_tokens, got_logprobs, got_versions, got_lengths, got_stopped) in groups.items():
        tokens, mask, budgets, key = _batch(v)
        with _on_mesh(QUEUED):
            ref = jax.device_get(sampling.sample(graphdef, params, tokens, mask, SETTINGS, key, budgets))
        rows = slice(p * n, p * n + n)
        np.testing.assert_array_equal(got_tokens, ref.tokens[rows], err_msg=f"{v, p}")
        np.testing.assert_array_equal(got_lengths, ref.lengths[rows])
        np.testing.assert_array_equal(got_stopped, ref.stopped[rows])
        np.testing.assert_allclose(got_logprobs, ref.logprobs[rows], rtol=1e-5, atol=1e-5)
    queued = _pool_shard(sampler, QUEUED)
    one = _pool_shard(_new_sampler(graphdef, groups=3), QUEUED)
    # [queue, K, L, pages, s, Dh] against [K, L, pages, s, Dh]: G P TP + F pages (+ 1 spare) split over 2 queues
    assert queued[0] == 1 and queued[1:3] == one[:2] and queued[4:] == one[3:], (queued, one)
    assert (queued[3] - 1) * 2 == one[2] - 1, (queued, one)


@pytest.mark.slow(seconds=60)
def test_rows_exported_by_a_queue_per_shard_resume_as_the_engine_never_stopped():
    """The export of a sampler running a queue per batch shard (``QUEUED``) has the one-queue format (the
    call's row numbering: each slot's row among its own queue's prompts) and a fresh sampler on the same
    mesh resumes it: every group comes back as from the sampler never stopped, bit for bit. An export
    whose slots hold rows of another queue's prompts is refused, naming the split."""
    seeds = [3] * (CALLS + DRAIN)
    groups, _, _ = _run(seeds, mesh_shape=QUEUED, groups=2)
    resumed, _, sampler = _run(seeds, mesh_shape=QUEUED, groups=2, resume_after=1)
    exported = sampler.exported
    held = exported.slots[exported.slots >= 0]
    assert len(held) >= 2 and (held % (P * SETTINGS.n) >= P * SETTINGS.n // 2).any()  # queue 1's rows too
    assert sorted(resumed) == sorted(groups)
    for key, expected in groups.items():
        for got, want in zip(resumed[key], expected):
            np.testing.assert_array_equal(got, want, err_msg=f"{key}")
    swapped = exported._replace(slots=np.roll(exported.slots, SETTINGS.slots // 2))  # each queue's rows in the other's
    graphdef, params = _graphdef_and_params(3, QUEUED)
    with _on_mesh(QUEUED), pytest.raises(ValueError, match="another split of the batch"):
        _new_sampler(graphdef, groups=2).resume(params, swapped, [_batch(v)[:2] for v in exported.generations])

@functools.cache
def _reference():
    """A row decoded alone with a contiguous cache [L, 1, K, T + N, Dh], jitted: prefill(params, tokens
    [T], mask [T], row key) -> (token 0, its log-prob, cache); step(params, cache, mask, token t - 1,
    its position, t, row key) -> (token t, its log-prob, cache with token t - 1's K/V). A token's key
    and selection as the sampler's."""
    graphdef = _graphdef_and_params(3)[0]
    model = lambda params: nnx.merge(graphdef, seam.decode_layout(params, jnp.float32))
    select = lambda logits, row_key, t: Selection(jnp.float32(SETTINGS.temperature), jnp.float32(SETTINGS.top_p),
                                                  SETTINGS.top_k).select(logits, jax.random.fold_in(row_key, t)[None])

    @jax.jit
    def prefill(params, tokens, mask, row_key):
        m = model(params)
        hidden, cache = m.forward(tokens[None], positions_from_mask(mask[None]), mask[None].astype(bool),
                                  m.init_cache(1, T), 0)
        cache = KVCache(*(jnp.pad(c, ((0, 0), (0, 0), (0, 0), (0, N), (0, 0))) for c in cache))
        return *select(m.logits(hidden[:, -1:])[:, 0], row_key, 0), cache

    @jax.jit
    def step(params, cache, mask, token, position, t, row_key):
        m = model(params)
        kv_valid = jnp.concatenate([mask.astype(bool), jnp.ones((N,), bool)])[None]
        hidden, cache = m.forward(token[None], position[None, None], kv_valid, cache, T + t - 1)
        return *select(m.logits(hidden)[:, 0], row_key, t), cache

    return prefill, step


def _reference_row(seeds, version, prompt, sample, versions, length):
    """Row (prompt, sample) of call ``version``'s batch decoded alone: the prompt prefilled with the
    weights of ``versions[0]`` and again with those of ``versions[t]`` where the version changes (every
    call prefills its earlier generations' prompts again), token t selected by a step with the weights
    of ``versions[t]`` (which writes token t - 1's K/V). -> tokens [length], logprobs [length]."""
    prefill, step = _reference()
    tokens, mask, _, key = _batch(version)
    row_key = jax.random.fold_in(jax.random.fold_in(key, prompt), sample)
    params = lambda t: _graphdef_and_params(seeds[int(versions[t])])[1]
    token, logp, cache = prefill(params(0), tokens[prompt], mask[prompt], row_key)
    out_tokens, out_logprobs = [token], [logp]
    real = int(mask[prompt].sum())
    for t in range(1, length):
        if versions[t] != versions[t - 1]:  # the prompt's K/V as this call's weights compute it
            fresh = prefill(params(t), tokens[prompt], mask[prompt], row_key)[2]
            cache = KVCache(*(c.at[:, :, :, :T].set(f[:, :, :, :T]) for c, f in zip(cache, fresh)))
        token, logp, cache = step(params(t), cache, mask[prompt], token, jnp.int32(real + t - 1), jnp.int32(t), row_key)
        out_tokens.append(token)
        out_logprobs.append(logp)
    return np.concatenate(jax.device_get(out_tokens)), np.concatenate(jax.device_get(out_logprobs))


@pytest.mark.slow(seconds=120)
def test_changed_weights_rows_equal_a_per_row_decode_switching_weights_where_the_versions_change():
    """Weights changed every call (a new random model a version): each returned row equals a decode
    of that row alone with a contiguous cache, token t selected with the weights of its recorded
    version, attending to its prompt's K/V as those weights compute it and to earlier tokens' K/V as
    computed then: same tokens, log-probs to tolerance; some rows span two or more versions."""
    seeds = [20 + v for v in range(CALLS + DRAIN)]
    groups, _, _ = _run(seeds)
    assert sorted(groups) == [(v, p) for v in range(CALLS) for p in range(P)]
    spanning = 0
    for (v, p), (tokens, logprobs, versions, lengths, _) in groups.items():
        for j in range(SETTINGS.n):
            length = int(lengths[j])
            assert versions[j, 0] == v and (np.diff(versions[j, :length]) >= 0).all()
            spanning += len(set(versions[j, :length].tolist())) > 1
            ref_tokens, ref_logprobs = _reference_row(seeds, v, p, j, versions[j], length)
            np.testing.assert_array_equal(tokens[j, :length], ref_tokens, err_msg=f"{v, p, j}")
            np.testing.assert_allclose(logprobs[j, :length], ref_logprobs, rtol=1e-4, atol=1e-4)
    assert spanning >= 4


@pytest.mark.slow(seconds=60)
def test_a_row_unfinished_two_versions_after_its_insert_is_dropped_and_its_prompt_reported():
    """max_staleness 1, B = 1, 4 slots, prompts of 2 rows with budgets 2 (prompt 0) and 12 (prompt 1),
    no stop id: call 0 returns prompt 0 after one decode step, its prompt 1 runs on; call 1 returns
    its own prompt 0 (one step), so call 0's prompt 1 is still running when call 2 retires its
    generation: dropped, reported (version 0, prompt 1), its pages back on the free stack."""
    settings = sampling.SamplingSettings(max_new_tokens=N, n=2, temperature=1.0, slots=4, page_size=4, chunk_steps=3)
    graphdef, params = _graphdef_and_params(3)
    sampler = carry_over.CarryOverSampler(graphdef, settings, prompts=2, prompt_length=T, groups=1, max_staleness=1)
    tokens = np.arange(1, 2 * T + 1, dtype=np.int32).reshape(2, T)
    mask = np.ones((2, T), np.int32)
    budgets = np.array([2, 2, N, N], np.int32)
    outs = [jax.device_get(sampler.step(params, v, tokens, mask, jax.random.key(v), budgets)) for v in range(3)]
    assert [(int(o.group_version[0]), int(o.group_prompt[0])) for o in outs] == [(0, 0), (1, 0), (2, 0)]
    assert [int(o.decode_steps) for o in outs] == [1, 1, 1]
    assert not outs[0].dropped.any() and not outs[1].dropped.any()
    np.testing.assert_array_equal(outs[2].dropped, [False, True])
    assert int(outs[2].dropped_version) == 0 and int(outs[1].dropped_version) == -1
    assert int(outs[1].carried_rows) == 2 and int(outs[1].staleness_max) == 0
    kv = sampler._state.decode.kv
    F = sampler.spec.engine.pages
    assert int(kv.count) + int(kv.held.sum()) == F  # every page is free or held by a running row
    running = np.asarray(sampler._state.decode.slots.row)
    # running: gen 1's prompt 1 (region 1: prompt 2 + 1) and gen 2's (region 0: prompt 1)
    assert set(running[running < sampler.spec.rows] // 2) == {1, 3}


@pytest.mark.parametrize("order", ["completion", "admission"])
def test_completion_order_returns_the_first_complete_group_and_admission_order_the_oldest(order):
    """B = 1 of 2 prompts a call, prompt 0's rows with the whole budget N, prompt 1's with 2 tokens, no stop
    id: in completion order call 0 returns prompt 1 after one decode step and call 1 prompt 0, carried
    (N - 2 steps later); in admission order call 0 waits N - 1 steps for prompt 0, and call 1 returns
    call 0's prompt 1, complete since call 0, without a decode step: never a group before an older one."""
    settings = sampling.SamplingSettings(max_new_tokens=N, n=2, temperature=1.0, slots=4, page_size=4, chunk_steps=3)
    graphdef, params = _graphdef_and_params(3)
    sampler = carry_over.CarryOverSampler(graphdef, settings, prompts=2, prompt_length=T, groups=1, max_staleness=1,
                                          order=order)
    tokens = np.arange(1, 2 * T + 1, dtype=np.int32).reshape(2, T)
    mask = np.ones((2, T), np.int32)
    budgets = np.array([N, N, 2, 2], np.int32)
    outs = [jax.device_get(sampler.step(params, v, tokens, mask, jax.random.key(v), budgets)) for v in range(2)]
    returned = [(int(o.group_version[0]), int(o.group_prompt[0])) for o in outs]
    steps = [int(o.decode_steps) for o in outs]
    if order == "completion":
        assert returned == [(0, 1), (0, 0)] and steps == [1, N - 2], (returned, steps)
    else:
        assert returned == [(0, 0), (0, 1)] and steps == [N - 1, 0], (returned, steps)
    assert all(int(o.lengths[0]) == N for o in outs if int(o.group_prompt[0]) == 0)


def test_an_unknown_order_is_refused_naming_it():
    settings = sampling.SamplingSettings(max_new_tokens=N, n=2, temperature=1.0, slots=4, page_size=4)
    with pytest.raises(ValueError, match="order='newest': must be one of completion, admission"):
        carry_over.carry_over_spec(settings, prompts=2, prompt_length=T, groups=1, max_staleness=1, order="newest")


@pytest.mark.slow(seconds=90)
def test_slot_utilisation_of_a_log_normal_length_mix_is_near_one_against_a_call_that_waits_for_its_tail():
    """B = 8 groups of 4 samples a step, 8 slots, budgets log-normal (median 4, cut at 8 x the median =
    32), no stop id. Carry-over, max_staleness 2, room for 12 prompts a call: 12 at the first call,
    then the flow a trainer keeps (B new prompts a call and those dropped, the rest batch padding):
    over calls 1-5 the decode steps sample >= 0.9 of their slots (measured 0.99), no prompt
    dropped. ``engine.sample`` of each step's 8 prompts waits for its longest row (measured 0.65)."""
    capacity, B, n, budget = 12, 8, 4, 32
    settings = sampling.SamplingSettings(max_new_tokens=budget, n=n, temperature=1.0, slots=8, page_size=8,
                                         chunk_steps=8)
    graphdef, params = _graphdef_and_params(3)
    sampler = carry_over.CarryOverSampler(graphdef, settings, prompts=capacity, prompt_length=T, groups=B,
                                          max_staleness=2)
    rng = np.random.default_rng(7)
    decoded = slot_steps = ref_decoded = ref_slot_steps = dropped = 0
    per_call, staleness = [], []
    for v in range(6):
        real = capacity if v == 0 else B + dropped
        tokens = rng.integers(1, CFG.vocab_size, size=(capacity, T)).astype(np.int32)
        mask = (np.arange(capacity) < real)[:, None].repeat(T, axis=1).astype(np.int32)
        budgets = np.clip(np.round(rng.lognormal(np.log(4.0), 1.0, size=capacity * n)), 1, budget).astype(np.int32)
        out = jax.device_get(sampler.step(params, v, tokens, mask, jax.random.key(v), budgets))
        dropped = int(out.dropped.sum())
        assert out.group_valid.all() and dropped == 0
        ref = jax.device_get(sampling.sample(graphdef, params, tokens[:B], mask[:B], settings, jax.random.key(v),
                                             budgets[:B * n]))
        per_call.append((round(out.slot_utilisation, 3),
                         round(sampling.slot_utilisation(ref.lengths, int(ref.slot_steps)), 3)))
        staleness.append((round(float(out.staleness_mean), 3), int(out.staleness_max)))
        if v:  # the first call starts from empty slots
            decoded += int(out.decoded_tokens)
            slot_steps += int(out.slot_steps)
            ref_decoded += int(np.maximum(ref.lengths - 1, 0).sum())
            ref_slot_steps += int(ref.slot_steps)
    carry, today = decoded / slot_steps, ref_decoded / ref_slot_steps
    print(f"slot utilisation per call (carry-over, sample): {per_call}; calls 1-5: carry-over {carry:.3f}, "
          f"sample {today:.3f}; staleness (mean, max) per call {staleness}")
    assert carry >= 0.9 and today < 0.75
