"""The training data of a config: the arithmetic task, the character tokenizer, the held-out split of
files and of the generated task (data/sources.py)."""

from __future__ import annotations

import re

import ml_collections
import pytest

from pacs_jax import data
from pacs_jax.data.arithmetic import make_problems
from pacs_jax.training.run import prompt_source
from pacs_jax.training.spec import RunSpec
from train_helpers import load_config

_OPERATION = {"gets": "+", "adds": "+", "loses": "-", "takes": "-"}


def _solve(text: str) -> int:
    """The answer of a generated problem, read from its words (independently of the generator)."""
    a, b = (int(x) for x in re.findall(r"\d+", text))
    verb = next(word for word in _OPERATION if word in text.split())
    return a + b if _OPERATION[verb] == "+" else a - b


def test_arithmetic_problems_are_distinct_and_their_gold_answers_right():
    problems = make_problems(500, seed=3, max_operand=30)
    assert len({p.problem for p in problems}) == 500
    assert all(int(p.ground_truth) == _solve(p.problem) >= 0 for p in problems)
    assert all(max(int(x) for x in re.findall(r"\d+", p.problem)) <= 30 for p in problems)
    assert [p.problem for p in make_problems(500, seed=3, max_operand=30)] == [p.problem for p in problems]
    assert [p.problem for p in make_problems(500, seed=4, max_operand=30)] != [p.problem for p in problems]
    with pytest.raises(ValueError, match="operands up to 2 give 7"):
        make_problems(8, seed=0, max_operand=2)


def test_the_demo_holds_out_problems_it_never_trains_on_and_gives_rl_problems_the_warm_start_never_saw():
    dc = load_config("default.py").data
    train, warm, held_out, counts = data.training_problems(dc, seed=1)
    assert (len(warm), len(train), len(held_out)) == (
        dc.warmstart_problems, dc.arithmetic.problems - dc.warmstart_problems, dc.held_out_problems)
    assert counts == {"rows": dc.arithmetic.problems + dc.held_out_problems, "skipped": 0,
                      "held_out": dc.held_out_problems, "warmstart": dc.warmstart_problems, "skipped_rows": []}
    equations = lambda ps: {tuple(re.findall(r"\d+", p.problem)) + (_solve(p.problem),) for p in ps}  # noqa: E731
    assert len(equations(warm) | equations(train) | equations(held_out)) == counts["rows"]  # pairwise disjoint
    with pytest.raises(ValueError, match="config.data.warmstart_problems: 2200 with data.held_out_problems=200 leaves no RL"):
        data.training_problems(dict(dc, warmstart_problems=dc.arithmetic.problems), seed=1)


def _files_config(shared_data, held_out: int, seed: int = 0, warmstart: int = 0) -> ml_collections.ConfigDict:
    dc = load_config("default.py").data
    dc.source, dc.held_out_problems, dc.warmstart_problems, dc.shuffle_seed = "files", held_out, warmstart, seed
    dc.train_files = (str(shared_data / "amc23" / "test.jsonl"), str(shared_data / "aime_2025" / "test.jsonl"))
    return dc


def test_files_source_reads_every_file_and_splits_off_seeded_held_out_and_warm_start_sets(shared_data):
    whole, no_warm, none, counts = data.training_problems(_files_config(shared_data, 0), seed=0)
    assert counts == {"rows": 70, "skipped": 0, "held_out": 0, "warmstart": 0, "skipped_rows": []}
    assert none == no_warm == []
    assert [p.data_source for p in whole] == ["amc23"] * 40 + ["aime_2025"] * 30  # file order without a split
    train, _, held_out, _ = data.training_problems(_files_config(shared_data, 10), seed=0)
    key = lambda p: (p.data_source, p.index)  # noqa: E731
    keys = lambda ps: {key(p) for p in ps}  # noqa: E731
    assert len(held_out) == 10 and not keys(train) & keys(held_out)
    assert keys(train) | keys(held_out) == keys(whole)
    again, _, _, _ = data.training_problems(_files_config(shared_data, 10), seed=5)  # config.seed plays no part
    other, _, _, _ = data.training_problems(_files_config(shared_data, 10, seed=1), seed=0)
    assert [key(p) for p in again] == [key(p) for p in train] != [key(p) for p in other]
    rl, warm, held, counts = data.training_problems(_files_config(shared_data, 10, warmstart=20), seed=0)
    assert (len(warm), len(rl), counts["warmstart"]) == (20, 40, 20)
    assert [key(p) for p in held] == [key(p) for p in held_out]  # the same held-out rows with a warm-start split
    assert keys(warm) | keys(rl) == keys(train) and not keys(warm) & keys(rl)
    with pytest.raises(ValueError, match="config.data.held_out_problems: 70 leaves no training problems"):
        data.training_problems(_files_config(shared_data, 70), seed=0)
    with pytest.raises(ValueError, match="config.data.warmstart_problems: 60 with data.held_out_problems=10 leaves no RL"):
        data.training_problems(_files_config(shared_data, 10, warmstart=60), seed=0)


def test_character_tokenizer_round_trips_and_renders_the_answer_prompt():
    tokenizer = data.load_tokenizer("char")
    text = "Ann has 12 pens and gets 3 more. How many now? \\boxed{15}"
    ids = tokenizer([text])["input_ids"][0]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    assert tokenizer.decode([tokenizer.eos_token_id, *ids[:3], tokenizer.pad_token_id]) == "Ann"
    assert tokenizer.decode([*ids[:3], tokenizer.eos_token_id], skip_special_tokens=False) == "Ann<eos>"
    with pytest.raises(ValueError, match=r"\['#', 'é'\]"):
        tokenizer.encode("é#1")
    problem = make_problems(1, seed=0)[0]
    (example,), dropped = data.build_prompts([problem], tokenizer, 100, instruction="")
    assert dropped == 0 and tokenizer.decode(example.prompt_ids) == f"Q: {problem.problem} A: "
    (with_instruction,), _ = data.build_prompts([problem], tokenizer, 200, instruction="Answer in \\boxed{}.")
    assert tokenizer.decode(with_instruction.prompt_ids) == f"Q: {problem.problem} Answer in \\boxed{{}}. A: "


@pytest.mark.parametrize("warmstart_problems", [1000, 0])
def test_the_run_gives_the_warm_start_its_own_prompts_and_rl_the_rest(warmstart_problems):
    config = load_config("default.py")
    config.data.warmstart_problems = warmstart_problems
    rl, warm, held_out, counts = prompt_source(RunSpec.unplaced(config), data.load_tokenizer(config.data.tokenizer))
    texts = lambda examples: [e.problem.problem for e in examples]  # noqa: E731
    assert counts["dropped_overlong"] == 0 and len(held_out) == config.data.held_out_problems
    if warmstart_problems:
        assert (len(warm), len(rl.examples)) == (1000, config.data.arithmetic.problems - 1000)
        assert not set(texts(warm)) & set(texts(rl.examples))
        sampled = {tuple(ids) for _ in range(40) for ids in rl.next_batch().prompt_ids}  # > an epoch of RL's stream
        assert len(sampled) > 1100 and sampled <= {tuple(e.prompt_ids) for e in rl.examples}
        assert sampled.isdisjoint(tuple(e.prompt_ids) for e in warm)
    else:
        assert warm is rl.examples and len(warm) == config.data.arithmetic.problems
