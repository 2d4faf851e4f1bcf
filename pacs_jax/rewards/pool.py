"""Scoring thousands of responses at once in a persistent pool of worker processes.

Each worker (``rewards/worker.py``, a fresh Python process that imports no JAX) checks one item
at a time; the parent keeps the clock. An item that overruns its time limit (a hung sympy call,
which no signal can interrupt inside C code) scores 0 and its worker is killed and replaced; a
worker that dies scores its item 0 and is replaced; when the batch deadline passes, the items not
yet checked get ``deadline_retries`` more rounds with a fresh deadline, and those still unchecked
then score 0 (status DEADLINE, counted as ``unscored``), or the call raises ``UnscoredError`` when
they exceed ``max_unscored_fraction`` of the batch. All of these are counted in the returned metrics.

    with RewardPool(item_timeout=5.0) as pool:
        scores, statuses, metrics = pool.score(responses, ground_truths, reward="math", deadline=60.0)
    # scores [N] float32 in {0, 1}; metrics {"mean_score", "timeouts", "unscored", "parse_failures", ...}

``math_reward(response, ground_truth)`` checks a single pair through a shared one-worker pool.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import NamedTuple

import numpy as np

from pacs_jax.rewards import verdict
from pacs_jax.rewards.worker import READY, REWARDS

_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
_MAX_FAILED_STARTS = 3
POLL_S = 0.25  # the most seconds between two calls of score's poll
# The parent owns Ctrl-C and preemption (SIGINT / SIGTERM to the process group): it finishes or drops the step and
# closes the worker's pipe, which is when the worker exits. A worker starts with both blocked (``_spawn`` blocks them
# around the fork; the mask outlives exec), ignores them, which drops one already pending, and only then unblocks
# them: a Ctrl-C while a worker's interpreter still started printed a KeyboardInterrupt traceback from site's .pth
# files (the editable install's finder) into the trainer's output, before a first line of the worker had run.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_WORKER_ENTRY = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM}); "
                 "import sys; from pacs_jax.rewards.worker import main; main(sys.argv)")
_log = logging.getLogger(__name__)


class UnscoredError(RuntimeError):
    """Too much of a batch was still unscored at the reward deadline (see ``RewardPool.score``)."""


class ScoredBatch(NamedTuple):
    scores: np.ndarray        # [N] float32, 1.0 or 0.0
    statuses: list[str]       # [N] one of verdict.STATUSES
    metrics: dict[str, float]


@dataclasses.dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    inbox: Connection         # parent -> worker
    outbox: Connection        # worker -> parent
    spawned_at: float
    ready: bool = False
    item: int | None = None   # index of the item being checked
    item_started: float = 0.0

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.inbox.close()
        self.outbox.close()


class RewardPool:
    """Persistent reward workers with a per-item time limit (see the module docstring).

    Args:
      num_workers: worker processes (default: CPU count, at most 32).
      item_timeout: seconds one item may take before its worker is killed (default 5).
      start_timeout: seconds a new worker may take to become ready before ``score`` raises.
      memory_limit_bytes: address-space limit of each worker (RLIMIT_AS), None for no limit.
    """

    def __init__(self, num_workers: int | None = None, item_timeout: float = 5.0, *,
                 start_timeout: float = 120.0, memory_limit_bytes: int | None = 8 << 30):
        if item_timeout <= 0:
            raise ValueError(f"item_timeout must be > 0, got {item_timeout}")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers or max(1, min(os.cpu_count() or 1, 32))
        self.item_timeout = item_timeout
        self.start_timeout = start_timeout
        self.memory_limit_bytes = memory_limit_bytes
        self._restarts = 0
        self._failed_starts = 0
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)
        self._workers.extend(self._spawn() for _ in range(self.num_workers))

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        self._finalizer()

    def score(self, responses: Sequence[str], ground_truths: Sequence[str], reward: str | Sequence[str] = "math",
              *, deadline: float | None = None, deadline_retries: int = 0,
              max_unscored_fraction: float | None = None, poll: Callable[[], None] | None = None) -> ScoredBatch:
        """Score ``responses[i]`` against ``ground_truths[i]`` with reward function ``reward`` (or ``reward[i]``).

        deadline: seconds from now after which unchecked items score 0 (status DEADLINE); the call
        returns shortly after it whatever the items do. deadline_retries: how many more rounds, each
        with a fresh ``deadline``, the items the deadline left unchecked get (those never started
        first, then those abandoned mid-check). max_unscored_fraction: raise ``UnscoredError`` when a
        larger fraction of the batch is still unchecked after the retries (rather than let it count
        as wrong answers). poll: called at least every ``POLL_S`` while the items are checked; it may
        raise to abandon the call (the trainer's stop at a signal: the items being checked are dropped).
        """
        if not self._workers:
            raise RuntimeError("RewardPool is closed")
        n = len(responses)
        if len(ground_truths) != n:
            raise ValueError(f"{n} responses but {len(ground_truths)} ground truths")
        rewards = [reward] * n if isinstance(reward, str) else list(reward)
        if len(rewards) != n:
            raise ValueError(f"{n} responses but {len(rewards)} reward names")
        unknown = sorted(set(rewards) - set(REWARDS))
        if unknown:
            raise ValueError(f"unknown reward(s) {unknown}; known: {sorted(REWARDS)}")
        if deadline_retries < 0:
            raise ValueError(f"deadline_retries must be >= 0, got {deadline_retries}")

        start = time.monotonic()
        restarts_before = self._restarts
        scores = np.zeros(n, np.float32)
        statuses = [verdict.DEADLINE] * n  # overwritten as items are checked
        items = [(responses[i], ground_truths[i], rewards[i]) for i in range(n)]
        pending, retried = list(range(n)), 0
        for round_ in range(deadline_retries + 1):
            abandoned = self._run(items, pending, deadline, scores, statuses, poll)
            unchecked = [i for i in pending if statuses[i] == verdict.DEADLINE]
            pending = [i for i in unchecked if i not in abandoned] + [i for i in unchecked if i in abandoned]
            if not pending or round_ == deadline_retries:
                break
            retried += len(pending)
        metrics = score_metrics(scores, statuses, restarts=self._restarts - restarts_before,
                                seconds=time.monotonic() - start)
        metrics["deadline_retried"] = float(retried)
        if max_unscored_fraction is not None and n and metrics["unscored_fraction"] > max_unscored_fraction:
            raise UnscoredError(
                f"{int(metrics['unscored'])} of {n} responses ({metrics['unscored_fraction']:.1%}) were still "
                f"unscored at the reward deadline of {deadline} s after {deadline_retries} retry round(s), above "
                f"the allowed {max_unscored_fraction:.1%} (reward.max_unscored_fraction); training on them would "
                "count them as wrong. Raise reward.deadline or reward.workers, or check the responses.")
        return ScoredBatch(scores, statuses, metrics)

    def _run(self, items: Sequence[tuple[str, str, str]], indices: Sequence[int], deadline: float | None,
             scores: np.ndarray, statuses: list[str], poll: Callable[[], None] | None = None) -> set[int]:
        """Check ``items[i]`` for i in ``indices`` until done or ``deadline`` seconds pass, writing each
        result into ``scores`` / ``statuses``; returns the items abandoned mid-check at the deadline
        (or when ``poll`` raises: ``score``)."""
        end = time.monotonic() + deadline if deadline is not None else float("inf")
        pending = deque(indices)

        def record(index: int, score: float, status: str) -> None:
            scores[index], statuses[index] = score, status

        try:
            while (pending or self._busy()) and time.monotonic() < end:
                if poll is not None:
                    poll()
                for worker in self._workers:
                    if worker.ready and worker.item is None and pending:
                        index = pending.popleft()
                        response, ground_truth, reward = items[index]
                        try:
                            worker.inbox.send((index, reward, response, ground_truth))
                        except OSError:  # died while idle: retry the item on its replacement
                            pending.appendleft(index)
                            self._replace(worker)
                            continue
                        worker.item, worker.item_started = index, time.monotonic()
                for event in self._collect(end if poll is None else min(end, time.monotonic() + POLL_S)):
                    record(*event)
                now = time.monotonic()
                for worker in self._workers:
                    if worker.item is not None and now - worker.item_started >= self.item_timeout:
                        record(worker.item, 0.0, verdict.TIMEOUT)
                        self._replace(worker)
                    elif not worker.ready and now - worker.spawned_at >= self.start_timeout:
                        raise RuntimeError(f"reward worker not ready after {self.start_timeout:.0f} s")
        finally:  # the deadline passed (or ``poll`` raised): abandon the items still being checked
            abandoned = set()
            for worker in self._workers:
                if worker.item is not None:
                    abandoned.add(worker.item)
                    self._replace(worker)
        return abandoned

    def _busy(self) -> bool:
        return any(worker.item is not None for worker in self._workers)

    def _collect(self, end: float) -> list[tuple[int, float, str]]:
        """Block until a worker reports or the next time limit falls due; return finished items."""
        wake = end
        for worker in self._workers:
            if worker.item is not None:
                wake = min(wake, worker.item_started + self.item_timeout)
            elif not worker.ready:
                wake = min(wake, worker.spawned_at + self.start_timeout)
        by_outbox = {worker.outbox: worker for worker in self._workers}
        finished = []
        for outbox in wait(list(by_outbox), timeout=max(0.0, wake - time.monotonic())):
            worker = by_outbox[outbox]
            try:
                message = outbox.recv()
            except (EOFError, OSError):  # the worker died (e.g. a C stack overflow in sympy)
                if worker.item is not None:
                    finished.append((worker.item, 0.0, verdict.CRASH))
                elif not worker.ready:
                    self._failed_starts += 1
                    if self._failed_starts >= _MAX_FAILED_STARTS:
                        raise RuntimeError(f"{self._failed_starts} reward workers died while starting; "
                                           "see their traceback on stderr")
                self._replace(worker)
                continue
            if message == READY:
                worker.ready = True
                self._failed_starts = 0
            else:
                finished.append(message)
                worker.item = None
        return finished

    def _spawn(self) -> _Worker:
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
        command = [sys.executable, "-c", _WORKER_ENTRY, str(to_worker_r), str(from_worker_w),
                   str(self.memory_limit_bytes or 0)]
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # one arriving now reaches another thread
        try:                                                                  # or waits for the unblock below
            process = subprocess.Popen(command, pass_fds=(to_worker_r, from_worker_w), env=env,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(to_worker_r)
            os.close(from_worker_w)
        return _Worker(process, Connection(to_worker_w, readable=False), Connection(from_worker_r, writable=False),
                       time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker`` (whatever it is doing) and put a fresh one in its slot."""
        worker.stop()
        self._workers[self._workers.index(worker)] = self._spawn()
        self._restarts += 1


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()


def score_metrics(scores: np.ndarray, statuses: Sequence[str], *, restarts: int, seconds: float) -> dict[str, float]:
    """Batch summary: mean score, how many items ended in each failure mode, worker restarts, wall time."""
    counts = Counter(statuses)
    return {
        "count": float(len(statuses)),
        "mean_score": float(scores.mean()) if len(statuses) else 0.0,
        "timeouts": float(counts[verdict.TIMEOUT]),
        "unscored": float(counts[verdict.DEADLINE]),  # still unchecked at the deadline (after any retries)
        "unscored_fraction": float(counts[verdict.DEADLINE]) / max(len(statuses), 1),
        "parse_failures": float(counts[verdict.NO_ANSWER] + counts[verdict.BAD_GOLD]),
        "rejected": float(counts[verdict.REJECTED]),
        "errors": float(counts[verdict.ERROR] + counts[verdict.CRASH]),
        "worker_restarts": float(restarts),
        "seconds": seconds,
    }


_shared_pool: RewardPool | None = None
_shared_lock = threading.Lock()


def math_reward(response: str, ground_truth: str, timeout: float = 5.0) -> float:
    """1.0 if ``response``'s final answer is equivalent to ``ground_truth``, else 0.0.

    Never raises and returns within about ``timeout`` seconds (plus the first call's worker start,
    about a second): the check runs in a shared one-worker RewardPool whose worker is killed and
    replaced on overrun.
    """
    global _shared_pool
    try:
        with _shared_lock:
            if _shared_pool is None:
                _shared_pool = RewardPool(num_workers=1, item_timeout=timeout)
            _shared_pool.item_timeout = timeout
            return float(_shared_pool.score([response], [ground_truth], "math").scores[0])
    except Exception:  # e.g. no process could be started: score 0 rather than crash the caller
        _log.exception("math_reward failed; scoring 0")
        return 0.0
