"""One program on many hosts (docs/design.md section 5.4): start-up, and moving rows between the host
and global arrays whose shards live on several processes.

    initialize(coordinator="10.0.0.2:8476", num_processes=8, process_id=3)   # before any jax call
    tokens = put_rows(np_tokens, sharding)      # every process passes the same [B, ...] host array;
                                                # only the rows its devices hold are copied
    rows, local = local_rows(global_tokens)     # the rows this process holds, as numpy
    lengths = to_host(global_lengths)           # a small array, in full on every process
    verdict = from_process_zero(refusal)        # process 0's (JSON-able) value on every process

``initialize`` first runs a rendezvous of its own (a TCP barrier on the coordinator's port + 1)
with a timeout, so a process that never starts makes the others exit with an error naming it;
``jax.distributed.initialize`` alone waits and then aborts without saying who is missing.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import jax
import numpy as np
from jax.experimental import multihost_utils


class StartupError(RuntimeError):
    """Processes of a multi-process run did not all join the start-up barrier in time."""


# --------------------------------------------------------------------------------------------- start
def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, timeout_s: float = 300.0) -> None:
    """``jax.distributed.initialize`` behind a start-up barrier with a timeout.

    All three arguments None: JAX detects the cluster (Cloud TPU pods, SLURM) and its own timeout
    applies. Otherwise all three are required, and every process first reports to a barrier served
    by process 0 on the coordinator's port + 1; a process missing after ``timeout_s`` seconds makes
    every other process raise ``StartupError`` naming it.
    """
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ValueError("coordinator, num_processes and process_id must be given together (or none, to "
                         "let JAX detect a TPU pod or SLURM cluster)")
    if not any(given):
        jax.distributed.initialize()
        return
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} is outside [0, num_processes={num_processes})")
    rendezvous(coordinator, num_processes, process_id, timeout_s)
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               initialization_timeout=max(int(timeout_s), 1))


def _barrier_address(coordinator: str) -> tuple[str, int]:
    host, sep, port = coordinator.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"coordinator={coordinator!r}: expected host:port")
    return host or "localhost", int(port) + 1


def rendezvous(coordinator: str, num_processes: int, process_id: int, timeout_s: float) -> None:
    """Block until all ``num_processes`` processes have called this, or raise ``StartupError``.

    Process 0 listens on the coordinator's port + 1 and answers every process once all have
    reported or ``timeout_s`` has passed, with the list of the missing ones.
    """
    if num_processes == 1:
        return
    host, port = _barrier_address(coordinator)
    deadline = time.monotonic() + timeout_s
    if process_id == 0:
        _serve_barrier(port, num_processes, deadline, timeout_s)
    else:
        _join_barrier(host, port, process_id, num_processes, deadline, timeout_s, coordinator)


def _missing_message(missing: list[int], num_processes: int, timeout_s: float) -> str:
    return (f"processes {missing} of {num_processes} did not join the start-up barrier within {timeout_s:g} s "
            f"(not started, crashed, or cannot reach the coordinator)")


def _serve_barrier(port: int, num_processes: int, deadline: float, timeout_s: float) -> None:
    joined: dict[int, socket.socket] = {}
    with socket.create_server(("", port), reuse_port=False) as server:
        server.settimeout(0.2)
        while len(joined) < num_processes - 1 and time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(max(deadline - time.monotonic(), 1.0))
            with contextlib.suppress(OSError, ValueError):
                joined[int(conn.makefile().readline())] = conn
        missing = sorted(set(range(1, num_processes)) - set(joined))
        reply = json.dumps({"missing": missing}) + "\n"
        for conn in joined.values():
            with contextlib.suppress(OSError), conn:
                conn.sendall(reply.encode())
    if missing:
        raise StartupError(_missing_message(missing, num_processes, timeout_s))


def _join_barrier(host: str, port: int, process_id: int, num_processes: int, deadline: float,
                  timeout_s: float, coordinator: str) -> None:
    no_answer = StartupError(f"process 0 (the coordinator, barrier at {host}:{port}) did not answer within "
                             f"{timeout_s:g} s: it is not running or not reachable at {coordinator}")
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=1.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise no_answer from None
            time.sleep(0.2)
    with conn:
        conn.sendall(f"{process_id}\n".encode())
        conn.settimeout(max(deadline - time.monotonic(), 0) + 30.0)  # process 0 answers at its deadline
        try:
            answer = json.loads(conn.makefile().readline() or "null")
        except (OSError, ValueError):
            raise no_answer from None
    if answer is None:
        raise no_answer
    if not isinstance(answer, dict) or not isinstance(answer.get("missing"), list):
        raise StartupError(f"{host}:{port} answered {answer!r}, not as process 0's start-up barrier: another "
                           f"program holds that port; pick a coordinator port whose successor is free")
    if answer["missing"]:
        raise StartupError(_missing_message(answer["missing"], num_processes, timeout_s))


# ---------------------------------------------------------------------------------------------- rows
def put_rows(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array with ``sharding`` from a host array of the global shape; only the rows of
    this process's devices are read (the other rows may hold anything)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def local_rows(x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """(sorted row indices, their values [len(rows), ...]) of the rows of ``x`` this process holds,
    read from its addressable shards only."""
    by_row: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        rows = range(*shard.index[0].indices(x.shape[0])) if shard.index else range(x.shape[0])
        if rows.start in by_row and rows.stop - 1 in by_row:
            continue  # a replica of rows already read
        data = np.asarray(shard.data)
        full_width = all(s == slice(None) or s.indices(n) == (0, n, 1)
                         for s, n in zip(shard.index[1:], x.shape[1:]))
        if not full_width:
            raise ValueError(f"local_rows: a shard of {x.shape} splits the columns ({shard.index}); "
                             "only row-sharded arrays are supported")
        for i, row in enumerate(rows):
            by_row[row] = data[i]
    order = np.asarray(sorted(by_row), np.int64)
    return order, np.stack([by_row[r] for r in order]) if len(order) else np.zeros((0,) + x.shape[1:], x.dtype)


def to_host(tree):
    """The whole of every array of ``tree`` as numpy on every process, in one transfer (a collective
    every process must call when an array spans processes); for small arrays (lengths, rewards,
    metrics), never for the generated tokens."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.tree.map(np.asarray, jax.device_get(tree))
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def gather_per_process(values: np.ndarray) -> np.ndarray:
    """[num_processes, ...]: each process's ``values`` (same shape everywhere), on every process."""
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values[None]
    return np.asarray(multihost_utils.process_allgather(values))


def from_process_zero(value):
    """Process 0's ``value`` (anything ``json.dumps`` takes) on every process, the others' ignored: its
    JSON text's length, then the text as bytes, each broadcast (two collectives every process must call)."""
    if jax.process_count() == 1:
        return value
    primary = jax.process_index() == 0
    text = json.dumps(value).encode() if primary else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(text))))
    data = np.frombuffer(text, np.uint8) if primary else np.zeros(size, np.uint8)
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(data), np.uint8).tobytes().decode())
