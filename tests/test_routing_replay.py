"""Routing replay (``train.router_replay``, models/moe.py): a Qwen3-MoE run on given experts equals transformers'
``Qwen3MoeForCausalLM`` in float64 with its routers made to choose them; the sampler records the experts of every
token (static, continuous and paged) as the learner recomputes them, and a sampler with a noisy router is replayed
(R3) with the routing metrics showing the difference; pi_old's passes (padded and packed) record the experts its
router chose, and the update's loss on replayed experts equals a float64 statement of PACS on transformers'
log-probs with them (R2); routing replay where it cannot serve is refused naming the field."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pacs_jax import checkpoints, rl, sampling
from pacs_jax.sampling import carry_over
from pacs_jax.errors import PERMANENT_ERROR_STATUS
from pacs_jax.models import kernels
from pacs_jax.models.moe import routing_dtype, routing_shape
from pacs_jax.rl import packing
from pacs_jax.rl.loss_and_grad import loss_and_grad_fn
from pacs_jax.sampling.settings import SamplingSettings
from pacs_jax.sharding import make_mesh
from pacs_jax.training.engine.sampler_programs import call_routing
from pacs_jax.training.learner.old_policy import old_policy_passes, update_rows
from pacs_jax.training.learner.rollout_consistency import consistency_program, routing_consistency_program
from qwen_reference import hf_logits, max_rel_err, padded_batch, save_random_hf_model
from pacs_jax.rewards import RewardPool
from pacs_jax.training import compilations
from pacs_jax.training.config_check import ConfigError, check_inputs
from pacs_jax.training.records import PromptBatch
from pacs_jax.training.rollout import RolloutCollector, carry_over_source
from pacs_jax.training.spec import RunSpec
from pacs_jax.training.step_programs import StepPrograms
from test_configs import _parse
from test_dynamic_sampling import _parity as parity_answer
from test_rl_pacs import ref_pacs
from test_train_config import load_config
from train_helpers import REPO, RL_ONLY_FLAGS, ListPromptSource, tiny_model_on_mesh, train_env

P, N_SAMPLES, TP, R = 2, 2, 5, 6  # prompts, samples a prompt, prompt and response widths


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers' model in float64, ours in float32) of one random Qwen3-MoE (8 experts, 2 a token, 2 layers)."""
    path = tmp_path_factory.mktemp("moe") / "hf"
    hf = save_random_hf_model("qwen3_moe", path, seed=7)
    hf.config._experts_implementation = "eager"  # its expert loop: the grouped-mm kernel has no float64
    return hf.double().eval(), checkpoints.from_pretrained(path, dtype="float32")


def _hf_on_experts(hf, tokens, mask, routed) -> np.ndarray:
    """transformers' logits [B, T, V] (float64) with every layer's router choosing ``routed`` [B, T, L, k]: its
    gate's softmax read at those experts, renormalised (norm_topk_prob), in place of its top k."""
    flat = torch.from_numpy(np.asarray(routed, np.int64).reshape(-1, *routed.shape[2:]))  # [B T, L, k]

    def gate_on(layer, gate):
        def forward(hidden):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            weights = torch.softmax(logits, dim=-1).gather(1, flat[:, layer])
            return logits, weights / weights.sum(-1, keepdim=True), flat[:, layer]
        return forward

    gates = [layer.mlp.gate for layer in hf.model.layers]
    try:
        for i, gate in enumerate(gates):
            gate.forward = gate_on(i, gate)
        return hf_logits(hf, tokens, mask)
    finally:
        for gate in gates:
            del gate.forward


def _other_experts(routing: np.ndarray, num_experts: int, seed: int) -> np.ndarray:
    """Another valid routing of the same shape [..., k]: k distinct experts a token, differing from ``routing``."""
    rng = np.random.default_rng(seed)
    flat = routing.reshape(-1, routing.shape[-1])
    out = np.stack([rng.permutation(num_experts)[:flat.shape[1]] for _ in range(len(flat))])
    same = np.all(np.sort(out, -1) == np.sort(flat, -1), -1)
    out[same] = (out[same] + 1) % num_experts
    return out.reshape(routing.shape).astype(routing.dtype)


def test_replaying_the_models_own_experts_changes_nothing_and_others_compute_as_transformers(models):
    hf, ours = models
    tokens, mask = padded_batch(ours.cfg.vocab_size, [9, 4, 7], 9, "left", seed=3)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    logits, own = ours(tokens, attention_mask=mask, with_routing=True)
    assert own.shape == (3, 9, ours.cfg.num_hidden_layers, ours.cfg.num_experts_per_tok)
    np.testing.assert_array_equal(np.asarray(ours(tokens, attention_mask=mask, routed=own)), np.asarray(logits))
    other = _other_experts(np.asarray(own), ours.cfg.num_experts, seed=0)
    replayed = np.asarray(ours(tokens, attention_mask=mask, routed=jnp.asarray(other)))
    assert max_rel_err(replayed, hf_logits(hf, np.asarray(tokens), np.asarray(mask)), np.asarray(mask)) > 1e-2
    assert max_rel_err(replayed, _hf_on_experts(hf, np.asarray(tokens), np.asarray(mask), other),
                       np.asarray(mask)) < 1e-4


def _fed(mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[B, TP + R] bool: the update rows' tokens a sampler fed through the model (real, but each row's last)."""
    fed = np.asarray(mask, bool).copy()
    rows = np.flatnonzero(np.asarray(lengths) > 0)
    fed[rows, TP + np.asarray(lengths)[rows] - 1] = False
    return fed


@pytest.fixture(scope="module")
def plain_sample(models):
    """The static sampler's rows of ``_rollout``'s prompts without the record (key 0): the tokens every sampler
    samples, recording or not (on a CPU the samplers' tokens are the same: tests/test_sampling_continuous.py)."""
    _, ours = models
    prompts, prompt_mask, *_ = _rollout(ours.cfg.vocab_size)
    settings = SamplingSettings(max_new_tokens=R, n=N_SAMPLES, temperature=1.0)
    return sampling.sample(*nnx.split(ours), prompts, prompt_mask, settings, jax.random.key(0))


@pytest.mark.parametrize("sampler", [dict(), dict(slots=4, tail_slots=2), dict(slots=4, page_size=4)],
                         ids=["static", "continuous-narrowing", "paged"])
def test_the_sampler_records_the_experts_the_learner_recomputes_for_every_token(models, plain_sample, sampler):
    """R3's record: the prefill's experts of every prompt token and each decode step's of the token it fed, in the
    update rows' layout, equal pi_old's router's at every token the sampler fed (the same weights, float32); the
    tokens are those of the static sampler without the record (one program for the three cases: a record that
    moved one sampler's tokens differs from it)."""
    _, ours = models
    graphdef, params = nnx.split(ours)
    prompts, prompt_mask, *_ = _rollout(ours.cfg.vocab_size)
    settings = SamplingSettings(max_new_tokens=R, n=N_SAMPLES, temperature=1.0, record_routing=True, **sampler)
    out = sampling.sample(graphdef, params, prompts, prompt_mask, settings, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain_sample.tokens))
    assert plain_sample.routing is None and out.routing.dtype == np.uint8
    record = call_routing(out.prompt_routing, out.routing, TP)
    ids, mask = update_rows(prompts, prompt_mask, out.tokens, out.response_mask)
    _, own = ours(ids, attention_mask=mask, with_routing=True)
    fed = _fed(np.asarray(mask), np.asarray(out.lengths))
    np.testing.assert_array_equal(np.sort(np.asarray(record), -1)[fed], np.sort(np.asarray(own), -1)[fed])


def test_on_a_mesh_each_batch_shards_queue_records_its_rows_in_the_calls_order(models):
    """Four queues (one a batch shard of a 2x2x1 mesh) over prompts spread around a batch-padding one: the records
    come back in the call's prompt and row order, equal to the learner's routing at every fed token of the real
    rows (the padding prompt's rows hold none)."""
    _, ours = models
    graphdef, params = nnx.split(ours)
    prompts, prompt_mask = padded_batch(ours.cfg.vocab_size, [5, 3, 4, 2], TP, "left", seed=13)
    prompt_mask[2] = 0  # batch padding: its samples come back empty
    settings = SamplingSettings(max_new_tokens=R, n=N_SAMPLES, temperature=1.0, slots=8, page_size=4,
                                record_routing=True)
    mesh = make_mesh(2, 2, 1, devices=jax.devices()[:4])
    kernels._CHOSEN.clear()  # the record keeps a process's first of each choice: this call's alone
    with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))  # replicated (the model is tiny)
        out = sampling.sample(graphdef, params, jnp.asarray(prompts), jnp.asarray(prompt_mask), settings,
                              jax.random.key(2))
        record = np.asarray(call_routing(out.prompt_routing, out.routing, TP))
        tokens, response_mask, lengths = (np.asarray(a) for a in (out.tokens, out.response_mask, out.lengths))
    ids, mask = update_rows(jnp.asarray(prompts), jnp.asarray(prompt_mask), jnp.asarray(tokens),
                            jnp.asarray(response_mask))
    _, own = ours(ids, attention_mask=mask, with_routing=True)
    fed = _fed(np.asarray(mask), lengths)
    real = np.repeat(prompt_mask.any(1), N_SAMPLES)
    assert fed[real].sum() > 20 and not fed[~real].any()
    np.testing.assert_array_equal(np.sort(record, -1)[fed], np.sort(np.asarray(own), -1)[fed])
    # each queue's layers sort its own tokens, and the kernels line says so (not "one sort", the single device's)
    assert "moe dispatch: per batch shard (its queue's)" in [str(c) for c in kernels.chosen()]


def test_the_sampler_holds_every_expert_whole_with_expert_parallel():
    """model.expert_parallel splits the learner's experts over fsdp; the sampler's decode layout holds every expert on
    every device, so its prefill and decode dispatch without the split (``seam.sampling_model``: the kernels line
    names none, where the split would have gathered every fsdp pair's tokens for nothing)."""
    mesh, model = tiny_model_on_mesh(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=16, expert_parallel=True)
    graphdef, params = nnx.split(model)
    prompts, prompt_mask = padded_batch(96, [5, 3, 4, 2], TP, "left", seed=14)
    kernels._CHOSEN.clear()
    with jax.set_mesh(mesh):
        out = sampling.sample(graphdef, params, jnp.asarray(prompts), jnp.asarray(prompt_mask),
                              SamplingSettings(max_new_tokens=R, n=N_SAMPLES, temperature=1.0), jax.random.key(4))
    dispatch = [str(c) for c in kernels.chosen() if c.op == "moe dispatch"]
    assert int(np.asarray(out.lengths).sum()) > 0 and dispatch, dispatch
    assert not any("experts over" in c for c in dispatch), dispatch


def test_a_sampler_with_a_noisy_router_is_replayed_and_the_metrics_show_the_difference_it_removes(models):
    """A sampler whose routers are perturbed routes other experts; pi_old's own router differs from its record on
    many tokens (``routing_mismatch_tokens``), and running pi_old on the record (R3) brings its log-probs
    closer to the sampler's than its own routing does (``rollout_kl``)."""
    _, ours = models
    cfg = ours.cfg
    graphdef, params = nnx.split(ours)
    noisy = jax.tree.map(lambda x: x, params)
    router = noisy["layers"]["mlp"]["router_kernel"]
    scale = float(jnp.std(router.get_value()))
    router.set_value(router.get_value() + scale * jax.random.normal(jax.random.key(1), router.get_value().shape))
    prompts, prompt_mask, *_ = _rollout(cfg.vocab_size)
    settings = SamplingSettings(max_new_tokens=R, n=N_SAMPLES, temperature=1.0, record_routing=True)
    out = sampling.sample(graphdef, noisy, prompts, prompt_mask, settings, jax.random.key(0))
    record = call_routing(out.prompt_routing, out.routing, TP)
    passes = old_policy_passes(graphdef, temperature=1.0, num_micro_batches=1,
                               routing=(*routing_shape(cfg), routing_dtype(cfg.num_experts)))
    with jax.set_mesh(make_mesh(1, 1, 1, devices=jax.devices()[:1])):
        own, _ = passes(params, prompts, prompt_mask, out.tokens, out.response_mask)
        replayed, _ = passes(params, prompts, prompt_mask, out.tokens, out.response_mask, replay=record)
        routing = {name: float(v) for name, v in routing_consistency_program()(record, own.routing,
                                                                                own.response_mask).items()}
        logp = (out.logprobs,)
        kl_own, kl_replayed = (float(consistency_program()(logp, b.old_logp, b.response_mask)["rollout_kl"])
                               for b in (own, replayed))
    print(f"noisy sampler router: routing_mismatch_tokens {routing['routing_mismatch_tokens']:.3f}, decisions "
          f"{routing['routing_mismatch_decisions']:.3f}; rollout_kl without replay {kl_own:.3g}, with {kl_replayed:.3g}")
    # the record is the router's own choice, replay or not: the first layer's, whose input replay does not reach
    np.testing.assert_array_equal(np.asarray(replayed.routing)[:, :, 0], np.asarray(own.routing)[:, :, 0])
    assert 0.1 < routing["routing_mismatch_tokens"] <= 1 and 0 < routing["routing_mismatch_decisions"] \
        <= routing["routing_mismatch_tokens"]
    assert kl_replayed < kl_own / 2, (kl_replayed, kl_own)


def _rollout(vocab_size: int):
    """A step's rows: prompts [P, TP] left-padded, responses [P n, R] right-padded, their masks, rewards [P n]."""
    prompts, prompt_mask = padded_batch(vocab_size, [5, 3], TP, "left", seed=11)
    responses, response_mask = padded_batch(vocab_size, [6, 2, 4, 5], R, "right", seed=12)
    return (*(jnp.asarray(a) for a in (prompts, prompt_mask, responses, response_mask)),
            np.array([1.0, 0.0, 0.0, 1.0], np.float32))


def _packing_plan(prompt_mask, response_mask):
    plan = packing.plan_packing(np.asarray(prompt_mask).sum(1).repeat(N_SAMPLES), np.asarray(response_mask).sum(1),
                                prompt_width=TP, response_width=R, packed_length=TP + R, mini_batches=1, passes=4,
                                unit=N_SAMPLES, shards=1, rows=2)
    return jax.tree.map(jnp.asarray, plan.arrays()), int(plan.passes[0])


def test_pi_old_records_its_routers_experts_and_the_update_on_replayed_experts_is_float64_pacs(models):
    """pi_old's passes (2 padded micro-batches; a packed plan) write each row's experts where the rows are; the
    update's loss on another routing is PACS (float64 NumPy) of transformers' float64 log-probs with that routing,
    and its gradient reaches the router (the gate weights are the learner's own)."""
    hf, ours = models
    cfg = ours.cfg
    graphdef, params = nnx.split(ours)
    prompts, prompt_mask, responses, response_mask, rewards = _rollout(cfg.vocab_size)
    record = (*routing_shape(cfg), routing_dtype(cfg.num_experts))
    with jax.set_mesh(make_mesh(1, 1, 1, devices=jax.devices()[:1])):
        padded, _ = old_policy_passes(graphdef, temperature=1.0, num_micro_batches=2, routing=record)(
            params, prompts, prompt_mask, responses, response_mask)
        plan, passes = _packing_plan(prompt_mask, response_mask)
        packed, _ = old_policy_passes(graphdef, temperature=1.0, num_micro_batches=1, routing=record)(
            params, prompts, prompt_mask, responses, response_mask, plan, passes=passes)
        ids, mask = update_rows(prompts, prompt_mask, responses, response_mask)
        _, own = ours(ids, attention_mask=mask, with_routing=True)
        real = np.asarray(mask, bool)
        assert padded.routing.dtype == np.uint8 and padded.routing.shape == (*ids.shape, *record[:2])
        np.testing.assert_array_equal(np.asarray(padded.routing), np.asarray(own))
        np.testing.assert_array_equal(np.asarray(packed.routing)[real], np.asarray(own)[real])

        other = _other_experts(np.asarray(padded.routing), cfg.num_experts, seed=1)
        batch = padded.replace(rewards=jnp.asarray(rewards), routing=jnp.asarray(other))
        loss, _, grads = jax.jit(loss_and_grad_fn(graphdef, "pacs", group_size=N_SAMPLES))(params, batch)

    logits = _hf_on_experts(hf, np.asarray(ids), np.asarray(mask), other)[:, :-1]  # float64, [B, TP + R - 1, V]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, np.asarray(ids)[:, 1:, None], axis=-1)[:, TP - 1:, 0]  # [B, R]
    want, _, _ = ref_pacs(picked, np.asarray(batch.old_logp, np.float64), np.asarray(response_mask), rewards, N_SAMPLES)
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
    assert np.abs(np.asarray(grads["layers"]["mlp"]["router_kernel"].get_value())).max() > 0


def test_dynamic_sampling_carries_each_kept_rows_record_to_the_update():
    """R3 with DAPO's dynamic sampling on a 2x2x2 mesh: the step's kept groups come from several gen batches, and
    the update batch's routing is each kept row's own record (the learner's routing at every fed token: the
    same float32 weights), as the metric says."""
    mesh, model = tiny_model_on_mesh(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=16)
    config = load_config("default.py")
    config.rollout.update(n=N_SAMPLES, max_new_tokens=R, temperature=1.0)
    config.data.max_prompt_length, config.data.prompt_buckets = 16, (8, 16)
    config.train.update(prompts_per_step=4, logprob_micro_batches=1, packing=False, router_replay="R3")
    config.algorithm.filter_groups.update(enable=True, max_num_gen_batches=20)
    rs = np.random.RandomState(0)
    batches = iter([PromptBatch([list(rs.randint(2, 96, size=rs.randint(3, 16))) for _ in range(4)], ["7"] * 4,
                                [f"batch {b}"] * 4) for b in range(20)])
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        graphdef, params = nnx.split(model)
        spec = RunSpec.unplaced(config)
        collector = RolloutCollector.from_spec(spec, StepPrograms(spec, graphdef, params, (1,)), decode=parity_answer,
                                               reward_pool=pool)
        rollout = collector(params, lambda: next(batches), jax.random.key(11))
        _, own = model(rollout.batch.input_ids, attention_mask=rollout.batch.attention_mask, with_routing=True)
        batch, own = jax.tree.map(np.asarray, (rollout.batch, own))
    assert rollout.metrics["num_gen_batches"] >= 2 and rollout.metrics["routing_mismatch_tokens"] == 0
    lengths = batch.response_mask.sum(1).astype(int)
    fed = np.asarray(batch.attention_mask, bool).copy()
    fed[np.arange(len(lengths)), batch.input_ids.shape[1] - batch.response_mask.shape[1] + lengths - 1] = False
    np.testing.assert_array_equal(np.sort(batch.routing, -1)[fed], np.sort(own, -1)[fed])


def _spied_rollout(mode: str, monkeypatch, *, kl: bool = False, adapters: bool = False):
    """One step's rollout of a tiny mixture of experts on the 2x2x2 mesh with ``train.router_replay`` ``mode`` (the KL
    loss on with ``kl``; LoRA on its q_proj and experts with ``adapters``, else a frozen reference copy for the KL),
    pi_old's passes spied: (mesh, model, rollout, its batch on the host, the record each pass got to run on)."""
    from pacs_jax.models import lora

    mesh, model = tiny_model_on_mesh(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=16)
    config = load_config("default.py")
    config.rollout.update(n=N_SAMPLES, max_new_tokens=R, temperature=1.0)
    config.data.max_prompt_length, config.data.prompt_buckets = 16, (8, 16)
    config.train.update(prompts_per_step=4, logprob_micro_batches=1, packing=False, router_replay=mode)
    config.algorithm.update(use_kl_loss=kl, kl_loss_coef=0.01)
    if adapters:
        config.model.update(lora_rank=2, lora_alpha=4.0, target_parameters="gate_up_proj,down_proj")
    rs = np.random.RandomState(1)
    prompts = PromptBatch([list(rs.randint(2, 96, size=rs.randint(3, 16))) for _ in range(4)], ["7"] * 4, ["b"] * 4)
    replays = []
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        if adapters:
            model = lora.attach(model, rank=2, alpha=4.0, targets=("q_proj", "mlp.experts.gate_up_proj",
                                                                 "mlp.experts.down_proj"))
        graphdef, params = nnx.split(model)
        spec = RunSpec.unplaced(config)
        programs = StepPrograms(spec, graphdef, params, (1,))
        passes = type(programs.learner.pi_old)
        calls = passes.__call__

        def spy(self, *args, replay=None, **kwargs):
            replays.append(replay)
            return calls(self, *args, replay=replay, **kwargs)

        monkeypatch.setattr(passes, "__call__", spy)
        collector = RolloutCollector.from_spec(spec, programs, decode=parity_answer, reward_pool=pool)
        if kl and not adapters:
            collector.batcher.hold_reference(params)
        rollout = collector(params, lambda: prompts, jax.random.key(3))
        batch = jax.tree.map(np.asarray, rollout.batch)
    return mesh, model, rollout, batch, replays


@pytest.mark.parametrize("mode", ["disabled", "R2"])
def test_without_replaying_the_samplers_record_pi_old_routes_as_its_routers_choose(mode, monkeypatch):
    """``train.router_replay`` disabled (the sampler's record only measured) or R2 (the update replays pi_old's own
    choice): the sampler's record is measured against pi_old's routers, and pi_old's passes get no record to run on,
    their log-probs are the model's own routing's; the update batch holds pi_old's record (R2) or none (disabled). (A stop-74 bug ran pi_old on the sampler's record in the
    disabled mode, R3's pi_old, in a program the warm-up had not compiled.)"""
    mesh, model, rollout, batch, replays = _spied_rollout(mode, monkeypatch)
    with jax.set_mesh(mesh):
        want = np.asarray(rl.logprobs_of_pass(model, batch.input_ids, batch.attention_mask, R,
                                              np.zeros(batch.response_mask.shape, np.float32), 0))
    assert replays == [None]  # one pass, on no record
    assert "routing_mismatch_tokens" in rollout.metrics  # the sampler's record measured, not replayed
    np.testing.assert_allclose(batch.old_logp * batch.response_mask, want * batch.response_mask, rtol=1e-5,
                               atol=1e-6)
    assert (batch.routing is None) == (mode == "disabled")


@pytest.mark.parametrize("mode, adapters", [("R3", True), ("R3", False), ("R2", True)])
def test_the_kl_references_pass_replays_the_samplers_experts_as_pi_old_does(mode, adapters, monkeypatch):
    """With the KL loss on, its reference log-probs are pi_old's program again (LoRA's reference: the adapters off;
    full fine-tuning's: the frozen copy RL started from). Under R3 that pass runs on the sampler's record as pi_old
    does (the KL then measures the weights' change, not a routing the policy's passes never took; verl 0.9.1's
    ``ref_in_actor`` replays too), and on R2 or without replay it routes as its routers choose: the passes' records,
    spied, and the first step's KL, which is 0 where both routes agree (B = 0, or the copy itself)."""
    *_, batch, replays = _spied_rollout(mode, monkeypatch, kl=True, adapters=adapters)
    assert len(replays) == 2  # pi_old, then the reference
    if mode == "R3":
        assert replays[0] is not None and replays[1] is replays[0]
    else:
        assert replays == [None, None]
    np.testing.assert_array_equal(batch.ref_logp * batch.response_mask, batch.old_logp * batch.response_mask)


MOE_FLAGS = ("--config.model.model_type=qwen3_moe", "--config.model.num_experts=4",
             "--config.model.num_experts_per_tok=2", "--config.model.moe_intermediate_size=64")


def _refusal(flags: tuple[str, ...]) -> str:
    """The trainer's one line for the shrunk demo with ``flags``: its config parsed as the CLI parses it and
    checked as it checks it before the workdir exists (``check_inputs``)."""
    with pytest.raises(ConfigError) as error:
        check_inputs(_parse(f"--config={REPO / 'configs' / 'default.py'}", *RL_ONLY_FLAGS, *flags))
    return str(error.value)


def test_routing_replay_on_a_dense_model_is_refused_before_anything_is_written(tmp_path):
    """The trainer CLI on a dense model with R3: one line naming the field, status 78, no workdir (the other
    refusals below are the same check before the workdir, run in-process)."""
    workdir = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "pacs_jax.train", *RL_ONLY_FLAGS, "--config.train.router_replay=R3",
                          f"--workdir={workdir}"], capture_output=True, text=True, timeout=300, env=train_env())
    assert run.returncode == PERMANENT_ERROR_STATUS, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert "train.router_replay" in last and "has none" in last, run.stderr[-2000:]
    assert last.endswith(f": error: {_refusal(('--config.train.router_replay=R3',))}")  # the in-process check's
    assert not workdir.exists()


def test_carry_over_records_the_experts_the_learner_recomputes_through_carried_and_resumed_rows(models):
    """Carry-over's engine with the record on (R3): 2 prompts a call, the oldest group returned, its rows' budgets 3
    tokens and the other's 6, so the other's rows run on into the next call; after call 0 the rows in flight
    (3 tokens, 2 of them fed) are exported and a fresh engine resumes them (their K/V, and their record, recomputed
    by the reseat). Every returned group's record, in the update rows' layout, equals
    pi_old's router's at every token the sampler fed (the same float32 weights in every call). Rows that ended
    before an export have no record to resume with: refused."""
    _, ours = models
    graphdef, params = nnx.split(ours)
    settings = SamplingSettings(max_new_tokens=R, n=N_SAMPLES, temperature=1.0, slots=4, page_size=4, chunk_steps=1,
                                record_routing=True)
    make = lambda: carry_over.CarryOverSampler(graphdef, settings, prompts=P, prompt_length=TP, groups=1,
                                               max_staleness=3, order="admission")  # the oldest group first: none dropped
    batches = [padded_batch(ours.cfg.vocab_size, lengths, TP, "left", seed=20 + v)
               for v, lengths in enumerate([[5, 3], [4, 2], [2, 5]])]
    batches += [(np.zeros((P, TP), np.int32),) * 2] * 4  # batch padding: the engine drains
    sampler, returned, carried, resumed = make(), [], 0, None
    for v, (tokens, mask) in enumerate(batches):
        out = sampler.step(params, v, tokens, mask, jax.random.key(v), np.array([3, 3, R, R], np.int32))
        carried += int(out.carried_rows)
        for k in np.flatnonzero(np.asarray(out.group_valid)):
            rows = slice(k * N_SAMPLES, (k + 1) * N_SAMPLES)
            prompt = int(out.group_prompt[k])
            prompts = batches[int(out.group_version[k])]
            returned.append(tuple(np.asarray(a) for a in (
                prompts[0][prompt:prompt + 1], prompts[1][prompt:prompt + 1], out.tokens[rows], out.lengths[rows],
                call_routing(out.prompt_routing[k:k + 1], out.routing[rows], TP))))
        if v == 0:
            resumed = sampler.export()
            sampler = make()
            sampler.resume(params, resumed, [batches[g] for g in resumed.generations])
    assert len(returned) == 6 and carried > 0 and resumed.running == 2 and resumed.tokens == 6
    # rows that fed tokens and held no slot (ended before the export) would come back without a record: refused
    unseated = resumed._replace(slots=np.full_like(resumed.slots, -1))
    with pytest.raises(ValueError, match="ended before the export and holds no routing record"):
        make().resume(params, unseated, [batches[g] for g in unseated.generations])
    assert returned[0][4].dtype == np.uint8
    for prompts, prompt_mask, tokens, lengths, record in returned:
        response_mask = (np.arange(R)[None, :] < lengths[:, None]).astype(np.int32)
        ids, mask = update_rows(jnp.asarray(prompts), jnp.asarray(prompt_mask), jnp.asarray(tokens),
                                jnp.asarray(response_mask))
        _, own = ours(ids, attention_mask=mask, with_routing=True)
        fed = _fed(np.asarray(mask), lengths)
        np.testing.assert_array_equal(np.sort(record, -1)[fed], np.sort(np.asarray(own), -1)[fed])


def test_carry_over_with_r3_trains_each_rows_own_record():
    """R3 with carry-over on a 2x2x2 mesh (its queues one a batch shard), 3 steps of one set of weights: rows run
    across the engine's calls, and each step's update batch holds each returned row's record, the learner's routing
    at every fed token (float32: the metric says 0); the steps after the first compile nothing. A checkpoint's state
    queues the prompts in flight again rather than keep rows without a record."""
    mesh, model = tiny_model_on_mesh(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=16)
    config = load_config("default.py")
    config.rollout.update(n=N_SAMPLES, max_new_tokens=R, temperature=1.0, carry_over=True, slots=8,
                          response_buckets=(R,))
    config.data.max_prompt_length, config.data.prompt_buckets = 16, (16,)  # one bucket: every step's programs alike
    config.train.update(prompts_per_step=4, logprob_micro_batches=1, packing=False, router_replay="R3")
    rs = np.random.RandomState(0)
    batches = [PromptBatch([list(rs.randint(2, 96, size=rs.randint(3, 16))) for _ in range(4)], ["7"] * 4,
                           [f"batch {b}"] * 4) for b in range(8)]
    carried = 0
    with jax.set_mesh(mesh), RewardPool(1) as pool:
        graphdef, params = nnx.split(model)
        spec = RunSpec.unplaced(config)
        programs = StepPrograms(spec, graphdef, params, (1,))
        carry = carry_over_source(programs, ListPromptSource(batches), 4)
        collector = RolloutCollector.from_spec(spec, programs, decode=parity_answer, reward_pool=pool, carry=carry)
        for step in range(3):
            with compilations.built() as events:
                rollout = collector(params, carry.next_batch, jax.random.key(step))
            assert not step or not events, (step, events)  # the record's programs too: the first step's serve
            _, own = model(rollout.batch.input_ids, attention_mask=rollout.batch.attention_mask, with_routing=True)
            batch, own = jax.tree.map(np.asarray, (rollout.batch, own))
            carried += rollout.metrics["carried_rows"]
            assert rollout.metrics["routing_mismatch_tokens"] == 0, step
            lengths = batch.response_mask.sum(1).astype(int)
            fed = np.asarray(batch.attention_mask, bool).copy()
            fed[np.arange(len(lengths)), batch.input_ids.shape[1] - batch.response_mask.shape[1] + lengths - 1] = False
            np.testing.assert_array_equal(np.sort(batch.routing, -1)[fed], np.sort(own, -1)[fed], err_msg=str(step))
    assert carried > 0
    # a checkpoint keeps no rows in flight under R3 (an export holds no record): their prompts are queued first
    in_flight = sum(map(len, carry.live.values()))
    state = carry.get_state()
    assert in_flight > 0 and state["in_flight"] is None and len(state["queued"]) == in_flight + len(carry.queued)


@pytest.mark.parametrize("flags, says", [
    (("--config.train.router_replay=R1",), "'disabled'"),
    ((*MOE_FLAGS, "--config.train.router_replay=R2", "--config.algorithm.rollout_correction.bypass_mode=True",
      "--config.rollout.max_logprob_diff=0"), "bypass mode"),
])
def test_routing_replay_where_it_cannot_serve_is_refused_naming_the_field(flags, says):
    """A name not a mode, pi_old skipped by bypass mode: the trainer's check before its workdir (the CLI's one
    line, status 78: the dense model's case above) names the field."""
    line = _refusal(flags)
    assert line.startswith("config.train.router_replay") and says in line, line


@pytest.mark.parametrize("flags, says", [
    (("--config.train.router_aux_loss_coef=0.01",), "the model (qwen3) has none; set it to 0"),
    ((*MOE_FLAGS, "--config.train.router_aux_loss_coef=-1.0"), "must be a number >= 0"),
])
def test_a_load_balancing_loss_it_cannot_serve_is_refused_naming_the_field(flags, says):
    """train.router_aux_loss_coef on a dense model, or below 0: the trainer's check before its workdir names it."""
    line = _refusal(flags)
    assert line.startswith("config.train.router_aux_loss_coef") and says in line, line
