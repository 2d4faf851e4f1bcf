"""The README's "Reproducing the paper" section end to end on a shrunk paper setup: its commands, read
from the README (the qwen25_3b setups of Table 1, as the README says to run them), on a tiny random
Qwen2.5-3B-shaped base model folder with its own tokenizer files (test_model_tokenizer.py's, on the
small tokenizer of 4,096 entries), each a CLI subprocess with the README's flags and shrinking overrides
after them: the Base row by ``python -m pacs_jax.evaluate --config=configs/eval.py:paper``, the PACS and
GRPO rows by ``python -m pacs_jax.train --config=configs/paper.py:qwen25_3b,{pacs_beta1,grpo}`` (one RL
step each; evaluated after RL and, PACS, before, at the tables' per-set settings shrunk), then the README's
tools/paper_table.py line and the tool's other forms (its main, in this process) on their outputs: the
Markdown's rows, columns and values against the runs' eval_metrics.json and the published numbers' file,
the PNG, the row names and the errors."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO
from qwen_reference import load_tool
from test_model_tokenizer import QWEN25_GENERATION_CONFIG, write_qwen25_tokenizer
from train_helpers import SMALL_TOKENIZER_SIZE, compile_cache_dir, train_env

table_tool = load_tool("paper_table")
PUBLISHED = REPO / "data" / "paper_results" / "pacs_2509.02522.json"
# The tables' samples per problem (configs/paper_evaluation.py: 32 on MATH-500, 256 on the others) shrunk,
# MATH-500 still drawing fewer. GSM8K (the paper setups evaluate it too, at eval.final.n) as AIME and AMC: sets
# of one setting are sampled together, and the runs' samplers are then the programs (shapes) that the
# evaluation CLI compiled, read from the shared compilation cache.
N = {"math_500": 2, "aime_2024": 8, "aime_2025": 8, "amc23": 8}
GSM8K_N = 8
EVAL_FLAGS = ("--config.eval.max_problems=1", "--config.eval.max_new_tokens=4", "--config.model.dtype=float32",
              "--config.reward.workers=1",
              *(f"--config.eval.final.per_set.{name}.{field}={value}" for name, n in N.items()
                for field, value in (("n", n), ("max_new_tokens", 4))))


def train_flags(data_file) -> tuple[str, ...]:
    """The paper setup shrunk to seconds on one CPU device (test_train_real_config.py shrinks it alike for
    8): 2 prompts x 8 responses of at most 8 tokens, 2 mini-batches (8 responses: GRPO's verl micro-batch),
    one RL step, prompts of the shortest DeepScaleR-subset problems in one 128-token bucket."""
    return ("--config.mesh.fsdp=1", f"--config.data.train_files=('{data_file}',)",
            "--config.data.max_prompt_length=128", "--config.data.prompt_buckets=(128,)",
            "--config.rollout.max_new_tokens=8", "--config.rollout.response_buckets=(8,)",
            "--config.train.steps=1", "--config.train.prompts_per_step=2", "--config.train.mini_batches=2",
            "--config.train.micro_batches=1", "--config.train.logprob_micro_batches=0",
            "--config.train.checkpoint_every=0", f"--config.eval.final.n={GSM8K_N}", *EVAL_FLAGS)


def readme_commands(model_dir, root) -> dict[str, list[str]]:
    """{"base" | a workdir's name | "table": argv} of the README's "Reproducing the paper" block, for
    Table 1 as it says (qwen25_3b in place of qwen25_7b), $M the model folder, runs/ under ``root``."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Reproducing the paper\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = {}
    for line in block.splitlines():
        if not line.startswith("python "):
            continue
        argv = [sys.executable, *(word.replace("$M", str(model_dir)).replace("configs/paper.py:qwen25_7b,",
                                                                             "configs/paper.py:qwen25_3b,")
                                  for word in shlex.split(line, comments=True)[1:])]
        argv = [re.sub(r"(^|=)runs/", rf"\g<1>{root}/", word) for word in argv]
        if "pacs_jax.evaluate" in argv:
            commands["base"] = argv
        elif "tools/paper_table.py" in argv:
            commands["table"] = argv
        else:
            (workdir,) = [w.split("=", 1)[1] for w in argv if w.startswith("--workdir=")]
            commands[workdir.rsplit("/", 1)[1]] = argv
    return commands


@pytest.fixture(scope="module")
def qwen25_dir(small_tokenizer_dir, tmp_path_factory):
    """A Qwen2.5-3B-shaped base model folder, shrunk as test_model_tokenizer.py's qwen25_dir (a random 2-layer
    Qwen2, tied embeddings, bos = eos = <|endoftext|>, Qwen2.5's generation_config.json and tokenizer files)
    but on conftest.py's small tokenizer: 4,096 vocabulary entries, not 151,936 (the table is not about the
    vocabulary, whose [T, V] logits and embedding were most of the three runs' CPU time)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("Qwen2.5-3B-tiny")
    write_qwen25_tokenizer(small_tokenizer_dir, path)
    added = json.loads((path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    (endoftext,) = [int(i) for i, token in added.items() if token["content"] == "<|endoftext|>"]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=SMALL_TOKENIZER_SIZE, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024, tie_word_embeddings=True,
                                         bos_token_id=endoftext, eos_token_id=endoftext))
    model.eval().save_pretrained(path)
    generation = {**QWEN25_GENERATION_CONFIG, "bos_token_id": endoftext, "eos_token_id": endoftext}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


@pytest.fixture(scope="module")
def runs(qwen25_dir, tmp_path_factory):
    """{"Base": the evaluation's folder, "PACS" / "GRPO": the runs' workdirs, "table": the README's
    tools/paper_table.py argv}, made by the README's commands (shrunk) on the tiny Qwen2.5 folder."""
    root = tmp_path_factory.mktemp("paper_table_runs")
    rows = json.loads((REPO / "data" / "deepscaler_subset" / "math.json").read_text())
    data_file = root / "deepscaler_subset" / "math.json"  # its 8 shortest problems, in the subset's own format
    data_file.parent.mkdir()
    data_file.write_text(json.dumps(sorted(rows, key=lambda r: len(r["problem"]))[:8]))
    commands = readme_commands(qwen25_dir, root)
    assert set(commands) == {"base", "pacs", "pacs_noweight", "grpo", "ppo", "table"}, commands
    assert commands["base"][1:5] == ["-m", "pacs_jax.evaluate", "--config=configs/eval.py:paper",
                                     f"--checkpoint={qwen25_dir}"]
    assert commands["pacs"][1:4] == ["-m", "pacs_jax.train", "--config=configs/paper.py:qwen25_3b,pacs_beta1"]
    assert commands["grpo"][1:4] == ["-m", "pacs_jax.train", "--config=configs/paper.py:qwen25_3b,grpo"]
    env = train_env(compile_cache_dir())
    argvs = {"base": [*commands["base"], *EVAL_FLAGS, "--config.evaluate.progress=False"],
             "pacs": [*commands["pacs"], *train_flags(data_file)],
             # the Base row needs one evaluation before RL (PACS's): GRPO skips its own
             "grpo": [*commands["grpo"], *train_flags(data_file), "--config.eval.before_rl=False"]}
    for name, argv in argvs.items():  # the evaluation's samplers compiled once: the runs read them from the cache
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stderr[-3000:]}"
    # the README's tools/paper_table.py line on the two runs made here
    table = [a for a in commands["table"] if a not in (f"{root}/pacs_noweight", f"{root}/ppo")]
    assert table[1:] == ["tools/paper_table.py", f"{root}/pacs", f"{root}/grpo", f"--out={root}/table"], table
    return {"Base": root / "base", "PACS": root / "pacs", "GRPO": root / "grpo", "table": table}


def _tool(*args) -> subprocess.CompletedProcess:
    """tools/paper_table.py's ``main`` on ``args`` in this process (the README's line runs it as a script): its
    exit status and what it printed, as a CompletedProcess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = table_tool.main(list(map(str, args)))
    return subprocess.CompletedProcess(["paper_table.py", *map(str, args)], status, out.getvalue(), err.getvalue())


def _tables(markdown: str) -> dict[str, dict[str, list[str]]]:
    """{section title: {"header": [...], method: [cells...]}} of the tool's Markdown."""
    tables, title = {}, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            title = line[3:].removesuffix(" (pass@k)")
            tables[title] = {}
        elif title and line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            key = "header" if cells[0] == "Model" else cells[0]
            assert key not in tables[title], f"{title}: row {key} twice"
            tables[title][key] = cells[1:]
    return tables


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.2f}"


def _cell(ours: float | None, paper: float) -> str:
    """A published set's cell as the paper's layout has it: ours / paper (ours - paper), in percent."""
    return f"— / {paper:.2f}" if ours is None else f"{100 * ours:.2f} / {paper:.2f} ({100 * ours - paper:+.2f})"


@pytest.mark.slow(seconds=40)  # the fixture's three CLI runs
def test_the_readme_commands_give_the_papers_table(runs, tmp_path):
    # The README's command: the runs only, the Base row their first evaluation before RL, the published
    # table the runs' preset's (qwen25_3b: Qwen2.5-3B, Table 1)
    readme = subprocess.run(runs["table"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert readme.returncode == 0, readme.stderr
    readme_out = pathlib.Path(runs["table"][-1].removeprefix("--out="))
    text = (readme_out / "paper_table.md").read_text()
    assert readme.stdout.startswith(text)
    assert text.startswith("# pass@k of our runs against arXiv 2509.02522v1, Table 1 (Qwen2.5-3B)")
    for method, folder in (("Base", "before_rl"), ("PACS", "final"), ("GRPO", "final")):
        assert f"- {method}: {runs[method.replace('Base', 'PACS')] / 'eval' / folder}\n" in text
    assert (readme_out / "pass_at_k.png").is_file()

    # The Base row from `python -m pacs_jax.evaluate` (an explicit Base wins over the runs' evaluations before RL)
    out = tmp_path / "table"
    done = _tool(f"Base={runs['Base']}", runs["PACS"], runs["GRPO"], f"--out={out}")
    assert done.returncode == 0, done.stderr
    markdown = (out / "paper_table.md").read_text()
    assert done.stdout.startswith(markdown)
    assert markdown.startswith("# pass@k of our runs against arXiv 2509.02522v1, Table 1 (Qwen2.5-3B)")
    ours = {"Base": runs["Base"], "PACS": runs["PACS"] / "eval" / "final", "GRPO": runs["GRPO"] / "eval" / "final"}
    for method, folder in ours.items():
        assert f"- {method}: {folder}\n" in markdown
    metrics = {m: json.loads((f / "eval_metrics.json").read_text()) for m, f in ours.items()}
    for method, values in metrics.items():  # each set at its own samples per problem (the paper's per-set n)
        for name, n in N.items():
            assert f"pass@{n}" in values[name] and f"pass@{2 * n}" not in values[name], (method, name)
        assert ("gsm8k" in values) == (method != "Base")  # configs/eval.py:paper: the tables' four sets
    published = json.loads(PUBLISHED.read_text())
    paper = published["tables"]["Qwen2.5-3B"]["rows"]
    tables = _tables(markdown)
    # the paper's four sets in its order, then the set the runs evaluated beside them (GSM8K)
    assert list(tables) == ["MATH 500", "AMC 23", "AIME 2024", "AIME 2025", "gsm8k"]
    for name, title in published["set_names"].items():
        ks = published["k"][name]
        table = tables[title]
        assert table["header"] == [f"k={ks[0]}", *map(str, ks[1:])]
        assert list(table)[1:] == ["Base", "PPO", "GRPO", "PACS"]  # Table 1's rows, in order
        for method, cells in table.items():
            if method == "header":
                continue
            ours_at = metrics.get(method, {}).get(name, {})
            expected = [_cell(ours_at.get(f"pass@{k}"), value) for k, value in zip(ks, paper[method][name])]
            assert cells == expected, (title, method)
            # ours at every published k up to the set's n (k = 1 at least), none above it
            assert sum(not c.startswith("—") for c in cells) == (sum(k <= N[name] for k in ks) if ours_at else 0)
    gsm8k = tables["gsm8k"]
    assert gsm8k["header"] == ["k=1", "2", "4", "8"]
    assert list(gsm8k)[1:] == ["Base", "GRPO", "PACS"]  # the paper's order; no published row for this set
    assert gsm8k["Base"] == ["—"] * 4
    for method in ("GRPO", "PACS"):
        values = metrics[method]["gsm8k"]
        assert gsm8k[method] == [_percent(values[f"pass@{k}"]) for k in (1, 2, 4, 8)], method
    data = json.loads((out / "paper_table.json").read_text())
    assert data["model"] == "Qwen2.5-3B" and [s["name"] for s in data["sets"]][-1] == "gsm8k"
    rows = {r["method"]: r for r in data["sets"][0]["rows"]}
    assert rows["PACS"]["paper_source"] == "arXiv 2509.02522v1, Table 1, row PACS"
    assert rows["PACS"]["ours_from"] == str(ours["PACS"]) and rows["PPO"]["ours_from"] is None
    png = (out / "pass_at_k.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    # The evaluation alone (outside a training workdir, no model preset): no published table without --model
    plain = _tool(f"Base={runs['Base']}", f"--out={tmp_path / 'plain'}")
    assert plain.returncode == 0, plain.stderr
    text = (tmp_path / "plain" / "paper_table.md").read_text()
    assert "No published table for these runs' model" in text and list(_tables(text)) == list(metrics["Base"])

    # Rows named on the command line, against Table 2: an explicit Base wins over a run's evaluation before RL
    # given before it, and an evaluation's own folder is a row too
    assert not (runs["GRPO"] / "eval" / "before_rl").exists()
    named = _tool(runs["PACS"], f"Base={runs['Base']}", f"PACS w/o weight={runs['GRPO'] / 'eval' / 'final'}",
                  "--model=Qwen2.5-7B", f"--out={tmp_path / 'named'}")
    assert named.returncode == 0, named.stderr
    text = (tmp_path / "named" / "paper_table.md").read_text()
    assert text.startswith("# pass@k of our runs against arXiv 2509.02522v1, Table 2 (Qwen2.5-7B)")
    assert f"- Base: {runs['Base']}\n" in text and "/before_rl" not in text
    rows = _tables(text)["AMC 23"]
    table2 = published["tables"]["Qwen2.5-7B"]["rows"]
    assert list(rows)[1:] == ["Base", "PPO", "GRPO", "PACS", "PACS w/o weight"]
    for method, ours_of in (("Base", "Base"), ("GRPO", None), ("PACS", "PACS"), ("PACS w/o weight", "GRPO")):
        ours_at = metrics[ours_of]["amc23"] if ours_of else {}
        assert rows[method] == [_cell(ours_at.get(f"pass@{k}"), v) for k, v in zip(published["k"]["amc23"],
                                                                                    table2[method]["amc23"])], method

    # Two runs of one method, a folder that is neither, an evaluation outside a workdir without a name
    twice = _tool(runs["PACS"], runs["PACS"], f"--out={tmp_path / 'x'}")
    assert twice.returncode == 2 and "two runs are both 'PACS'" in twice.stderr and "LABEL=RUN_DIR" in twice.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    neither = _tool(empty, f"--out={tmp_path / 'x'}")
    assert neither.returncode == 2 and str(empty) in neither.stderr and "eval/final/eval_metrics.json" in neither.stderr
    unnamed = _tool(runs["Base"], f"--out={tmp_path / 'x'}")
    assert unnamed.returncode == 2 and f"LABEL={runs['Base']}" in unnamed.stderr
    unknown = _tool(runs["PACS"], "--model=Qwen9-1T", f"--out={tmp_path / 'x'}")
    assert unknown.returncode == 2 and "Qwen9-1T" in unknown.stderr and "Qwen2.5-7B" in unknown.stderr


def test_cells_are_ours_beside_the_paper_and_the_difference_at_the_papers_k():
    """The cell arithmetic on the published file: ours at each of the paper's k (none above a set's n),
    the paper's number of that row, table and k, and ours - paper."""
    published = table_tool.load_published(PUBLISHED)
    row = table_tool.Row.__new__(table_tool.Row)  # metrics of a run with 64 samples per problem
    row.method, row.folder, row.preset = "GRPO", REPO, None
    row.metrics = {"math_500": {k: 0.5 + k / 100 for k in (1, 2, 4, 8, 16, 32, 64)},
                   "aime_2024": {k: k / 1000 for k in (1, 2, 4, 8, 16, 32, 64)}}
    result = table_tool.build([row], published, "Qwen2.5-3B")
    sets = {s["name"]: s for s in result["sets"]}
    assert list(sets) == ["math_500", "amc23", "aime_2024", "aime_2025"]
    grpo = {s: next(r for r in sets[s]["rows"] if r["method"] == "GRPO") for s in sets}
    cells = grpo["math_500"]["cells"]
    assert [c["k"] for c in cells] == [1, 2, 4, 8, 16, 32]
    assert cells[0] == dict(k=1, ours=pytest.approx(51.0), paper=66.92, diff=pytest.approx(51.0 - 66.92))
    assert table_tool.cell_text(cells[0]) == "51.00 / 66.92 (-15.92)"
    assert table_tool.cell_text(cells[5]) == "82.00 / 89.00 (-7.00)"
    aime = grpo["aime_2024"]["cells"]
    assert [c["k"] for c in aime] == [1, 8, 32, 64, 128, 256]
    assert [table_tool.cell_text(c) for c in aime] == [
        "0.10 / 8.14 (-8.04)", "0.80 / 19.13 (-18.33)", "3.20 / 26.06 (-22.86)", "6.40 / 31.65 (-25.25)",
        "— / 37.75", "— / 42.76"]  # k = 128, 256 above the run's 64 samples
    assert table_tool.cell_text(dict(k=1, ours=90.0, paper=89.0, diff=1.0)) == "90.00 / 89.00 (+1.00)"
    assert all(r["ours_from"] is None for s in sets.values() for r in s["rows"] if r["method"] != "GRPO")
    assert grpo["aime_2024"]["paper_source"] == "arXiv 2509.02522v1, Table 1, row GRPO"


def test_the_published_file_holds_tables_1_and_2_with_a_source_for_every_row():
    published = table_tool.load_published(PUBLISHED)
    assert published["k"] == {"math_500": [1, 2, 4, 8, 16, 32], "amc23": [1, 8, 32, 64, 128, 256],
                              "aime_2024": [1, 8, 32, 64, 128, 256], "aime_2025": [1, 8, 32, 64, 128, 256]}
    for model, number, methods in (("Qwen2.5-3B", 1, ["Base", "PPO", "GRPO", "PACS"]),
                                   ("Qwen2.5-7B", 2, ["Base", "PPO", "GRPO", "PACS", "PACS w/o weight"])):
        table = published["tables"][model]
        assert table["source"] == f"arXiv 2509.02522v1, Table {number} ({model})"
        assert list(table["rows"]) == methods
        for method, row in table["rows"].items():
            assert re.fullmatch(rf"arXiv 2509\.02522v1, Table {number}, row .+", row["source"])
            assert all(0 < v <= 100 for name in published["k"] for v in row[name])
            for name in published["k"]:  # pass@k grows with k
                assert row[name] == sorted(row[name]), (model, method, name)
    # the v1 abstract's 59.78 at pass@256 and its margins over PPO (13.32) and GRPO (14.36)
    rows = published["tables"]["Qwen2.5-7B"]["rows"]
    pacs = rows["PACS"]["aime_2024"][-1]
    assert pacs == 59.78 and [round(pacs - rows[m]["aime_2024"][-1], 2) for m in ("PPO", "GRPO")] == [13.32, 14.36]
