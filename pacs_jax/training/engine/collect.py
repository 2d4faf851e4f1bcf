"""The rollout engine's collection of a step's rows (docs/design.md section 3), on its own mesh with its
programs (training/engine/sampler_programs.py):

    sample   the prompts, left-padded to a prompt bucket, in ``rollout.micro_batches`` calls of the
             jitted sampler (n responses each, sharded); every process places only the rows its
             devices hold, and only the (small) lengths and stop flags are shared by all processes
    trim     on the device: the calls' responses joined into [P*n, R] rows, cut to the smallest
             response bucket that holds the longest one (packed passes: the largest buckets)
    reward   each process decodes and scores the rows its devices hold (read from its addressable
             shards; the ids never leave their host); what the deadline leaves unscored gets one more
             round, then counts (``reward_unscored``) or, above ``max_unscored_fraction`` of a process's
             rows, stops the run (rewards.UnscoredError); every row's reward, status and checksum then
             reach every process in one transfer
    filter   with ``algorithm.filter_groups`` (DAPO's dynamic sampling, training/engine/dynamic_sampling.py):
             sample and score batches of prompts until B groups whose rewards differ are kept; their
             rows move on the device into the step's buffer (one program)

The learner makes the update batch of the collected rows (training/learner/rollout_batch.py); the two meet
in training/records.py. Every process sees the whole PromptBatch (token ids are small) so all choose the
same buckets without a collective (docs/design.md section 5.4).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pacs_jax import distributed, sampling
from pacs_jax.rewards import STATUSES, RewardPool, ScoredBatch
from pacs_jax.rl import filter_groups
from pacs_jax.sharding import batch_sharding
from pacs_jax.training.engine import dynamic_sampling
from pacs_jax.training.engine.carry_over import CarryOverRollouts
from pacs_jax.training.engine.sampler_programs import SamplerPrograms
from pacs_jax.training.progress import StepWatch
from pacs_jax.training.records import CallRows, Collected, PhaseTimes, PromptBatch, SampledRows, Scores
from pacs_jax.training.spec import FilterGroupsSpec

REWARD_DEADLINE_RETRIES = 1  # rounds with a fresh reward deadline for what the first one left unscored


def pick_bucket(length: int, buckets: Sequence[int], what: str) -> int:
    """The smallest bucket >= length (buckets sorted ascending)."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    raise ValueError(f"{what} of {length} tokens is longer than the largest bucket {buckets[-1]}")


def row_checksums(rows: np.ndarray, local_tokens: np.ndarray, batch: int) -> np.ndarray:
    """[batch] int32: a checksum of each of the ``rows`` (local_tokens [b, R]: their tokens) by its place
    in the [batch, R] batch, 0 for the rows not given (metric ``sampled_tokens_checksum``, their sum)."""
    R = local_tokens.shape[1]
    checksums = np.zeros(batch, np.int32)
    positions = 1 + rows[:, None] * R + np.arange(R)[None, :]
    checksums[rows] = np.sum(local_tokens.astype(np.int64) * positions % 1_000_003, axis=1) % 1_000_003
    return checksums


class RowCollector:
    """Samples and scores batches of prompts with the engine's programs ``sampler`` (on its mesh); ``split``:
    the engine has a mesh of its own (one step off on split devices), where a step's key is placed too."""

    def __init__(self, sampler: SamplerPrograms, *, decode: Callable[[Sequence[int]], str], reward_pool: RewardPool,
                 reward_name: str, reward_deadline: float | None = None, max_unscored_fraction: float | None = None,
                 filter_groups: FilterGroupsSpec | None = None, carry: CarryOverRollouts | None = None,
                 split: bool = False):
        self.sampler, self.split = sampler, split
        self.decode, self.pool, self.reward_name = decode, reward_pool, reward_name
        self.reward_deadline, self.max_unscored_fraction = reward_deadline, max_unscored_fraction
        self.filter_groups = filter_groups or FilterGroupsSpec.disabled()  # None: no dynamic sampling
        self.carry = carry

    def _put(self, x: np.ndarray) -> jax.Array:
        """A host array of the global shape -> a global array on the engine's mesh, sharded over the batch
        axes (each process copies only the rows its devices hold)."""
        return distributed.put_rows(x, batch_sharding(x.shape, self.sampler.mesh))

    def sample(self, state: nnx.State, prompts: PromptBatch, key: jax.Array,
               watch: StepWatch | None = None) -> SampledRows:
        """Sample n responses per prompt (every process passes the same ``prompts``); ``watch``
        (training/progress.py) is told of each chunk of decode steps, and may stop between them.

        The calls run one after another, each in chunks of decode steps (sampling.sample): ``watch``
        writes their progress (rows done, tokens so far) and may stop between two chunks. Waits for the
        sampler (this process's rows of the tokens come to the host). With carry-over (``carry``): the
        engine's next call, whose rows are the groups it returns (training/engine/carry_over.py).
        """
        sampler = self.sampler
        K = sampler.sampler_calls
        prompt_ids = prompts.prompt_ids
        num_prompts = len(prompt_ids)
        if num_prompts % K:
            raise ValueError(f"{num_prompts} prompts cannot be split into {K} sampler micro-batches")
        watch = watch or StepWatch.silent()
        if self.carry is not None:
            return self._carried(state, prompts, key, watch)
        length = pick_bucket(max(len(p) for p in prompt_ids), sampler.prompt_buckets, "a prompt")
        tokens_np, mask_np = sampling.left_pad(prompt_ids, num_prompts, length)
        per_call = num_prompts // K

        def wait(progress, last, c):  # each chunk of decode steps: progress lines, and a stop between chunks
            watch.wait_after_program(progress, lambda: f"sampler call {c + 1}/{K}: " + (
                f"{last.rows_done}/{last.rows} rows done, {last.tokens} tokens" if last else "prefill"))

        outs = [sampler.sample(state, self._put(tokens_np[i:i + per_call]), self._put(mask_np[i:i + per_call]),
                                jax.random.fold_in(key, c), functools.partial(wait, c=c))
                for c, i in enumerate(range(0, num_prompts, per_call))]
        # one transfer for all calls
        host_calls = distributed.to_host([(o.lengths, o.stopped, o.decode_steps, o.slot_steps) for o in outs])
        lengths, stopped, decode_steps, slot_steps = zip(*host_calls)
        records = [None if o.routing is None else  # R3: each call's rows' routing record
                   sampler.call_routing(o.prompt_routing, o.routing, sampler.prompt_buckets[-1]) for o in outs]
        return self._rows(prompts, tuple(CallRows(o.tokens, o.logprobs, o.lengths, r) for o, r in zip(outs, records)),
                          length, np.concatenate(lengths), np.concatenate(stopped), sum(map(int, decode_steps)),
                          sum(map(int, slot_steps)))

    def _carried(self, state: nnx.State, prompts: PromptBatch, key: jax.Array, watch: StepWatch) -> SampledRows:
        """Carry-over's next call on ``prompts`` (at the largest prompt bucket): the groups it returns as the
        rows, its metrics in ``SampledRows.metrics``."""
        length, slots = self.sampler.prompt_buckets[-1], self.carry.engine.spec.prompts
        tokens_np, mask_np = sampling.left_pad(self.carry.placed(prompts.prompt_ids), slots, length)  # the rest padding

        def wait(progress, last):
            watch.wait_after_program(progress, lambda: "carry-over call: " + (
                f"{last.groups} groups complete, {last.running} rows running" if last else "insert"))

        call = self.carry.sample(state, prompts, self._put(tokens_np), self._put(mask_np), key, wait)
        rows = call.rows
        lengths, stopped = distributed.to_host((rows.lengths, rows.stopped))
        bucket = pick_bucket(max(len(p) for p in call.prompts.prompt_ids), self.sampler.prompt_buckets,
                             "a prompt")
        record = None if rows.routing is None else self.sampler.call_routing(rows.prompt_routing, rows.routing,
                                                                              length)  # R3: the returned rows' experts
        sampled = self._rows(call.prompts, (CallRows(rows.tokens, rows.logprobs, rows.lengths, record),), bucket,
                             lengths, stopped, call.decode_steps, call.slot_steps)
        return dataclasses.replace(sampled, metrics=call.metrics)

    def _rows(self, prompts: PromptBatch, calls: tuple[CallRows, ...], prompt_bucket: int, lengths: np.ndarray,
              stopped: np.ndarray, decode_steps: int, slot_steps: int) -> SampledRows:
        """The ``SampledRows`` of ``prompts``' sampler calls: the prompts left-padded to ``prompt_bucket``
        (packed passes: the largest bucket), the calls' responses joined and cut to the smallest response
        bucket that holds the longest (packed: the budget's width); waits for them."""
        sampler = self.sampler
        prompt_ids = prompts.prompt_ids
        R = pick_bucket(int(lengths.max()), sampler.response_buckets, "a response")
        tokens, response_mask = sampler.assemble(tuple(c.tokens for c in calls), tuple(c.lengths for c in calls),
                                                  sampler.pass_widths[1] if sampler.packing else R)
        pass_tokens, pass_mask = sampling.left_pad(prompt_ids, len(prompt_ids),
                                                   sampler.pass_widths[0] if sampler.packing else prompt_bucket)
        routing = None if calls[0].routing is None else sampler.assemble_routing(
            tuple(c.routing for c in calls), sampler.prompt_buckets[-1], pass_tokens.shape[1], tokens.shape[1])
        rows, local_tokens = distributed.local_rows(tokens)  # waits for the sampler
        return SampledRows(prompts, calls, self._put(pass_tokens), self._put(pass_mask), tokens, response_mask,
                           np.repeat([len(p) for p in prompt_ids], sampler.n), lengths, stopped, prompt_bucket, R,
                           decode_steps, slot_steps, rows, local_tokens[:, :R], routing=routing)

    def score(self, sampled: SampledRows, watch: StepWatch) -> ScoredBatch:
        """Decode and score the rows this process holds (``sampled.local_rows``, in order; a stop ends the
        scoring within RewardPool's POLL_S)."""
        n = self.sampler.n
        rows, local_tokens = sampled.local_rows, sampled.local_tokens
        texts = [self.decode(local_tokens[i, :sampled.lengths[row]]) for i, row in enumerate(rows)]
        golds = [sampled.prompts.ground_truths[row // n] for row in rows]
        return self.pool.score(texts, golds, reward=self.reward_name, deadline=self.reward_deadline,
                               deadline_retries=REWARD_DEADLINE_RETRIES, max_unscored_fraction=self.max_unscored_fraction,
                               poll=watch.poll)

    def gather(self, sampled: SampledRows, scored: ScoredBatch) -> Scores:
        """Every row's reward, status and checksum on every process, in one transfer (a collective of
        every process), from each process's ``score`` of its rows."""
        rows, B = sampled.local_rows, len(sampled.lengths)
        rewards_np, status_np = np.zeros(B, np.float32), np.zeros(B, np.int32)
        rewards_np[rows] = scored.scores
        status_np[rows] = [STATUSES.index(status) for status in scored.statuses]
        rewards, status_ids, checksums = distributed.to_host(
            (self._put(rewards_np), self._put(status_np), self._put(row_checksums(rows, sampled.local_tokens, B))))
        restarts, seconds, retried = distributed.gather_per_process(np.asarray(
            [scored.metrics[k] for k in ("worker_restarts", "seconds", "deadline_retried")])).T
        return Scores(rewards, [STATUSES[i] for i in status_ids], checksums, int(restarts.sum()), float(seconds.max()),
                      int(retried.sum()))

    def collect(self, state: nnx.State, batches: Callable[[], PromptBatch], key: jax.Array, watch: StepWatch,
                step: int) -> Collected:
        """The rollout engine's part of a step (on its mesh, from its copy of the weights ``state``): the
        rows of ``batches()`` sampled (with ``algorithm.filter_groups``, of as many batches as it takes)
        and scored; ``finish`` makes the update batch of them on the learner's mesh."""
        times = PhaseTimes()
        with jax.set_mesh(self.sampler.mesh):  # the sampler and carry-over's engine read it
            if self.split:  # the key, as every array the engine's programs take, on its mesh
                key = jax.device_put(key, NamedSharding(self.sampler.mesh, PartitionSpec()))
            if self.filter_groups.enable:
                sampled, scores, metrics = self._filtered(state, batches, key, watch, times, step)
                return Collected(sampled, scores, metrics, times)
            sampled = self._sample_phase(state, batches(), key, watch, times)
            watch.start("reward")
            t0 = time.perf_counter()
            scores = self.gather(sampled, self.score(sampled, watch))
            times.reward += time.perf_counter() - t0
            watch.done(f"{len(sampled.local_rows)} responses scored")
        return Collected(sampled, scores, sampled.metrics, times)

    def _sample_phase(self, state: nnx.State, prompts: PromptBatch, key: jax.Array, watch: StepWatch,
                      times: PhaseTimes) -> SampledRows:
        """The sampling phase of one batch of prompts (its seconds added to ``times.sample``)."""
        t0 = time.perf_counter()
        watch.start("sampling")
        sampled = self.sample(state, prompts, key, watch)
        times.sample += time.perf_counter() - t0
        watch.done(f"{len(sampled.lengths)} rows, {int(sampled.lengths.sum())} tokens")
        return sampled

    def _filtered(self, state: nnx.State, batches: Callable[[], PromptBatch], key: jax.Array, watch: StepWatch,
                  times: PhaseTimes, step: int) -> tuple[SampledRows, Scores, dict[str, float]]:
        """DAPO's dynamic sampling (training/engine/dynamic_sampling.py): gen batches sampled and scored until B
        groups with spread are kept -> (their rows, their scores, the metrics ``num_gen_batches``,
        ``filtered_fraction`` (groups drawn and dropped for no spread / groups drawn) and the tokens,
        decode steps and slot utilisation of every gen batch sampled; with carry-over, a gen batch is one
        call of the engine, and the metrics add its calls' staleness (mean of the calls', and max),
        ``carried_rows`` (as the first began) and ``carry_over_dropped`` (summed)). Every process decides
        alike: the rewards are every row's on every process."""
        fg, n, need = self.filter_groups, self.sampler.n, self.sampler.num_prompts
        calls = None
        have, drawn, dropped, gen = 0, 0, 0, 0
        ids, golds, sources = [], [], []
        lengths, stopped, rewards, statuses, sampled_tokens, engine = [], [], [], [], [], []
        decode_steps = slot_steps = 0
        restarts, seconds, retried = 0, 0.0, 0
        while have < need:
            if fg.max_num_gen_batches and gen == fg.max_num_gen_batches:
                raise dynamic_sampling.FilterGroupsExhausted(dynamic_sampling.exhausted_message(
                    step, gen, need, have, fg.metric))
            gen += 1
            prompts = batches()
            sampled = self._sample_phase(state, prompts, key if gen == 1 else jax.random.fold_in(key, gen - 1),
                                         watch, times)
            watch.start("reward")
            t0 = time.perf_counter()
            scores = self.gather(sampled, self.score(sampled, watch))
            times.reward += time.perf_counter() - t0
            watch.done(f"{len(sampled.local_rows)} responses scored")
            spread = filter_groups.groups_with_spread(filter_groups.group_metric(scores.rewards, fg.metric), n)
            source, taken = dynamic_sampling.placement(spread, have, need, n)
            calls = self.sampler.select_groups(sampled.calls if calls is None else calls, sampled.calls, source)
            rows = (taken[:, None] * n + np.arange(n)).reshape(-1)
            ids += [sampled.prompts.prompt_ids[g] for g in taken]
            golds += [sampled.prompts.ground_truths[g] for g in taken]
            sources += [sampled.prompts.data_sources[g] for g in taken]
            lengths.append(sampled.lengths[rows])
            stopped.append(sampled.stopped[rows])
            rewards.append(scores.rewards[rows])
            statuses += [scores.statuses[r] for r in rows]
            sampled_tokens.append(sampled.lengths)
            engine.append(sampled.metrics)  # carry-over's call's
            decode_steps, slot_steps = decode_steps + sampled.decode_steps, slot_steps + sampled.slot_steps
            restarts, seconds, retried = restarts + scores.restarts, seconds + scores.seconds, retried + scores.deadline_retried
            have += len(taken)
            drawn += len(spread)
            dropped += int(np.sum(~spread))
        kept = PromptBatch(ids, golds, sources)
        length = pick_bucket(max(len(p) for p in ids), self.sampler.prompt_buckets, "a prompt")
        sampled = self._rows(kept, calls, length, np.concatenate(lengths), np.concatenate(stopped), decode_steps,
                             slot_steps)
        B = len(sampled.lengths)
        checksums = distributed.to_host(self._put(row_checksums(sampled.local_rows, sampled.local_tokens, B)))
        scores = Scores(np.concatenate(rewards), statuses, checksums, restarts, seconds, retried)
        # the sampler's work is every gen batch's (tokens_per_second, slot utilisation); the rest, the kept rows'
        metrics = {"num_gen_batches": float(gen), "filtered_fraction": dropped / drawn}
        if self.carry is None:
            generated = np.concatenate(sampled_tokens)
            return sampled, scores, {**metrics, "generated_tokens": float(generated.sum()),
                                     "slot_utilisation": sampling.slot_utilisation(generated, slot_steps)}
        decoded = sum(m["generated_tokens"] for m in engine)
        return sampled, scores, {
            **metrics, "rollout_staleness_mean": float(np.mean([m["rollout_staleness_mean"] for m in engine])),
            "rollout_staleness_max": max(m["rollout_staleness_max"] for m in engine),
            "carried_rows": engine[0]["carried_rows"], "carry_over_dropped": sum(m["carry_over_dropped"] for m in engine),
            "generated_tokens": decoded, "slot_utilisation": decoded / max(slot_steps, 1)}
