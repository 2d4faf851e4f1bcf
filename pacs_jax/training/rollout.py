"""From a batch of prompts to the update batch of one training step (DESIGN.md section 3).

sample n responses per prompt (jitted, sharded) -> decode text and score on the host (worker pool)
-> pi_old log-probs and entropy from the trainer's own forward at temperature 1 (jitted, no grad).

Only the generated ids, their lengths and the stop flags come to the host (the reward needs text);
the update batch is assembled on the device.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pacs_jax import sampling
from pacs_jax.rewards import RewardPool
from pacs_jax.rl import token_logprobs_and_entropy
from pacs_jax.sharding import MeshRules, constrain


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Prompts of one step: token ids, gold answers and where each came from (same length)."""

    prompt_ids: Sequence[Sequence[int]]
    ground_truths: Sequence[str]
    data_sources: Sequence[str]


@dataclasses.dataclass
class Rollout:
    """One step's rollout: the update batch (device arrays) and what the host saw."""

    batch: dict[str, jax.Array]  # input_ids, attention_mask [B, P+R]; response_mask, old_logp [B, R]; rewards [B]
    texts: list[str]
    rewards: np.ndarray  # [B]
    metrics: dict[str, float]


def make_old_logprobs_fn(graphdef: nnx.GraphDef, rules: MeshRules | None, chunk_size: int | None = None) -> Callable:
    """Jitted (params, input_ids [B, L], attention_mask [B, L], R) -> (logp [B, R], entropy [B, R]).

    pi_old at temperature 1 and the policy's per-token entropy, with the fused (chunked) log-probs.
    """
    extra = {} if chunk_size is None else {"chunk_size": chunk_size}

    def fn(params, input_ids, attention_mask, response_length):
        model = nnx.merge(graphdef, params)
        prompt_length = input_ids.shape[1] - response_length
        hidden = model(input_ids, attention_mask=attention_mask, return_hidden=True)
        logp, entropy = token_logprobs_and_entropy(hidden[:, prompt_length - 1:-1], model.lm_head_kernel(),
                                                   input_ids[:, prompt_length:], **extra)
        return jax.lax.stop_gradient(logp), jax.lax.stop_gradient(entropy)

    return jax.jit(fn, static_argnums=3)


def _assemble(prompt_tokens, prompt_mask, tokens, response_mask, n, rules):
    """[P, Tp] prompts + [P*n, R] responses -> input_ids, attention_mask [P*n, Tp+R] on the device."""
    ids = jnp.concatenate([jnp.repeat(prompt_tokens, n, axis=0), tokens], axis=1)
    mask = jnp.concatenate([jnp.repeat(prompt_mask, n, axis=0), response_mask], axis=1)
    return constrain(ids, rules, ("batch", None)), constrain(mask, rules, ("batch", None))


_assemble_jit = jax.jit(_assemble, static_argnums=(4, 5))


class RolloutCollector:
    """Samples, scores and computes pi_old for batches of prompts with a fixed model graph."""

    def __init__(self, graphdef: nnx.GraphDef, rules: MeshRules | None, params: sampling.SamplingParams, *,
                 decode: Callable[[Sequence[int]], str], reward_pool: RewardPool, reward_name: str,
                 prompt_length_multiple: int, max_prompt_length: int, reward_deadline: float | None = None,
                 chunk_size: int | None = None):
        self.graphdef, self.rules, self.params = graphdef, rules, params
        self.decode, self.pool, self.reward_name = decode, reward_pool, reward_name
        self.length_multiple, self.max_prompt_length = prompt_length_multiple, max_prompt_length
        self.reward_deadline = reward_deadline
        self.old_logprobs = make_old_logprobs_fn(graphdef, rules, chunk_size)

    def _put(self, x: np.ndarray) -> jax.Array:
        """This process's rows -> a global array sharded over the batch axes."""
        if self.rules is None:
            return jnp.asarray(x)
        global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        sharding = self.rules.sharding(("batch",) + (None,) * (x.ndim - 1), global_shape)
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    def __call__(self, state: nnx.State, prompts: PromptBatch, key: jax.Array) -> Rollout:
        n = self.params.n
        times = {}
        t0 = time.perf_counter()
        length = sampling.bucket_length(max(len(p) for p in prompts.prompt_ids), self.length_multiple,
                                        self.max_prompt_length)
        tokens_np, mask_np = sampling.left_pad(prompts.prompt_ids, len(prompts.prompt_ids), length)
        prompt_tokens, prompt_mask = self._put(tokens_np), self._put(mask_np)
        out = sampling.rollout(self.graphdef, state, prompt_tokens, prompt_mask, self.params, key)
        gen, lengths, stopped = jax.device_get((out.tokens, out.lengths, out.stopped))
        times["time_sample"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        texts = [self.decode(gen[i, :lengths[i]]) for i in range(gen.shape[0])]
        golds = [g for g in prompts.ground_truths for _ in range(n)]
        scored = self.pool.score(texts, golds, reward=self.reward_name, deadline=self.reward_deadline)
        rewards = np.asarray(scored.scores, np.float32)
        times["time_reward"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        input_ids, attention_mask = _assemble_jit(prompt_tokens, prompt_mask, out.tokens, out.response_mask, n,
                                                  self.rules)
        R = out.tokens.shape[1]
        old_logp, entropy = self.old_logprobs(state, input_ids, attention_mask, R)
        response_mask = out.response_mask.astype(jnp.float32)
        entropy_mean = float(jnp.sum(entropy * response_mask) / jnp.maximum(jnp.sum(response_mask), 1.0))
        times["time_old_logprob"] = time.perf_counter() - t0

        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
                 "old_logp": old_logp, "rewards": self._put(rewards)}
        per_prompt = rewards.reshape(-1, n)
        metrics = {
            "reward_mean": float(rewards.mean()),
            "accuracy": float((rewards == 1.0).mean()),
            "pass_at_n": float((per_prompt == 1.0).any(axis=1).mean()),
            "groups_all_equal": float((per_prompt.min(1) == per_prompt.max(1)).mean()),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
            "clip_ratio": float(1.0 - stopped.mean()),
            "entropy": entropy_mean,
            "generated_tokens": float(lengths.sum()),
            # identifies the sampled tokens (resume tests compare it across runs)
            "sampled_tokens_checksum": float(np.sum(gen.astype(np.int64) * (1 + np.arange(gen.size).reshape(gen.shape)) % 1_000_003)),
            **{f"reward_{k}": float(v) for k, v in scored.metrics.items()},
            **times,
        }
        return Rollout(batch, texts, rewards, metrics)
