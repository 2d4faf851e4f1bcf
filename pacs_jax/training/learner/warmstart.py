"""The supervised warm-start (the spec's ``warmstart``): teacher-forced cross-entropy before RL.

Each training prompt's target response is ``warmstart.response`` with its gold answer filled in
(``\\boxed{{{answer}}}``: the format the reward parses), then the tokenizer's eos. A step draws
``batch_size`` distinct training prompts (a ``seed``-determined order) and takes one AdamW step on the
token-mean negative log-likelihood of the response tokens; the prompt tokens are context. Batches
walk a fresh permutation of the prompts each epoch, seeded by (seed, epoch).

Batches have the rollout's layout (prompt left-padded to ``data.max_prompt_length``, response
right-padded to ``warmstart.max_response_tokens``), so the log-probs come from the trainer's one
log-prob path (``rl.response_logprobs``: fused, chunked over the vocabulary; rows sharded over the
batch axes). With ``warmstart.target_accuracy`` > 0, the greedy accuracy on a probe set (the run
passes the first ``probe_problems`` of RL's prompts, which the warm-start does not train on when
``data.warmstart_problems`` sets its own aside) is measured every ``check_every`` steps and the
phase stops once it reaches the target. Where the model starts to generalise, and how far, differs
between seeds and machines (the floating-point path of the updates differs): stopping at an accuracy
on prompts it never trained on makes RL start from the same skill level on any of them.

Before each step the warm-start calls the caller's ``safe_point`` (training/run.py passes the run's
``StopSignals.safe_point``: on several processes a stop signal ends the run there, on every process at
the same step; training/signals.py).

With LoRA (model.lora_rank > 0) the run warm-starts the model without adapters, this same program at full
rank, and draws the fresh adapters after it (training/run.py): the warm-start stands in for a pretrained model,
so full fine-tuning and LoRA at any rank start RL from the same weights (decision 0014). The run keeps that
base in <workdir>/lora_base (training/warm_base.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pacs_jax import console, distributed, sampling
from pacs_jax.data import PromptExample
from pacs_jax.models import Qwen
from pacs_jax.rewards import RewardPool
from pacs_jax.rl import response_logprobs
from pacs_jax.rl.update_batch import SFTBatch
from pacs_jax.sampling.buckets import left_pad
from pacs_jax.sharding import abstract, abstract_optimizer_state, batch_sharding, state_shardings
from pacs_jax.training.spec import WarmstartSpec


@dataclasses.dataclass(frozen=True)
class WarmStartResult:
    """What the phase did: optimizer steps taken, the last probe accuracy (None: never probed), seconds."""

    steps: int
    probe_accuracy: float | None
    seconds: float


def sft_batch(examples: Sequence[PromptExample], responses: Sequence[Sequence[int]], prompt_length: int,
              response_length: int) -> SFTBatch:
    """Prompts left-padded to ``prompt_length``, target responses right-padded to ``response_length``:
    input_ids, attention_mask [B, prompt_length + response_length] int32 and response_mask
    [B, response_length] float32 (1 on the target's tokens), host arrays.
    """
    prompts, prompt_mask = left_pad([e.prompt_ids for e in examples], len(examples), prompt_length)
    tokens = np.zeros((len(examples), response_length), np.int32)
    for row, response in enumerate(responses):
        if len(response) > response_length:
            raise ValueError(f"warmstart.max_response_tokens={response_length}: a target response has "
                             f"{len(response)} tokens")
        tokens[row, :len(response)] = response
    mask = (np.arange(response_length)[None, :] < np.array([len(r) for r in responses])[:, None]).astype(np.int32)
    return SFTBatch(input_ids=np.concatenate([prompts, tokens], axis=1),
                    attention_mask=np.concatenate([prompt_mask, mask], axis=1), response_mask=mask.astype(np.float32))


class SFTStep(NamedTuple):
    """The warm-start's program and its optimizer (training/step_programs.py makes a run's)."""

    optimizer: optax.GradientTransformation
    step: Callable  # jitted (params, opt_state, batch) -> (params, opt_state, loss); state donated
    opt_shardings: object  # the AdamW state's shardings the step keeps


def sft_step(graphdef: nnx.GraphDef, wc: WarmstartSpec, params) -> SFTStep:
    """The warm-start step of ``wc`` (``warmstart``: AdamW at ``lr``, ``weight_decay``; responses
    of ``max_response_tokens``) for ``params`` (arrays or abstract, with shardings)."""
    optimizer = optax.adamw(wc.lr, weight_decay=wc.weight_decay)
    shardings = state_shardings((abstract(params), abstract_optimizer_state(optimizer, params)))
    return SFTStep(optimizer, make_sft_step(graphdef, optimizer, wc.max_response_tokens, shardings), shardings[1])


def make_sft_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, response_length: int,
                  state_shardings: tuple | None = None):
    """A jitted (params, opt_state, batch: ``SFTBatch``) -> (params, opt_state, loss) step; state buffers
    donated.

    state_shardings: the (params, opt_state) shardings its outputs keep (``sharding.state_shardings``), so that step 2 runs the program step 1 compiled (default: XLA's choice, which
    can name the same layout differently, P() for P(None,), and compile the step a second time).
    """

    def loss_fn(params, batch):
        logp = response_logprobs(nnx.merge(graphdef, params), batch.input_ids, batch.attention_mask,
                                 response_length)  # [B, R]
        mask = batch.response_mask
        return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    out_shardings = None if state_shardings is None else (*state_shardings, None)
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)


def probe_accuracy(model: Qwen, examples: Sequence[PromptExample], tokenizer, pool: RewardPool, *, reward_name: str,
                   max_new_tokens: int, stop_token_ids: Sequence[int]) -> float:
    """Mean reward of the greedy responses to ``examples``."""
    out = sampling.generate(model, [list(e.prompt_ids) for e in examples], max_new_tokens=max_new_tokens,
                            temperature=0.0, stop_token_ids=tuple(stop_token_ids))
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in out.tokens]
    return float(np.mean(pool.score(texts, [e.problem.ground_truth for e in examples], reward_name).scores))


def warm_start(model: Qwen, examples: Sequence[PromptExample], tokenizer, wc: WarmstartSpec, *,
               program: SFTStep, probe: Sequence[PromptExample], prompt_length: int, seed: int, pool: RewardPool, reward_name: str,
               probe_max_new_tokens: int, stop_token_ids: Sequence[int],
               safe_point: Callable[[], object] | None = None) -> tuple[Qwen, WarmStartResult]:
    """Up to ``wc.steps`` supervised steps on ``examples``, stopping early once the greedy accuracy on
    ``probe`` reaches ``wc.target_accuracy`` (see the module docstring); returns the updated model and
    what the phase did. The buffers of ``model`` are donated: use the returned one.

    safe_point: called before each step, on every process in the same order (see the module docstring)."""
    t0 = time.perf_counter()
    if len(examples) < wc.batch_size:
        raise ValueError(f"warmstart.batch_size={wc.batch_size}: only {len(examples)} training prompts")
    eos = tokenizer.eos_token_id
    responses = [tokenizer([wc.response.format(answer=e.problem.ground_truth)], add_special_tokens=False)["input_ids"][0]
                 + [eos]
                 for e in examples]
    graphdef, params = nnx.split(model)
    opt_state = jax.jit(program.optimizer.init, out_shardings=program.opt_shardings)(params)
    step_fn = program.step
    probe_kwargs = dict(reward_name=reward_name, max_new_tokens=probe_max_new_tokens, stop_token_ids=stop_token_ids)
    per_epoch = len(examples) // wc.batch_size
    accuracy, steps = None, 0
    bar = console.bar(range(1, wc.steps + 1), desc="warm-start", dynamic_ncols=True)
    for steps in bar:
        if safe_point is not None:
            safe_point()
        epoch, position = divmod(steps - 1, per_epoch)
        if position == 0:  # each epoch a fresh permutation of (seed, epoch): the same order on every machine
            order = np.random.default_rng([seed, epoch]).permutation(len(examples))
        rows = order[position * wc.batch_size:(position + 1) * wc.batch_size]
        host = sft_batch([examples[i] for i in rows], [responses[i] for i in rows], prompt_length,
                         wc.max_response_tokens)
        batch = jax.tree.map(lambda v: distributed.put_rows(v, batch_sharding(v.shape)), host)
        params, opt_state, loss = step_fn(params, opt_state, batch)
        if wc.target_accuracy > 0 and (steps % wc.check_every == 0 or steps == wc.steps):
            accuracy = probe_accuracy(nnx.merge(graphdef, params), probe, tokenizer, pool, **probe_kwargs)
            bar.set_postfix(loss=f"{float(loss):.3f}", probe=f"{accuracy:.3f}", refresh=False)
            if accuracy >= wc.target_accuracy:
                break
        elif steps % 10 == 0:
            bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
    bar.close()
    return nnx.merge(graphdef, params), WarmStartResult(steps, accuracy, time.perf_counter() - t0)
