"""The learner's part of a step's rollout (docs/design.md section 3): the update batch of the engine's
collected rows (training/records.py ``Collected``), with the learner's programs
(training/learner/learner_programs.py):

    pi_old   one jitted program per (prompt bucket, response bucket): assemble [B, P + R] rows on the
             device and compute pi_old and the entropy at the rollout temperature (logits / T, as
             verl) of one micro-batch of rows, dispatched once a micro-batch (training/learner/old_policy.py);
             packed (``train.packing``): the rows are the largest buckets' and every pass runs on its
             packed rows (one program per pass, rl/packing.py; pi_old's dispatched once a packed pass):
             each process plans the packing of every pass from every row's prompt and response lengths
             (host arrays all processes hold: no collective)
    ref      ``algorithm.use_kl_loss``: the reference model's log-probs of the response tokens, pi_old's
             program on the reference's weights (LoRA: the learner's with the adapters off; else the frozen
             copy RL started from, ``RolloutBatcher.hold_reference``: training/learner/kl_reference.py)
    checks   the sampler's log-probs against pi_old (training/learner/rollout_consistency.py) and the
             rollout correction's weights (training/learner/rollout_correction_step.py)
    batch    the rewards put back into a global array; the step's metrics computed from all rows
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from pacs_jax import distributed
from pacs_jax.models import lora
from pacs_jax.rewards import score_metrics
from pacs_jax.rl.packing import PackedPlanArrays
from pacs_jax.rl.update_batch import UpdateBatch
from pacs_jax.sharding import batch_sharding
from pacs_jax.training.learner import rollout_consistency
from pacs_jax.training.learner.learner_programs import LearnerPrograms
from pacs_jax.training.passes import Passes
from pacs_jax.training.progress import StepWatch, dispatches_done
from pacs_jax.training.records import CallRows, Collected, Rollout, SampledRows, Scores


@dataclasses.dataclass
class OldPolicy:
    """pi_old's passes on a step's rows, dispatched (``RolloutBatcher.dispatch``): the update
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
        sampled, calls=tuple(CallRows(*(None if x is None else move(x) for x in c)) for c in sampled.calls),
        prompt_tokens=move(sampled.prompt_tokens), prompt_mask=move(sampled.prompt_mask),
        tokens=move(sampled.tokens), response_mask=move(sampled.response_mask),
        routing=None if sampled.routing is None else move(sampled.routing))


def packing_metrics(tokens_real: int, tokens_computed: int) -> dict[str, float]:
    """A step's ``tokens_real`` (the prompt and response tokens of its sequences, once per pass:
    pi_old and the update, PPO's values and critic update), ``tokens_computed`` (the rows x length the
    device ran in those passes, padded or packed) and ``packing_efficiency`` (real / computed)."""
    return {"tokens_real": float(tokens_real), "tokens_computed": float(tokens_computed),
            "packing_efficiency": tokens_real / max(tokens_computed, 1)}


def wait_old_policy(dispatched: OldPolicy, watch: StepWatch, *, bypass: bool, max_logprob_diff: float,
                    started: bool = False) -> tuple[dict[str, float], float]:
    """Wait for pi_old (phase "pi_old", unless ``started``; ``bypass`` mode: the update batch of the sampler's
    log-probs, no pass) and check the sampler against it (``rollout.max_logprob_diff``): (the comparison's
    and the correction's metrics, the phase's seconds)."""
    if not started:
        watch.start("pi_old")
    t0 = time.perf_counter()
    if bypass:
        pending, detail = dispatched.batch.old_logp, lambda: "the sampler's log-probs as pi_old (bypass mode, no pass)"
    else:
        pending, detail = dispatched.entropy_means, lambda: dispatches_done(dispatched.entropy_means, "passes")
    watch.wait((pending, dispatched.mismatch), detail)
    mismatch = {k: float(v) for k, v in dispatched.mismatch.items()}  # replicated scalars
    if mismatch:
        rollout_consistency.check(mismatch, max_logprob_diff)
    seconds = time.perf_counter() - t0
    watch.done()
    return mismatch, seconds


class RolloutBatcher:
    """Makes a step's update batch of the engine's rows with the learner's programs ``learner``: pi_old's
    passes, the rollout checks and correction, the rewards, and the step's rollout metrics. n: responses a
    prompt; split: the engine's rows come from a mesh of their own (moved to the learner's first)."""

    def __init__(self, learner: LearnerPrograms, *, n: int, max_logprob_diff: float = 0.0, split: bool = False):
        self.learner, self.n, self.max_logprob_diff, self.split = learner, n, max_logprob_diff, split
        self.reference: nnx.State | None = None  # the KL loss's frozen reference copy (``hold_reference``)

    def hold_reference(self, reference: nnx.State | None) -> None:
        """The KL loss's reference weights for the run (full fine-tuning: the frozen copy RL started from;
        with LoRA, whose reference is the learner's weights with the adapters off, the copy of the modules it
        trains whole, or None when it trains none)."""
        self.reference = reference

    def _reference_logprobs(self, state: nnx.State, args: list, replay: jax.Array | None, **packed) -> jax.Array:
        """The KL loss's reference log-probs of the rows [B, R]: pi_old's program (``packed``: its packing plan
        and passes) on the reference's weights. Under R3 it runs on the sampler's routing record ``replay`` as
        pi_old and the update do, so that the KL measures the weights' change, not a routing the policy's passes
        never took, and pi_old's compiled program serves it. verl 0.9.1 does so with LoRA (its reference in the
        actor, ``ref_in_actor``, is ``compute_log_prob``, which replays); its reference worker of a full
        fine-tuning run does not (``compute_ref_log_prob``: routing replay off), ours does (docs/design.md 4.8)."""
        learner = self.learner
        if learner.trainable.adapters_only:
            reference = lora.switched_off(state, self.reference)
        elif self.reference is None:
            raise ValueError("algorithm.use_kl_loss without LoRA: the run holds no reference (hold_reference)")
        else:
            reference = self.reference
        batch, _ = learner.pi_old(reference, *args, replay=replay, **packed)
        return batch.old_logp

    def _put(self, x: np.ndarray) -> jax.Array:
        """A host array of the global shape -> a global array on the learner's mesh, sharded over the batch
        axes (each process copies only the rows its devices hold)."""
        return distributed.put_rows(x, batch_sharding(x.shape, self.learner.mesh))

    def old_policy(self, state: nnx.State, sampled: SampledRows) -> tuple[UpdateBatch, list[jax.Array], dict,
                                                                          dict]:
        """Dispatch pi_old's passes on a ``sample`` result (asynchronous): (update batch without
        rewards, the mean entropy of the responses after each pass (the last: all of them; none in bypass
        mode: no pass measures it), the passes' packing plans on the device (by pass, as
        ``LearnerPrograms.packing_plans``; None when padded), the packing metrics)."""
        learner = self.learner
        args = [sampled.prompt_tokens, sampled.prompt_mask, sampled.tokens, sampled.response_mask]
        B, W = args[2].shape[0], args[0].shape[1] + args[2].shape[1]
        real = int(np.sum(sampled.prompt_lengths) + np.sum(sampled.lengths))
        passes = 2 if learner.critic is None else 4  # pi_old and the update (PPO: the critic's values and update)
        reference_pass = int(learner.kl_loss is not None)  # the KL loss's reference log-probs: pi_old's program again
        bypass = learner.sampler_as_old_policy is not None  # the sampler's log-probs as pi_old: no pass, no entropy
        if bypass:
            batch, entropy = learner.sampler_as_old_policy(sampled.sampler_logprobs, *args), []
            passes -= 1
        # R3: the sampler's routing record, which pi_old runs on; else None (a record measured without replay stays
        # a measurement: pi_old routes as its routers choose)
        replay = sampled.routing if learner.replays_sampler else None
        if not learner.packing:
            if not bypass:
                batch, entropy = learner.pi_old(state, *args, replay=replay)
            if learner.kl_loss is not None:
                batch = batch.replace(ref_logp=self._reference_logprobs(state, args, replay))
            passes += reference_pass
            return batch, entropy, None, packing_metrics(passes * real, passes * B * W)
        plans = learner.packing_plans(sampled.prompt_lengths, sampled.lengths)
        on_device = plans.map(lambda plan: jax.tree.map(self._put, plan.arrays()))
        (logprob_passes,) = plans.logprob.passes  # one mini-batch: the whole batch
        if not bypass:
            batch, entropy = learner.pi_old(state, *args, on_device.logprob, passes=logprob_passes, replay=replay)
        if learner.kl_loss is not None:
            batch = batch.replace(ref_logp=self._reference_logprobs(state, args, replay, packing=on_device.logprob,
                                                                    passes=logprob_passes))
        batch = batch.replace(packing=on_device.update)
        computed = plans.logprob.tokens_computed * ((passes - bypass) // 2 + reference_pass) + plans.update.tokens_computed
        passes += reference_pass
        if plans.critic is not None:
            computed += plans.critic.tokens_computed
        return batch, entropy, on_device, packing_metrics(passes * real, computed)

    def finish(self, state: nnx.State, collected: Collected, watch: StepWatch) -> Rollout:
        """The learner's part of a step on ``collect``'s rows: they move to the learner's mesh (when the
        engine has its own), pi_old runs with the learner's weights ``state``, the rollout checks and the
        correction after it, and the update batch is made."""
        sampled = to_mesh(collected.sampled, self.learner.mesh) if self.split else collected.sampled
        watch.start("pi_old")
        dispatched = self.dispatch(state, sampled)
        mismatch, seconds = self.wait(dispatched, watch, started=True)
        times = dataclasses.replace(collected.times, old_logprob=seconds)
        return self.rollout(sampled, collected.scores, dispatched, mismatch, {**collected.metrics, **times.metrics()})

    def dispatch(self, state: nnx.State, sampled: SampledRows) -> OldPolicy:
        """Dispatch pi_old's passes on ``sampled``, the sampler / pi_old comparison and the rollout
        correction (asynchronous)."""
        batch, entropy_means, packing, packing_stats = self.old_policy(state, sampled)
        learner = self.learner
        mismatch = ({} if learner.bypass is not None else  # bypass: no pi_old to compare with
                    learner.rollout_consistency(sampled.sampler_logprobs, batch.old_logp, batch.response_mask))
        if learner.routing_consistency is not None:  # the sampler's experts against pi_old's own
            mismatch = {**mismatch, **learner.routing_consistency(sampled.routing, batch.routing, batch.response_mask)}
        if learner.replays_sampler:  # R3: the update replays the sampler's experts
            batch = batch.replace(routing=sampled.routing)
        elif not learner.update_replays:  # measured only: the update routes as its routers choose
            batch = batch.replace(routing=None)
        correction = {}
        if learner.rollout_correction is not None:  # verl's weights and rejection mask (docs/design.md 6.7)
            weights, response_mask, correction = learner.rollout_correction(sampled.sampler_logprobs, batch.old_logp,
                                                                            batch.response_mask)
            batch = batch.replace(rollout_is_weights=weights, response_mask=response_mask)
        return OldPolicy(batch, entropy_means, packing, packing_stats, {**mismatch, **correction})

    def wait(self, dispatched: OldPolicy, watch: StepWatch, started: bool = False) -> tuple[dict[str, float], float]:
        """``wait_old_policy`` on ``dispatch``'s passes."""
        return wait_old_policy(dispatched, watch, bypass=self.learner.bypass is not None,
                               max_logprob_diff=self.max_logprob_diff, started=started)

    def rollout(self, sampled: SampledRows, scores: Scores, dispatched: OldPolicy, mismatch: dict[str, float],
                 extra: dict[str, float]) -> Rollout:
        """The step's ``Rollout``: the update batch with the rewards, and the step's metrics (``extra``:
        the sampler's own and the phases' seconds)."""
        batch = dispatched.batch.replace(rewards=self._put(scores.rewards))
        rewards, lengths = scores.rewards, sampled.lengths
        reward_metrics = score_metrics(rewards, scores.statuses, restarts=scores.restarts, seconds=scores.seconds)
        reward_metrics["deadline_retried"] = float(scores.deadline_retried)
        per_prompt = rewards.reshape(-1, self.n)
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
            **mismatch,  # the sampler's log-probs against pi_old (training/learner/rollout_consistency.py)
            "generated_tokens": float(lengths.sum()),
            "decode_steps": float(sampled.decode_steps),  # of the step's sampler calls, summed
            "slot_utilisation": sampled.slot_utilisation,  # decoded tokens / slot steps
            # identifies the sampled tokens (resume and multi-process tests compare it across runs)
            "sampled_tokens_checksum": float(np.sum(scores.checksums.astype(np.int64))),
            **{f"reward_{k}": v for k, v in reward_metrics.items()},
            **extra,
        }
        return Rollout(batch, rewards, metrics, dispatched.packing)
