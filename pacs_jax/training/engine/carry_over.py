"""Carry-over rollouts in training (``rollout.carry_over``; issue 50; docs/design.md 3.2b): the trainer's
side of the engine's ``CarryOverSampler`` (sampling/carry_over.py).

    prompts = CarryOverRollouts(source, engine)           # the loop's prompt source from here on
    batch = prompts.next_batch()                          # the P prompts of step s's call
    call = prompts.sample(params, s, batch, tokens, mask, key)   # a CarriedCall: the B = P groups trained

Step s's call (policy version s: the weights after step s - 1's update) returns the B = P oldest
complete groups, from its own prompts or earlier calls'; responses still running stay in the engine
for the next call. The engine takes 2P prompts a call (its static shape; the rest batch padding):
a call inserts as many new prompts as keep 2P groups in the engine, so the first call inserts 2P and
a later one as many as the call before returned (P), unless some were dropped: about P groups are
in flight between two calls, their responses still decoding while the learner updates. A batch still unfinished ``rollout.max_staleness`` calls after its own is
dropped by the engine: its prompts not yet trained are queued again and open a later call's batch
(sampled afresh).

Resume loses nothing: the prompt source's state, which every checkpoint holds (``get_state``), is
the source's cursor, the queue, and the rows in flight after the last call (``in_flight``: each
generation's prompts and, of its live prompts' rows, the tokens sampled so far with their log-probs
and policy versions, lengths, stop flags, budgets and keys, and the row each decode slot held:
``CarryOverSampler.export``, read from the device only when a checkpoint is written: the loop asks
for the state then). ``resume(params, step, watch)`` puts them back into the engine in the phase
"resume" of the resumed session's first step, before its call, their K/V recomputed with the restored
weights (``CarryOverSampler.resume``), so no prompt is lost, none trained twice, no partial response
thrown away. Their tokens after the resume can differ from the uninterrupted run's: that run's K/V of a
partial response came from the weights that decoded each token, the replay's from the checkpoint's
(docs/design.md 3.2b). A stop that drops a step whose previous step
wrote no checkpoint writes it with ``state_before_call``'s state, where once the step's call has begun
the prompts in flight are queued instead (their partial responses sampled again).

In the checkpoint the rows are JSON (the meta item, written by process 0, read by every process, as
the cursor): each array little-endian bytes in base64, the per-token arrays only up to each row's
length, so a token in flight costs 16 characters (token, log-prob and version: 12 bytes; 8 million
tokens in flight, 130 MB). Orbax arrays would need a global sharding of ragged per-row data; these
are the same host arrays on every process (``distributed.to_host``).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from pacs_jax import distributed
from pacs_jax.sampling.buckets import left_pad
from pacs_jax.sampling.carry_over import CarryOverRows, CarryOverSampler, InFlightRows, SavedRows
from pacs_jax.sampling.engine import PAD_ID
from pacs_jax.sharding import batch_sharding
from pacs_jax.training.progress import StepWatch
from pacs_jax.training.records import PromptBatch

_PER_TOKEN = ("tokens", "logprobs", "versions")  # SavedRows' [P n, N] fields, kept up to each row's length


def _packed(array: np.ndarray) -> dict:
    """A numpy array as JSON: its dtype, shape and little-endian bytes in base64."""
    array = np.ascontiguousarray(array, dtype=np.dtype(array.dtype).newbyteorder("<"))
    return {"dtype": array.dtype.str, "shape": list(array.shape), "data": base64.b64encode(array.tobytes()).decode()}


def _unpacked(packed: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(packed["data"]), np.dtype(packed["dtype"])).reshape(packed["shape"]).copy()


def _rows_json(rows: SavedRows) -> dict:
    """A generation's ``SavedRows`` as JSON: per-token arrays flattened over each row's length."""
    inside = np.arange(rows.tokens.shape[1])[None, :] < rows.lengths[:, None]  # [P n, N]
    return {name: _packed(getattr(rows, name)[inside] if name in _PER_TOKEN else getattr(rows, name))
            for name in SavedRows._fields}


def _prompts_json(prompts: list[tuple[list[int], str, str]]) -> list:
    """Prompts (token ids, gold answer, data source) as JSON."""
    return [[[int(t) for t in ids], gold, data] for ids, gold, data in prompts]


def _rows_from_json(packed: dict, max_new_tokens: int) -> SavedRows:
    arrays = {name: _unpacked(value) for name, value in packed.items()}
    lengths = arrays["lengths"]
    inside = np.arange(max_new_tokens)[None, :] < lengths[:, None]
    for name, empty in zip(_PER_TOKEN, (PAD_ID, 0, 0)):
        full = np.full((len(lengths), max_new_tokens), empty, arrays[name].dtype)
        full[inside] = arrays[name]
        arrays[name] = full
    return SavedRows(**arrays)


def is_carry_over_state(data_state) -> bool:
    """Whether a checkpoint's data state is carry-over's (``CarryOverRollouts.get_state``: the source's
    state, the queue and the rows in flight, absent from older checkpoints), not a plain prompt source's
    cursor: each source takes only its own (training/workdir.py ``check_resume`` refuses the other)."""
    return isinstance(data_state, dict) and {"source", "queued"} <= data_state.keys()


@dataclasses.dataclass(frozen=True)
class CarriedCall:
    """One step's carry-over call (``CarryOverRollouts.sample``): B groups of n rows."""

    rows: CarryOverRows  # the engine's rows of the B groups returned (device arrays, [B n, ...])
    prompts: PromptBatch  # their B prompts, in the rows' order
    metrics: dict[str, float]  # the call's (``CarryOverRollouts.sample``)
    decode_steps: int
    slot_steps: int  # decode steps x slots (engine.SampleArrays.slot_steps)


class CarryOverRollouts:
    """The loop's prompt source under carry-over (training/loop.py ``PromptSource``), over ``source``'s
    batches, and the prompts the engine holds. A prompt is (token ids, gold answer, data source)."""

    def __init__(self, source, engine: CarryOverSampler, prompts_per_step: int):
        self.source, self.engine, self.prompts_per_step = source, engine, prompts_per_step
        self.queued: list[tuple[list[int], str, str]] = []  # drawn or dropped, not yet inserted
        self.inserted: dict[int, list[tuple[list[int], str, str]]] = {}  # version -> its call's P prompts (padding: [])
        self.positions: list[int] = []  # where the next call's new prompts sit in its batch of P
        self.live: dict[int, set[int]] = {}  # version -> its prompts neither trained nor dropped
        self._in_flight: dict | None = None  # the JSON of the rows in flight after the last call, once made
        self._pending = False  # whether ``_in_flight`` is a checkpoint's, not yet put back into the engine
        self.version = 0  # the engine's last call's (its policy version): one a call, one a step unfiltered

    # ------------------------------------------------------------------------ the prompt source
    def next_batch(self):
        """The next call's new prompts, as many as bring the engine's groups to its 2P (at least one, at
        most 2P): those queued again first, then the source's (drawn a batch at a time; the rest wait).
        With the engine's queues per batch shard (``CarryOverSampler.queues``) each queue's share of the
        batch takes as many as bring its own live groups to 2P / queues (queue q's positions q 2P / queues
        .., ``positions``), so every queue has its share of the groups a call returns."""
        share = self.engine.spec.prompts // self.engine.queues
        live = np.zeros(self.engine.queues, int)
        for prompts in self.live.values():
            np.add.at(live, np.asarray(sorted(prompts), int) // share, 1)
        self.positions = [q * share + k for q in range(self.engine.queues) for k in range(share - live[q])] or [0]
        count = len(self.positions)
        while len(self.queued) < count:
            batch = self.source.next_batch()
            self.queued += [(list(p), g, d) for p, g, d in zip(batch.prompt_ids, batch.ground_truths,
                                                               batch.data_sources)]
        taken, self.queued = self.queued[:count], self.queued[count:]
        return PromptBatch(*map(list, zip(*taken)))

    def get_state(self) -> dict:
        """The source's state, the prompts queued, and the rows in flight after the last call (None before
        any): ``{"version", "slots", "generations": [{"version", "prompts", "rows"}]}``, each generation's
        prompts (ids, answer, source) and ``SavedRows`` as JSON. The rows are read from the device at most
        once a call, when a checkpoint is written (the loop asks for the state only then). Recording routing
        (R3, ``SamplingSettings.record_routing``) the rows are not kept: their prompts are queued first and a
        resume samples them again from their start (``_requeued``)."""
        if self.engine.settings.record_routing:
            return self._requeued(self.source.get_state(), list(self.queued))
        return {"source": self.source.get_state(), "queued": _prompts_json(self.queued), "in_flight": self._rows()}

    def _in_flight_prompts(self) -> list:
        """The prompts the engine holds, neither returned nor dropped, oldest call first."""
        return [self.inserted[v][p] for v in sorted(self.live) for p in sorted(self.live[v])]

    def _requeued(self, source: dict, queued: list, in_flight: list | None = None) -> dict:
        """A state whose prompts in flight (``in_flight``, else the engine's now) are queued before ``queued``
        and whose engine is empty: a resume samples them again from their start, no prompt lost or trained
        twice. An export holds no routing record, and a row that ended before it would come back without one
        (sampling/carry_over.py ``_check_recordable``): under R3 a checkpoint's rows are not kept."""
        in_flight = self._in_flight_prompts() if in_flight is None else in_flight
        return {"source": source, "queued": _prompts_json(in_flight + queued), "in_flight": None}

    def state_before_call(self) -> Callable[[], dict]:
        """``get_state`` as of now, before the next call, as a function called only when a stop drops the
        step and writes the checkpoint of the step before (training/loop.py): the rows in flight are then
        read from the engine if no call has begun since (a stop at the step's first phase boundary); a call
        that began took the engine's state (its insert donates it), so then the prompts in flight are
        queued first instead, oldest call first, and a resume samples them again from their start: no
        prompt lost or trained twice, their partial responses lost."""
        version, source, queued = self.version, self.source.get_state(), list(self.queued)
        in_flight = self._in_flight_prompts()

        def state() -> dict:
            if self.version == version and not self.engine.settings.record_routing:
                return {"source": source, "queued": _prompts_json(queued), "in_flight": self._rows()}
            return self._requeued(source, queued, in_flight)
        return state

    def _rows(self) -> dict | None:
        """The JSON of the rows in flight after the last call (``get_state``'s ``in_flight``), read from the
        engine once a call (``CarryOverSampler.export``); a checkpoint's until the next call."""
        if self._in_flight is None and not self._pending:
            exported = self.engine.export()
            self._in_flight = None if exported is None else {
                "version": exported.version, "slots": _packed(exported.slots),
                "generations": [{"version": v, "prompts": _prompts_json(self.inserted[v]), "rows": _rows_json(rows)}
                                for v, rows in zip(exported.generations, exported.rows)]}
        return self._in_flight

    def set_state(self, state: dict) -> None:
        """A checkpoint's ``get_state``; its rows in flight go back into the engine at ``resume``. (A
        checkpoint from before rows were kept lists the prompts in flight among the queued ones: they
        are sampled again from their start.)"""
        self.source.set_state(state["source"])
        self.queued = [(list(p), g, d) for p, g, d in state["queued"]]
        self.inserted, self.live = {}, {}
        self.engine.reset()
        self._in_flight = state.get("in_flight")
        self._pending = self._in_flight is not None
        self.version = 0 if self._in_flight is None else self._in_flight["version"]  # an empty engine takes any

    def resume(self, params: nnx.State, step: int, watch: StepWatch) -> None:
        """The checkpoint's rows in flight (``set_state``) back into the engine, their K/V recomputed with
        ``params`` (step ``step``'s weights, the checkpoint's), before the next call: the phase "resume" of
        the session's first step on ``watch``, with a line before it (the rows, their tokens, those in
        decode slots) and one after (its seconds); a stop signal ends it between two of its programs
        (``StepInterrupted``: nothing is written, a resume replays them again). Nothing when there are none."""
        if not self._pending:
            return
        saved, self._pending = self._in_flight, False  # the export of the engine resumed: kept as its state
        spec = self.engine.spec
        generations, prompts = [], []
        for generation in saved["generations"]:
            version, batch = generation["version"], [(list(p), g, d) for p, g, d in generation["prompts"]]
            rows = _rows_from_json(generation["rows"], spec.engine.max_new_tokens)
            self.inserted[version], self.live[version] = batch, set(np.flatnonzero(rows.live).tolist())
            tokens, mask = left_pad([ids for ids, _, _ in batch], spec.prompts, spec.prompt_length)
            prompts.append(tuple(distributed.put_rows(x, batch_sharding(x.shape)) for x in (tokens, mask)))
            generations.append((version, rows))
        exported = InFlightRows(saved["version"], tuple(v for v, _ in generations), tuple(r for _, r in generations),
                                _unpacked(saved["slots"]))
        watch.start("resume")
        watch.say(f"resume: replaying {exported.row_count} rows in flight ({exported.tokens:,} tokens, "
                  f"{exported.running} in decode slots), their K/V recomputed with step {step}'s weights")

        def wait(progress, last):  # after each program: a stop ends the replay here
            watch.wait_after_program(progress, lambda: f"{last.left} positions left to feed" if last else
                                     "the prompts' prefill or the first positions fed")

        self.engine.resume(params, exported, prompts, wait=wait)
        watch.done(f"{exported.row_count} rows in flight", always=True)

    # ------------------------------------------------------------------------ a step's call
    def placed(self, prompt_ids: list) -> list:
        """``next_batch``'s prompts' token ids at their places (``positions``) in the call's batch of P
        (the others empty: batch padding)."""
        ids = [[] for _ in range(self.engine.spec.prompts)]
        for position, prompt in zip(self.positions, prompt_ids):
            ids[position] = prompt
        return ids

    def sample(self, params, prompts, prompt_tokens: jax.Array, prompt_mask: jax.Array, key: jax.Array,
               wait=None) -> CarriedCall:
        """The engine's next call (policy ``version`` + 1) on ``prompts`` (``next_batch``'s, left-padded
        at their ``placed`` rows: [P, T]): the engine's rows of the B groups returned, their prompts, the call's metrics
        (``rollout_staleness_mean`` / ``_max``: policy versions behind, over the returned tokens;
        ``carried_rows``: rows of earlier calls in the engine as the call began; ``carry_over_dropped``:
        prompts dropped as stale by it, queued again; ``slot_utilisation``; ``generated_tokens``: the
        tokens this call sampled) and its decode and slot steps. A step makes one call, or with dynamic
        sampling as many as it takes: versions count the calls."""
        self.version = version = self.version + 1
        batch = [([], "", "")] * self.engine.spec.prompts
        for position, prompt in zip(self.positions, zip(prompts.prompt_ids, prompts.ground_truths,
                                                        prompts.data_sources)):
            batch[position] = prompt
        self.inserted[version], self.live[version] = batch, set(self.positions[:len(prompts.prompt_ids)])
        self._in_flight = None  # the engine's rows change: read them again when asked
        rows = self.engine.step(params, version, prompt_tokens, prompt_mask, key, wait=wait)
        (group_version, group_prompt, valid, dropped, dropped_version, carried, steps, decoded, slot_steps,
         staleness_mean, staleness_max) = distributed.to_host(
            (rows.group_version, rows.group_prompt, rows.group_valid, rows.dropped, rows.dropped_version,
             rows.carried_rows, rows.decode_steps, rows.decoded_tokens, rows.slot_steps, rows.staleness_mean,
             rows.staleness_max))
        if not valid.all():  # every call inserts as many groups as it returns: B are always complete in time
            raise RuntimeError(f"carry-over: call {version} completed {int(valid.sum())} of {len(valid)} groups")
        returned = [self.inserted[int(v)][int(p)] for v, p in zip(group_version, group_prompt)]
        for v, p in zip(group_version, group_prompt):
            self.live[int(v)].discard(int(p))
        dropped_count = 0
        if int(dropped_version) >= 0:
            again = [p for p in np.flatnonzero(dropped) if p in self.live.get(int(dropped_version), ())]
            self.queued = [self.inserted[int(dropped_version)][p] for p in again] + self.queued
            self.live.get(int(dropped_version), set()).difference_update(again)
            dropped_count = len(again)
        for v in [v for v in self.live if not self.live[v]]:  # every prompt of that call trained or dropped
            del self.live[v], self.inserted[v]
        metrics = {"rollout_staleness_mean": float(staleness_mean), "rollout_staleness_max": float(staleness_max),
                   "carried_rows": float(carried), "carry_over_dropped": float(dropped_count),
                   "slot_utilisation": float(decoded) / max(float(slot_steps), 1.0),
                   "generated_tokens": float(decoded)}
        return CarriedCall(rows, PromptBatch(*map(list, zip(*returned))), metrics, int(steps), int(slot_steps))
