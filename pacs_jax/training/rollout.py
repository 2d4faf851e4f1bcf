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
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pacs_jax import distributed, sampling
from pacs_jax.rewards import STATUSES, RewardPool, reward_for, score_metrics
from pacs_jax.sharding import batch_sharding
from pacs_jax.training import rollout_consistency
from pacs_jax.training.progress import StepWatch, dispatches_done
from pacs_jax.training.spec import RunSpec
from pacs_jax.training.step_programs import StepPrograms


REWARD_DEADLINE_RETRIES = 1  # rounds with a fresh reward deadline for what the first one left unscored


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Prompts of one step: token ids, gold answers and where each came from (same length)."""

    prompt_ids: Sequence[Sequence[int]]
    ground_truths: Sequence[str]
    data_sources: Sequence[str]


@dataclasses.dataclass
class Rollout:
    """One step's rollout: the update batch (global device arrays) and what the host saw."""

    batch: dict[str, jax.Array]  # input_ids, attention_mask [B, P+R]; response_mask, old_logp [B, R]; rewards [B];
    #                              packed: the update's plan arrays (rl/packing.py PACKING_KEYS)
    rewards: np.ndarray  # [B] every row's reward (the same on every process)
    metrics: dict[str, float]  # over all rows of all processes
    packing: dict[str, dict[str, jax.Array]] = dataclasses.field(default_factory=dict)  # PPO's critic passes'
    #                              plans ("logprob": the values, "critic": its update), when packed


def pick_bucket(length: int, buckets: Sequence[int], what: str) -> int:
    """The smallest bucket >= length (buckets sorted ascending)."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    raise ValueError(f"{what} of {length} tokens is longer than the largest bucket {buckets[-1]}")


class RolloutCollector:
    """Samples, scores and computes pi_old for batches of prompts with a step's programs."""

    def __init__(self, programs: StepPrograms, *, decode: Callable[[Sequence[int]], str], reward_pool: RewardPool,
                 reward_name: str, reward_deadline: float | None = None, max_unscored_fraction: float | None = None,
                 max_logprob_diff: float = 0.0):
        self.programs, self.max_logprob_diff = programs, max_logprob_diff
        self.decode, self.pool, self.reward_name = decode, reward_pool, reward_name
        self.reward_deadline, self.max_unscored_fraction = reward_deadline, max_unscored_fraction

    @classmethod
    def from_spec(cls, spec: RunSpec, programs: StepPrograms, *,
                  decode: Callable[[Sequence[int]], str], reward_pool: RewardPool | None) -> RolloutCollector:
        """The collector of ``spec.reward`` (the reward, its deadline and unscored fraction) and
        ``rollout.max_logprob_diff``."""
        rw = spec.reward
        return cls(programs, decode=decode, reward_pool=reward_pool, reward_name=reward_for(rw.name, rw.mode),
                   reward_deadline=rw.deadline, max_unscored_fraction=rw.max_unscored_fraction,
                   max_logprob_diff=spec.rollout.max_logprob_diff)

    def _put(self, x: np.ndarray) -> jax.Array:
        """A host array of the global shape -> a global array sharded over the batch axes (each process
        copies only the rows its devices hold)."""
        return distributed.put_rows(x, batch_sharding(x.shape))

    # ------------------------------------------------------------------------ one step
    def sample(self, state: nnx.State, prompt_ids: Sequence[Sequence[int]], key: jax.Array,
               watch: StepWatch | None = None) -> dict:
        """Sample n responses per prompt (every process passes the same ``prompt_ids``); ``watch``
        (training/progress.py) is told of each chunk of decode steps, and may stop between them.

        The calls run one after another, each in chunks of decode steps (sampling.sample): ``watch``
        writes their progress (rows done, tokens so far) and may stop between two chunks.

        Returns global device arrays prompt_tokens, prompt_mask [P, Tp] (left-padded to the prompt
        bucket), tokens, response_mask [P*n, R] (cut to the response bucket; packed passes: Tp and R
        the largest buckets), host arrays lengths, stopped, prompt_lengths [P*n] (every row's, on
        every process), the sampler's prompt and response buckets, the calls' decode steps (summed)
        and slot utilisation (decoded tokens / slot steps: slots x decode steps at each decode batch
        width), and
        sampler_logprobs: each call's log-probs of its tokens, [P*n / K, max_new] device arrays.
        """
        programs = self.programs
        K = programs.sampler_calls
        num_prompts = len(prompt_ids)
        if num_prompts % K:
            raise ValueError(f"{num_prompts} prompts cannot be split into {K} sampler micro-batches")
        length = pick_bucket(max(len(p) for p in prompt_ids), programs.prompt_buckets, "a prompt")
        tokens_np, mask_np = sampling.left_pad(prompt_ids, num_prompts, length)
        # the passes' prompts: the sampler's, or packed, the largest bucket's (one program per pass)
        pass_tokens, pass_mask = (sampling.left_pad(prompt_ids, num_prompts, programs.pass_widths[0])
                                  if programs.packing else (tokens_np, mask_np))
        per_call = num_prompts // K
        watch = watch or StepWatch.silent()

        def wait(progress, last, c):  # each chunk of decode steps: progress lines, and a stop between chunks
            watch.wait(progress, lambda: f"sampler call {c + 1}/{K}: " + (
                f"{last.rows_done}/{last.rows} rows done, {last.tokens} tokens" if last else "prefill"))

        outs = [programs.sample(state, self._put(tokens_np[i:i + per_call]), self._put(mask_np[i:i + per_call]),
                                jax.random.fold_in(key, c), functools.partial(wait, c=c))
                for c, i in enumerate(range(0, num_prompts, per_call))]
        # one transfer for all calls
        host_calls = distributed.to_host([(o.lengths, o.stopped, o.decode_steps, o.slot_steps) for o in outs])
        lengths, stopped = (np.concatenate(parts) for parts in list(zip(*host_calls))[:2])
        decode_steps = sum(int(call[2]) for call in host_calls)
        slot_steps = sum(int(call[3]) for call in host_calls)
        R = pick_bucket(int(lengths.max()), programs.response_buckets, "a response")
        tokens, response_mask = programs.assemble(tuple(o.tokens for o in outs), tuple(o.lengths for o in outs),
                                                  programs.pass_widths[1] if programs.packing else R)
        return {"prompt_tokens": self._put(pass_tokens), "prompt_mask": self._put(pass_mask), "tokens": tokens,
                "prompt_lengths": np.repeat([len(p) for p in prompt_ids], self.programs.n), "response_bucket": R,
                "prompt_bucket": length,
                "response_mask": response_mask, "lengths": lengths, "stopped": stopped,
                "decode_steps": decode_steps, "sampler_logprobs": tuple(o.logprobs for o in outs),
                "slot_utilisation": sampling.slot_utilisation(lengths, slot_steps)}

    def old_policy(self, state: nnx.State, sampled: dict) -> tuple[dict[str, jax.Array], list[jax.Array], dict, dict]:
        """Dispatch pi_old's passes on a ``sample`` result (asynchronous): (update batch without
        rewards, the mean entropy of the responses after each pass (the last: all of them), the passes'
        packing plans on the device (by pass, as ``StepPrograms.packing_plans``; {} when padded), the
        packing metrics)."""
        programs = self.programs
        args = [sampled[k] for k in ("prompt_tokens", "prompt_mask", "tokens", "response_mask")]
        B, W = args[2].shape[0], args[0].shape[1] + args[2].shape[1]
        real = int(np.sum(sampled["prompt_lengths"]) + np.sum(sampled["lengths"]))
        passes = 2 if programs.critic is None else 4  # pi_old and the update (PPO: the critic's values and update)
        bypass = programs.sampler_as_old_policy is not None  # the sampler's log-probs as pi_old: no pass, no entropy
        if bypass:
            batch, entropy = programs.sampler_as_old_policy(sampled["sampler_logprobs"], *args), [jnp.full((), jnp.nan)]
            passes -= 1
        if not programs.packing:
            if not bypass:
                batch, entropy = programs.pi_old(state, *args)
            return batch, entropy, {}, packing_metrics(passes * real, passes * B * W)
        plans = programs.packing_plans(sampled["prompt_lengths"], sampled["lengths"])
        on_device = {name: {k: self._put(v) for k, v in plan.arrays().items()} for name, plan in plans.items()}
        (logprob_passes,) = plans["logprob"].passes  # one mini-batch: the whole batch
        if not bypass:
            batch, entropy = programs.pi_old(state, *args, on_device["logprob"], passes=logprob_passes)
        batch = {**batch, **on_device.pop("update")}
        computed = plans["logprob"].tokens_computed * ((passes - bypass) // 2) + plans["update"].tokens_computed
        if "critic" in plans:
            computed += plans["critic"].tokens_computed
        return batch, entropy, on_device, packing_metrics(passes * real, computed)

    def __call__(self, state: nnx.State, prompts: PromptBatch, key: jax.Array, watch: StepWatch | None = None
                 ) -> Rollout:
        """One step's rollout of ``prompts``; ``watch`` (training/progress.py): its phases' progress
        lines and stop boundaries (sampling, reward, pi_old)."""
        n = self.programs.n
        watch = watch or StepWatch.silent()
        times = {}
        t0 = time.perf_counter()
        watch.start("sampling")
        sampled = self.sample(state, prompts.prompt_ids, key, watch)
        lengths, stopped = sampled["lengths"], sampled["stopped"]
        rows, local_tokens = distributed.local_rows(sampled["tokens"])  # waits for the sampler
        times["time_sample"] = time.perf_counter() - t0
        watch.done(f"{len(lengths)} rows, {int(lengths.sum())} tokens")

        watch.start("reward")
        t0 = time.perf_counter()
        batch, entropy_means, packing, packing_stats = self.old_policy(state, sampled)  # on the device while the host scores
        mismatch = ({} if self.programs.bypass is not None else  # bypass: no pi_old to compare with
                    self.programs.rollout_consistency(sampled["sampler_logprobs"], batch["old_logp"],
                                                      batch["response_mask"]))
        correction = {}
        if self.programs.rollout_correction is not None:  # verl's weights and rejection mask (docs/design.md 6.7)
            batch["rollout_is_weights"], batch["response_mask"], correction = self.programs.rollout_correction(
                sampled["sampler_logprobs"], batch["old_logp"], batch["response_mask"])
        texts = [self.decode(local_tokens[i, :lengths[row]]) for i, row in enumerate(rows)]
        golds = [prompts.ground_truths[row // n] for row in rows]
        scored = self.pool.score(texts, golds, reward=self.reward_name, deadline=self.reward_deadline,
                                 deadline_retries=REWARD_DEADLINE_RETRIES, max_unscored_fraction=self.max_unscored_fraction,
                                 poll=watch.poll)  # one process: a stop ends the scoring within RewardPool's POLL_S
        times["time_reward"] = time.perf_counter() - t0
        watch.done(f"{len(texts)} responses scored")
        watch.start("pi_old")
        t0 = time.perf_counter()
        watch.wait((entropy_means, mismatch), lambda: dispatches_done(entropy_means, "passes"))
        entropy_mean = float(entropy_means[-1])  # waits for pi_old
        mismatch = {k: float(v) for k, v in {**mismatch, **correction}.items()}  # replicated scalars
        if mismatch:
            rollout_consistency.check(mismatch, self.max_logprob_diff)
        times["time_old_logprob"] = time.perf_counter() - t0
        watch.done()

        B, R = sampled["tokens"].shape[0], sampled["response_bucket"]
        local_tokens = local_tokens[:, :R]  # packed passes take the budget's width; the checksum the bucket's
        rewards_np, status_np, checksum_np = np.zeros(B, np.float32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        rewards_np[rows] = scored.scores
        status_np[rows] = [STATUSES.index(status) for status in scored.statuses]
        positions = 1 + rows[:, None] * R + np.arange(R)[None, :]
        checksum_np[rows] = np.sum(local_tokens.astype(np.int64) * positions % 1_000_003, axis=1) % 1_000_003
        batch["rewards"] = self._put(rewards_np)
        # every row's, on every process, in one transfer
        rewards, status_ids, checksum = distributed.to_host(
            (batch["rewards"], self._put(status_np), self._put(checksum_np)))
        statuses = [STATUSES[i] for i in status_ids]
        restarts, seconds, retried = distributed.gather_per_process(np.asarray(
            [scored.metrics[k] for k in ("worker_restarts", "seconds", "deadline_retried")])).T
        reward_metrics = score_metrics(rewards, statuses, restarts=int(restarts.sum()), seconds=float(seconds.max()))
        reward_metrics["deadline_retried"] = float(retried.sum())
        per_prompt = rewards.reshape(-1, n)
        metrics = {
            "reward_mean": float(rewards.mean()),
            "accuracy": float((rewards == 1.0).mean()),
            "pass_at_n": float((per_prompt == 1.0).any(axis=1).mean()),
            "groups_all_equal": float((per_prompt.min(1) == per_prompt.max(1)).mean()),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
            "response_bucket": float(sampled["response_bucket"]),
            **packing_stats,
            "prompt_bucket": float(sampled["prompt_bucket"]),  # the sampler's (packed passes take the largest)
            "truncated_fraction": float(1.0 - stopped.mean()),  # responses cut at max_new_tokens
            "entropy": entropy_mean,
            **mismatch,  # the sampler's log-probs against pi_old (training/rollout_consistency.py)
            "generated_tokens": float(lengths.sum()),
            "decode_steps": float(sampled["decode_steps"]),  # of the step's sampler calls, summed
            "slot_utilisation": sampled["slot_utilisation"],  # decoded tokens / slot steps
            # identifies the sampled tokens (resume and multi-process tests compare it across runs)
            "sampled_tokens_checksum": float(np.sum(checksum.astype(np.int64))),
            **{f"reward_{k}": v for k, v in reward_metrics.items()},
            **times,
        }
        return Rollout(batch, rewards, metrics, packing)


def packing_metrics(tokens_real: int, tokens_computed: int) -> dict[str, float]:
    """A step's ``tokens_real`` (the prompt and response tokens of its sequences, once per pass:
    pi_old and the update, PPO's values and critic update), ``tokens_computed`` (the rows x length the
    device ran in those passes, padded or packed) and ``packing_efficiency`` (real / computed)."""
    return {"tokens_real": float(tokens_real), "tokens_computed": float(tokens_computed),
            "packing_efficiency": tokens_real / max(tokens_computed, 1)}
