"""Issue 41 item 3: a paper setup's CPU smoke test (``configs/paper.py:MODEL,ALGO,cpu``) trains through
the CLI as the README says, shrunk further by flags to one step of 2 prompts x 8 responses in one
prompt bucket (512) and one response bucket (64: each bucket pair's programs compile before step 1; the
setup's four pairs made most of the run), no evaluation and the Qwen tokenizer cut to 4,096 entries (conftest.py's small_tokenizer_dir: the real
vocabulary's logits were most of the run), with progress lines inside its sampler call (rows done and
tokens so far, read between chunks of decode steps), inside pi_old (passes done) and inside its update
(mini-batches done), one dispatch each."""

import math
import re
import subprocess
import sys

import pytest

from train_helpers import REPO, compile_cache_dir, metrics_rows, train_env

SHRINK = ("--config.train.steps=1", "--config.eval.sets=", "--config.train.prompts_per_step=2",
          "--config.rollout.micro_batches=1", "--config.rollout.slots=16", "--config.train.mini_batches=2",
          "--config.train.progress_seconds=0.001", "--config.data.prompt_buckets=(512,)",
          "--config.rollout.response_buckets=(64,)")  # a heartbeat at each look at an unfinished result


@pytest.mark.slow(seconds=40)
def test_a_paper_setup_shrunk_to_a_cpu_trains_a_step_through_the_cli(small_tokenizer_dir, tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "pacs_jax.train", "--config=configs/paper.py:qwen25_7b,pacs_beta1,cpu",
                             f"--workdir={workdir}", *SHRINK, f"--config.data.tokenizer={small_tokenizer_dir}"],
                            cwd=REPO, env=train_env(compile_cache_dir()), capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "warning:" not in output and "Traceback" not in output
    # inside the one sampler call: 16 rows, and tokens beyond the prefill's token 0 of each
    inside = [tuple(map(int, m)) for m in re.findall(r"step 1: sampling, sampler call 1/1: (\d+)/16 rows done, "
                                                     r"(\d+) tokens, \d+ s so far", output)]
    assert inside and max(tokens for _, tokens in inside) > 16, output[-3000:]
    assert re.search(r"step 1: sampling done in \d+ s \(16 rows, \d+ tokens\)", output)
    for phase in ("reward", "pi_old", "update"):
        assert f"step 1: {phase} done in " in output
    # inside pi_old: its packed passes (4 here), some seen done while others run
    passes = {tuple(map(int, m)) for m in re.findall(r"step 1: pi_old, (\d+)/(\d+) passes done, \d+ s so far", output)}
    assert any(0 < done < total for done, total in passes), output[-3000:]
    # inside the update: its 2 mini-batches, the first seen done while the second runs
    assert re.search(r"step 1: update, 1/2 mini-batches of the update done, \d+ s so far", output), output[-3000:]
    (row,) = metrics_rows(workdir)
    assert row["step"] == 1 and (row["prompt_bucket"], row["response_bucket"]) == (512, 64) and math.isfinite(row["loss"])
