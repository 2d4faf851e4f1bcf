"""The reward worker pool: hostile output, time limits, the batch deadline, dead workers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

import pytest

from pacs_jax import rewards
from pacs_jax.rewards import pool as pool_module
from pacs_jax.rewards import verdict

# A real answer that never finishes: sympy sums k^k exactly for a million terms.
HANGING = "The answer is $\\boxed{\\sum_{k=1}^{10^{6}} k^{k}}$."


@pytest.fixture(scope="module")
def pool():
    with rewards.RewardPool(num_workers=2, item_timeout=5.0) as shared:
        yield shared


def _payloads(command: str) -> list[str]:
    """Ways a response could try to get ``command`` run by a checker that evaluates text."""
    call = f"__import__('os').system('{command}')"
    return [
        f"\\boxed{{{call}}}",
        f"The answer is {call}",
        f"$({call})$",
        f"Final answer: (lambda: {call})()",
        f"\\boxed{{eval(\"{call}\")}}",
        f"\\boxed{{exec(\"import os; os.system('{command}')\")}}",
        f"$\\boxed{{{call}}}$ and 3 = {call}",
        f"#### {call}",
    ]


def test_hostile_output_is_never_executed(pool, tmp_path):
    control, marker = tmp_path / "control", tmp_path / "marker"
    # The payload is live: executed by Python it creates its file.
    subprocess.run([sys.executable, "-c", f"__import__('os').system('touch {control}')"], check=True)
    assert control.exists()

    responses = _payloads(f"touch {marker}")
    golds = ["424242"] * len(responses)  # a number no payload contains
    math_scores, _, _ = pool.score(responses, golds, "math")
    gsm8k_scores, _, _ = pool.score(responses, golds, "gsm8k")
    paper_scores, _, _ = pool.score(responses, golds, "paper")  # the authors' call: whole response, plain expressions
    single = [rewards.math_reward(response, "424242") for response in responses]
    assert not marker.exists()
    assert math_scores.tolist() == [0.0] * len(responses)
    assert gsm8k_scores.tolist() == [0.0] * len(responses)
    assert paper_scores.tolist() == [0.0] * len(responses)
    assert single == [0.0] * len(responses)


def test_pathological_answers_come_back_within_the_limit(pool):
    one_megabyte = "Let me think about this carefully. " * 30_000 + "So the answer is $\\boxed{3}$."
    assert len(one_megabyte) > 1_000_000
    cases = [  # (response, gold, expected score)
        ("\\boxed{9^{9^{9^{9}}}}", "3", 0.0),
        ("\\boxed{2^{2^{2^{2^{2^{2}}}}}}", "3", 0.0),
        ("\\boxed{10000!}", "3", 0.0),
        ("\\boxed{10000!}", "10000!", 1.0),
        ("\\boxed{" + "{" * 50_000 + "1" + "}" * 50_000 + "}", "1", 0.0),
        (one_megabyte, "3", 1.0),
    ]
    scores, statuses, metrics = pool.score([c[0] for c in cases], [c[1] for c in cases], "math")
    assert scores.tolist() == [c[2] for c in cases]
    # Each was settled by the checker (answered, or refused as too costly), not cut off by the clock.
    assert set(statuses) <= {verdict.OK, verdict.REJECTED}, statuses
    assert metrics["timeouts"] == 0 and metrics["worker_restarts"] == 0


def test_hanging_item_is_cut_off_and_its_worker_replaced():
    responses = ["\\boxed{1}", HANGING, "\\boxed{\\frac{1}{2}}", "\\boxed{4}"]
    golds = ["1", "3", "0.5", "5"]
    with rewards.RewardPool(num_workers=2, item_timeout=1.0) as short:
        scores, statuses, metrics = short.score(responses, golds)
        assert statuses == [verdict.OK, verdict.TIMEOUT, verdict.OK, verdict.OK]
        assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]
        assert metrics["timeouts"] == 1 and metrics["worker_restarts"] == 1
        assert short.score(["\\boxed{7}"] * 4, ["7"] * 4).scores.tolist() == [1.0] * 4  # the replacement works


def test_deadline_bounds_the_batch():
    with rewards.RewardPool(num_workers=1, item_timeout=600.0) as slow:
        slow.score(["\\boxed{1}"], ["1"])  # the worker is up
        scores, statuses, metrics = slow.score(["\\boxed{1}", HANGING, "\\boxed{2}"], ["1", "3", "2"], deadline=3.0)
        assert statuses == [verdict.OK, verdict.DEADLINE, verdict.DEADLINE]
        assert scores.tolist() == [1.0, 0.0, 0.0]
        assert (metrics["unscored"], metrics["unscored_fraction"], metrics["deadline_retried"]) == (2, 2 / 3, 0)
        # A bound, not a speed: the hanging item had 600 s to run, the call returned near its deadline.
        assert metrics["seconds"] < 60
        assert slow.score(["\\boxed{2}"], ["2"]).scores.tolist() == [1.0]


def test_deadline_misses_are_retried_once_then_counted_or_refused():
    with rewards.RewardPool(num_workers=1, item_timeout=600.0) as slow:
        slow.score(["\\boxed{1}"], ["1"])  # the worker is up
        responses, golds = ["\\boxed{1}", HANGING, "\\boxed{2}"], ["1", "3", "2"]
        # Round 1: the hanging item holds the only worker past the deadline, the third never starts.
        # Round 2 (fresh deadline): the never-started item first, then the hanging one again.
        scores, statuses, metrics = slow.score(responses, golds, deadline=4.0, deadline_retries=1)
        assert statuses == [verdict.OK, verdict.DEADLINE, verdict.OK]
        assert scores.tolist() == [1.0, 0.0, 1.0]
        assert (metrics["unscored"], metrics["unscored_fraction"], metrics["deadline_retried"]) == (1, 1 / 3, 2)
        assert metrics["seconds"] < 60
        slow.score(responses, golds, deadline=4.0, deadline_retries=1, max_unscored_fraction=0.34)  # 1/3 is allowed
        with pytest.raises(rewards.UnscoredError, match=r"1 of 3 responses \(33.3%\).*reward.max_unscored_fraction"):
            slow.score(responses, golds, deadline=4.0, deadline_retries=1, max_unscored_fraction=0.2)
        assert slow.score(["\\boxed{2}"], ["2"]).scores.tolist() == [1.0]


def test_a_dying_worker_scores_its_item_zero():
    with rewards.RewardPool(num_workers=1, item_timeout=600.0) as one:
        one.score(["\\boxed{1}"], ["1"])
        victim = one._workers[0].process.pid
        killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
        killer.start()
        scores, statuses, metrics = one.score([HANGING], ["3"])
        killer.join()
        assert statuses == [verdict.CRASH] and scores.tolist() == [0.0]
        assert metrics["errors"] == 1 and metrics["worker_restarts"] == 1
        assert one.score(["\\boxed{1}"], ["1"]).scores.tolist() == [1.0]


def test_ctrl_c_while_a_worker_starts_reaches_neither_it_nor_the_output(capfd):
    """Ctrl-C reaches the whole process group, the workers too, which may still be starting: their interpreter
    importing site's .pth files (the editable install's finder), before a line of theirs ran. A SIGINT every
    few milliseconds from the moment each worker is spawned until it is ready: no worker dies, none prints
    a KeyboardInterrupt traceback (both did while the workers ignored SIGINT only from their first line on)."""
    with rewards.RewardPool(num_workers=2, item_timeout=60.0) as pool:
        pids = [worker.process.pid for worker in pool._workers]
        stop = threading.Event()

        def interrupt():
            while not stop.wait(0.003):
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):  # a worker the signal killed
                        os.kill(pid, signal.SIGINT)

        interrupter = threading.Thread(target=interrupt)
        interrupter.start()
        try:
            scores, _, metrics = pool.score(["\\boxed{1}", "\\boxed{2}"], ["1", "2"])
        finally:
            stop.set()
            interrupter.join()
    assert scores.tolist() == [1.0, 1.0] and metrics["worker_restarts"] == 0
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def test_workers_that_cannot_start_raise(monkeypatch):
    monkeypatch.setattr(pool_module, "_WORKER_ENTRY", "import sys; sys.exit(3)")
    with rewards.RewardPool(num_workers=1) as broken:
        with pytest.raises(RuntimeError, match="died while starting"):
            broken.score(["\\boxed{1}"], ["1"])


def test_mixed_rewards_and_bad_arguments(pool):
    scores, statuses, _ = pool.score(["\\boxed{\\frac{1}{2}}", "So 1,600 dollars."], ["0.5", "1600"], ["math", "gsm8k"])
    assert scores.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="unknown reward"):
        pool.score(["1"], ["1"], "code")
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        pool.score(["1", "2"], ["1"])
    with pytest.raises(ValueError, match="item_timeout"):
        rewards.RewardPool(1, item_timeout=0)


def test_closed_pool_refuses_work():
    closed = rewards.RewardPool(num_workers=1)
    closed.close()
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.score(["\\boxed{1}"], ["1"])
