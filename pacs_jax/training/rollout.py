"""From a batch of prompts to the update batch of one training step (docs/design.md section 3), with
the step's programs (training/step_programs.py):

    sample   the prompts, left-padded to a prompt bucket, in ``rollout.micro_batches`` calls of the
             jitted sampler (n responses each, sharded); every process places only the rows its
             devices hold, and only the (small) lengths and stop flags are shared by all processes
    trim     on the device: the calls' responses joined into [P*n, R] rows, cut to the smallest
             response bucket that holds the longest one
    pi_old   one jitted program per (prompt bucket, response bucket): assemble [B, P + R] rows on the
             device and compute pi_old and the entropy at the rollout temperature (logits / T, as
             verl) of one micro-batch of rows, dispatched once a micro-batch (training/old_policy.py),
             before the rewards are scored; packed
             (``train.packing``): the rows are the largest buckets' and every pass runs on its packed
             rows (one program per pass, rl/packing.py; pi_old's dispatched once a packed pass): each
             process plans the packing of every pass from
             every row's prompt and response lengths (host arrays all processes hold: no collective)
    reward   each process decodes and scores the rows its devices hold (read from its addressable
             shards; the ids never leave their host) while the device computes pi_old; what the
             deadline leaves unscored gets one more round, then counts (``reward_unscored``) or,
             above ``max_unscored_fraction`` of a process's rows, stops the run (rewards.UnscoredError);
             the rewards go back into a global array, and the step's metrics are computed from all rows
    filter   with ``algorithm.filter_groups`` (DAPO's dynamic sampling, training/dynamic_sampling.py):
             sample and score batches of prompts until B groups whose rewards differ are kept; their
             rows move on the device into the step's buffer (one program), then pi_old runs on them
             (after the scoring: the filter chooses its rows)

Every program's shapes come from the config's buckets, so ``StepPrograms.compile`` compiles all of
them up front and a run compiles nothing after it. Every process sees the whole PromptBatch (token ids are small)
so all choose the same buckets without a collective (docs/design.md section 5.4).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from pacs_jax import distributed, sampling
from pacs_jax.rewards import STATUSES, RewardPool, ScoredBatch, reward_for, score_metrics
from pacs_jax.sharding import batch_sharding, replicated
from pacs_jax.rl import filter_groups
from pacs_jax.rl.packing import PackedPlanArrays
from pacs_jax.rl.update_batch import UpdateBatch
from pacs_jax.training import dynamic_sampling, rollout_consistency
from pacs_jax.training.carry_over import CarryOverRollouts
from pacs_jax.training.dynamic_sampling import CallRows
from pacs_jax.training.passes import Passes
from pacs_jax.training.progress import StepWatch, dispatches_done
from pacs_jax.training.prompt_batch import PromptBatch
from pacs_jax.training.spec import FilterGroupsSpec, RunSpec
from pacs_jax.training.step_programs import StepPrograms


REWARD_DEADLINE_RETRIES = 1  # rounds with a fresh reward deadline for what the first one left unscored


@dataclasses.dataclass
class Rollout:
    """One step's rollout: the update batch (global device arrays) and what the host saw."""

    batch: UpdateBatch  # with rewards [B]; packed: with the update's plan
    rewards: np.ndarray  # [B] every row's reward (the same on every process)
    metrics: dict[str, float]  # over all rows of all processes
    packing: Passes[PackedPlanArrays] | None = None  # the passes' plan arrays when packed (PPO's critic reads
    #                                                   the logprob pass's for its values, the critic pass's for its update)


def pick_bucket(length: int, buckets: Sequence[int], what: str) -> int:
    """The smallest bucket >= length (buckets sorted ascending)."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    raise ValueError(f"{what} of {length} tokens is longer than the largest bucket {buckets[-1]}")


@dataclasses.dataclass
class SampledRows:
    """The rows of a batch of prompts' sampler calls (``RolloutCollector.sample``): P prompts, n rows each,
    B = P n rows, K sampler calls, N = max_new_tokens, R the response bucket, Tp the prompt bucket
    (packed passes: R and Tp the largest buckets)."""

    prompts: PromptBatch
    calls: tuple[CallRows, ...]  # each call's tokens, log-probs [B / K, N], lengths [B / K] (device)
    prompt_tokens: jax.Array  # [P, Tp] int32, left-padded (device, sharded over the rows)
    prompt_mask: jax.Array  # [P, Tp] int32
    tokens: jax.Array  # [B, R] int32
    response_mask: jax.Array  # [B, R] int32
    prompt_lengths: np.ndarray  # [B] every row's prompt tokens (host, the same on every process)
    lengths: np.ndarray  # [B] every row's response tokens
    stopped: np.ndarray  # [B] bool: ended at a stop id
    prompt_bucket: int  # the sampler's
    response_bucket: int
    decode_steps: int  # of the calls, summed
    slot_steps: int  # of the calls, summed (engine.SampleArrays.slot_steps)
    local_rows: np.ndarray  # [b] the rows this process holds, sorted
    local_tokens: np.ndarray  # [b, R] their tokens (host)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the sampler's own (carry-over's)

    @property
    def sampler_logprobs(self) -> tuple[jax.Array, ...]:
        """Each call's log-probs of its tokens, [B / K, N]."""
        return tuple(call.logprobs for call in self.calls)

    @property
    def slot_utilisation(self) -> float:
        """Decoded tokens / slot steps (engine.slot_utilisation)."""
        return sampling.slot_utilisation(self.lengths, self.slot_steps)


@dataclasses.dataclass(frozen=True)
class Scores:
    """Every row's reward [B] float32 and status [B] (rewards.STATUSES) on every process, the rows' token
    checksums [B] int32 (``row_checksums``), and the scoring's counts (summed over the processes; the
    seconds, the slowest process's)."""

    rewards: np.ndarray
    statuses: list[str]
    checksums: np.ndarray
    restarts: int
    seconds: float
    deadline_retried: int


@dataclasses.dataclass
class PhaseTimes:
    """The seconds of a step's rollout phases: sampling (every gen batch's), scoring, pi_old's passes."""

    sample: float = 0.0
    reward: float = 0.0
    old_logprob: float = 0.0

    def metrics(self) -> dict[str, float]:
        """As a step's metrics name them."""
        return {"time_sample": self.sample, "time_reward": self.reward, "time_old_logprob": self.old_logprob}


@dataclasses.dataclass
class Collected:
    """The rollout engine's part of a step (``RolloutCollector.collect``): its rows, their scores, the
    engine's own metrics (dynamic sampling's, carry-over's) and its phases' seconds (sampling, scoring)."""

    sampled: SampledRows
    scores: Scores
    metrics: dict[str, float]
    times: PhaseTimes


@dataclasses.dataclass
class OldPolicy:
    """pi_old's passes on a step's rows, dispatched (``RolloutCollector._old_policy_phase``): the update
    batch without rewards, the mean entropy after each pass [] (the last: all rows; none in bypass mode,
    which runs no pass), the critic passes' packing plans, the packing metrics, and the sampler / pi_old
    comparison's and the correction's metrics (device scalars)."""

    batch: UpdateBatch
    entropy_means: list[jax.Array]
    packing: Passes[PackedPlanArrays] | None
    packing_stats: dict[str, float]
    mismatch: dict[str, jax.Array]


def to_mesh(sampled: SampledRows, mesh: Mesh) -> SampledRows:
    """``sampled``'s device arrays moved to ``mesh``, each sharded over its rows (the engine's rows to the
    learner's mesh, one step off on split devices)."""
    move = lambda x: jax.device_put(x, batch_sharding(x.shape, mesh))  # noqa: E731
    return dataclasses.replace(
        sampled, calls=tuple(CallRows(*map(move, c)) for c in sampled.calls),
        prompt_tokens=move(sampled.prompt_tokens), prompt_mask=move(sampled.prompt_mask),
        tokens=move(sampled.tokens), response_mask=move(sampled.response_mask))


def row_checksums(rows: np.ndarray, local_tokens: np.ndarray, batch: int) -> np.ndarray:
    """[batch] int32: a checksum of each of the ``rows`` (local_tokens [b, R]: their tokens) by its place
    in the [batch, R] batch, 0 for the rows not given (metric ``sampled_tokens_checksum``, their sum)."""
    R = local_tokens.shape[1]
    checksums = np.zeros(batch, np.int32)
    positions = 1 + rows[:, None] * R + np.arange(R)[None, :]
    checksums[rows] = np.sum(local_tokens.astype(np.int64) * positions % 1_000_003, axis=1) % 1_000_003
    return checksums


class RolloutCollector:
    """Samples, scores and computes pi_old for batches of prompts with a step's programs."""

    def __init__(self, programs: StepPrograms, *, decode: Callable[[Sequence[int]], str], reward_pool: RewardPool,
                 reward_name: str, reward_deadline: float | None = None, max_unscored_fraction: float | None = None,
                 max_logprob_diff: float = 0.0, filter_groups: FilterGroupsSpec | None = None,
                 carry: CarryOverRollouts | None = None):
        self.programs, self.max_logprob_diff = programs, max_logprob_diff
        self.decode, self.pool, self.reward_name = decode, reward_pool, reward_name
        self.reward_deadline, self.max_unscored_fraction = reward_deadline, max_unscored_fraction
        self.filter_groups = filter_groups or FilterGroupsSpec.disabled()  # None: no dynamic sampling
        self.carry = carry

    @classmethod
    def from_spec(cls, spec: RunSpec, programs: StepPrograms, *, decode: Callable[[Sequence[int]], str],
                  reward_pool: RewardPool | None, carry: CarryOverRollouts | None = None) -> RolloutCollector:
        """The collector of ``spec.reward`` (the reward, its deadline and unscored fraction),
        ``rollout.max_logprob_diff`` and ``algorithm.filter_groups``; ``carry``: the run's carry-over
        prompt source (``rollout.carry_over``; training/carry_over.py), which samples its steps."""
        rw = spec.reward
        return cls(programs, decode=decode, reward_pool=reward_pool, reward_name=reward_for(rw.name, rw.mode),
                   reward_deadline=rw.deadline, max_unscored_fraction=rw.max_unscored_fraction,
                   max_logprob_diff=spec.rollout.max_logprob_diff, filter_groups=spec.algorithm.filter_groups,
                   carry=carry)

    def _put(self, x: np.ndarray) -> jax.Array:
        """A host array of the global shape -> a global array sharded over the batch axes (each process
        copies only the rows its devices hold)."""
        return distributed.put_rows(x, batch_sharding(x.shape))

    # ------------------------------------------------------------------------ one step
    def sample(self, state: nnx.State, prompts: PromptBatch, key: jax.Array,
               watch: StepWatch | None = None) -> SampledRows:
        """Sample n responses per prompt (every process passes the same ``prompts``); ``watch``
        (training/progress.py) is told of each chunk of decode steps, and may stop between them.

        The calls run one after another, each in chunks of decode steps (sampling.sample): ``watch``
        writes their progress (rows done, tokens so far) and may stop between two chunks. Waits for the
        sampler (this process's rows of the tokens come to the host). With carry-over (``carry``): the
        engine's next call, whose rows are the groups it returns (training/carry_over.py).
        """
        programs = self.programs
        K = programs.sampler.sampler_calls
        prompt_ids = prompts.prompt_ids
        num_prompts = len(prompt_ids)
        if num_prompts % K:
            raise ValueError(f"{num_prompts} prompts cannot be split into {K} sampler micro-batches")
        watch = watch or StepWatch.silent()
        if self.carry is not None:
            return self._carried(state, prompts, key, watch)
        length = pick_bucket(max(len(p) for p in prompt_ids), programs.sampler.prompt_buckets, "a prompt")
        tokens_np, mask_np = sampling.left_pad(prompt_ids, num_prompts, length)
        per_call = num_prompts // K

        def wait(progress, last, c):  # each chunk of decode steps: progress lines, and a stop between chunks
            watch.wait_after_program(progress, lambda: f"sampler call {c + 1}/{K}: " + (
                f"{last.rows_done}/{last.rows} rows done, {last.tokens} tokens" if last else "prefill"))

        outs = [programs.sampler.sample(state, self._put(tokens_np[i:i + per_call]), self._put(mask_np[i:i + per_call]),
                                jax.random.fold_in(key, c), functools.partial(wait, c=c))
                for c, i in enumerate(range(0, num_prompts, per_call))]
        # one transfer for all calls
        host_calls = distributed.to_host([(o.lengths, o.stopped, o.decode_steps, o.slot_steps) for o in outs])
        lengths, stopped, decode_steps, slot_steps = zip(*host_calls)
        return self._rows(prompts, tuple(CallRows(o.tokens, o.logprobs, o.lengths) for o in outs), length,
                          np.concatenate(lengths), np.concatenate(stopped), sum(map(int, decode_steps)),
                          sum(map(int, slot_steps)))

    def _carried(self, state: nnx.State, prompts: PromptBatch, key: jax.Array, watch: StepWatch) -> SampledRows:
        """Carry-over's next call on ``prompts`` (at the largest prompt bucket): the groups it returns as the
        rows, its metrics in ``SampledRows.metrics``."""
        length, slots = self.programs.sampler.prompt_buckets[-1], self.carry.engine.spec.prompts
        tokens_np, mask_np = sampling.left_pad(self.carry.placed(prompts.prompt_ids), slots, length)  # the rest padding

        def wait(progress, last):
            watch.wait_after_program(progress, lambda: "carry-over call: " + (
                f"{last.groups} groups complete, {last.running} rows running" if last else "insert"))

        call = self.carry.sample(state, prompts, self._put(tokens_np), self._put(mask_np), key, wait)
        rows = call.rows
        lengths, stopped = distributed.to_host((rows.lengths, rows.stopped))
        bucket = pick_bucket(max(len(p) for p in call.prompts.prompt_ids), self.programs.sampler.prompt_buckets,
                             "a prompt")
        sampled = self._rows(call.prompts, (CallRows(rows.tokens, rows.logprobs, rows.lengths),), bucket, lengths,
                             stopped, call.decode_steps, call.slot_steps)
        return dataclasses.replace(sampled, metrics=call.metrics)

    def _rows(self, prompts: PromptBatch, calls: tuple[CallRows, ...], prompt_bucket: int, lengths: np.ndarray,
              stopped: np.ndarray, decode_steps: int, slot_steps: int) -> SampledRows:
        """The ``SampledRows`` of ``prompts``' sampler calls: the prompts left-padded to ``prompt_bucket``
        (packed passes: the largest bucket), the calls' responses joined and cut to the smallest response
        bucket that holds the longest (packed: the budget's width); waits for them."""
        programs = self.programs
        prompt_ids = prompts.prompt_ids
        R = pick_bucket(int(lengths.max()), programs.sampler.response_buckets, "a response")
        tokens, response_mask = programs.sampler.assemble(tuple(c.tokens for c in calls), tuple(c.lengths for c in calls),
                                                  programs.sampler.pass_widths[1] if programs.sampler.packing else R)
        pass_tokens, pass_mask = sampling.left_pad(prompt_ids, len(prompt_ids),
                                                   programs.sampler.pass_widths[0] if programs.sampler.packing else prompt_bucket)
        rows, local_tokens = distributed.local_rows(tokens)  # waits for the sampler
        return SampledRows(prompts, calls, self._put(pass_tokens), self._put(pass_mask), tokens, response_mask,
                           np.repeat([len(p) for p in prompt_ids], programs.sampler.n), lengths, stopped, prompt_bucket, R,
                           decode_steps, slot_steps, rows, local_tokens[:, :R])

    def old_policy(self, state: nnx.State, sampled: SampledRows) -> tuple[UpdateBatch, list[jax.Array], dict,
                                                                          dict]:
        """Dispatch pi_old's passes on a ``sample`` result (asynchronous): (update batch without
        rewards, the mean entropy of the responses after each pass (the last: all of them; none in bypass
        mode: no pass measures it), the passes' packing plans on the device (by pass, as
        ``LearnerPrograms.packing_plans``; None when padded), the packing metrics)."""
        programs = self.programs
        args = [sampled.prompt_tokens, sampled.prompt_mask, sampled.tokens, sampled.response_mask]
        B, W = args[2].shape[0], args[0].shape[1] + args[2].shape[1]
        real = int(np.sum(sampled.prompt_lengths) + np.sum(sampled.lengths))
        passes = 2 if programs.learner.critic is None else 4  # pi_old and the update (PPO: the critic's values and update)
        bypass = programs.learner.sampler_as_old_policy is not None  # the sampler's log-probs as pi_old: no pass, no entropy
        if bypass:
            batch, entropy = programs.learner.sampler_as_old_policy(sampled.sampler_logprobs, *args), []
            passes -= 1
        if not programs.learner.packing:
            if not bypass:
                batch, entropy = programs.learner.pi_old(state, *args)
            return batch, entropy, None, packing_metrics(passes * real, passes * B * W)
        plans = programs.learner.packing_plans(sampled.prompt_lengths, sampled.lengths)
        on_device = plans.map(lambda plan: jax.tree.map(self._put, plan.arrays()))
        (logprob_passes,) = plans.logprob.passes  # one mini-batch: the whole batch
        if not bypass:
            batch, entropy = programs.learner.pi_old(state, *args, on_device.logprob, passes=logprob_passes)
        batch = batch.replace(packing=on_device.update)
        computed = plans.logprob.tokens_computed * ((passes - bypass) // 2) + plans.update.tokens_computed
        if plans.critic is not None:
            computed += plans.critic.tokens_computed
        return batch, entropy, on_device, packing_metrics(passes * real, computed)

    def score(self, sampled: SampledRows, watch: StepWatch) -> ScoredBatch:
        """Decode and score the rows this process holds (``sampled.local_rows``, in order; a stop ends the
        scoring within RewardPool's POLL_S)."""
        n = self.programs.sampler.n
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

    def __call__(self, state: nnx.State, batches: Callable[[], PromptBatch], key: jax.Array,
                 watch: StepWatch | None = None, step: int = 0) -> Rollout:
        """One step's rollout of the prompts ``batches()`` gives (one batch; with ``algorithm.filter_groups``,
        as many as it takes: training/dynamic_sampling.py), sampled and trained with the same weights
        ``state``; ``watch`` (training/progress.py): its phases' progress lines and stop boundaries
        (sampling, reward, pi_old); ``step`` names the step in errors. Unfiltered, pi_old runs on the
        device while the host scores."""
        watch = watch or StepWatch.silent()
        if self.filter_groups.enable:
            return self.finish(state, self.collect(state, batches, key, watch, step), watch)
        times = PhaseTimes()
        sampled = self._sample_phase(state, batches(), key, watch, times)
        watch.start("reward")
        t0 = time.perf_counter()
        dispatched = self._old_policy_phase(state, sampled)  # on the device while the host scores
        scored = self.score(sampled, watch)
        times.reward += time.perf_counter() - t0
        watch.done(f"{len(sampled.local_rows)} responses scored")
        mismatch, times.old_logprob = self._wait_old_policy(dispatched, watch)
        scores = self.gather(sampled, scored)  # after pi_old: several processes' collective waits for it on the device
        return self._rollout(sampled, scores, dispatched, mismatch, {**sampled.metrics, **times.metrics()})

    def collect(self, state: nnx.State, batches: Callable[[], PromptBatch], key: jax.Array, watch: StepWatch,
                step: int) -> Collected:
        """The rollout engine's part of a step (on its mesh, from its copy of the weights ``state``): the
        rows of ``batches()`` sampled (with ``algorithm.filter_groups``, of as many batches as it takes)
        and scored; ``finish`` makes the update batch of them on the learner's mesh."""
        times = PhaseTimes()
        with jax.set_mesh(self.programs.sampler.mesh):  # the engine's rows are placed on its own mesh
            if self.programs.split:  # the key, as every array the engine's programs take, on its mesh
                key = jax.device_put(key, replicated())
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

    def finish(self, state: nnx.State, collected: Collected, watch: StepWatch) -> Rollout:
        """The learner's part of a step on ``collect``'s rows: they move to the learner's mesh (when the
        engine has its own), pi_old runs with the learner's weights ``state``, the rollout checks and the
        correction after it, and the update batch is made."""
        sampled = to_mesh(collected.sampled, self.programs.learner.mesh) if self.programs.split else collected.sampled
        watch.start("pi_old")
        dispatched = self._old_policy_phase(state, sampled)
        mismatch, seconds = self._wait_old_policy(dispatched, watch, started=True)
        times = dataclasses.replace(collected.times, old_logprob=seconds)
        return self._rollout(sampled, collected.scores, dispatched, mismatch, {**collected.metrics, **times.metrics()})

    def _old_policy_phase(self, state: nnx.State, sampled: SampledRows) -> OldPolicy:
        """Dispatch pi_old's passes on ``sampled``, the sampler / pi_old comparison and the rollout
        correction (asynchronous)."""
        batch, entropy_means, packing, packing_stats = self.old_policy(state, sampled)
        learner = self.programs.learner
        mismatch = ({} if learner.bypass is not None else  # bypass: no pi_old to compare with
                    learner.rollout_consistency(sampled.sampler_logprobs, batch.old_logp, batch.response_mask))
        correction = {}
        if learner.rollout_correction is not None:  # verl's weights and rejection mask (docs/design.md 6.7)
            weights, response_mask, correction = learner.rollout_correction(sampled.sampler_logprobs, batch.old_logp,
                                                                            batch.response_mask)
            batch = batch.replace(rollout_is_weights=weights, response_mask=response_mask)
        return OldPolicy(batch, entropy_means, packing, packing_stats, {**mismatch, **correction})

    def _wait_old_policy(self, dispatched: OldPolicy, watch: StepWatch, started: bool = False
                         ) -> tuple[dict[str, float], float]:
        """Wait for pi_old (phase "pi_old", unless ``started``; bypass mode: the update batch of the sampler's
        log-probs, no pass) and check the sampler against it: (the comparison's and the correction's metrics,
        the phase's seconds)."""
        if not started:
            watch.start("pi_old")
        t0 = time.perf_counter()
        if self.programs.learner.bypass is not None:
            pending, detail = dispatched.batch.old_logp, lambda: "the sampler's log-probs as pi_old (bypass mode, no pass)"
        else:
            pending, detail = dispatched.entropy_means, lambda: dispatches_done(dispatched.entropy_means, "passes")
        watch.wait((pending, dispatched.mismatch), detail)
        mismatch = {k: float(v) for k, v in dispatched.mismatch.items()}  # replicated scalars
        if mismatch:
            rollout_consistency.check(mismatch, self.max_logprob_diff)
        seconds = time.perf_counter() - t0
        watch.done()
        return mismatch, seconds

    def _rollout(self, sampled: SampledRows, scores: Scores, dispatched: OldPolicy, mismatch: dict[str, float],
                 extra: dict[str, float]) -> Rollout:
        """The step's ``Rollout``: the update batch with the rewards, and the step's metrics (``extra``:
        the sampler's own and the phases' seconds)."""
        batch = dispatched.batch.replace(rewards=self._put(scores.rewards))
        rewards, lengths = scores.rewards, sampled.lengths
        reward_metrics = score_metrics(rewards, scores.statuses, restarts=scores.restarts, seconds=scores.seconds)
        reward_metrics["deadline_retried"] = float(scores.deadline_retried)
        per_prompt = rewards.reshape(-1, self.programs.sampler.n)
        metrics = {
            "reward_mean": float(rewards.mean()),
            "accuracy": float((rewards == 1.0).mean()),
            "pass_at_n": float((per_prompt == 1.0).any(axis=1).mean()),
            "groups_all_equal": float((per_prompt.min(1) == per_prompt.max(1)).mean()),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
            "response_bucket": float(sampled.response_bucket),
            **dispatched.packing_stats,
            "prompt_bucket": float(sampled.prompt_bucket),  # the sampler's (packed passes take the largest)
            "truncated_fraction": float(1.0 - sampled.stopped.mean()),  # responses cut at max_new_tokens
            **({"entropy": float(dispatched.entropy_means[-1])} if dispatched.entropy_means else {}),  # bypass: none
            **mismatch,  # the sampler's log-probs against pi_old (training/rollout_consistency.py)
            "generated_tokens": float(lengths.sum()),
            "decode_steps": float(sampled.decode_steps),  # of the step's sampler calls, summed
            "slot_utilisation": sampled.slot_utilisation,  # decoded tokens / slot steps
            # identifies the sampled tokens (resume and multi-process tests compare it across runs)
            "sampled_tokens_checksum": float(np.sum(scores.checksums.astype(np.int64))),
            **{f"reward_{k}": v for k, v in reward_metrics.items()},
            **extra,
        }
        return Rollout(batch, rewards, metrics, dispatched.packing)

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
        """DAPO's dynamic sampling (training/dynamic_sampling.py): gen batches sampled and scored until B
        groups with spread are kept -> (their rows, their scores, the metrics ``num_gen_batches``,
        ``filtered_fraction`` (groups drawn and dropped for no spread / groups drawn) and the tokens,
        decode steps and slot utilisation of every gen batch sampled; with carry-over, a gen batch is one
        call of the engine, and the metrics add its calls' staleness (mean of the calls', and max),
        ``carried_rows`` (as the first began) and ``carry_over_dropped`` (summed)). Every process decides
        alike: the rewards are every row's on every process."""
        fg, n, need = self.filter_groups, self.programs.sampler.n, self.programs.sampler.num_prompts
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
            calls = self.programs.sampler.select_groups(sampled.calls if calls is None else calls, sampled.calls, source)
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
        length = pick_bucket(max(len(p) for p in ids), self.programs.sampler.prompt_buckets, "a prompt")
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


def packing_metrics(tokens_real: int, tokens_computed: int) -> dict[str, float]:
    """A step's ``tokens_real`` (the prompt and response tokens of its sequences, once per pass:
    pi_old and the update, PPO's values and critic update), ``tokens_computed`` (the rows x length the
    device ran in those passes, padded or packed) and ``packing_efficiency`` (real / computed)."""
    return {"tokens_real": float(tokens_real), "tokens_computed": float(tokens_computed),
            "packing_efficiency": tokens_real / max(tokens_computed, 1)}
