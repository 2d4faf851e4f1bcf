"""A step's cost from its compiled programs (tools/plan_step.py, pacs_jax/hlo_cost.py): loops
counted by their trips against XLA's own cost analysis, and the bars of a paper config's decode step
and update compiled for a v5p-64 (compile-time facts, nothing timed)."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import hlo_cost
from test_memory_check import SHRUNK_LAYERS
from train_helpers import REPO, train_env


def _scan(unroll):
    return jax.jit(lambda x, w: jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w, unroll=unroll)[0])


def test_a_loop_counts_its_trips_and_a_loop_free_program_reads_as_xla_counts_it():
    """XLA counts a scan's body once (6 layers of [64, 256] x [256, 256] read as one); the counter
    multiplies it by its 6 trips, and on the unrolled program (no loop) agrees with XLA's FLOPs and,
    within a quarter, its bytes. A loop bounded by a device value asks for its trips."""
    x, w = jnp.ones((64, 256), jnp.float32), jnp.ones((6, 256, 256), jnp.float32)
    matmul = 2 * 64 * 256 * 256
    looped = _scan(1).lower(x, w).compile()
    assert looped.cost_analysis()["flops"] < 2 * matmul  # XLA: the body once
    assert hlo_cost.program_cost(looped.as_text()).flops == 6 * matmul
    unrolled = _scan(True).lower(x, w).compile()
    xla, ours = unrolled.cost_analysis(), hlo_cost.program_cost(unrolled.as_text())
    assert ours.flops == 6 * matmul and abs(xla["flops"] - ours.flops) / ours.flops < 0.05, (xla, ours)
    assert 0.75 < ours.bytes / xla["bytes accessed"] < 1.25, (xla["bytes accessed"], ours.bytes)

    def dynamic(x, w, n):
        return jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w[i]), x)

    text = jax.jit(dynamic).lower(x, w, 3).compile().as_text()
    with pytest.raises(ValueError, match="trip count is known only on the device"):
        hlo_cost.program_cost(text)
    cost = hlo_cost.program_cost(text, lambda loop: 4)
    assert cost.flops == 4 * matmul and [loop.depth for loop in cost.asked] == [0]
    assert not cost.unread_steps and not hlo_cost.program_cost(looped.as_text()).unread_steps


def test_a_loop_whose_counter_does_not_step_by_a_constant_is_named():
    """A loop bounded by a constant whose counter doubles (0, 1, 3, 7, ..., 127: 7 trips under 100),
    compiled for a TPU (XLA:CPU fuses the bound's compare, and the counter reads the known trip count),
    is counted as stepping by 1, an overstatement the cost names rather than hides."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from pacs_jax import topologies

    one = NamedSharding(jax.sharding.Mesh(np.array(topologies.abstract_devices("v5p-64")[:1]), ("x",)), P())
    x, w = (jax.ShapeDtypeStruct(shape, jnp.float32, sharding=one) for shape in ((64, 256), (256, 256)))
    doubling = jax.jit(lambda x, w: jax.lax.while_loop(lambda s: s[0] < 100, lambda s: (2 * s[0] + 1, jnp.tanh(s[1] @ w)),
                                                       (0, x))[1])
    cost = hlo_cost.program_cost(doubling.lower(x, w).compile().as_text())
    assert len(cost.unread_steps) == 1 and cost.flops == 100 * 2 * 64 * 256 * 256, cost


def test_a_branch_traced_under_a_skipped_scope_is_not_costed():
    """A conditional counts the costliest of the branches that run; one traced under a named scope that
    the caller says does not run is left out. The token selection names its greedy branch, its top-p
    bisection and (beside the fused GPU kernel) its logits' path (sampling/selection.py): compiled, each
    name is found on its branch, and a rollout (sampled, top_p 1) costs neither the bisection's 32
    passes nor the greedy branch."""
    x = jnp.zeros((64, 64), jnp.float32)
    big = jax.named_scope("big")(lambda x: jax.lax.fori_loop(0, 8, lambda i, c: jnp.tanh(c @ c), x))
    text = jax.jit(lambda p, x: jax.lax.cond(p, big, jnp.sin, x)).lower(True, x).compile().as_text()
    costliest, skipped = hlo_cost.program_cost(text), hlo_cost.program_cost(text, skip_scopes=frozenset({"big"}))
    assert costliest.flops == 8 * 2 * 64 ** 3 and skipped.flops == 0, (costliest, skipped)
    assert 0 < skipped.bytes < costliest.bytes / 4, (skipped, costliest)  # sin's pass, not 8 matmuls

    from pacs_jax.sampling.selection import select_tokens

    keys = jax.random.split(jax.random.key(0), 8)
    select = jax.jit(lambda logits, keys, t, p: select_tokens(logits, keys, t, p, top_k=0))
    text = select.lower(jnp.zeros((8, 4096)), keys, jnp.float32(1), jnp.float32(1)).compile().as_text()
    program = hlo_cost._Program(text, lambda loop: 1.0)
    branches = {s for c in program.comps for s in program._branch_scopes(c)}
    assert {"greedy_selection", "top_p_bisection"} <= branches, branches
    every = hlo_cost.program_cost(text)
    rollout = hlo_cost.program_cost(text, skip_scopes=frozenset({"greedy_selection", "top_p_bisection"}))
    assert rollout.bytes < every.bytes / 2, (rollout, every)  # 32 bisection passes over [8, 4096] not counted


_TWO_POOLS = """HloModule two_pools

%fused_update (param_0: bf16[1,4,64,16,128], param_1: bf16[1,4,1,16,128], param_2: s32[], param_3: bf16[1,4,64,16,128], param_4: bf16[1,4,1,16,128]) -> (bf16[1,4,64,16,128], bf16[1,4,64,16,128]) {
  %param_0 = bf16[1,4,64,16,128]{4,3,2,1,0} parameter(0)
  %param_1 = bf16[1,4,1,16,128]{4,3,2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %param_2 = s32[] parameter(2)
  %update_k = bf16[1,4,64,16,128]{4,3,2,1,0} dynamic-update-slice(%param_0, %param_1, %zero, %zero, %param_2, /*index=5*/%zero, %zero)
  %param_3 = bf16[1,4,64,16,128]{4,3,2,1,0} parameter(3)
  %param_4 = bf16[1,4,1,16,128]{4,3,2,1,0} parameter(4)
  %update_v = bf16[1,4,64,16,128]{4,3,2,1,0} dynamic-update-slice(%param_3, %param_4, %zero, %zero, %param_2, /*index=5*/%zero, %zero)
  ROOT %tuple = (bf16[1,4,64,16,128]{4,3,2,1,0}, bf16[1,4,64,16,128]{4,3,2,1,0}) tuple(%update_k, %update_v)
}

ENTRY %main (k: bf16[1,4,64,16,128], uk: bf16[1,4,1,16,128], i: s32[], v: bf16[1,4,64,16,128], uv: bf16[1,4,1,16,128]) -> (bf16[1,4,64,16,128], bf16[1,4,64,16,128]) {
  %k = bf16[1,4,64,16,128]{4,3,2,1,0} parameter(0)
  %uk = bf16[1,4,1,16,128]{4,3,2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %v = bf16[1,4,64,16,128]{4,3,2,1,0} parameter(3)
  %uv = bf16[1,4,1,16,128]{4,3,2,1,0} parameter(4)
  ROOT %fusion = (bf16[1,4,64,16,128]{4,3,2,1,0}, bf16[1,4,64,16,128]{4,3,2,1,0}) fusion(%k, %uk, %i, %v, %uv), kind=kLoop, calls=%fused_update
}
"""


def test_a_fusion_updating_two_buffers_in_place_counts_their_updates_not_the_buffers():
    """XLA:TPU's decode step writes a K and a V page into the pools in one fusion whose root is a tuple
    of two dynamic-update-slices (the refill's partial-page copy, as compiled for a v6e-64; this module
    has its shape at 64 pages): each pool is updated where it lies, so the fusion reads and writes
    the two updates (and the index), not the pools. Counted as whole buffers in and out, the 7B v6e-64
    decode step read 24.24 GB at a full pool, 20.98 counted so."""
    update = 4 * 16 * 128 * 2  # bytes of a [1, 4, 1, 16, 128] page
    # each pool: its update read, its region read and written (as a lone dynamic-update-slice counts), indices
    assert 2 * 3 * update <= hlo_cost.program_cost(_TWO_POOLS).bytes < 2 * 3 * update + 128  # a pool: 64 pages


def test_a_windowed_einsum_counts_its_two_shards_a_trip_once():
    """XLA:TPU's all-gather windowed einsum (a [4096, 3584] x [3584, 18944] bf16 matmul, the weight's
    3584 rows over fsdp 8 and its columns over tensor 4 of a v5p-64, as the 7B's projections): a loop of
    i < 4 whose counter steps by 2, two convolutions a trip each contracting 2 of the 8 weight shards.
    Counted from its start and step it is 2 trips, the matmul's FLOPs exactly; counted as i = 0, 1, 2, 3
    (the counter taken to step by 1) it was 2x."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from pacs_jax import topologies

    devices = np.array(topologies.abstract_devices("v5p-64")).reshape(1, 8, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))
    T, D, F = 32 * 1024, 3584, 18944
    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=NamedSharding(mesh, P(("data", "fsdp"), None)))
    w = jax.ShapeDtypeStruct((D, F), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", "tensor")))
    text = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P(("data", "fsdp"), "tensor"))
                   ).lower(x, w).compile().as_text()
    assert "windowed_dot_general" in text and text.count(" convolution(") == 2, "no windowed einsum to count"
    cost = hlo_cost.program_cost(text)
    assert cost.flops == 2 * T * D * F / 32 and not cost.unread_steps


def _plan_step(*args, timeout=600):
    return subprocess.run([sys.executable, "tools/plan_step.py", *args], cwd=REPO, env=train_env(),
                          capture_output=True, text=True, timeout=timeout)


# Qwen2.5-7B's heads, head size and vocabulary (the update's LM head is part of its FLOP ratio), two narrow layers
SHRUNK_7B = [*SHRUNK_LAYERS, "--config.model.vocab_size=151936", "--config.model.model_type=qwen2",
             "--config.model.num_attention_heads=8", "--config.model.num_key_value_heads=4"]


@pytest.fixture(scope="module")
def paper_7b_on_v5p_64() -> str:
    """tools/plan_step.py's output for the decode and update phases of qwen25_7b,pacs_beta1 on the 32 chips of a
    v5p-64 (its mesh, slots, page pool, packing and remat; the model shrunk as test_memory_check shrinks it): one
    run for both tests below (the phases are compiled and costed each on its own, as two runs of one phase each
    do; one run spares the second process's start and its abstract step)."""
    result = _plan_step("--config=configs/paper.py:qwen25_7b,pacs_beta1", "--topology=v5p-64", "--phases=decode,update",
                        *SHRUNK_7B, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "counter does not step by a constant" not in result.stdout, result.stdout  # every loop's trips read
    return result.stdout


@pytest.mark.slow(seconds=170)  # the module fixture's plan_step run (the decode and update phases)
def test_the_7b_paper_configs_decode_step_reads_at_most_1_3x_what_it_must(paper_7b_on_v5p_64):
    """A decode step of one queue (512 slots on a batch shard's 4 chips), every page live: its compiled
    bytes are at most 1.35x its weights' shard and the queue's page pool. A copy of the pool in the step
    (as the step lowered without donating its state made: 2 pool copies, 3.3x), or a read of a whole
    contiguous cache, fails this. (1.25x costing the greedy selection; the sampled one a rollout runs
    adds two passes over the float32 logits [512, 151936 / 4], large beside this shrunk model: 1.32x.)"""
    out = paper_7b_on_v5p_64
    bar = re.search(r"decode at a full pool: must read ([\d.]+) GB, compiled ([\d.]+) GB", out)
    assert bar, out
    must, compiled = map(float, bar.groups())
    assert 2.0 < must and compiled <= 1.35 * must, out
    carry = re.search(r"with carry-over .*: (\d+) decode steps a step against (\d+), slot fill ([\d.]+) against "
                      r"([\d.]+),", out)
    assert carry and int(carry.group(1)) < int(carry.group(2)) and float(carry.group(3)) > float(carry.group(4)), out
    # its prefills: room for 2P prompts a call, for the new batch and again for each of the 3 carried ones (the paper
    # configs' max_staleness), against a synchronous call's P (this run costs no prefill phase: no prefill
    # seconds to scale)
    assert re.search(r"^with carry-over .*: decode [\d.]+ s, prefill x8 [\d.]+ s, step", out, re.M), out


def test_the_7b_paper_configs_packed_update_computes_at_most_1_5x_its_useful_flops(paper_7b_on_v5p_64):
    """The packed update (4 mini-batches of packed passes, remat dots_with_no_batch_dims_saveable, the
    LM head in chunks) compiles to at most 1.5x the FLOPs its real tokens need (6N a token, the LM
    head a response token, causal attention; the splash kernel's attention on both sides): 1.40x
    here, on the shrunk model that the suite can compile (the full-width 7B: 1.07x, docs/plan_tables.md). This width
    makes XLA:TPU's windowed einsums too (16 loops), whose counters pass through a copy before they
    step by 2: every loop's step is read (the tool names those it cannot read: none here)."""
    out = paper_7b_on_v5p_64
    update = re.search(r"^update .* ([\d.]+) useful/compiled FLOPs$", out, re.M)
    assert update and float(update.group(1)) >= 1 / 1.5, out


def test_a_lengths_file_that_is_not_there_is_one_line_and_status_78(tmp_path):
    result = _plan_step("--topology=v5p-64", f"--lengths={tmp_path / 'metrics.jsonl'}", timeout=120)
    assert result.returncode == 78, result.stderr
    assert result.stderr.strip() == (f"plan_step: error: --lengths: {tmp_path / 'metrics.jsonl'}: no such file "
                                     "(lognormal, budget, or a run's metrics.jsonl)"), result.stderr
    assert result.stdout == ""


def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_step", REPO / "tools" / "plan_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_step"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_finished_runs_lengths_and_the_decode_steps_they_take(tmp_path):
    """A run's metrics.jsonl: the log-normal fitted to its second half's mean response length draws,
    clipped to the budget, that mean (numpy's own draws); the longest queue's decode steps, a slot
    taking the next response as its own ends (responses of 5, 3, 4 tokens, token 0 from the prefill,
    in 2 slots: 4 steps, then 2 and 3 after it: 5)."""
    import json

    import numpy as np

    tool = _tool()
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"step": i, "response_length_mean": m})
                                                      for i, m in enumerate([2000, 2000, 600, 600])) + "\n")
    median, words = tool.lengths_median(str(tmp_path / "metrics.jsonl"), 0.0, 4096)
    draws = np.minimum(np.round(np.random.default_rng(1).lognormal(np.log(median), 1.0, 400_000)), 4096)
    assert abs(draws.mean() - 600) < 6 and "mean response 600 tokens over its last 2 steps" in words
    assert tool.decode_steps(np.zeros(3), np.array([5, 3, 4]), 2, 1)[0] == 5
    assert tool.decode_steps(np.zeros(4), np.array([5, 3, 4, 9]), 2, 2)[0] == 11  # a slot each: [5, 3] 6, [4, 9] 11


def test_carry_over_keeps_the_slots_full_and_drops_what_is_too_stale():
    """The simulated steady state of carry-over: responses of equal length fill 4 slots in lockstep (2
    groups of 2 a step: 4 decode steps a step, nothing lost); a log-normal mix (budget 8x the median)
    takes the decode steps its tokens need at full slots, where today's call waits for its longest
    response; a mix of short and very long responses loses the long ones that outlive max_staleness
    steps (and none with a staleness bound above them)."""
    import numpy as np

    tool = _tool()
    assert tool.carry_over_decode_steps(np.full(10, 5), 4, 2, 2) == (4.0, 1.0, 0.0)
    rs = np.random.RandomState(0)
    lengths = np.minimum(np.maximum(np.round(rs.lognormal(np.log(64), 1.0, 2048)), 1), 512).astype(np.int64)
    steps, fill, lost = tool.carry_over_decode_steps(lengths, 64, 32, 8)
    ideal = np.mean(lengths - 1) * 32 * 8 / 64  # a step's tokens over the slots
    synchronous = tool.decode_steps(np.zeros(256), lengths[:256], 64, 1)[0]
    assert abs(steps / ideal - 1) < 0.1 and fill > 0.99 and steps < 0.8 * synchronous
    # a step lasts ~400 decode steps: a 511-token response admitted late in one may outlive the next
    assert 0 < lost < 0.1 and tool.carry_over_decode_steps(lengths, 64, 32, 8, max_staleness=2)[2] < lost / 4
    mix = np.array([2] * 30 + [400])
    assert tool.carry_over_decode_steps(mix, 4, 4, 1, max_staleness=1)[2] > 0.01
    assert tool.carry_over_decode_steps(mix, 4, 4, 1, max_staleness=1000)[2] == 0.0


def test_each_paper_configs_max_staleness_drops_nothing_its_plan_sees():
    """Each paper config of docs/plan_tables.md with --config.rollout.carry_over=True alone: at its
    rollout.max_staleness, plan_step's simulated steady state of its queues (one a batch shard of its slice, their
    slots and groups as ``decode_phase`` takes them) on plan_step's default lengths (log-normal, median 512,
    clipped to 4096) drops no decoded token; max_staleness 1 dropped 17-31 % of them, the longest responses."""
    from pacs_jax.sampling.engine import queues
    from pacs_jax.topologies import get_topology
    from pacs_jax.training.spec import RunSpec
    from train_helpers import load_config

    tool = _tool()  # puts tools/ on the path
    from plan_packing import response_lengths
    from plan_tables import ALGORITHM, ROWS

    lengths = np.maximum(response_lengths(8192, np.random.RandomState(0), 512, 4096), 1)
    for model, topology in ROWS:
        config = load_config("paper.py", f"{model},{ALGORITHM}")
        config.rollout.carry_over = True
        spec = RunSpec.unplaced(config).on_devices(get_topology(topology).num_devices)
        prompts, slots = spec.train.prompts_per_step, spec.sampler_slots
        shards = queues(prompts, slots, spec.rollout_batch_shards)
        dropped = tool.carry_over_decode_steps(lengths, slots // shards, prompts // shards, spec.rollout.n,
                                               max_staleness=spec.rollout.max_staleness)[2]
        assert dropped == 0, (model, spec.rollout.max_staleness, dropped)


def _phase(tool, name: str, trips: float, seconds_a_trip: float, **fields):
    """A plan_step Phase of ``trips`` trips, each ``seconds_a_trip`` bound by HBM at 1 GB/s (nothing else)."""
    return tool.Phase(name, trips, 0.0, seconds_a_trip * 1e9, 0.0, **fields)


def test_the_run_line_counts_carry_overs_step_with_its_dropped_tokens_and_names_the_peak_memory():
    """plan_step's report of a decode of 4000 steps (4 s), a prefill of 0.5 s and an update of 10 s (14.5 s),
    whose carry-over drops 30 % of its decoded tokens in 2000 steps at max_staleness 1 and none in 1600 at 3:
    configured at 1 with rollout.carry_over, a call prefills 2 regions (1 s), so a step takes 14.5 - 4.5 + 2 +
    1 = 13 s, 0.6 s of it decoding the tokens dropped; the line names the staleness that drops none, and the
    run's hours and chip-hours (300 steps on 32 chips) are those of that 13 s step, beside the fullest program's
    memory against the chip's HBM."""
    import dataclasses
    import types

    from pacs_jax.training.memory_check import GiB, ProgramMemory
    from pacs_jax.training.spec import RunSpec
    from train_helpers import load_config

    tool = _tool()
    config = load_config("paper.py", "qwen25_7b,pacs_beta1")
    config.rollout.update(carry_over=True, max_staleness=1)
    spec = RunSpec.unplaced(config)
    plans = {1: (2000.0, 1.0, 0.3), 2: (1800.0, 1.0, 0.1), 3: (1600.0, 1.0, 0.0)}
    phases = [_phase(tool, "prefill", 1, 0.5), _phase(tool, "decode", 4000, 1e-3, carry_over=(plans, 0.4)),
              _phase(tool, "update", 4, 2.5)]
    topo = types.SimpleNamespace(bf16_flops=1e15, hbm_bandwidth=1e9, ici_bandwidth=1e9, device_kind="TPU v5",
                                 hbm_bytes=95 * GiB)
    memory = [ProgramMemory(name, "", 0, 0, 0, 0, peak=int(peak * GiB), outside=int(GiB), compile_seconds=1.0)
              for name, peak in (("sampler", 45.0), ("pi_old", 3.0), ("update", 20.0))]
    lines = tool.report(phases, topo, spec, 32, memory, ("assemble", "rollout_correction")).splitlines()
    assert next(line for line in lines if line.startswith("step: 14.5 s predicted (")).endswith(
        "the decode a synchronous call's: carry-over's step below); at 100 % of every bound 14.5 s: ratio 1.000")
    carry = next(line for line in lines if line.startswith("with carry-over"))
    assert ("2000 decode steps a step against 4000, slot fill 1.00 against 0.40, 30.0% of decoded tokens dropped as "
            "stale: decode 2.00 s, prefill x2 1.00 s, step 13.0 s predicted against 14.5 s (0.60 s of it decoding the "
            "dropped tokens); run 1.1 h, 35 chip-hours") in carry, carry
    # at 3: decode 1.6 s, 4 regions prefilled (2 s): 14.5 - 4.5 + 3.6
    assert carry.endswith("max_staleness 3: 1600 decode steps, 0.0% dropped, step 13.6 s; set rollout.max_staleness=3 "
                          "to drop none"), carry
    assert lines[-1] == ("run: 300 steps, 1.1 h, 35 chip-hours on 32 TPU v5 chips, at carry-over's step of 13.0 s (the "
                         "dropped tokens' decode counted); peak per device 46.00 GiB of 95.00 GiB (fits): sampler, the "
                         "fullest of sampler, pi_old, update (the phases planned; not compiled here: assemble, "
                         "rollout_correction; tools/plan_memory.py compiles every program of the step)"), lines[-1]
    # the learner's phases alone: carry-over's engine state, resident between calls, is not in their figures
    assert tool.report(phases, topo, spec, 32, memory[1:], ("sampler",)).splitlines()[-1].endswith(
        "peak per device 21.00 GiB of 95.00 GiB (fits): update, the fullest of pi_old, update (the phases planned; "
        "not compiled here: sampler; carry-over's engine state, resident between calls, not counted without the "
        "sampler's phases (prefill and decode); tools/plan_memory.py compiles every program of the step)")
    synchronous = dataclasses.replace(spec, rollout=dataclasses.replace(spec.rollout, carry_over=False))
    assert tool.report(phases, topo, synchronous, 32).splitlines()[-1] == ("run: 300 steps, 1.2 h, 39 chip-hours on 32 "
                                                                           "TPU v5 chips")


def test_one_step_off_takes_the_split_that_balances_the_engine_and_the_learner():
    """A decode of 3 s whose queues' tail does not shrink (the same trips on 4, 6 or 2 of 8 chips) and a
    learner of 3 s: 2 chips to the engine (3 s), the learner 4 s on 6; without a learner phase there is
    no split to make."""
    import types

    tool = _tool()
    topo = types.SimpleNamespace(ici_bandwidth=0.0)

    def phase(name, seconds, **fields):
        return types.SimpleNamespace(name=name, seconds=lambda topo: seconds, trips=100.0, weights=1e9,
                                     split_trips=fields.get("split_trips", {}))

    decode = phase("decode", 3.0, split_trips={2: 100.0, 4: 100.0, 6: 100.0})
    line = tool.one_step_off([decode, phase("update", 3.0)], topo, 8)
    assert "best mesh.rollout_devices=2 of 8: step 4.0 s (engine 3.0 s + weights 0.00 s, learner 4.0 s) against " \
           "6.0 s synchronous" in line, line
    assert tool.one_step_off([decode], topo, 8) == ""


def test_one_step_off_takes_only_a_split_the_config_accepts():
    """The 7B paper config on v5p-64 (mesh 8 fsdp x 4 tensor, micro-batches of 32 responses): its mesh as it
    is fits no split of the 32 chips (the learner's 8 x 4 needs them all); with mesh.fsdp filling the
    learner's chips, only 16 for the engine leaves a learner whose batch shards (4) divide a micro-batch (24
    chips' 6 do not). The split plan_step names is one of those; with carry-over on, the same, carry-over off."""
    import types

    from pacs_jax.training.spec import RunSpec
    from train_helpers import load_config

    tool = _tool()
    spec = RunSpec.unplaced(load_config("paper.py", "qwen25_7b,pacs_beta1"))
    needs = {r: tool.split_overrides(spec, r, 32) for r in (4, 8, 12, 16, 20, 24, 28)}
    assert needs == {4: None, 8: None, 12: None, 16: "mesh.data=1 mesh.fsdp=-1", 20: None, 24: None, 28: None}
    topo = types.SimpleNamespace(ici_bandwidth=0.0)
    phase = lambda name, s, split=None: types.SimpleNamespace(  # noqa: E731
        name=name, seconds=lambda topo: s, trips=100.0, weights=1e9, split_trips=split or {})
    decode = phase("decode", 3.0, {8: 100.0, 16: 100.0, 24: 100.0})
    line = tool.one_step_off([decode, phase("update", 3.0)], topo, 32, lambda r: needs.get(r))
    assert "best mesh.rollout_devices=16 of 32" in line and "with mesh.data=1 mesh.fsdp=-1" in line, line
    assert "refuses mesh.rollout_devices in [8, 24]" in line, line
    assert "no split" in tool.one_step_off([decode, phase("update", 3.0)], topo, 32, lambda r: None)
    # one step off does not combine with carry-over: with it on, the split needs it off too
    config = load_config("paper.py", "qwen25_7b,pacs_beta1")
    config.rollout.carry_over = True
    carry_over = RunSpec.unplaced(config)
    assert tool.split_overrides(carry_over, 16, 32) == "rollout.carry_over=False mesh.data=1 mesh.fsdp=-1"
    assert tool.split_overrides(carry_over, 8, 32) is None
