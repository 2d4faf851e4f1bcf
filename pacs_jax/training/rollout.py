"""From a batch of prompts to the update batch of one training step (docs/design.md section 3).

    sample   the prompts, left-padded to a prompt bucket, in ``sampler_micro_batches`` calls of the
             jitted sampler (n responses each, sharded); every process places only the rows its
             devices hold, and only the (small) lengths and stop flags are shared by all processes
    trim     on the device: the calls' responses joined into [P*n, R] rows, cut to the smallest
             response bucket that holds the longest one
    pi_old   one jitted program per (prompt bucket, response bucket): assemble [B, P + R] rows on the
             device and compute pi_old and the entropy at the rollout temperature (logits / T, as
             verl), in micro-batches of rows
             (pacs_jax.rl.micro_batched_logprobs), dispatched before the rewards are scored
    reward   each process decodes and scores the rows its devices hold (read from its addressable
             shards; the ids never leave their host) while the device computes pi_old; what the
             deadline leaves unscored gets one more round, then counts (``reward_unscored``) or,
             above ``max_unscored_fraction`` of a process's rows, stops the run (rewards.UnscoredError);
             the rewards go back into a global array, and the step's metrics are computed from all rows

Every program's shapes come from the config's buckets, so ``warm_up`` compiles all of them up front
and a run compiles nothing after it. Every process sees the whole PromptBatch (token ids are small)
so all choose the same buckets without a collective (docs/design.md section 5).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from pacs_jax import distributed, sampling
from pacs_jax.rewards import STATUSES, RewardPool, score_metrics
from pacs_jax.rl import micro_batched_logprobs
from pacs_jax.sampling.engine import lower_sample
from pacs_jax.sharding import MeshRules, constrain


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

    batch: dict[str, jax.Array]  # input_ids, attention_mask [B, P+R]; response_mask, old_logp [B, R]; rewards [B]
    rows: np.ndarray  # [b] the rows of the batch this process decoded and scored
    texts: list[str]  # [b] their decoded responses
    rewards: np.ndarray  # [B] every row's reward (the same on every process)
    metrics: dict[str, float]  # over all rows of all processes


def pick_bucket(length: int, buckets: Sequence[int], what: str) -> int:
    """The smallest bucket >= length (buckets sorted ascending)."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    raise ValueError(f"{what} of {length} tokens is longer than the largest bucket {buckets[-1]}")


def batch_sharding(rules: MeshRules | None, shape: tuple[int, ...]) -> jax.sharding.Sharding:
    """The sharding of a per-row array of a step: rows over the batch axes, the rest replicated (all
    replicated when the rows do not divide, e.g. a few prompts on many devices).

    The same objects place host arrays, pin the programs' outputs and compile them ahead of time,
    so every call finds its program already compiled.
    """
    if rules is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    axes = rules.batch_axes()
    if shape[0] % math.prod(rules.mesh.shape[a] for a in axes):
        axes = ()
    return NamedSharding(rules.mesh, PartitionSpec(axes or None, *([None] * (len(shape) - 1))))


class RolloutCollector:
    """Samples, scores and computes pi_old for batches of prompts with a fixed model graph."""

    def __init__(self, graphdef: nnx.GraphDef, rules: MeshRules | None, settings: sampling.SamplingSettings, *,
                 decode: Callable[[Sequence[int]], str], reward_pool: RewardPool, reward_name: str,
                 prompt_buckets: Sequence[int], response_buckets: Sequence[int] = (),
                 sampler_micro_batches: int = 1, logprob_micro_batches: int = 1,
                 reward_deadline: float | None = None, max_unscored_fraction: float | None = None,
                 chunk_size: int | None = None):
        self.graphdef, self.rules, self.settings = graphdef, rules, settings
        self.decode, self.pool, self.reward_name = decode, reward_pool, reward_name
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        self.response_buckets = tuple(sorted(response_buckets)) or (settings.max_new_tokens,)
        if self.response_buckets[-1] != settings.max_new_tokens:
            raise ValueError(f"the largest response bucket ({self.response_buckets[-1]}) must equal "
                             f"max_new_tokens ({settings.max_new_tokens})")
        self.sampler_micro_batches, self.logprob_micro_batches = sampler_micro_batches, logprob_micro_batches
        self.reward_deadline, self.max_unscored_fraction = reward_deadline, max_unscored_fraction
        extra = {} if chunk_size is None else {"chunk_size": chunk_size}
        rows = batch_sharding(rules, (0, 0))  # the update batch's rows always divide (validate_config)
        replicated = rows if rules is None else NamedSharding(rules.mesh, PartitionSpec())

        def prepare(state, prompt_tokens, prompt_mask, tokens, response_mask):
            """[P, Tp] prompts + [P*n, R] responses -> the update batch (without rewards) + mean entropy."""
            n = tokens.shape[0] // prompt_tokens.shape[0]
            ids = jnp.concatenate([jnp.repeat(prompt_tokens, n, axis=0), tokens], axis=1)
            mask = jnp.concatenate([jnp.repeat(prompt_mask, n, axis=0), response_mask], axis=1)
            ids, mask = constrain(ids, rules, ("batch", None)), constrain(mask, rules, ("batch", None))
            old_logp, entropy = micro_batched_logprobs(
                nnx.merge(graphdef, state), ids, mask, tokens.shape[1], num_micro_batches=logprob_micro_batches,
                temperature=settings.temperature, rules=rules, with_entropy=True, **extra)
            response_mask = response_mask.astype(jnp.float32)
            entropy_mean = jnp.sum(entropy * response_mask) / jnp.maximum(jnp.sum(response_mask), 1.0)
            return {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask,
                    "old_logp": old_logp}, entropy_mean

        self._prepare = jax.jit(prepare, out_shardings=(
            {"input_ids": rows, "attention_mask": rows, "response_mask": rows, "old_logp": rows},
            replicated))

        def assemble(tokens, lengths, bucket):
            """K sampler calls' [P*n/K, max_new] ids and [P*n/K] lengths -> [P*n, bucket] ids and mask."""
            tokens = jnp.concatenate(tokens, axis=0)[:, :bucket]
            lengths = jnp.concatenate(lengths, axis=0)
            return tokens, (jnp.arange(bucket)[None, :] < lengths[:, None]).astype(jnp.int32)

        self._assemble = jax.jit(assemble, static_argnums=2, out_shardings=(rows, rows))

    # ------------------------------------------------------------------------ device placement
    def _put(self, x: np.ndarray) -> jax.Array:
        """A host array of the global shape -> a global array sharded over the batch axes (each process
        copies only the rows its devices hold)."""
        return distributed.put_rows(x, batch_sharding(self.rules, x.shape))

    def _abstract(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(self.rules, shape))

    def _sample(self, state, prompt_tokens, prompt_mask, key):
        return sampling.sample(self.graphdef, state, prompt_tokens, prompt_mask, self.settings, key)

    def warm_up(self, state: nnx.State, num_prompts: int) -> None:
        """Compile (ahead of time, nothing runs) every program a step of ``num_prompts`` prompts can
        use: the sampler per prompt bucket, pi_old per (prompt bucket, response bucket)."""
        n, K = self.settings.n, self.sampler_micro_batches
        abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        jobs = [(p, None) for p in self.prompt_buckets] + \
               [(p, r) for p in self.prompt_buckets for r in self.response_buckets]
        jobs += [(None, r) for r in self.response_buckets]
        per_call = num_prompts * n // K
        call_tokens = (self._abstract((per_call, self.settings.max_new_tokens), jnp.int32),) * K
        call_lengths = (self._abstract((per_call,), jnp.int32),) * K
        for p, r in tqdm(jobs, desc="compiling programs", leave=False):
            prompts = self._abstract((num_prompts, p or 1), jnp.int32)
            if r is None:
                chunk = self._abstract((num_prompts // K, p), jnp.int32)
                lower_sample(self.graphdef, abstract_state, chunk, chunk, self.settings).compile()
            elif p is None:
                self._assemble.lower(call_tokens, call_lengths, r).compile()
            else:
                responses = self._abstract((num_prompts * n, r), jnp.int32)
                self._prepare.lower(abstract_state, prompts, prompts, responses, responses).compile()

    def abstract_batches(self, num_prompts: int) -> list[dict[str, jax.ShapeDtypeStruct]]:
        """The update batch of every (prompt bucket, response bucket), as abstract arrays."""
        B = num_prompts * self.settings.n
        out = []
        for p in self.prompt_buckets:
            for r in self.response_buckets:
                out.append({"input_ids": self._abstract((B, p + r), jnp.int32),
                            "attention_mask": self._abstract((B, p + r), jnp.int32),
                            "response_mask": self._abstract((B, r), jnp.float32),
                            "old_logp": self._abstract((B, r), jnp.float32),
                            "rewards": self._abstract((B,), jnp.float32)})
        return out

    # ------------------------------------------------------------------------ one step
    def sample(self, state: nnx.State, prompt_ids: Sequence[Sequence[int]], key: jax.Array) -> dict:
        """Sample n responses per prompt (every process passes the same ``prompt_ids``).

        Returns global device arrays prompt_tokens, prompt_mask [P, Tp] (left-padded to the prompt
        bucket), tokens, response_mask [P*n, R] (cut to the response bucket), host arrays lengths,
        stopped [P*n] (every row's, on every process), and the calls' decode steps (summed) and slot
        utilisation (decoded tokens / (slots x decode steps)).
        """
        K = self.sampler_micro_batches
        num_prompts = len(prompt_ids)
        if num_prompts % K:
            raise ValueError(f"{num_prompts} prompts cannot be split into {K} sampler micro-batches")
        length = pick_bucket(max(len(p) for p in prompt_ids), self.prompt_buckets, "a prompt")
        tokens_np, mask_np = sampling.left_pad(prompt_ids, num_prompts, length)
        per_call = num_prompts // K
        outs = [self._sample(state, self._put(tokens_np[i:i + per_call]), self._put(mask_np[i:i + per_call]),
                             jax.random.fold_in(key, c))
                for c, i in enumerate(range(0, num_prompts, per_call))]
        # one transfer for all calls
        host_calls = distributed.to_host([(o.lengths, o.stopped, o.decode_steps) for o in outs])
        lengths, stopped = (np.concatenate(parts) for parts in list(zip(*host_calls))[:2])
        decode_steps = sum(int(steps) for _, _, steps in host_calls)
        R = pick_bucket(int(lengths.max()), self.response_buckets, "a response")
        tokens, response_mask = self._assemble(tuple(o.tokens for o in outs), tuple(o.lengths for o in outs), R)
        slots = self.settings.slots or per_call * self.settings.n
        return {"prompt_tokens": self._put(tokens_np), "prompt_mask": self._put(mask_np), "tokens": tokens,
                "response_mask": response_mask, "lengths": lengths, "stopped": stopped,
                "decode_steps": decode_steps,
                "slot_utilisation": sampling.slot_utilisation(lengths, decode_steps, slots)}

    def old_policy(self, state: nnx.State, sampled: dict) -> tuple[dict[str, jax.Array], jax.Array]:
        """Dispatch the pi_old program on a ``sample`` result (asynchronous): (update batch without
        rewards, mean entropy of the responses)."""
        return self._prepare(state, *(sampled[k] for k in ("prompt_tokens", "prompt_mask", "tokens", "response_mask")))

    def __call__(self, state: nnx.State, prompts: PromptBatch, key: jax.Array) -> Rollout:
        n = self.settings.n
        times = {}
        t0 = time.perf_counter()
        sampled = self.sample(state, prompts.prompt_ids, key)
        lengths, stopped = sampled["lengths"], sampled["stopped"]
        rows, local_tokens = distributed.local_rows(sampled["tokens"])  # waits for the sampler
        times["time_sample"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        batch, entropy_mean = self.old_policy(state, sampled)  # runs on the device while the host scores
        texts = [self.decode(local_tokens[i, :lengths[row]]) for i, row in enumerate(rows)]
        golds = [prompts.ground_truths[row // n] for row in rows]
        scored = self.pool.score(texts, golds, reward=self.reward_name, deadline=self.reward_deadline,
                                 deadline_retries=REWARD_DEADLINE_RETRIES, max_unscored_fraction=self.max_unscored_fraction)
        times["time_reward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        entropy_mean = float(entropy_mean)  # waits for pi_old
        times["time_old_logprob"] = time.perf_counter() - t0

        B, R = sampled["tokens"].shape
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
            "response_bucket": float(R),
            "prompt_bucket": float(sampled["prompt_tokens"].shape[1]),
            "clip_ratio": float(1.0 - stopped.mean()),
            "entropy": entropy_mean,
            "generated_tokens": float(lengths.sum()),
            "decode_steps": float(sampled["decode_steps"]),  # of the step's sampler calls, summed
            "slot_utilisation": sampled["slot_utilisation"],  # decoded tokens / (slots x decode steps)
            # identifies the sampled tokens (resume and multi-process tests compare it across runs)
            "sampled_tokens_checksum": float(np.sum(checksum.astype(np.int64))),
            **{f"reward_{k}": v for k, v in reward_metrics.items()},
            **times,
        }
        return Rollout(batch, rows, texts, rewards, metrics)
