"""Dataset readers on the real data, malformed input, chat-template prompts, the grain pipeline."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pacs_jax import data
from pacs_jax.data import DataError, PipelineConfig, Problem, PromptExample

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spec, rows, spot_checks", [
    ("math_500/test.jsonl", 500, {0: "\\left( 3, \\frac{\\pi}{2} \\right)", 1: "p - q", 2: "\\frac{14}{3}"}),
    ("aime_2024/test.jsonl", 30, {0: "204", 1: "113"}),
    ("aime_2025/test.jsonl", 30, {0: "70", 1: "588"}),          # stored as integers
    ("amc23/test.jsonl", 40, {0: "27", 3: "3159"}),             # stored as floats (27.0)
    ("gsm8k/test.jsonl", 1319, {0: "18", 1: "3", 2: "70000"}),  # the text after ####
])
def test_real_datasets_load_with_their_row_counts(shared_data, spec, rows, spot_checks):
    problems, stats = data.load_problems(shared_data / spec)
    assert len(problems) == rows and stats.rows == rows and stats.skipped == 0
    assert problems[0].data_source == spec.split("/")[0]
    for index, answer in spot_checks.items():
        assert problems[index].ground_truth == answer
        assert problems[index].index == index


def test_first_problems_are_the_right_ones(shared_data):
    gsm8k, _ = data.load_problems(shared_data / "gsm8k" / "test.jsonl")
    assert gsm8k[0].problem.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert gsm8k[0].extra["answer"].endswith("#### 18")  # the worked answer is kept
    amc, _ = data.load_problems(shared_data / "amc23" / "test.jsonl")
    assert amc[0].problem.startswith("Cities $A$ and $B$ are $45$ miles apart.") and amc[0].extra["url"]
    aime, _ = data.load_problems(shared_data / "aime_2024" / "test.jsonl")
    assert aime[0].problem.startswith("Every morning Aya goes for a $9$-kilometer-long walk")


def test_gsm8k_thousands_separators_are_removed(shared_data):
    problems, _ = data.load_problems(shared_data / "gsm8k" / "train.jsonl")
    assert len(problems) == 7473
    lines = (shared_data / "gsm8k" / "train.jsonl").read_text().splitlines()
    raw = [json.loads(line)["answer"].rpartition("####")[2].strip() for line in lines]
    with_commas = [i for i, answer in enumerate(raw) if "," in answer]
    assert len(with_commas) > 50
    for i in with_commas:
        assert problems[i].ground_truth == raw[i].replace(",", "")


def test_deepscaler_subset(shared_data):
    """8449 rows; four of them (math.json) have a null or empty answer: an error, or counted skips."""
    with pytest.raises(DataError, match=r"deepscaler_subset/math\.json:5318: field 'answer' must be a string or "
                                        r"a number, got null"):
        data.load_problems(shared_data / "deepscaler_subset")
    problems, stats = data.load_problems(shared_data / "deepscaler_subset", on_error="skip")
    assert stats.rows + stats.skipped == 8449 and stats.skipped == 4 and len(problems) == 8445
    assert {p.data_source for p in problems} == {"deepscaler"}
    aime, _ = data.load_problems(shared_data / "deepscaler_subset" / "aime.json")
    assert len(aime) == 975 and aime[0].ground_truth == "60" and aime[0].problem.startswith("Let $x$, $y$ and $z$")
    assert aime[0].extra["year"] == 1983


def _write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_malformed_jsonl_names_file_and_line(tmp_path):
    good = json.dumps({"problem": "1+1?", "answer": "2"})
    cases = {
        "missing": (json.dumps({"problem": "1+1?"}), r"missing\.jsonl:2: missing field 'answer'"),
        "list_answer": (json.dumps({"problem": "1+1?", "answer": ["2"]}),
                        r"list_answer\.jsonl:2: field 'answer' must be a string or a number, got list"),
        "bool_answer": (json.dumps({"problem": "1+1?", "answer": True}), r"bool_answer\.jsonl:2: .* got bool"),
        "empty_problem": (json.dumps({"problem": " ", "answer": "2"}),
                          r"empty_problem\.jsonl:2: field 'problem' must be a non-empty string"),
        "not_object": ("[1, 2]", r"not_object\.jsonl:2: expected a JSON object, got list"),
    }
    for name, (bad_line, message) in cases.items():
        path = _write_jsonl(tmp_path / f"{name}.jsonl", [good, bad_line, good])
        with pytest.raises(DataError, match=message):
            data.load_problems(path, format="math_500")
        problems, stats = data.load_problems(path, format="math_500", on_error="skip")
        assert [p.index for p in problems] == [0, 2] and stats.skipped == 1
        assert stats.first_errors[0].startswith(f"{path}:2: ")


def test_a_line_that_is_not_json_is_an_error_even_when_skipping(tmp_path):
    """Issue 53 item 4: a jsonl line of invalid JSON (a damaged file) was skipped and counted with
    on_error="skip" (the paper configs' data.allow_skips), leaving only "1 malformed rows skipped"; it is
    an error naming the file and the line, as it is in a JSON list file."""
    good = json.dumps({"problem": "1+1?", "answer": "2"})
    path = _write_jsonl(tmp_path / "damaged.jsonl", [good, '{"problem": "1+1?", "answer": ', good])
    for on_error in ("raise", "skip"):
        with pytest.raises(DataError, match=rf"^{path}:2: invalid JSON \(Expecting value, column 31\)$") as error:
            data.load_problems(path, format="math_500", on_error=on_error)
        assert not error.value.skippable  # data.allow_skips would not skip it: the trainer does not offer it


def test_rows_all_without_the_formats_answer_name_the_field_file_and_first_line(tmp_path):
    """Issue 53 item 5: a FILE:problem_answer file whose rows have no "answer", read with on_error="skip"
    (data.allow_skips), gave no problems, which the trainer then reported as "config.data.held_out_problems:
    0 leaves no training problems of the 0 read"; a read whose every row is malformed names the first
    row's error and the fields the format reads. Some malformed rows among good ones are still skipped."""
    rows = [json.dumps({"problem": f"{i} + 1?", "solution": str(i + 1)}) for i in range(3)]
    path = _write_jsonl(tmp_path / "mine.jsonl", ["", *rows])
    with pytest.raises(DataError) as error:
        data.load_problems(f"{path}:problem_answer", on_error="skip")
    assert str(error.value) == (f"{path}:2: missing field 'answer'; no row of the 3 read is a problem (all "
                                "malformed): format 'problem_answer' reads the problem from 'problem' and the answer "
                                "from 'answer'")
    good = _write_jsonl(tmp_path / "some.jsonl", [*rows, json.dumps({"problem": "1 + 1?", "answer": "2"})])
    problems, stats = data.load_problems(f"{good}:problem_answer", on_error="skip")
    assert [p.ground_truth for p in problems] == ["2"] and stats.skipped == 3


def test_malformed_json_list_and_parquet(tmp_path):
    listing = tmp_path / "items.json"
    listing.write_text('[\n  {"problem": "a", "answer": "1"},\n  {"problem": "b"},\n'
                       '  {"problem": "c", "answer": "3"}\n]')
    with pytest.raises(DataError, match=r"items\.json:3: missing field 'answer'"):
        data.load_problems(listing, format="deepscaler")
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"problem": "a", "answer": "1"},\n  {"problem": "b", "answer": }\n]')
    with pytest.raises(DataError, match=r"broken\.json:3: invalid JSON"):
        data.load_problems(broken, format="deepscaler")
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"problem": ["a", "b"], "answer": ["1", None]}), table)
    with pytest.raises(DataError, match=r"rows\.parquet: row 2: field 'answer' must be a string or a number, got null"):
        data.load_problems(table, format="math_500")
    problems, stats = data.load_problems(table, format="math_500", on_error="skip")
    assert [p.ground_truth for p in problems] == ["1"] and stats.skipped == 1


def test_field_mapping_alternatives(tmp_path):
    (tmp_path / "aime_2024").mkdir()
    aime = _write_jsonl(tmp_path / "aime_2024" / "test.jsonl",
                        [json.dumps({"ID": "2024-I-1", "Problem": "Find x.", "Answer": 204})])
    [problem], _ = data.load_problems(aime)
    assert (problem.data_source, problem.problem, problem.ground_truth, problem.extra) == (
        "aime_2024", "Find x.", "204", {"ID": "2024-I-1"})
    amc = _write_jsonl(tmp_path / "amc.jsonl", [json.dumps({"question": "Q?", "problem": "P?", "answer": 0.25})])
    [problem], _ = data.load_problems(amc, format="amc23")
    assert (problem.problem, problem.ground_truth, problem.extra) == ("Q?", "0.25", {"problem": "P?"})
    [problem], _ = data.load_problems(f"{amc}:amc23")  # a spec's own format, as data.train_files takes it
    assert problem.problem == "Q?"
    with pytest.raises(ValueError, match="format='nope'"):
        data.load_problems(amc, format="nope")


def test_rows_of_ones_own_format_are_read_by_their_fields_whatever_the_file_name(tmp_path):
    """Issue 35 item 3: a file named after no dataset whose rows have the usual fields trains, its problems'
    data_source its name; rows with other fields are refused naming the file, the fields and how to name
    the format; an empty file names itself."""
    for fields, expected in ((("problem", "answer"), "problem_answer"), (("question", "answer"), "question_answer"),
                             (("prompt", "ground_truth"), "prompt_ground_truth")):
        path = _write_jsonl(tmp_path / f"mine_{expected}.jsonl", [json.dumps(dict(zip(fields, ("1 + 1?", "2"))))])
        [problem], _ = data.load_problems(path)
        assert (problem.data_source, problem.problem, problem.ground_truth) == (path.stem, "1 + 1?", "2"), expected
    both = _write_jsonl(tmp_path / "both.jsonl", [json.dumps({"question": "Q?", "problem": "P?", "answer": 0.25})])
    assert data.load_problems(both)[0][0].problem == "P?"  # {problem, answer} comes first
    odd = _write_jsonl(tmp_path / "odd.jsonl", [json.dumps({"q": "Q?", "a": "1"})])
    with pytest.raises(DataError, match=rf"^{re.escape(str(odd))}:1: cannot tell the dataset format from its name or "
                                        r"fields \(its first row has the fields \['a', 'q'\]\); name it, as PATH:FORMAT"):
        data.load_problems(odd)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(empty))}: holds no rows \(an empty file\?\)$"):
        data.load_problems(empty)


def test_our_jsonl_round_trips(tmp_path, shared_data):
    problems, _ = data.load_problems(shared_data / "amc23" / "test.jsonl")
    # Named like a native format, but the rows are ours: recognised by their fields.
    path = _write_jsonl(tmp_path / "amc23_prepared.jsonl", [json.dumps(p.to_json()) for p in problems])
    again, _ = data.load_problems(path)
    assert again == problems
    bad = _write_jsonl(tmp_path / "bad.jsonl", [json.dumps({**problems[0].to_json(), "index": "7"})])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: field 'index' must be an integer"):
        data.load_problems(bad)


def test_prepare_data_tool(tmp_path, shared_data):
    tool = [sys.executable, str(REPO / "tools" / "prepare_data.py")]
    out = tmp_path / "out.jsonl"
    failed = subprocess.run(tool + ["--input", str(shared_data / "deepscaler_subset"), "--output", str(out)],
                            capture_output=True, text=True)
    assert failed.returncode != 0 and "math.json:5318: field 'answer'" in failed.stderr and not out.exists()
    done = subprocess.run(tool + ["--input", str(shared_data / "deepscaler_subset"), "--output", str(out),
                                  "--allow_skips"], capture_output=True, text=True, check=True)
    assert "8445 problems written, 4 malformed rows skipped" in done.stdout
    problems, _ = data.load_problems(out)
    assert len(problems) == 8445 and problems[0].data_source == "deepscaler" and problems[0].ground_truth == "60"
    again = subprocess.run(tool + ["--input", str(shared_data / "amc23" / "test.jsonl"), "--output", str(out)],
                           capture_output=True, text=True)
    assert again.returncode != 0 and "exists (pass --overwrite" in again.stderr


def test_tfds_source_without_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pacs_jax\[tfds\]"):
        data.load_problems("tfds:gsm8k:test")


def test_tfds_source_reads_records_as_tfds_gives_them(monkeypatch, shared_data):
    """GSM8K test records as ``tfds.data_source("gsm8k", split="test")`` serves them (a random-access
    sequence of dicts of bytes; the real package is an optional extra not installed for the tests)
    read into the same problems as the repository's gsm8k jsonl."""
    rows = [json.loads(line) for line in (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()]
    calls = []

    def data_source(name, split, data_dir=None):
        calls.append((name, split, data_dir))
        return [{"question": row["question"].encode(), "answer": row["answer"].encode()} for row in rows]

    monkeypatch.setitem(sys.modules, "tensorflow_datasets", types.SimpleNamespace(data_source=data_source))
    problems, stats = data.load_problems("tfds:gsm8k:test")
    assert calls == [("gsm8k", "test", None)]
    from_file, _ = data.load_problems(shared_data / "gsm8k" / "test.jsonl")
    assert len(problems) == stats.rows == 1319 and stats.skipped == 0
    assert [(p.problem, p.ground_truth, p.data_source) for p in problems] == \
        [(p.problem, p.ground_truth, p.data_source) for p in from_file]
    assert problems[0].ground_truth == "18"


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir):
    return data.load_tokenizer(qwen_tokenizer_dir)


def test_prompts_use_the_chat_template_and_instruction(tokenizer, shared_data):
    problems, _ = data.load_problems(shared_data / "math_500" / "test.jsonl")
    expected = ("<|im_start|>user\n" + problems[0].problem
                + " Please reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
                + "<|im_start|>assistant\n")
    assert data.render_prompt(tokenizer, problems[0].problem) == expected
    examples, dropped = data.build_prompts(problems, tokenizer, max_prompt_length=10_000)
    assert dropped == 0 and [e.problem for e in examples] == problems
    assert tokenizer.decode(list(examples[0].prompt_ids)) == expected
    assert examples[0].prompt_ids[:3] == (151644, 872, 198)  # <|im_start|> "user" "\n"


def test_overlong_prompts_are_dropped_and_counted(tokenizer, shared_data):
    problems, _ = data.load_problems(shared_data / "aime_2024" / "test.jsonl")
    lengths = [len(tokenizer.encode(data.render_prompt(tokenizer, p.problem))) for p in problems]
    limit = sorted(lengths)[len(lengths) // 2]
    examples, dropped = data.build_prompts(problems, tokenizer, max_prompt_length=limit)
    assert dropped == sum(length > limit for length in lengths) > 0
    assert [e.problem for e in examples] == [p for p, length in zip(problems, lengths) if length <= limit]
    assert all(len(e.prompt_ids) <= limit for e in examples)


def _examples(count: int) -> list[PromptExample]:
    return [PromptExample((i, i + 1), Problem("toy", f"q{i}", str(i), i)) for i in range(count)]


def _ids(batch) -> list[int]:
    return [example.problem.index for example in batch]


def test_shuffle_is_deterministic_by_seed_and_reshuffled_each_epoch():
    examples = _examples(50)
    config = PipelineConfig(batch_size=8, seed=3, num_epochs=2)
    first = [_ids(b) for b in data.prompt_iterator(examples, config)]
    again = [_ids(b) for b in data.prompt_iterator(examples, config)]
    other = [_ids(b) for b in data.prompt_iterator(examples, PipelineConfig(8, seed=4, num_epochs=2))]
    assert first == again and first != other
    assert len(first) == 2 * (50 // 8) and all(len(b) == 8 for b in first)
    epoch_1, epoch_2 = sum(first[:6], []), sum(first[6:], [])
    assert len(set(epoch_1)) == 48 and len(set(epoch_2)) == 48  # each epoch: distinct prompts, remainder dropped
    assert epoch_1 != epoch_2
    unshuffled = data.prompt_iterator(examples, PipelineConfig(8, shuffle=False))
    assert _ids(next(unshuffled)) == list(range(8))


def test_restored_iterator_state_continues_with_the_same_batches():
    examples = _examples(30)
    config = PipelineConfig(batch_size=4, seed=7, num_epochs=3)
    iterator = data.prompt_iterator(examples, config)
    for _ in range(9):  # into the second epoch
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))  # as a checkpoint would store it
    rest = [_ids(b) for b in iterator]
    resumed = [_ids(b) for b in data.prompt_iterator(examples, config, state=state)]
    assert resumed == rest and len(rest) == 3 * (30 // 4) - 9


def test_pipeline_argument_errors():
    examples = _examples(10)
    with pytest.raises(ValueError, match="batch_size=0: must be positive"):
        data.prompt_batches(examples, PipelineConfig(0))
    with pytest.raises(ValueError, match="10 prompts do not fill one batch of batch_size=16"):
        data.prompt_batches(examples, PipelineConfig(16))
    with pytest.raises(ValueError, match="num_epochs=0"):
        data.prompt_batches(examples, PipelineConfig(4, num_epochs=0))


def test_prompt_iterator_over_two_real_files(tokenizer, shared_data):
    problems = [p for name in ("amc23", "aime_2025") for p in data.load_problems(shared_data / name / "test.jsonl")[0]]
    examples, dropped = data.build_prompts(problems, tokenizer, max_prompt_length=10_000)
    assert dropped == 0 and len(examples) == 70
    batch = next(data.prompt_iterator(examples, PipelineConfig(batch_size=14, seed=1)))
    assert len(batch) == 14 and {e.problem.data_source for e in examples} == {"amc23", "aime_2025"}


# ------------------------------------------------------------------------------------------ the full DeepScaleR set
def _full_set_rows(shared_data, count: int) -> list[dict]:
    """Rows in the format of the hub's deepscaler.json ({problem, answer, solution}), from the subset."""
    rows = json.loads((shared_data / "deepscaler_subset" / "aime.json").read_text())[:count]
    return [{"problem": r["problem"], "answer": r["answer"], "solution": r["solution"]} for r in rows]


def _load_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_data", REPO / "tools" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loader_reads_the_full_deepscaler_sets_format(tmp_path, shared_data):
    """The hub's file as it is (a JSON list of {problem, answer, solution} named deepscaler.json), by its
    file name or its folder's."""
    rows = _full_set_rows(shared_data, 30)
    named = tmp_path / "deepscaler.json"
    named.write_text(json.dumps(rows, indent=2))
    problems, stats = data.load_problems(named)
    assert stats.rows == 30 and stats.skipped == 0
    assert [(p.problem, p.ground_truth) for p in problems] == [(r["problem"], r["answer"]) for r in rows]
    assert problems[0] == Problem("deepscaler", rows[0]["problem"], "60", 0, {"solution": rows[0]["solution"]})
    (tmp_path / "deepscaler").mkdir()
    in_folder = tmp_path / "deepscaler" / "full.json"
    in_folder.write_text(json.dumps(rows))
    assert data.load_problems(in_folder)[0] == problems
    assert data.load_problems(tmp_path / "deepscaler")[0] == problems


def test_prepare_deepscaler_converts_a_copy_in_the_hubs_format(tmp_path, shared_data):
    """`prepare_data.py deepscaler --url file://...`: the file checked, kept as OUT/deepscaler.json, and
    converted into OUT/train.jsonl; a null answer skipped and counted; nothing temporary left behind."""
    rows = _full_set_rows(shared_data, 40)
    rows[7]["answer"] = None
    source = tmp_path / "hub" / "deepscaler.json"
    source.parent.mkdir()
    source.write_text(json.dumps(rows, indent=1))
    out = tmp_path / "out"
    tool = [sys.executable, str(REPO / "tools" / "prepare_data.py"), "deepscaler", "--url", source.as_uri(),
            "--out", str(out)]
    done = subprocess.run(tool + ["--expected_rows", "40"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "39 problems written, 1 malformed rows skipped" in done.stdout
    assert "downloading deepscaler.json: 100%" in done.stderr  # the progress bar
    assert sorted(p.name for p in out.iterdir()) == ["deepscaler.json", "train.jsonl"]
    assert (out / "deepscaler.json").read_bytes() == source.read_bytes()
    problems, stats = data.load_problems(out / "train.jsonl")
    assert stats.rows == 39 and problems == data.load_problems(source, on_error="skip")[0]
    assert problems[0].data_source == "deepscaler" and problems[7].index == 8  # row 7 skipped, indices kept
    assert problems[0].extra == {"solution": rows[0]["solution"]}

    again = subprocess.run(tool + ["--expected_rows", "40"], capture_output=True, text=True)
    assert again.returncode != 0 and "train.jsonl: exists (pass --overwrite" in again.stderr


def test_prepare_deepscaler_refuses_a_wrong_file_and_leaves_nothing(tmp_path, shared_data):
    tool = _load_tool()
    rows = _full_set_rows(shared_data, 10)
    source = tmp_path / "deepscaler.json"
    source.write_text(json.dumps(rows))
    out = tmp_path / "out"
    args = ["deepscaler", "--url", source.as_uri(), "--out", str(out), "--no_progress"]
    with pytest.raises(SystemExit, match=rf"{source.as_uri()}: 10 rows, expected 40315 \(pass --expected_rows 10"):
        tool.main(args)
    assert not out.exists()
    source.write_text(json.dumps([*rows[:4], {"problem": "1 + 1?", "answer": "2"}, *rows[5:]]))
    with pytest.raises(SystemExit, match=r"item 4 has no field 'solution'"):
        tool.main(args + ["--expected_rows", "10"])
    source.write_text(json.dumps({"data": rows}))
    with pytest.raises(SystemExit, match=r"expected a JSON list of \{problem, answer, solution\} objects"):
        tool.main(args + ["--expected_rows", "0"])
    source.write_text(json.dumps([*rows[:9], {**rows[9], "answer": ""}]))
    with pytest.raises(SystemExit, match=r"item 9: field 'answer' holds no answer"):
        tool.main(args + ["--expected_rows", "10", "--strict"])
    assert not out.exists()


def test_prepare_deepscaler_names_the_url_when_the_hub_is_unreachable(tmp_path, monkeypatch, capsys):
    """The hub's resolve URL (HF_ENDPOINT honoured); an endpoint that refuses connections stands for
    the hub being unreachable (it is, from the test machines)."""
    from pacs_jax.data import deepscaler

    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert deepscaler.hub_url() == ("https://huggingface.co/datasets/agentica-org/DeepScaleR-Preview-Dataset"
                                    "/resolve/main/deepscaler.json")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    url = "http://127.0.0.1:9/datasets/agentica-org/DeepScaleR-Preview-Dataset/resolve/main/deepscaler.json"
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as error:
        _load_tool().main(["deepscaler", "--out", str(out), "--timeout", "5", "--no_progress"])
    message = str(error.value)
    assert message.startswith(f"prepare_data deepscaler: cannot download {url}: "), message
    assert "HF_ENDPOINT" in message and "--url file://" in message
    assert not out.exists()
    missing = tmp_path / "nowhere" / "deepscaler.json"
    with pytest.raises(SystemExit, match=rf"cannot download {missing.as_uri()}: "):
        _load_tool().main(["deepscaler", "--url", missing.as_uri(), "--out", str(out), "--no_progress"])
