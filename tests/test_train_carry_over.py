"""Carry-over rollouts in the trainer (``rollout.carry_over``; issue 50), on the (2, 2, 2) mesh: each step
trains the groups that the engine (sampling/carry_over.py) returns when driven step by step as the
trainer should drive it (step s's call at version s, with the weights after step s - 1's update, its
own prompts and key); rows go over from step to step; nothing compiles after step 1; a run stopped
after step 2 and resumed trains what the run never stopped trains: no prompt lost or trained twice,
the rows in flight at the stop continue from their saved tokens (their K/V recomputed, said in one
line), nothing compiled after the resumed session's step 1; the warm-up before step 1 compiles the
engine's six programs (a call's four, a resume's two), so step 1 compiles none of them."""

import collections
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax.rewards import RewardPool
from pacs_jax.sampling import buckets, carry_over
from pacs_jax.sampling.carry_over import CarryOverSampler
from pacs_jax.sampling.settings import row_pages
from pacs_jax.training import rollout as rollout_module
from pacs_jax.training.config_check import ConfigError, validate_config
from pacs_jax.training.loop import rl_train
from pacs_jax.training.records import PromptBatch
from pacs_jax.training.spec import RunSpec
from pacs_jax.training import compilations, memory_check
from pacs_jax.training.step_programs import StepPrograms
from test_train_config import load_config
from train_helpers import ListPromptSource, tiny_model_on_mesh, with_adapters

N, PROMPTS, MAX_NEW_TOKENS, SEED = 2, 4, 12, 4
STOPS = tuple(range(2, 22))  # about 1 token in 5 ends a response: lengths from 1 to the budget


@pytest.fixture(scope="module")
def setup():
    mesh, model = tiny_model_on_mesh()
    config = load_config("default.py")
    config.seed = SEED
    config.rollout.update(n=N, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, carry_over=True, max_staleness=1,
                          slots=8, stop_token_ids=STOPS)
    config.data.max_prompt_length, config.data.prompt_buckets = 16, (8, 16)
    config.train.update(prompts_per_step=PROMPTS, logprob_micro_batches=1, mini_batches=1, packing=False,
                        checkpoint_every=1, precompile=False)
    config.optim.update(schedule="constant", warmup_steps=0, lr=1e-3)
    rs = np.random.RandomState(0)
    batches = [PromptBatch([list(rs.randint(30, 96, size=rs.randint(3, 16))) for _ in range(PROMPTS)],
                           ["7"] * PROMPTS, [f"prompt {b * PROMPTS + i}" for i in range(PROMPTS)]) for b in range(24)]
    return mesh, model, config, batches


def _parity(ids) -> str:
    return "7" if len(ids) and int(ids[0]) % 2 == 0 else "8"


def test_carry_over_needs_the_paged_sampler_and_one_call_a_step():
    for field, value, words in (("sampler", "continuous", "set rollout.sampler=paged"),
                                ("micro_batches", 2, "set rollout.micro_batches=1")):
        config = load_config("default.py")
        config.rollout.carry_over = True
        config.rollout[field] = value
        with pytest.raises(ConfigError, match=f"config.rollout.carry_over: .*{words}"):
            validate_config(config)
    config = load_config("default.py")
    config.rollout.update(carry_over=True, carry_over_order="newest")
    with pytest.raises(ConfigError, match="config.rollout.carry_over_order: must be one of 'completion', 'admission', "
                                          "got 'newest'"):
        validate_config(config)
    config.rollout.carry_over_order = "admission"
    assert RunSpec.unplaced(config).algorithm.rollout_correction.rollout_is == "token"  # the stale tokens weighed


def test_carry_overs_pages_must_hold_a_response_in_each_queue_of_the_mesh():
    """With a queue per batch shard, ``rollout.pages`` (the whole pool's response pages) is split over the
    queues: one response's pages (enough for one queue) on 8 data shards leave each queue none, refused
    before anything is built, naming the field and the smallest count that fits; with one queue it fits."""
    config = load_config("default.py")
    longest = row_pages(config.rollout.page_size, config.rollout.max_new_tokens)
    config.rollout.update(carry_over=True, tail_slots=0, pages=longest)
    config.mesh.update(data=8, fsdp=1, tensor=1)
    with pytest.raises(ConfigError, match=rf"config.rollout.pages: {longest}, split over carry-over's 8 queues .* set "
                                          rf"it to at least {8 * longest}, or 0"):
        validate_config(config, 8)
    config.mesh.update(data=1, tensor=2)
    validate_config(config, 2)  # no batch shards: one queue, the pool whole


def _train(config, model, batches, workdir, steps, pool, trained):
    """rl_train for ``steps`` (resuming ``workdir``): its history, each step's params before its update
    (by step) and its carry-over prompt source; each step's trained rows, metrics and the batches of prompts
    its calls inserted (one a call: the prompts and their token ids placed in the engine's batch) appended to
    ``trained``."""
    config.train.steps = steps
    graphdef, params = nnx.split(model)
    weights = {}

    def on_step(step, model, metrics):
        weights[step + 1] = jax.tree.map(np.asarray, nnx.state(model))

    collect = rollout_module.RolloutCollector.__call__

    def recording(self, state, batches_fn, key, watch=None, step=0):
        weights.setdefault(step, jax.tree.map(np.asarray, state))
        inserted = []
        def drawn():  # each gen batch's prompts and their token ids at their places in the engine's batch
            prompts = batches_fn()
            inserted.append((prompts, self.carry.placed(prompts.prompt_ids)))
            return prompts

        result = collect(self, state, drawn, key, watch, step)
        trained.append((step, {k: np.asarray(getattr(result.batch, k)) for k in ("input_ids", "response_mask")},
                        result.metrics, inserted))
        return result

    rollout_module.RolloutCollector.__call__ = recording
    try:
        source = ListPromptSource(batches)
        fresh = nnx.merge(graphdef, jax.tree.map(jax.numpy.copy, params))
        result = rl_train(RunSpec.unplaced(config), workdir, fresh, source, decode=_parity, stop_token_ids=(1,),
                          reward_pool=pool, on_step=on_step)
    finally:
        rollout_module.RolloutCollector.__call__ = collect
    return result.history, weights, result.collector.carry


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_each_step_trains_the_groups_the_engine_returns_driven_step_by_step(setup, tmp_path, capsys, adapters):
    """With LoRA adapters (rank 2 on every linear layer) the same: the engine samples each step with the newest
    adapters, where an engine left on the first ones would sample other tokens (checked: the test fails on it)."""
    mesh, model, config, batches = setup
    if adapters:
        model, config = with_adapters(mesh, model, config)
    config = config.copy_and_resolve_references()
    config.train.checkpoint_every = 0  # the last step's checkpoint only (the resume tests read theirs)
    trained = []
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        history, weights, _ = _train(config.copy_and_resolve_references(), model, batches, tmp_path / "run", 4, pool,
                                     trained)
        # the reference: the engine alone, step s's call with the weights step s started from
        spec = RunSpec.unplaced(config)
        graphdef, _ = nnx.split(model)
        settings = StepPrograms(spec, *nnx.split(model), (1,)).sampler.settings
        engine = CarryOverSampler(graphdef, settings, prompts=2 * PROMPTS, prompt_length=16, groups=PROMPTS,
                                  max_staleness=1)
        base = jax.random.key(SEED)
        first = CarryOverSampler(graphdef, settings, prompts=2 * PROMPTS, prompt_length=16, groups=PROMPTS,
                                 max_staleness=1) if adapters else None  # on the first adapters throughout
        differ = []
        for step, batch, metrics, ((_, placed),) in trained:
            tokens, mask = buckets.left_pad(placed, 2 * PROMPTS, 16)
            rows = jax.tree.map(np.asarray, engine.step(weights[step], step, tokens, mask,
                                                        jax.random.fold_in(base, step)))
            if first is not None:
                stale = first.step(weights[1], step, tokens, mask, jax.random.fold_in(base, step))
                differ.append(not np.array_equal(np.asarray(stale.tokens), rows.tokens))
            R = batch["response_mask"].shape[1]
            for r in range(PROMPTS * N):
                L = int(rows.lengths[r])
                assert batch["response_mask"][r].sum() == L, (step, r)
                np.testing.assert_array_equal(batch["input_ids"][r, -R:][:L], rows.tokens[r, :L], err_msg=f"{step} {r}")
            assert metrics["rollout_staleness_max"] == float(rows.staleness_max)
            assert metrics["carried_rows"] == float(rows.carried_rows)
    if adapters:  # step 1: both on the first adapters; later, the stale engine samples other tokens
        assert not differ[0] and any(differ[1:]), differ
    assert [len(inserted[0][0].prompt_ids) for *_, inserted in trained][0] == 2 * PROMPTS  # then what the last call returned
    assert all(m["carried_rows"] > 0 for _, _, m, _ in trained[1:])  # responses went over to the next step
    assert max(m["rollout_staleness_max"] for _, _, m, _ in trained) == 1.0
    assert len({h["compilations"] for h in history}) == 1  # nothing compiled after step 1
    out = capsys.readouterr().out  # issue 67 item 4: a line a step of what carry-over did, from its metrics
    for step, _, metrics, _ in trained:
        assert (f"step {step}: carry-over: {metrics['carried_rows']:.0f} rows carried in, staleness mean "
                f"{metrics['rollout_staleness_mean']:.2f} max {metrics['rollout_staleness_max']:.0f}") in out, out


def test_dynamic_sampling_with_carry_over_keeps_the_first_groups_with_spread_the_engine_returns(setup, tmp_path):
    """algorithm.filter_groups with rollout.carry_over: a step's gen batches are calls of the engine (versions
    counting the calls); each step trains the first B groups with spread among the groups those calls return,
    in order, as the engine driven alone call by call (each with its step's weights and gen-batch key) returns
    them and the host judges them."""
    mesh, model, config, batches = setup
    config = config.copy_and_resolve_references()
    config.algorithm.filter_groups.update(enable=True, metric="acc", max_num_gen_batches=0)
    config.train.checkpoint_every = 0  # the last step's checkpoint only
    trained = []
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        history, weights, _ = _train(config, model, batches, tmp_path / "run", 3, pool, trained)
        graphdef, _ = nnx.split(model)
        settings = StepPrograms(RunSpec.unplaced(config), *nnx.split(model), (1,)).sampler.settings
        engine = CarryOverSampler(graphdef, settings, prompts=2 * PROMPTS, prompt_length=16, groups=PROMPTS,
                                  max_staleness=1)
        base, version = jax.random.key(SEED), 0
        for step, batch, metrics, inserted in trained:
            assert metrics["num_gen_batches"] == len(inserted)
            key, kept = jax.random.fold_in(base, step), []
            for g, (_, placed) in enumerate(inserted):
                version += 1
                tokens, mask = buckets.left_pad(placed, 2 * PROMPTS, 16)
                rows = jax.tree.map(np.asarray, engine.step(weights[step], version, tokens, mask,
                                                            key if g == 0 else jax.random.fold_in(key, g)))
                for group in range(PROMPTS):
                    responses = [rows.tokens[r, :rows.lengths[r]] for r in range(group * N, group * N + N)]
                    if len({_parity(ids) for ids in responses}) > 1:  # some right, some wrong: spread
                        kept.append(responses)
            R = batch["response_mask"].shape[1]
            for g, responses in enumerate(kept[:PROMPTS]):
                for j, ids in enumerate(responses):
                    r = g * N + j
                    assert batch["response_mask"][r].sum() == len(ids), (step, r)
                    np.testing.assert_array_equal(batch["input_ids"][r, -R:][:len(ids)], ids, err_msg=f"{step} {r}")
    assert max(m["num_gen_batches"] for _, _, m, _ in trained) >= 2  # some step needed a second call
    assert all(m["groups_all_equal"] == 0.0 for _, _, m, _ in trained)
    assert len({h["compilations"] for h in history}) == 1  # nothing compiled after step 1


def test_a_run_stopped_after_step_2_and_resumed_trains_every_prompt_once_and_its_rows_in_flight_go_on(
        setup, tmp_path, capsys, monkeypatch):
    """The checkpoint of step 2 holds the prompt cursor, the queue and the rows in flight (their tokens so
    far), read from the engine only for the steps that write a checkpoint (train.checkpoint_every=2: one
    export in two steps); the resumed session puts them back into the engine in its first step's phase
    "resume", their K/V recomputed with step 2's weights, with a line before and after. A session
    stopped by SIGINT during that replay exits in step 3's phase "resume" with the checkpoint of step 2
    as it was; the session after it resumes from it: over the sessions no prompt is trained twice,
    every prompt drawn is trained or still held, every step is the run never stopped's bit for bit,
    the rows in flight at the stop are trained with their saved tokens as prefixes (they went on, not
    sampled again), and the resumed session compiles nothing after its step 1."""
    import signal

    from pacs_jax.training import progress

    mesh, model, config, batches = setup
    config = config.copy_and_resolve_references()
    config.train.checkpoint_every = 2
    export, exports = CarryOverSampler.export, []
    monkeypatch.setattr(CarryOverSampler, "export", lambda self: exports.append(1) or export(self))
    trained = []
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        _, _, first = _train(config.copy_and_resolve_references(), model, batches, tmp_path / "run", 2, pool, trained)
        assert len(exports) == 1  # the rows went to the host for the checkpoint of step 2 only, not after step 1
        exported = first.engine.export()
        saved = {(tuple(first.inserted[v][p][0]), j): rows.tokens[p * N + j, :rows.lengths[p * N + j]]
                 for v, rows in zip(exported.generations, exported.rows) for p in np.flatnonzero(rows.live)
                 for j in range(N) if rows.lengths[p * N + j]}
        meta = tmp_path / "run" / "checkpoints" / "2" / "meta" / "metadata"
        written = meta.read_bytes()

        wait, asked = progress.StepWatch.wait, []

        def signalled(self, arrays, detail):  # SIGINT during the replay, after its first program
            if self.phase == "resume" and not asked:
                asked.append(detail())
                signal.raise_signal(signal.SIGINT)
            return wait(self, arrays, detail)

        monkeypatch.setattr(progress.StepWatch, "wait", signalled)
        capsys.readouterr()
        stopped, _, _ = _train(config.copy_and_resolve_references(), model, batches, tmp_path / "run", 5, pool, [])
        out = capsys.readouterr().out
        monkeypatch.setattr(progress.StepWatch, "wait", wait)
        assert asked and stopped == [] and "SIGINT during step 3 (resume): step 3 dropped" in out, out
        assert meta.read_bytes() == written and sorted(p.name for p in meta.parents[1].parent.iterdir()
                                                       if p.name.isdigit()) == ["2"]  # untouched
        history, _, source = _train(config.copy_and_resolve_references(), model, batches, tmp_path / "run", 5, pool,
                                    trained)
        out = capsys.readouterr().out
        whole = []  # the run never stopped
        _train(config.copy_and_resolve_references(), model, batches, tmp_path / "whole", 5, pool, whole)
    for (step, batch, *_), (_, reference, *_) in zip(trained, whole):
        for name in ("input_ids", "response_mask"):
            np.testing.assert_array_equal(batch[name], reference[name], err_msg=f"step {step} {name}")
    assert re.search(rf"step 3: resume: replaying {len(saved)} rows in flight \({sum(map(len, saved.values())):,} "
                     rf"tokens, {exported.running} in decode slots\), their K/V recomputed with step 2's weights\n"
                     rf"step 3: resume done in \d+ s \({len(saved)} rows in flight\)\n", out), out
    assert exported.running and max(map(len, saved.values())) >= 2  # some rows were mid-response at the stop
    assert [step for step, *_ in trained] == [1, 2, 3, 4, 5]
    counts, responses = collections.Counter(), {}
    for step, batch, *_ in trained:
        R = batch["response_mask"].shape[1]
        for g in range(PROMPTS):
            prompt = tuple(int(t) for t in batch["input_ids"][g * N, :-R] if t)  # left padding is 0
            counts[prompt] += 1
            for j in range(N):
                row = g * N + j
                responses[prompt, j] = batch["input_ids"][row, -R:][:int(batch["response_mask"][row].sum())]
    assert max(counts.values()) == 1, counts  # no prompt trained twice
    drawn = {tuple(p) for b in batches[:source.source.next_index] for p in b.prompt_ids}
    held = {tuple(p) for p, _, _ in source.queued} | {tuple(source.inserted[v][p][0]) for v in source.live
                                                      for p in source.live[v]}
    assert drawn == set(counts) | held and not set(counts) & held
    # a saved row goes on to be trained with its tokens as a prefix, unless its prompt was later dropped as
    # stale (max_staleness 1) and sampled afresh
    went_on = {key for key, tokens in saved.items() if key in responses
               and np.array_equal(responses[key][:len(tokens)], tokens)}
    not_on = {prompt for prompt, _ in set(saved) - went_on}
    assert len(went_on) >= len(saved) // 2 and len(not_on) <= sum(h["carry_over_dropped"] for h in history), (
        len(went_on), len(saved), not_on)
    assert len({h["compilations"] for h in history}) == 1  # the resumed session: nothing compiled after its step 1


@pytest.mark.parametrize("phase,every", [("sampling", 1), ("sampling", 2), ("reward", 1), ("pi_old", 2), ("update", 1)])
def test_a_run_stopped_in_each_phase_of_step_2_and_resumed_trains_every_prompt_once(setup, tmp_path, monkeypatch,
                                                                                      phase, every):
    """A stop signal at the start of step 2's ``phase`` drops step 2 (its call abandoned in sampling); the resumed
    session trains steps 2 and 3: over the sessions no prompt is trained twice, and every prompt drawn is
    trained or still held. train.checkpoint_every 1: the engine's rows after step 1's call are in step 1's
    checkpoint; 2: step 1 wrote none, the stop writes it, the rows in flight read from the engine then
    (the only export of the session) when the stop came before step 2's call began, else (its insert took
    the engine's state) none read, the prompts in flight queued first instead (sampled again)."""
    import signal

    from pacs_jax.training import progress

    mesh, model, config, batches = setup
    config = config.copy_and_resolve_references()
    config.train.checkpoint_every = every
    export, exports = CarryOverSampler.export, []
    monkeypatch.setattr(CarryOverSampler, "export", lambda self: exports.append(1) or export(self))
    start, asked = progress.StepWatch.start, []

    def start_phase(self, name, last_boundary=False):
        if (self.step, name) == (2, phase) and not asked:
            asked.append(name)
            signal.raise_signal(signal.SIGINT)
        return start(self, name, last_boundary)

    monkeypatch.setattr(progress.StepWatch, "start", start_phase)
    sessions = []
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        for steps in (3, 3):
            trained = []
            history, _, source = _train(config.copy_and_resolve_references(), model, batches, tmp_path / "run",
                                        steps, pool, trained)
            finished = {h["step"] for h in history}
            sessions.append([(step, batch) for step, batch, *_ in trained if step in finished])
            if len(sessions) == 1:
                meta = tmp_path / "run" / "checkpoints" / "1" / "meta" / "metadata"
                first = len(exports), json.loads(meta.read_text())["data_state"]
    if every == 1 or phase == "sampling":  # written after step 1's call, or at a stop before step 2's began
        assert first[0] == 1 and first[1]["in_flight"]["version"] == 1 and first[1]["in_flight"]["generations"]
    else:  # step 2's call had begun: no rows read, its prompts in flight queued first
        assert first[0] == 0 and first[1]["in_flight"] is None and len(first[1]["queued"]) >= PROMPTS
    assert asked and [step for step, _ in sessions[0]] == [1] and [step for step, _ in sessions[1]] == [2, 3]
    counts = collections.Counter()
    for step, batch in sessions[0] + sessions[1]:
        R = batch["response_mask"].shape[1]
        counts.update(tuple(int(t) for t in batch["input_ids"][g * N, :-R] if t) for g in range(PROMPTS))
    assert max(counts.values()) == 1, counts  # no prompt trained twice
    drawn = {tuple(p) for b in batches[:source.source.next_index] for p in b.prompt_ids}
    held = {tuple(p) for p, _, _ in source.queued} | {tuple(source.inserted[v][p][0]) for v in source.live
                                                      for p in source.live[v]}
    assert drawn == set(counts) | held and not set(counts) & held  # none lost


@pytest.mark.slow(seconds=45)
def test_the_warm_up_compiles_the_carry_over_programs_and_step_1_compiles_none(setup, tmp_path, monkeypatch):
    """train.precompile: ``StepPrograms.compile`` lists carry-over's sampler (its init, insert, chunk and
    harvest programs and a resume's restore and reseat, lowered on abstract arguments; XLA's memory read
    with the state and parameters among the arguments; the state, as a real call leaves it, counted beside
    every later program) and traces the six (max_staleness 2: programs no other test compiled); step 1's
    call then traces and compiles none of them."""
    mesh, model, config, batches = setup
    config = config.copy_and_resolve_references()
    config.rollout.max_staleness, config.train.precompile = 2, True
    compiled, calls, made = [], [], []
    compile_step, step = StepPrograms.compile, CarryOverSampler.step

    def compiling(self, **kwargs):
        compiled.extend(compile_step(self, **kwargs))
        made.append(self)
        return compiled

    def calling(self, *args, **kwargs):
        traced = carry_over.compile_count()
        with compilations.built() as events:
            try:
                return step(self, *args, **kwargs)
            finally:
                calls.append((traced, carry_over.compile_count(), len(events)))

    monkeypatch.setattr(StepPrograms, "compile", compiling)
    monkeypatch.setattr(CarryOverSampler, "step", calling)
    before = carry_over.compile_count()
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        _, _, carry = _train(config, model, batches, tmp_path / "run", 1, pool, [])
    # the engine's state stays on the devices beside every later program: the memory check counts it there
    state = memory_check.per_device_bytes(carry.engine._state)
    listed = {p.name: p.outside for p in made[0].programs()}
    for program in compiled:
        if program.name != "sampler":
            assert program.outside == listed[program.name] + state, program.name
    sampler = [p for p in compiled if p.name == "sampler"]
    assert len(sampler) == 1 and sampler[0].shape.startswith(
        f"carry-over: {2 * PROMPTS} prompts x 16 tokens a call, n={N}, 3 generations (max_staleness + 1): "
        f"{3 * 2 * PROMPTS * N} rows in 8 decode slots"), sampler
    params = memory_check.per_device_bytes(nnx.state(model))
    assert sampler[0].argument > params and sampler[0].peak >= sampler[0].argument and not sampler[0].error
    assert calls[0][0] - before == 6  # the warm-up traced init, insert, chunk, harvest, restore and reseat
    assert [(end - start, events) for start, end, events in calls] == [(0, 0)]
