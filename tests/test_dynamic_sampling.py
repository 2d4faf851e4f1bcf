"""DAPO's dynamic sampling (``algorithm.filter_groups``): the group filter against verl's rule in float64,
and the trainer's collector on the (2, 2, 2) mesh keeping exactly the first B groups whose rewards
differ, as sampled batch by batch with the same keys by the unfiltered sampler, with the same pi_old."""

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax.rewards import RewardPool
from pacs_jax.rl import filter_groups
from pacs_jax.training.config_check import ConfigError, validate_config
from pacs_jax.training.engine.dynamic_sampling import FilterGroupsExhausted
from pacs_jax.training.loop import rl_train
from pacs_jax.training.records import PromptBatch
from pacs_jax.training.rollout import RolloutCollector
from pacs_jax.training.spec import RunSpec
from pacs_jax.training.step_programs import StepPrograms
from test_train_config import load_config
from train_helpers import ListPromptSource, tiny_model_on_mesh

N, PROMPTS, MAX_NEW_TOKENS = 2, 4, 6


def _verl_keeps(values: np.ndarray, n: int) -> np.ndarray:
    """verl's rule (recipe/dapo: ``np.std(vals) > 0 or len(vals) == 1`` per prompt uid), float64, group by group."""
    return np.array([np.std(group) > 0 or len(group) == 1 for group in values.reshape(-1, n)])


@pytest.mark.parametrize("n", [1, 2, 5])
def test_the_group_filter_is_verls_rule(n):
    rs = np.random.RandomState(n)
    rewards = rs.choice([0.0, 1.0, 0.5, -1.0], size=(40, n), p=[0.45, 0.45, 0.05, 0.05]).reshape(-1)
    for metric in filter_groups.FILTER_METRICS:
        values = filter_groups.group_metric(rewards, metric)
        np.testing.assert_array_equal(filter_groups.groups_with_spread(values, n), _verl_keeps(values, n))
    acc = filter_groups.group_metric(rewards, "acc")
    assert set(np.unique(acc)) <= {0.0, 1.0} and np.array_equal(acc, rewards == 1.0)
    if n > 1:  # rewards 0 and 0.5 differ as scores but are both wrong: acc drops the group, score keeps it
        assert not np.array_equal(filter_groups.groups_with_spread(acc, n),
                                  filter_groups.groups_with_spread(filter_groups.group_metric(rewards, "score"), n))


def test_bad_filter_groups_values_name_their_field():
    for field, value in (("metric", "accuracy"), ("max_num_gen_batches", -1)):
        config = load_config("default.py")
        config.algorithm.filter_groups[field] = value
        with pytest.raises(ConfigError, match=f"config.algorithm.filter_groups.{field}"):
            validate_config(config)


@pytest.fixture(scope="module")
def setup():
    mesh, model = tiny_model_on_mesh()
    config = load_config("default.py")
    config.rollout.update(n=N, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)
    config.data.max_prompt_length, config.data.prompt_buckets = 16, (8, 16)
    config.train.update(prompts_per_step=PROMPTS, logprob_micro_batches=1, packing=False)
    config.algorithm.filter_groups.update(enable=True, max_num_gen_batches=20)
    rs = np.random.RandomState(0)
    batches = [PromptBatch([list(rs.randint(2, 96, size=rs.randint(3, 16))) for _ in range(PROMPTS)],
                           ["7"] * PROMPTS, [f"batch {b}"] * PROMPTS) for b in range(20)]
    return mesh, model, config, batches


def _parity(ids) -> str:
    """The 'answer' of a response: right ("7") when its first token is a multiple of 3 (so about 5 in 9
    groups of two responses agree, and are dropped)."""
    return "7" if len(ids) and int(ids[0]) % 3 == 0 else "8"


def test_the_step_keeps_the_first_groups_with_spread_as_the_unfiltered_sampler_drew_them(setup):
    mesh, model, config, batches = setup
    key = jax.random.key(11)
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        graphdef, params = nnx.split(model)
        spec = RunSpec.unplaced(config)
        programs = StepPrograms(spec, graphdef, params, (1,))
        collector = RolloutCollector.from_spec(spec, programs, decode=_parity, reward_pool=pool)
        source = iter(batches)
        rollout = collector(params, lambda: next(source), key)
        drawn = int(rollout.metrics["num_gen_batches"])
    
        # the reference: each gen batch sampled alone with its key, its groups judged on the host
        kept_rows, want_logp, dropped = [], [], 0
        for g in range(drawn):
            sampled = collector.sample(params, batches[g], key if g == 0 else jax.random.fold_in(key, g))
            tokens = np.asarray(sampled.tokens)
            rewards = np.array([_parity(tokens[r, :sampled.lengths[r]]) == "7" for r in range(len(tokens))], float)
            old_logp = np.asarray(collector.old_policy(params, sampled)[0].old_logp)
            dropped += int(np.sum(rewards.reshape(-1, N).std(axis=1) == 0))
            for group in np.flatnonzero(rewards.reshape(-1, N).std(axis=1) > 0):
                for r in range(group * N, group * N + N):
                    kept_rows.append((tokens[r, :sampled.lengths[r]], rewards[r], batches[g].prompt_ids[group]))
                    want_logp.append(old_logp[r, :sampled.lengths[r]])
    assert next(source) is batches[drawn]  # the step took exactly the batches it reports
    assert drawn >= 2 and len(kept_rows) >= PROMPTS * N and len(kept_rows[:-1]) < PROMPTS * N + drawn * PROMPTS * N
    kept_rows, want_logp = kept_rows[:PROMPTS * N], want_logp[:PROMPTS * N]  # the first B groups, in draw order

    batch = jax.tree.map(np.asarray, rollout.batch)
    R = batch.response_mask.shape[1]
    for row, (tokens, reward, prompt) in enumerate(kept_rows):
        L = len(tokens)
        np.testing.assert_array_equal(batch.input_ids[row, -R:][:L], tokens, err_msg=f"row {row}")
        assert batch.response_mask[row].sum() == L
        assert batch.rewards[row] == reward == rollout.rewards[row]
        prompt_part = batch.input_ids[row, :-R][batch.attention_mask[row, :-R] == 1]
        np.testing.assert_array_equal(prompt_part, prompt)
        np.testing.assert_allclose(batch.old_logp[row, :L], want_logp[row], atol=2e-5, err_msg=f"row {row}")
    assert (rollout.rewards.reshape(-1, N).std(axis=1) > 0).all()  # every kept group differs
    assert rollout.metrics["groups_all_equal"] == 0.0
    assert rollout.metrics["filtered_fraction"] == dropped / (drawn * PROMPTS) and dropped > 0


def test_a_step_that_finds_too_few_groups_stops_naming_the_field(setup):
    mesh, model, config, batches = setup
    config = config.copy_and_resolve_references()
    config.algorithm.filter_groups.max_num_gen_batches = 3
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        graphdef, params = nnx.split(model)
        spec = RunSpec.unplaced(config)
        programs = StepPrograms(spec, graphdef, params, (1,))
        collector = RolloutCollector.from_spec(spec, programs, decode=lambda ids: "8", reward_pool=pool)  # all wrong
        source = iter(batches)
        with pytest.raises(FilterGroupsExhausted, match=r"^config\.algorithm\.filter_groups\.max_num_gen_batches: "
                                                        r"step 7 sampled 3 batches of 4 prompts and kept 0 of the 4"):
            collector(params, lambda: next(source), jax.random.key(0), step=7)
    assert next(source) is batches[3]


def test_a_resumed_run_draws_the_same_batches_and_trains_no_group_twice(setup, tmp_path):
    """Two steps with dynamic sampling, straight and as one step plus a resume: the resumed step 2 draws
    the gen batches after step 1's (the cursor saved with step 1 counts every batch step 1 drew), with
    the same keys, so its groups, rewards and loss are the straight run's."""
    mesh, model, config, batches = setup
    config = config.copy_and_resolve_references()
    config.train.update(checkpoint_every=1, precompile=False)
    runs = {}
    config.optim.update(schedule="constant", warmup_steps=0)  # the same programs for 1 and 2 steps
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        graphdef, params = nnx.split(model)
        programs = StepPrograms(RunSpec.unplaced(config), graphdef, params, (1,))  # compiled once for the 3 runs

        def train(workdir, steps):
            config.train.steps = steps
            source = ListPromptSource(batches)
            fresh = nnx.merge(graphdef, jax.tree.map(jax.numpy.copy, params))
            result = rl_train(RunSpec.unplaced(config), workdir, fresh, source, decode=_parity, stop_token_ids=(1,),
                              reward_pool=pool, programs=programs)
            return result.history, source.next_index

        runs["straight"] = train(tmp_path / "straight", 2)
        first, drawn_by_step_1 = train(tmp_path / "resumed", 1)
        runs["resumed"] = train(tmp_path / "resumed", 2)
    (straight, straight_cursor), (resumed, resumed_cursor) = runs["straight"], runs["resumed"]
    assert [h["step"] for h in straight] == [1, 2] and [h["step"] for h in resumed] == [2]
    assert drawn_by_step_1 == first[0]["num_gen_batches"] == straight[0]["num_gen_batches"]
    assert resumed_cursor == straight_cursor == drawn_by_step_1 + straight[1]["num_gen_batches"]
    for key in ("sampled_tokens_checksum", "num_gen_batches", "filtered_fraction", "reward_mean", "loss"):
        assert resumed[0][key] == straight[1][key], key
