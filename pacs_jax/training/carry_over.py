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
(sampled afresh). The queue and the prompts in flight are part of the prompt source's state, which
every checkpoint holds: a resume samples the prompts that were in flight again, from their start
(their partial responses are not kept), so no prompt is lost and none is trained twice.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from pacs_jax import distributed
from pacs_jax.sampling.carry_over import CarryOverRows, CarryOverSampler
from pacs_jax.training.prompt_batch import PromptBatch


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
        self.inserted: dict[int, list[tuple[list[int], str, str]]] = {}  # version -> its call's prompts
        self.live: dict[int, set[int]] = {}  # version -> its prompts neither trained nor dropped

    # ------------------------------------------------------------------------ the prompt source
    def next_batch(self):
        """The next call's new prompts, as many as bring the engine's groups to its 2P (at least one, at
        most 2P): those queued again first, then the source's (drawn a batch at a time; the rest wait)."""
        count = max(self.engine.spec.prompts - sum(map(len, self.live.values())), 1)
        while len(self.queued) < count:
            batch = self.source.next_batch()
            self.queued += [(list(p), g, d) for p, g, d in zip(batch.prompt_ids, batch.ground_truths,
                                                               batch.data_sources)]
        taken, self.queued = self.queued[:count], self.queued[count:]
        return PromptBatch(*map(list, zip(*taken)))

    def get_state(self) -> dict:
        """The source's state and the prompts to sample before its next batch: those in flight (oldest
        call first; a resume samples them again) and those queued."""
        in_flight = [self.inserted[v][p] for v in sorted(self.live) for p in sorted(self.live[v])]
        return {"source": self.source.get_state(),
                "queued": [[[int(t) for t in ids], gold, data] for ids, gold, data in in_flight + self.queued]}

    def set_state(self, state: dict) -> None:
        """A checkpoint's ``get_state``: the engine starts empty, the prompts it held queued first."""
        self.source.set_state(state["source"])
        self.queued = [(list(p), g, d) for p, g, d in state["queued"]]
        self.inserted, self.live = {}, {}
        self.engine.reset()

    # ------------------------------------------------------------------------ a step's call
    def sample(self, params, version: int, prompts, prompt_tokens: jax.Array, prompt_mask: jax.Array,
               key: jax.Array, wait=None) -> CarriedCall:
        """Step ``version``'s call on ``prompts`` (``next_batch``'s, left-padded: [P, T]): the engine's
        rows of the B groups returned, their prompts, the call's metrics (``rollout_staleness_mean`` /
        ``_max``: policy versions behind, over the returned tokens; ``carried_rows``: rows of earlier
        calls in the engine as the call began; ``carry_over_dropped``: prompts dropped as stale by it,
        queued again; ``slot_utilisation``; ``generated_tokens``: the tokens this call sampled) and its
        decode and slot steps."""
        batch = list(zip(prompts.prompt_ids, prompts.ground_truths, prompts.data_sources))
        self.inserted[version], self.live[version] = batch, set(range(len(batch)))
        rows = self.engine.step(params, version, prompt_tokens, prompt_mask, key, wait=wait)
        (group_version, group_prompt, valid, dropped, dropped_version, carried, steps, decoded, slot_steps,
         staleness_mean, staleness_max) = distributed.to_host(
            (rows.group_version, rows.group_prompt, rows.group_valid, rows.dropped, rows.dropped_version,
             rows.carried_rows, rows.decode_steps, rows.decoded_tokens, rows.slot_steps, rows.staleness_mean,
             rows.staleness_max))
        if not valid.all():  # every call inserts as many groups as it returns: B are always complete in time
            raise RuntimeError(f"carry-over: step {version}'s call completed {int(valid.sum())} of {len(valid)} groups")
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
