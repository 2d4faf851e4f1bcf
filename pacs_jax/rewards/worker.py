"""A reward worker process, started by ``rewards.pool`` as ``main([_, READ_FD, WRITE_FD, MEMORY_LIMIT_BYTES])``.

It reads ``(index, reward, response, ground_truth)`` messages from READ_FD
and answers ``(index, score, status)`` on WRITE_FD, one item at a time, until it reads None or the
pipe closes. It imports no JAX and runs nothing from the model's output; the pool kills it when an
item overruns, so nothing here keeps time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from multiprocessing.connection import Connection

from pacs_jax.rewards.verdict import Verdict

# Each reward's checker, as (module, function): imported by the worker process that scores with it (``checkers``,
# before it answers READY), not where a reward is only named: sympy and math-verify, which the math and paper
# checkers import, cost every trainer and evaluator process ~1.5 s of CPU at start-up.
REWARDS: dict[str, tuple[str, str]] = {"math": ("pacs_jax.rewards.math", "judge_math"),
                                       "gsm8k": ("pacs_jax.rewards.gsm8k", "judge_gsm8k"),
                                       "paper": ("pacs_jax.rewards.paper", "judge_paper")}
# reward.mode: "strict" scores with reward.name's checker; "paper" with the authors' call for every data source.
REWARD_MODES = ("strict", "paper")


def reward_for(name: str, mode: str) -> str:
    """The REWARDS entry that scores reward ``name`` in ``mode`` (one of REWARD_MODES)."""
    if mode not in REWARD_MODES:
        raise ValueError(f"reward.mode={mode!r}: expected one of {REWARD_MODES}")
    return "paper" if mode == "paper" else name
READY = "ready"


def checkers() -> dict[str, Callable[[str, str], Verdict]]:
    """{REWARDS name: its checker}, their modules imported."""
    return {name: getattr(importlib.import_module(module), function) for name, (module, function) in REWARDS.items()}


def serve(inbox: Connection, outbox: Connection) -> None:
    """Answer messages from ``inbox`` on ``outbox`` until None or end of file."""
    judges = checkers()
    outbox.send(READY)
    while True:
        try:
            message = inbox.recv()
        except EOFError:
            return
        if message is None:
            return
        index, reward, response, ground_truth = message
        score, status = judges[reward](response, ground_truth)
        outbox.send((index, score, status))


def main(argv: list[str]) -> None:
    """argv: [program, READ_FD, WRITE_FD, MEMORY_LIMIT_BYTES (0: none)]. Run by rewards/pool.py's entry, which has
    SIGINT and SIGTERM ignored before this module is imported."""
    read_fd, write_fd = int(argv[1]), int(argv[2])
    memory_limit = int(argv[3])
    if memory_limit:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))

