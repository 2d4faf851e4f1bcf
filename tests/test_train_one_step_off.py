"""One step off on split devices (``train.off_policy_steps=1``, ``mesh.rollout_devices=4``; issue 50 item 4):
the rollout engine on the first 4 of the 8 simulated devices, the learner on the other 4. The trainer,
which samples step s + 1 while step s's update runs, equals a sequential reference that samples step s
with the weights step s - 1 started from and then trains it, bit for bit (the tokens, pi_old, the losses,
the weights after every step); the weights round-trip the move to the engine's mesh exactly; a run
stopped at each phase of a step and resumed trains every prompt once; and the config refuses what one
step off cannot do, naming the field."""

import collections
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import models, sharding
from pacs_jax.rewards import RewardPool
from pacs_jax.training import memory_check, progress
from pacs_jax.training.config_check import ConfigError, validate_config
from pacs_jax.training.learner.learner_programs import LearnerPrograms
from pacs_jax.training.loop import rl_train
from pacs_jax.training.records import PromptBatch
from pacs_jax.training.rollout import RolloutCollector
from pacs_jax.training.spec import RunSpec
from pacs_jax.training.step_programs import StepPrograms
from pacs_jax.training.engine.weight_sync import WeightSync
from test_train_config import load_config
from train_helpers import ListPromptSource, with_adapters

N, PROMPTS, MAX_NEW_TOKENS, SEED, ENGINE = 2, 4, 10, 4, 4
STOPS = tuple(range(2, 22))  # about 1 token in 5 ends a response


def _parity(ids) -> str:
    return "7" if len(ids) and int(ids[0]) % 2 == 0 else "8"


@pytest.fixture(scope="module")
def setup():
    """(learner mesh (1, 2, 2) on devices 4-7, engine mesh (2, 1, 2) on devices 0-3, a 1-layer Qwen3 of a 96-token
    vocabulary on the learner's mesh, the config, 12 batches of prompts)."""
    config = load_config("default.py")
    config.seed = SEED
    config.mesh.update(data=-1, fsdp=2, tensor=2, rollout_devices=ENGINE)
    config.rollout.update(n=N, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, slots=4, stop_token_ids=STOPS)
    config.data.max_prompt_length, config.data.prompt_buckets = 16, (8, 16)
    config.train.update(prompts_per_step=PROMPTS, logprob_micro_batches=1, mini_batches=1, packing=False,
                        checkpoint_every=1, precompile=False, off_policy_steps=1)
    config.optim.update(schedule="constant", warmup_steps=0, lr=1e-3)
    learner = sharding.config_mesh(config.mesh)
    engine = sharding.rollout_mesh(config.mesh, learner.shape["tensor"])
    cfg = models.QwenConfig(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            attention_bias=False, bos_token_id=None, eos_token_id=1, max_position_embeddings=128)
    with jax.set_mesh(learner):
        model = models.init_random(cfg, seed=5)
    rs = np.random.RandomState(0)
    batches = [PromptBatch([list(rs.randint(30, 96, size=rs.randint(3, 16))) for _ in range(PROMPTS)],
                           ["7"] * PROMPTS, [f"prompt {b * PROMPTS + i}" for i in range(PROMPTS)]) for b in range(12)]
    return learner, engine, model, config, batches


def test_the_meshes_split_the_devices(setup):
    learner, engine, *_ = setup
    assert [d.id for d in engine.devices.reshape(-1)] == [0, 1, 2, 3] and dict(engine.shape) == {
        "data": 2, "fsdp": 1, "tensor": 2}
    assert [d.id for d in learner.devices.reshape(-1)] == [4, 5, 6, 7] and dict(learner.shape) == {
        "data": 1, "fsdp": 2, "tensor": 2}


def _copy(params):
    return jax.tree.map(jnp.copy, params)


def _host(batch) -> dict[str, np.ndarray]:
    """An update batch's rows, prompts and responses, pi_old and rewards, on the host."""
    return {k: np.asarray(getattr(batch, k)) for k in ("input_ids", "response_mask", "old_logp", "rewards")}


def _train(config, model, batches, workdir, steps, pool, programs, trained, on_step=None):
    """rl_train for ``steps`` (resuming ``workdir``) with ``programs``; each step's trained rows (input_ids,
    response_mask, old_logp, rewards on the host) and metrics appended to ``trained``."""
    config.train.steps = steps
    finish = RolloutCollector.finish

    def recording(self, state, collected, watch):
        rollout = finish(self, state, collected, watch)
        trained.append((_host(rollout.batch), rollout.metrics))
        return rollout

    RolloutCollector.finish = recording
    try:
        graphdef, params = nnx.split(model)
        return rl_train(RunSpec.unplaced(config), workdir, nnx.merge(graphdef, _copy(params)), ListPromptSource(batches),
                        decode=_parity, stop_token_ids=(1,), reward_pool=pool, programs=programs, on_step=on_step)
    finally:
        RolloutCollector.finish = finish


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_the_trainer_equals_the_sequential_reference_bit_for_bit(setup, tmp_path, adapters):
    """The reference, step by step and nothing overlapped: the engine's copy of the weights step s - 1 started
    from (cast and put on the engine's devices by hand, not by WeightSync) samples step s's rows with step s's
    key, the learner computes pi_old with the weights step s starts from and updates. With LoRA adapters
    (rank 2 on every linear layer; WeightSync moves the adapters alone after the first move) the same, and
    the engine left on the first adapters would sample other tokens (checked: the test fails on it)."""
    learner, engine, model, config, batches = setup
    config = config.copy_and_resolve_references()
    if adapters:
        model, config = with_adapters(learner, model, config)
    steps, trained, weights = 4, [], {}
    with jax.set_mesh(learner), RewardPool(1) as pool:
        spec = RunSpec.unplaced(config)
        programs = StepPrograms(spec, *nnx.split(model), (1,), rollout_mesh=engine)
        result = _train(config, model, batches, tmp_path / "run", steps, pool, programs, trained,
                        on_step=lambda s, m, _: weights.__setitem__(s, jax.tree.map(np.asarray, nnx.state(m))))
        assert spec.algorithm.rollout_correction.rollout_is == "token"  # the stale tokens weighed, by default
        collector = RolloutCollector.from_spec(spec, programs, decode=_parity, reward_pool=pool)
        graphdef, params = nnx.split(model)
        params = _copy(params)
        opt_state = programs.learner.init_optimizer(params)
        targets = programs.weight_sync.abstract
        by_hand = lambda p: jax.tree.map(lambda x, t: jax.device_put(x.astype(t.dtype), t.sharding), p, targets)  # noqa: E731
        base, source = jax.random.key(SEED), ListPromptSource(batches)
        started_from = {1: by_hand(params)}  # the engine's copies of the weights each step started from
        reference = []
        for step in range(1, steps + 1):
            started_from[step] = by_hand(params)
            weights_of_rows = started_from[max(step - 1, 1)]
            rows = collector.collect(weights_of_rows, source.next_batch, jax.random.fold_in(base, step),
                                     progress.StepWatch.silent(), step)
            if adapters and step == steps:  # the first adapters (the engine never told of an update) sample others
                first = collector.collect(started_from[1], ListPromptSource([batches[step - 1]]).next_batch,
                                          jax.random.fold_in(base, step), progress.StepWatch.silent(), step)
                assert not np.array_equal(first.sampled.local_tokens, rows.sampled.local_tokens), "adapters change nothing"
            rollout = collector.finish(params, rows, progress.StepWatch.silent())
            reference.append((_host(rollout.batch), rollout.metrics))
            params, opt_state, per_minibatch = programs.learner.update(params, opt_state, rollout.batch)
            reference[-1][1].update(jax.tree.map(float, per_minibatch[0]))
            for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(weights[step]), strict=True):
                np.testing.assert_array_equal(np.asarray(ours), theirs, err_msg=f"weights after step {step}")
    assert [m["rollout_staleness_max"] for _, m in trained] == [0.0, 1.0, 1.0, 1.0]
    # the sampler's own log-probs against pi_old's recompute: the same weights at step 1, an update apart after
    diffs = [m["rollout_logprob_diff_max"] for _, m in trained]
    assert diffs[0] < 1e-5 < 1e-3 < min(diffs[1:]), diffs
    for step, ((batch, metrics), (ref_batch, ref_metrics), row) in enumerate(
            zip(trained, reference, result.history, strict=True), 1):
        for k in ("input_ids", "response_mask", "old_logp", "rewards"):
            np.testing.assert_array_equal(batch[k], ref_batch[k], err_msg=f"step {step} {k}")
        for k in ("loss", "grad_norm", "entropy", "rollout_kl", "sampled_tokens_checksum"):
            assert row[k] == ref_metrics[k], (step, k)
    assert len({h["compilations"] for h in result.history[1:]}) == 1  # nothing compiled after step 2's


def test_the_weights_round_trip_the_move_exactly(setup):
    learner, engine, model, *_ = setup
    with jax.set_mesh(learner):
        params = _copy(nnx.state(model))
        exact = WeightSync(params, engine, jnp.float32)
        copy = exact(params)
        for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(copy), strict=True):
            assert {d.id for d in y.sharding.device_set} == {0, 1, 2, 3}
            back = jax.device_put(y, x.sharding)
            np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
            assert back.dtype == x.dtype
        cast = WeightSync(params, engine, jnp.bfloat16)
        moved = cast(params)
        again = cast(params, previous=moved)  # the previous copy's buffers freed as the new ones arrive
        assert all(x.is_deleted() for x in jax.tree.leaves(moved))
        for x, y, t in zip(jax.tree.leaves(params), jax.tree.leaves(again), jax.tree.leaves(cast.abstract), strict=True):
            assert y.dtype == jnp.bfloat16 and y.sharding == t.sharding
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x.astype(jnp.bfloat16)))
            # the decode layout: replicated over the engine's batch axes, split over its tensor axis only
            assert "data" not in str(y.sharding.spec) and "fsdp" not in str(y.sharding.spec)


def test_the_copy_on_the_learners_own_devices_outlives_the_learners_donated_buffers(setup):
    """One step off with the engine on the learner's devices (no mesh.rollout_devices: they take turns) in the
    learner's dtype and layout, the demo's case: the copy is buffers of its own, so the update donating (here:
    deleting) the learner's parameters leaves the engine's copy readable, with the values it had. (It aliased
    them: the demo with train.off_policy_steps=1 stopped at step 1 with "Array has been deleted".)"""
    learner, _, model, *_ = setup
    with jax.set_mesh(learner):
        params = _copy(nnx.state(model))
        leaves = jax.tree.leaves(params)
        shared = WeightSync(params, learner, jnp.float32)
        # the decode layout of a tensor-split mesh equals the learner's for the replicated leaves: those alias
        assert any(t.sharding == x.sharding for x, t in zip(leaves, jax.tree.leaves(shared.abstract), strict=True))
        expected = [np.asarray(x) for x in leaves]
        copy = shared(params)
        for x in leaves:
            x.delete()  # what the update's donation does to the learner's buffers
        for y, value in zip(jax.tree.leaves(copy), expected, strict=True):
            assert not y.is_deleted()
            np.testing.assert_array_equal(np.asarray(y), value)


@pytest.mark.parametrize("stop", [(2, "sampling"), (2, "reward"), (2, "pi_old"), (2, "update"), (3, "sampling")])
def test_a_run_stopped_at_each_phase_and_resumed_trains_every_prompt_once(setup, tmp_path, monkeypatch, stop):
    """A stop signal at the start of ``stop`` = (step, phase): step 2's sampling and reward run ahead, during
    step 1's update (the rows are dropped; step 1 ends: finished and checkpointed, or its update abandoned);
    its pi_old and update are the learner's (step 2 dropped); step 3's sampling runs during step 2's update. Over the stopped session and the
    resumed one, the steps trained are the prompt batches in order, each once."""
    learner, engine, model, config, batches = setup
    config = config.copy_and_resolve_references()
    start, asked = progress.StepWatch.start, []

    def start_phase(self, phase, last_boundary=False):
        if (self.step, phase) == stop and not asked:
            asked.append(phase)
            signal.raise_signal(signal.SIGINT)
        return start(self, phase, last_boundary)

    monkeypatch.setattr(progress.StepWatch, "start", start_phase)
    finished, rows = [], {}
    record = lambda step, m, metrics: finished.append((step, rows[step]))  # noqa: E731
    finish = RolloutCollector.finish

    def keep(self, state, collected, watch):
        rollout = finish(self, state, collected, watch)
        rows[watch.step] = np.asarray(rollout.batch.input_ids)
        return rollout

    monkeypatch.setattr(RolloutCollector, "finish", keep)
    with jax.set_mesh(learner), RewardPool(1) as pool:
        programs = StepPrograms(RunSpec.unplaced(config), *nnx.split(model), (1,), rollout_mesh=engine)
        first = _train(config, model, batches, tmp_path / "run", 4, pool, programs, [], on_step=record)
        assert first.stopped_by_signal and asked
        # a stop in the learner's phases drops its step; one while sampling ahead drops those rows and ends the
        # step under way (finished, or its update abandoned if it is still running: step - 1's checkpoint is on disk)
        s = stop[0]
        assert (first.final_step, first.dropped_step) in ([(s - 1, None), (s - 2, s - 1)] if stop[1] in ("sampling", "reward")
                                                          else [(s - 1, s)])
        second = _train(config, model, batches, tmp_path / "run", 4, pool, programs, [], on_step=record)
    assert not second.stopped_by_signal
    assert [step for step, _ in finished] == [1, 2, 3, 4][:len(finished)] and len(finished) == 4
    counts = collections.Counter()
    for step, ids in finished:
        prompts = [tuple(int(t) for t in ids[g * N, :16] if t) for g in range(PROMPTS)]  # left padding is 0
        assert prompts == [tuple(p) for p in batches[step - 1].prompt_ids], step  # in order: none lost
        counts.update(prompts)
    assert max(counts.values()) == 1  # none trained twice


@pytest.mark.parametrize("changes, field, words", [
    ({"mesh.rollout_devices": 4}, "mesh.rollout_devices", "set train.off_policy_steps=1"),
    ({"train.off_policy_steps": 2}, "train.off_policy_steps", "must be 0 .* or 1"),
    ({"train.off_policy_steps": 1, "rollout.carry_over": True}, "train.off_policy_steps", "carry_over=True is not built"),
    ({"train.off_policy_steps": 1, "rollout.max_logprob_diff": 0.5}, "rollout.max_logprob_diff", "a step behind"),
    # issue 67 item 7: a refused number of devices names the largest that works with the other values (4 of 8:
    # the learner's 4 take the demo's micro-batches, the engine's its slots), or says that none does
    ({"train.off_policy_steps": 1, "mesh.rollout_devices": 8}, "mesh.rollout_devices",
     r"leaves none of the 8 devices to the learner; the largest mesh.rollout_devices that works here is 4 \(the "
     r"learner's mesh on the other 4 of the 8 devices\)"),
    ({"train.off_policy_steps": 1, "mesh.rollout_devices": 2, "mesh.fsdp": 2, "mesh.tensor": 3},
     "mesh.rollout_devices", r"2 is not a multiple of the learner's tensor axis \(3\), which the rollout engine's "
     r"mesh keeps; no mesh.rollout_devices above 0 works on 8 devices"),
    ({"train.off_policy_steps": 1, "mesh.rollout_devices": 4, "mesh.device_order": (0, 1, 2, 3)}, "mesh.device_order",
     "leave it"),
])
def test_the_config_refuses_what_one_step_off_cannot_do(changes, field, words):
    config = load_config("default.py")
    for dotted, value in changes.items():
        section, name = dotted.split(".")
        config[section][name] = value
    with pytest.raises(ConfigError, match=f"config.{field}: .*{words}"):
        RunSpec.from_config(config, 8)


def test_a_learner_mesh_the_split_leaves_too_few_devices_names_the_largest_split_that_works():
    """Issue 67 item 7: mesh.data=4 on the 6 devices mesh.rollout_devices=2 leaves the learner is refused naming
    them and the largest number of rollout devices that works with the other values (4: the learner's 4)."""
    config = load_config("default.py")
    config.train.off_policy_steps, config.mesh.rollout_devices, config.mesh.data = 1, 2, 4
    with pytest.raises(ConfigError, match=r"^config.mesh \(data, fsdp, tensor\)=\(4, 1, 1\) needs 4 devices, 6 are "
                                          r"available \(the 6 devices mesh.rollout_devices leaves the learner\); the "
                                          r"largest mesh.rollout_devices that works here is 4 \(the learner's mesh on "
                                          r"the other 4 of the 8 devices\)$"):
        RunSpec.from_config(config, 8)


def test_the_engines_own_mesh_is_refused_across_processes(monkeypatch):
    """The weights' move is a device_put between the two device sets of one process: with several processes
    building the engine's mesh is a ValueError naming the field (the CLI prints it as a usage error)."""
    config = load_config("default.py")
    config.mesh.rollout_devices = 4
    assert sharding.rollout_mesh(config.mesh, 1).devices.size == 4
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"mesh.rollout_devices=4: the rollout engine's own mesh is built for one "
                                         r"process .* set it to 0"):
        sharding.rollout_mesh(config.mesh, 1)


def test_dynamic_sampling_one_step_off_filters_on_the_engines_side(setup, tmp_path):
    """algorithm.filter_groups with one step off: the engine samples and filters gen batches on its own mesh
    (select_groups there), the learner trains only groups whose rewards differ."""
    learner, engine, model, config, batches = setup
    config = config.copy_and_resolve_references()
    config.algorithm.filter_groups.update(enable=True, metric="acc", max_num_gen_batches=0)
    trained = []
    with jax.set_mesh(learner), RewardPool(1) as pool:
        programs = StepPrograms(RunSpec.unplaced(config), *nnx.split(model), (1,), rollout_mesh=engine)
        result = _train(config, model, batches, tmp_path / "run", 3, pool, programs, trained)
    assert [m["rollout_staleness_max"] for _, m in trained] == [0.0, 1.0, 1.0]
    for batch, metrics in trained:
        assert (batch["rewards"].reshape(-1, N).std(axis=1) > 0).all() and metrics["groups_all_equal"] == 0.0
    assert sum(h["num_gen_batches"] for h in result.history) > 3  # some step drew more than one batch


def test_on_shared_devices_the_engines_copy_is_counted_beside_the_learners_programs(setup):
    """mesh.rollout_devices=0: the engine's copy of the weights stays on the learner's devices, so the memory check
    counts it outside every learner program; on split devices it does not (the copy is on the engine's)."""
    learner, engine, model, config, _ = setup
    config = config.copy_and_resolve_references()
    with jax.set_mesh(learner):
        split = StepPrograms(RunSpec.unplaced(config), *nnx.split(model), (1,), rollout_mesh=engine)
        config.mesh.rollout_devices = 0
        shared = StepPrograms(RunSpec.unplaced(config), *nnx.split(model), (1,))
        copy = memory_check.per_device_bytes(shared.weight_sync(nnx.state(model)))  # the copy's real buffers
        outside = lambda programs: {p.name: p.outside for p in programs.programs() if p.name in ("pi_old", "update")}  # noqa: E731
        assert {k: v + copy for k, v in outside(split).items()} == outside(shared)
