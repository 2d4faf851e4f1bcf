"""How long does a training step take on a slice, and which bound holds it? Compile, don't run.

    python tools/plan_step.py --config=configs/paper.py:qwen25_7b,pacs_beta1 --topology=v5p-64
    python tools/plan_step.py --config=... --topology=v6e-64 --lengths=/runs/pacs_7b/metrics.jsonl
    python tools/plan_step.py --config=... --topology=h200x1 --lengths=budget

Compiles ahead of time, for ``--topology``'s compile-only devices (pacs_jax/topologies.py: TPU
slices need libtpu, GPU nodes JAX's CUDA plugin), the programs of a step as the trainer makes them
(training/abstract_step.py, the machinery of tools/plan_memory.py): the sampler's prefill, one decode step of
one queue alone (sampling/engine.py ``lower_decode_step``, on the "tensor" devices of one batch
shard, as the sampler's ``shard_map`` runs it), pi_old, the update and PPO's critic programs. Each
program's per-device cost is read from its compiled HLO with every loop counted as many times as it
runs (pacs_jax/hlo_cost.py: XLA's own ``cost_analysis`` counts a loop body once): the layer scans
and micro-batch loops from the program, the loops only the device can count from a simulated step:

    decode   the longest queue's decode steps: the step's responses decoded by ``rollout.slots``
             slots, a queue a batch shard, each slot taking the next waiting response as one ends
             (every step costed at the full width: the tail's narrowed steps read the same weights
             and fewer pages, so they are overstated by a little)
    prefill  what the sampler runs before its decode loops (engine.py ``lower_prefill``: the decode
             layout, the prompts' prefill, the page pool), once a sampler call
    pi_old / update / critic   the packed passes of the trainer's plan (rl/packing.py) for these
             lengths, and the LM head's chunks of each pass; the updates' program is one
             mini-batch's, run ``train.mini_batches`` times, pi_old's one pass's, run once a pass

The step's response lengths (``--lengths``): ``lognormal`` (default: tools/plan_packing.py's
log-normal, median ``--median`` or max_new_tokens / 8, sigma 1, clipped to the budget), ``budget``
(every response runs to max_new_tokens, as random weights do), or a finished run's
``metrics.jsonl`` (the log-normal whose clipped mean is the run's mean ``response_length_mean``
over its second half). Prompts: DeepScaleR problems from data/ in the Qwen chat template.

Per phase it prints FLOPs, bytes and collective bytes per trip (per device), the trips, the time of
a trip at each peak (FLOPs / bf16 peak, bytes / HBM bandwidth, collective bytes / interconnect
bandwidth: ``Topology`` peaks), the bound (the largest), the phase's seconds, and its ratio:

    pi_old, update, critic   useful / compiled FLOPs: 2N (pi_old) or 6N (update) FLOPs per real
                             token, N the layers' matmul parameters, the LM head per response
                             token, causal attention per sequence (the MFU convention), against the
                             compiled FLOPs (what remat, padding and the LM head's chunks add;
                             XLA counts no FLOPs in a kernel: where attention runs in one, its
                             useful FLOPs are added to the compiled ones)
    decode                   bytes a step must read (the weights' shard in the compute dtype,
                             the embedding table only if the LM head is tied to it, of a MoE
                             layer's experts the share the step's tokens route to, uniformly:
                             ``experts_touched``, and the queue's page pool, full) / compiled
                             bytes accessed

For the decode step it also prints what the compiled step launches (``hlo.program_profile``: fusions,
library kernels, copies, each times the known trips around it) and how many of its layers' weights
it copies to buffers of their own (``hlo.weight_copies``; on a GPU, where the decode layout holds
them a buffer a layer (sampling/engine.py), none: a layer scan's slices of the stacked weights were
copied out by XLA:GPU for its gemms, 196 a step for the 1.5B; tools/plan_memory.py counts them
inside the sampler's decode loops), then the step: predicted seconds (the phases'
sum; the host's reward scoring, overlapped with pi_old, is not counted), the same step with carry-over
(issue 50: a call ends once the step has its groups and unfinished rows continue in the next; its
decode steps from a simulated steady state of the same lengths, ``carry_over_decode_steps``, each
costed as a full-width step, the steps of rows later dropped as stale among them; its prefills 2
(max_staleness + 1) times the synchronous call's: room for 2P prompts a call, prefilled for the new
batch and again for each carried one) at the configured ``rollout.max_staleness`` with its run's hours
and chip-hours, at each smaller one and on to the first that drops nothing (``carry_over_plans``),
naming it when the configured one drops some; one step off at its best split of the slice
(``one_step_off``: from these phases, not compiled per split), at 100 % of every bound / predicted;
and last the run's (``train.steps``) hours and chip-hours at the step the config runs (synchronous,
or with ``rollout.carry_over`` carry-over's) and the peak memory a device against the chip's HBM: the
fullest of the trainer's programs of the phases planned (training/memory_check.py's figures: the sampler's
program, compiled for it when both the prefill and the decode are planned, pi_old's, the update's, PPO's
critic's; the learner's phases are costed from that same compile). It covers only those: the line names the
step's other programs, which are not compiled here (the weights' move, assemble, rollout_consistency,
rollout_correction, ... as the config has them), and says when carry-over's engine state, resident between
calls, is not counted (the sampler's phases not planned: its size comes from the sampler's compile);
tools/plan_memory.py compiles every one, as the trainer's check does. Every time assumes a program runs at
its bound's peak: a lower bound on the real time.

A bad input (topology, lengths file, config) is one line naming it and exit status 78; 2 when the
topology's compiler is not installed.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import pathlib
import sys
from collections.abc import Callable

REPO = pathlib.Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import numpy as np  # noqa: E402

from pacs_jax.errors import PermanentError  # noqa: E402


class LengthsError(PermanentError, ValueError):
    """--lengths names nothing usable (status 78)."""


# ------------------------------------------------------------------------------------------ lengths
def fitted_median(mean: float, budget: int, rs_seed: int = 0) -> float:
    """The median of a log-normal (sigma 1) whose responses, clipped to ``budget``, average ``mean``."""
    base = np.random.RandomState(rs_seed).lognormal(0.0, 1.0, 20000)
    lo, hi = 1e-3, float(budget)
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if np.minimum(np.round(base * mid), budget).mean() < mean else (lo, mid)
    return math.sqrt(lo * hi)


def lengths_median(spec: str, median: float, budget: int) -> tuple[float | None, str]:
    """(median of the responses' log-normal, or None for every response at ``budget``; in words)."""
    if spec == "budget":
        return None, f"every response {budget} tokens (random weights run to the budget)"
    if spec == "lognormal":
        median = median or budget / 8
        return median, f"log-normal, median {median:.0f}, sigma 1, clipped to {budget}"
    path = pathlib.Path(spec)
    if not path.is_file():
        raise LengthsError(f"--lengths: {spec}: no such file (lognormal, budget, or a run's metrics.jsonl)")
    means = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError:
            raise LengthsError(f"--lengths: {spec}: line {number} is not JSON") from None
        if "response_length_mean" in record:
            means.append(float(record["response_length_mean"]))
    if not means:
        raise LengthsError(f"--lengths: {spec}: no step with response_length_mean")
    mean = float(np.mean(means[len(means) // 2:]))
    median = fitted_median(mean, budget)
    return median, (f"log-normal fitted to {spec} (mean response {mean:.0f} tokens over its last "
                    f"{len(means) - len(means) // 2} steps): median {median:.0f}, sigma 1, clipped to {budget}")


def experts_touched(tokens: int, experts: int, per_token: int) -> float:
    """The expected share of a mixture-of-experts layer's ``experts`` that a decode step of ``tokens`` tokens
    routes to, each token to ``per_token`` distinct experts drawn uniformly: 1 - (1 - k / E) ** tokens. The step
    must read only those experts' weights; routing less even than uniform touches fewer, so this is the most."""
    return 1.0 - (1.0 - per_token / experts) ** tokens


def decode_steps(prompts: np.ndarray, lengths: np.ndarray, slots: int, queues: int) -> tuple[int, float]:
    """(decode steps of the longest of ``queues`` queues, the K/V tokens its steps read on average).

    Each queue decodes its share of the responses (``lengths`` [Q] tokens, token 0 from the prefill;
    ``prompts`` [Q] their prompts' tokens) in order with ``slots // queues`` slots, a slot taking the
    next response in the step its own ends; a step reads, for every busy row, its prompt's and its
    response's K/V so far."""
    longest, reads = 0, 0.0
    for p, share in zip(np.array_split(np.asarray(prompts, np.int64), queues),
                        np.array_split(np.maximum(np.asarray(lengths, np.int64) - 1, 0), queues)):
        ends = [0] * min(slots // queues, len(share))
        for need in share:
            heapq.heapreplace(ends, ends[0] + int(need))
        steps = max(ends, default=0)
        if steps >= longest:
            longest = steps
            reads = float(np.sum(share * p + share * (share + 1) / 2)) / max(steps, 1)
    return longest, reads


def carry_over_decode_steps(lengths: np.ndarray, slots: int, groups: int, n: int, *, max_staleness: int = 1,
                            steps: int = 24, seed: int = 0) -> tuple[float, float, float]:
    """With carry-over (issue 50: a call ends once the step has its ``groups`` complete groups; rows still
    running continue in the next step's call), one queue of ``slots`` slots in its steady state: (decode
    steps a training step, on average; the slots' fill: busy slot-steps / slot-steps; the fraction of
    decoded tokens dropped for staleness).

    Groups of n responses, their lengths (token 0 from the prefill) drawn from ``lengths`` [Q], are
    admitted in order as slots free; a step ends in the decode step its ``groups``-th complete group
    ends and takes the oldest complete groups; a group still unfinished when a step ends with
    ``max_staleness`` steps since its admission is dropped (its slots freed, its tokens lost). The
    first third of ``steps`` simulated training steps warm the queue up and are not counted."""
    rs = np.random.RandomState(seed)
    need = np.maximum(np.asarray(lengths, np.int64) - 1, 0)
    running: list[tuple[int, int]] = []  # (end step, group) of the busy slots
    waiting: list[int] = []  # groups whose rows wait for a slot (one entry a row)
    left, admitted_at, started = {}, {}, {}  # group -> rows not done, version admitted; row starts
    complete: list[int] = []
    now, version, group_id = 0, 0, 0
    ends, busy, lost = [], 0, 0
    while version < steps:
        while len(running) < slots:  # fill the free slots, admitting groups as needed
            if not waiting:
                waiting, left[group_id], admitted_at[group_id] = [group_id] * n, n, version
                group_id += 1
            g = waiting.pop(0)
            length = int(rs.choice(need))
            heapq.heappush(running, (now + length, g))
            started.setdefault(g, []).append((now, length))
        end, g = heapq.heappop(running)
        busy += (end - now) * (len(running) + 1)
        now = end
        left[g] -= 1
        if left[g] == 0:
            complete.append(g)
        if len(complete) >= groups:  # the step ends: the oldest complete groups are trained
            del complete[:groups]
            version += 1
            ends.append((now, busy, sum(min(now, s + l) - s for g2 in started for s, l in started[g2]), lost))
            stale = {g2 for _, g2 in running if version - admitted_at[g2] > max_staleness}
            for g2 in stale:
                lost += sum(min(now, s + l) - s for s, l in started[g2])
            running = [(e, g2) for e, g2 in running if g2 not in stale]
            heapq.heapify(running)
            waiting = [g2 for g2 in waiting if g2 not in stale]
    first = steps // 3
    (t0, b0, d0, l0), (t1, b1, d1, l1) = ends[first], ends[-1]
    return (t1 - t0) / (steps - 1 - first), (b1 - b0) / max((t1 - t0) * slots, 1), (l1 - l0) / max(d1 - d0, 1)


STALENESS_SEARCH = 8  # the plan tries max_staleness up to this many above the configured one for one dropping nothing


def carry_over_plans(lengths: np.ndarray, slots: int, groups: int, n: int, staleness: int) -> dict[int, tuple]:
    """``carry_over_decode_steps``' (trips, slot fill, share dropped) by max_staleness: from 1 (0 when that is
    the configured ``staleness``) up to ``staleness``, then on until one drops nothing (at most
    ``STALENESS_SEARCH`` above it)."""
    plans = {}
    for s in range(min(staleness, 1), staleness + STALENESS_SEARCH + 1):
        plans[s] = carry_over_decode_steps(lengths, slots, groups, n, max_staleness=s)
        if s >= staleness and plans[s][2] == 0:
            break
    return plans


# ------------------------------------------------------------------------------------------ costs
@dataclasses.dataclass
class Phase:
    """A phase's per-device cost, per trip, with its trips; ``useful``: the FLOPs (or for decode the
    bytes) the work needs per trip, for the ratio."""

    name: str
    trips: float
    flops: float
    bytes: float
    collective_bytes: float
    useful: float = 0.0
    useful_kind: str = ""  # "flops" or "bytes"
    xla_seconds: float | None = None  # XLA's optimal_seconds of the program (its loop bodies once)
    full_pool: tuple[float, float] | None = None  # decode, every page live: (bytes it must read, compiled bytes)
    carry_over: tuple[dict, float] | None = None  # decode: (carry_over_plans: {max_staleness: (trips, slot fill,
    #                                               share of decoded tokens dropped as stale)}, today's fill)
    weights: float = 0.0  # decode: the bytes of the weights a sampler device holds (the decode layout)
    split_trips: dict[int, float] = dataclasses.field(default_factory=dict)  # decode: {engine chips: its trips}

    def times(self, topo) -> dict[str, float]:
        return {"flops": self.flops / topo.bf16_flops, "HBM": self.bytes / topo.hbm_bandwidth,
                "interconnect": self.collective_bytes / topo.ici_bandwidth}

    def seconds(self, topo) -> float:
        return self.trips * max(self.times(topo).values())

    def bound(self, topo) -> str:
        times = self.times(topo)
        return max(times, key=times.get)

    def ratio(self) -> float | None:
        if not self.useful:
            return None
        return self.useful / (self.flops if self.useful_kind == "flops" else self.bytes)

    def ideal_seconds(self, topo) -> float:
        """At 100 % of the bound, doing only the useful work."""
        if not self.useful:
            return self.seconds(topo)
        rate = topo.bf16_flops if self.useful_kind == "flops" else topo.hbm_bandwidth
        return self.trips * self.useful / rate


def matmul_parameters(cfg) -> tuple[int, int]:
    """(the layers' matmul parameters, the LM head's) of a QwenConfig."""
    D, F, H, K, Dh = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return cfg.num_hidden_layers * (D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F), D * cfg.vocab_size


def useful_flops(cfg, prompts: np.ndarray, responses: np.ndarray, passes: int) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) of ``passes`` (1 forward, 3 forward + backward) over the
    sequences: 2N per token and the LM head per response token; causal attention 2 H Dh s (s + 1) per
    layer and sequence of s tokens."""
    layers, head = matmul_parameters(cfg)
    s = (prompts + responses).astype(np.float64)
    attention = 2 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers * np.sum(s * (s + 1))
    return passes * (2 * layers * s.sum() + 2 * head * responses.sum()), passes * attention


# custom calls of attention kernels (Pallas on TPU / Triton, cuDNN): XLA counts no FLOPs in them
_KERNELS = tuple(f'custom_call_target="{t}' for t in ("tpu_custom_call", "__gpu$xla.gpu.triton", "__cudnn$fmha"))


def trips_from_plan(plan, chunk: int) -> Callable:
    """A packed program's device-counted loops: a loop holding loops runs a mini-batch's passes (their
    mean), an innermost one the LM head's chunks of a pass (their mean over the passes)."""
    passes = sum(plan.passes) / len(plan.passes)
    lengths = np.asarray(plan.stream_length)[:, 0]
    chunks = float(np.mean(np.ceil(lengths[lengths > 0] / chunk))) if np.any(lengths > 0) else 0.0
    return lambda loop: passes if loop.holds_loops else chunks


def say_unread_steps(cost, log) -> None:
    """A line naming the loops whose counter's step ``cost`` (hlo_cost.Cost) could not read, if any."""
    if cost.unread_steps:
        log(f"  {len(cost.unread_steps)} loops whose counter does not step by a constant, counted as stepping by 1 "
            f"(their trips may be overstated): {', '.join(cost.unread_steps)}")


def compiled_cost(compiled, trips: Callable, log) -> tuple:
    """(hlo_cost.Cost, XLA's optimal_seconds or None) of a compiled program; a line naming the loops whose
    trips it could not read."""
    from pacs_jax import hlo_cost

    xla = compiled.cost_analysis() or {}
    if isinstance(xla, list):
        xla = xla[0] if xla else {}
    cost = hlo_cost.program_cost(compiled.as_text(), trips)
    say_unread_steps(cost, log)
    return cost, xla.get("optimal_seconds")


def compile_cost(lowered, trips: Callable, log) -> tuple:
    """(hlo_cost.Cost, XLA's optimal_seconds or None, the compiled program) of a lowered program."""
    import time

    t0 = time.perf_counter()
    compiled = lowered.compile()
    log(f"  compiled in {time.perf_counter() - t0:.0f} s")
    return (*compiled_cost(compiled, trips, log), compiled)


def decode_phase(spec, devices, step, prompts: np.ndarray, lengths: np.ndarray, log) -> Phase:
    """One decode step of one queue compiled alone on a batch shard's "tensor" devices (its state
    donated, as the decode loop carries it), its trips the longest queue's steps. The paged
    kernel is handed the whole page pool of every layer and reads, per layer, the pages of its busy
    rows: counted as the pool's share of one layer (``kernel_reads``) at the step's mean fill. The
    refill's loop over the rows a step admits runs the mean admissions a step; of a conditional's
    branches the costliest that a rollout runs (the sampled selection; the top-p bisection only with
    top_p < 1)."""
    import jax

    from pacs_jax import hlo, hlo_cost
    from pacs_jax.sampling.engine import decode_layer_weights, lower_decode_step, queues
    from pacs_jax.sampling.paged import default_pages
    from pacs_jax.training.abstract_step import abstract_step
    from pacs_jax.training.model_spec import model_config

    P = spec.train.prompts_per_step // spec.rollout.micro_batches
    shards = queues(P, step.sampler.slots, step.sampler.batch_shards)
    tensor = len(devices) // step.sampler.batch_shards
    sub = spec
    if shards > 1:  # one batch shard's chips: a mesh of its "tensor" devices
        sub = dataclasses.replace(spec, mesh=dataclasses.replace(spec.mesh, data=1, fsdp=1, tensor=tensor, device_order=()),
                                  devices=tensor)
    settings = dataclasses.replace(step.sampler.settings, slots=step.sampler.slots // shards, tail_slots=None)
    cfg = model_config(spec)
    steps, reads = decode_steps(prompts, lengths, step.sampler.slots, shards)
    admitted = len(lengths) / shards / max(steps, 1)  # rows a queue's step admits, on average: the refill's loop

    def trips(loop):
        return admitted

    # a batch shard's chips: the first ``tensor`` device ids (a v6e slice lists its devices in another order,
    # and libtpu compiles for ids 0 .. tensor - 1 only)
    queue_devices = sorted(devices, key=lambda d: d.id)[:tensor] if shards > 1 else devices
    with abstract_step(sub, queue_devices, log=lambda s: None) as queue_step:
        rows = queue_step.sampler.abstract_rows((P // shards, step.sampler.prompt_buckets[-1]), np.int32)
        log(f"compiling a decode step of one queue ({settings.slots} slots, {P // shards} prompts) ...")
        lowered = lower_decode_step(queue_step.sampler.graphdef, queue_step.sampler.params, rows, rows, settings)
        layer_weights = decode_layer_weights(queue_step.sampler.graphdef, queue_step.sampler.params)
        _, xla, compiled = compile_cost(lowered, trips, log)
    text = compiled.as_text()
    shardings = jax.tree_util.tree_flatten_with_path(compiled.input_shardings[0], is_leaf=lambda x: x is None)[0]
    sizes = {jax.tree_util.keystr(path): (s, a) for (path, s), a in zip(shardings, jax.tree.leaves(lowered.args_info[0]))
             if s is not None}  # the arguments the step reads

    def per_device(paths) -> int:
        return sum(math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize for s, a in (sizes[p] for p in paths))

    log(f"  the step launches {hlo.program_profile(text).describe()}; {weight_copies_line(layer_weights, text)}")
    pool = per_device([p for p in sizes if p in ("[4].kv.k", "[4].kv.v")])  # the K/V the decode loop carries
    weights = per_device([p for p in sizes if p.startswith("[0]") and (cfg.tie_word_embeddings or "embedding" not in p)])
    # a MoE layer's experts (models/moe.py): a step reads those its tokens route to
    experts = per_device([p for p in sizes if p.startswith("[0]") and cfg.num_experts and
                          any(f"['mlp']['{name}']" in p for name in ("gate_kernel", "up_kernel", "down_kernel"))])
    touched = experts_touched(settings.slots, cfg.num_experts, cfg.num_experts_per_tok) if experts else 1.0
    weights -= (1.0 - touched) * experts
    L = cfg.num_hidden_layers

    def kernel_reads(fill: float) -> Callable:
        # an operand holding every layer's pages (half the pool: K or V) counts one layer's pages at ``fill``
        return lambda out, operands: out + sum(fill * b / L if b >= pool / 2 else b for b in operands)

    # the branches of the token selection that a rollout runs (sampling/selection.py names them): it samples
    # (temperature > 0, never greedy); with top_p 1 neither the top-p bisection (32 passes over the logits)
    # nor, where the fused GPU kernel selects, the logits' path runs
    skip = frozenset({"greedy_selection"} | ({"top_p_bisection", "logits_selection"} if spec.rollout.top_p >= 1.0
                                             else set()))
    full, empty = (hlo_cost.program_cost(text, trips, custom_call_bytes=kernel_reads(f), skip_scopes=skip)
                   for f in (1.0, 0.0))
    say_unread_steps(full, log)
    page = settings.page_size
    pages = page and (settings.pages or default_pages(settings.slots, page, settings.max_new_tokens))
    capacity = page and (P // shards * -(-step.sampler.prompt_buckets[-1] // page) + pages) * page  # the pool's tokens
    fill = min(1.0, reads / capacity) if page else 1.0  # the contiguous cache: its rows are read whole
    routed = (f" (the experts' {experts / 1e9:.2f} GB at the {touched:.4f} that {settings.slots} tokens route to, "
              f"uniformly)") if experts else ""
    log(f"  must read a step: weights {weights / 1e9:.2f} GB{routed} + page pool {pool / 1e9:.2f} GB (full); compiled "
        f"{full.bytes / 1e9:.2f} GB at a full pool; a mean step reads {fill:.2f} of the pool")
    calls = spec.rollout.micro_batches
    queue_slots = step.sampler.slots // shards
    carry = carry_over_plans(lengths, queue_slots, spec.train.prompts_per_step // shards, spec.rollout.n,
                             spec.rollout.max_staleness)
    sync_fill = float(np.sum(np.maximum(lengths - 1, 0))) / shards / calls / max(queue_slots * steps, 1)
    # one step off: the engine on q of the batch shards' chip groups runs q queues of the same slots (the same
    # decode step), each with its share of the step's responses
    split_trips = {q * tensor: decode_steps(prompts, lengths, queue_slots * q, q)[0] * calls for q in range(1, shards)}
    # our fused LM head and token selection (sampling/fused_selection_gpu.py) is a Pallas call, which
    # hlo_cost gives no FLOPs: its dot's, 2 B D V over the vocabulary's shards (the queue's tensor devices)
    head_flops = 2 * settings.slots * cfg.hidden_size * cfg.vocab_size / tensor if "pacs_fused_selection" in text else 0
    return Phase("decode", steps * calls, full.flops + head_flops, empty.bytes + fill * (full.bytes - empty.bytes),
                 full.collective_bytes, weights + fill * pool, "bytes", xla, (weights + pool, full.bytes),
                 (carry, sync_fill), weights, split_trips)


def weight_copies_line(weights: dict, text: str) -> str:
    """What a compiled decode step copies of its layers' weights: "copies of a layer's weights a step:
    NAME COUNT, ..." (or "none"), over ``weights`` (engine.decode_layer_weights: {name: [L, ...] a
    device's share}; hlo.weight_copies)."""
    from pacs_jax import hlo

    copies = hlo.weight_copies(text, weights)
    listed = ", ".join(f"{name} {n}" for name, n in sorted(copies.items())) or "none"
    return f"copies of a layer's weights a step: {listed}"


PHASES = ("prefill", "decode", "pi_old", "critic_values", "critic_update", "update")  # a step's, in order
SAMPLER_PHASES = ("prefill", "decode")  # the rollout engine's; the others the learner's, each its own program


def memory_programs(names: tuple[str, ...]) -> tuple[str, ...]:
    """The trainer's programs whose memory a plan of the phases ``names`` reads: the sampler's when both its
    phases are planned (its program is compiled for that alone), and each learner phase's own."""
    sampler = ("sampler",) if set(SAMPLER_PHASES) <= set(names) else ()
    return sampler + tuple(n for n in names if n not in SAMPLER_PHASES)


def plan_phases(spec, devices, prompts: np.ndarray, responses: np.ndarray, log,
                names: tuple[str, ...] = PHASES) -> tuple[list[Phase], list, tuple[str, ...]]:
    """The phases ``names`` of a step of ``spec`` (a placed RunSpec) on ``devices`` for these prompt and response
    lengths [B] (row i n + j: sample j of prompt i): compiled, costed, with trips (PPO's critic
    phases for PPO only); the memory (memory_check.ProgramMemory) of the trainer's programs among
    ``memory_programs(names)`` (a learner phase is costed from that compile; one the compiler refuses for lack
    of memory is not costed); and the names of the step's other programs, not compiled here."""
    from pacs_jax import sharding
    from pacs_jax.rl.logprobs import DEFAULT_CHUNK_SIZE
    from pacs_jax.sampling.engine import lower_prefill
    from pacs_jax.training.abstract_step import abstract_step
    from pacs_jax.training.model_spec import model_config

    cfg = model_config(spec)
    calls = spec.rollout.micro_batches
    phases = []
    with abstract_step(spec, devices, log=log) as step:
        programs = {p.name: p for p in step.programs(largest_only=True)}
        compiled = {}
        left_out = tuple(name for name in programs if name not in memory_programs(names))
        memory = step.compile(largest_only=True, names=memory_programs(names), progress=False, log=log,
                              on_compiled=lambda program, c: compiled.__setitem__(program.name, c))
        plans = step.learner.packing_plans(prompts, responses) if step.learner.packing else None
        chunk = min(DEFAULT_CHUNK_SIZE, step.learner.pass_widths[1])
        with sharding.tracing_device(step.sampler.mesh):  # tokamax's GPU kernel reads the GPU from the default device
            if "prefill" in names:
                log(f"compiling the sampler's prefill ({programs['sampler'].shape}) ...")
                chunk_prompts = programs["sampler"].args[1]
                cost, xla, _ = compile_cost(lower_prefill(step.sampler.graphdef, step.sampler.params, chunk_prompts,
                                                          chunk_prompts, step.sampler.settings), lambda loop: 0.0, log)
                phases.append(Phase("prefill", calls, cost.flops, cost.bytes, cost.collective_bytes, xla_seconds=xla))
            if "decode" in names:
                phases.append(decode_phase(spec, devices, step, prompts, responses, log))
        passes = {"pi_old": ("logprob", 1), "critic_values": ("logprob", 1), "critic_update": ("critic", 3),
                  "update": ("update", 3)}
        for name, (plan_name, factor) in passes.items():
            if name not in programs or name not in names:
                continue
            if name not in compiled:  # memory_check.refused: the memory line says so
                log(f"{name} not costed: the compiler refused it for lack of memory")
                continue
            plan = None if plans is None else getattr(plans, plan_name)
            trips = trips_from_plan(plan, chunk) if plan is not None else (lambda loop: 1.0)
            cost, xla = compiled_cost(compiled[name], trips, log)
            # the updates' program is one mini-batch's, dispatched once a mini-batch (training/learner/update_step.py);
            # pi_old's one pass's, dispatched once a pass (training/learner/old_policy.py)
            dispatches = {"update": spec.train.mini_batches, "critic_update": spec.train.mini_batches,
                          "pi_old": plan.passes[0] if plan is not None else step.learner.logprob_micro_batches}.get(name, 1)
            cost = dataclasses.replace(cost, flops=dispatches * cost.flops, bytes=dispatches * cost.bytes,
                                       collective_bytes=dispatches * cost.collective_bytes)
            count = float(sum(plan.passes)) if plan is not None else 1.0
            matmuls, attention = (x / len(devices) for x in useful_flops(cfg, prompts, responses, factor))
            text = compiled[name].as_text()
            kernel = any(k in text for k in _KERNELS)
            flops = cost.flops + (attention if kernel else 0.0)  # a kernel's attention, as the useful count has it
            useful = matmuls + attention if name in ("pi_old", "update") else 0.0
            phases.append(Phase(name, count, flops / count, cost.bytes / count, cost.collective_bytes / count,
                                useful / count, "flops" if useful else "", xla))
    return phases, memory, left_out


def report(phases: list[Phase], topo, spec, chips: int, memory: list | None = None,
           left_out: tuple[str, ...] = ()) -> str:
    """The table of phases and the step's lines: with a decode phase, the step with carry-over at the configured
    max_staleness (``carry_over_steps``), the others planned and which drops none; the last, the run's hours and
    chip-hours at the step the config runs (with ``rollout.carry_over``, carry-over's) and the fullest of the
    trainer's programs in ``memory`` (memory_check.ProgramMemory) against the chip's HBM, saying what it leaves
    out (``memory_words``)."""
    G = 1e9
    lines = [f"{'phase':13s} {'GFLOP':>9s} {'GB':>8s} {'coll GB':>8s} {'trips':>7s} {'ms flops':>9s} {'ms HBM':>8s} "
             f"{'ms coll':>8s} {'XLA ms':>7s} {'bound':>12s} {'seconds':>8s}  ratio"]
    for p in phases:
        t = p.times(topo)
        ratio = p.ratio()
        what = ("" if ratio is None else f"{ratio:.3f} useful/compiled FLOPs" if p.useful_kind == "flops"
                else f"{ratio:.3f} must-read/compiled bytes")
        xla = "-" if not p.xla_seconds or p.xla_seconds < 0 else f"{p.xla_seconds * 1e3:.1f}"
        lines.append(f"{p.name:13s} {p.flops / G:9.1f} {p.bytes / G:8.2f} {p.collective_bytes / G:8.3f} {p.trips:7.0f} "
                     f"{t['flops'] * 1e3:9.2f} {t['HBM'] * 1e3:8.2f} {t['interconnect'] * 1e3:8.2f} {xla:>7s} "
                     f"{p.bound(topo):>12s} {p.seconds(topo):8.2f}  {what}")
    lines += [f"decode at a full pool: must read {p.full_pool[0] / G:.2f} GB, compiled {p.full_pool[1] / G:.2f} GB "
              f"(ratio {p.full_pool[0] / p.full_pool[1]:.3f})" for p in phases if p.full_pool]
    total = sum(p.seconds(topo) for p in phases)
    ideal = sum(p.ideal_seconds(topo) for p in phases)
    lines += [f"step: {total:.1f} s predicted (the phases at their bounds' peaks; reward scoring, on the host and "
              f"overlapped with pi_old, not counted" + ("; the decode a synchronous call's: carry-over's step below"
                                                        if spec.rollout.carry_over else "")
              + f"); at 100 % of every bound {ideal:.1f} s: ratio {ideal / total:.3f}"]
    run_step, how = total, ""
    decode = next((p for p in phases if p.carry_over), None)
    if decode is not None:
        carry = carry_over_steps(decode, phases, topo, spec)
        staleness = spec.rollout.max_staleness
        chosen = carry[staleness]
        hours = chosen.seconds * spec.train.steps / 3600
        others = ", ".join(f"max_staleness {c.staleness}: {c.trips:.0f} decode steps, {c.dropped:.1%} dropped, step "
                           f"{c.seconds:.1f} s" for s, c in sorted(carry.items()) if s != staleness)
        none_dropped = [s for s, c in sorted(carry.items()) if s > staleness and not c.dropped]
        advice = ("" if not chosen.dropped else f"; set rollout.max_staleness={none_dropped[0]} to drop none"
                  if none_dropped else f"; every max_staleness up to {max(carry)} drops some")
        lines.append(f"with carry-over (rollout.carry_over, max_staleness {staleness}; simulated steady state): "
                     f"{chosen.trips:.0f} decode steps a step against {decode.trips:.0f}, slot fill {chosen.fill:.2f} "
                     f"against {decode.carry_over[1]:.2f}, {chosen.dropped:.1%} of decoded tokens dropped as stale: "
                     f"decode {chosen.decode:.2f} s, prefill x{chosen.prefills} {chosen.prefill:.2f} s, step "
                     f"{chosen.seconds:.1f} s predicted against {total:.1f} s ({chosen.dropped * chosen.decode:.2f} s "
                     f"of it decoding the dropped tokens); run {hours:.1f} h, {hours * chips:.0f} chip-hours"
                     + (f"; {others}" if others else "") + advice)
        if spec.rollout.carry_over:
            run_step = chosen.seconds
            how = f", at carry-over's step of {chosen.seconds:.1f} s (the dropped tokens' decode counted)"
    split = one_step_off(phases, topo, chips, lambda r: split_overrides(spec, r, chips))
    if split:
        lines.append(split)
    hours = run_step * spec.train.steps / 3600
    lines += [f"run: {spec.train.steps} steps, {hours:.1f} h, {hours * chips:.0f} chip-hours on {chips} "
              f"{topo.device_kind} chips{how}" + (f"; {memory_words(memory, topo.hbm_bytes, left_out, spec.rollout.carry_over)}" if memory else "")]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class CarryOverStep:
    """A step with carry-over at one max_staleness (``carry_over_steps``)."""

    staleness: int
    trips: float  # decode steps a step
    fill: float  # busy slot-steps / slot-steps
    dropped: float  # the share of decoded tokens dropped as stale
    decode: float  # seconds of the decode steps (the slots of rows later dropped among them)
    prefills: int  # prefill phases a call
    prefill: float  # seconds of those prefills
    seconds: float  # the step's


def carry_over_steps(decode: Phase, phases: list[Phase], topo, spec) -> dict[int, CarryOverStep]:
    """The step of ``phases`` with carry-over at each max_staleness of the ``decode`` phase's
    ``carry_over_plans``: the same decode step, run as many times as carry-over's steady state takes (the steps
    in which a row later dropped held its slot among them: its tokens thrown away cost their decode), and
    the prefills of a call: 2P prompts of room for its new batch and again each of the max_staleness
    carried batches' (sampling/carry_over.py), the prefill phase being a synchronous step's P prompts, or
    with rollout.carry_over one region's 2P."""
    total = sum(p.seconds(topo) for p in phases)
    prefill = sum(p.seconds(topo) for p in phases if p.name == "prefill")
    steps = {}
    for staleness, (trips, fill, dropped) in decode.carry_over[0].items():
        prefills = (staleness + 1) * (1 if spec.rollout.carry_over else 2)
        seconds = decode.seconds(topo) * trips / decode.trips
        steps[staleness] = CarryOverStep(staleness, trips, fill, dropped, seconds, prefills, prefills * prefill,
                                         total - decode.seconds(topo) - prefill + seconds + prefills * prefill)
    return steps


def memory_words(memory: list, hbm_bytes: int, left_out: tuple[str, ...] = (), carry_over: bool = False) -> str:
    """The fullest of the trainer's programs in ``memory`` (memory_check.ProgramMemory) against ``hbm_bytes``:
    "peak per device X GiB of Y GiB (fits): NAME, the fullest of NAMES (the phases planned; ...)", naming
    the step's programs not compiled here (``left_out``) and, with ``carry_over`` and no sampler in ``memory``,
    that carry-over's engine state is not counted."""
    from pacs_jax.training.memory_check import fullest, peak_words

    worst = fullest(memory)
    names = tuple(dict.fromkeys(p.name for p in memory))
    refused = "; the compiler refused it for lack of memory" if worst.error else ""
    covers = ["the phases planned"]
    if left_out:
        covers.append("not compiled here: " + ", ".join(left_out))
    if carry_over and "sampler" not in names:
        covers.append("carry-over's engine state, resident between calls, not counted without the sampler's phases "
                      "(prefill and decode)")
    return (f"peak per device {peak_words(worst, hbm_bytes)}: {worst.name}, the fullest of {', '.join(names)}{refused} "
            f"({'; '.join(covers)}; tools/plan_memory.py compiles every program of the step)")


def split_overrides(spec, r: int, chips: int) -> str | None:
    """Whether the config accepts one step off with ``r`` of the ``chips`` for the engine: "" as it is, the
    overrides it needs (with ``rollout.carry_over``, which one step off does not combine with,
    "rollout.carry_over=False"; "mesh.data=1 mesh.fsdp=-1": the learner's fsdp axis fills its chips), or None
    (its batch sizes or mesh refuse it either way)."""
    from pacs_jax.training.spec import ConfigError

    switch = ("rollout.carry_over=False",) if spec.rollout.carry_over else ()
    rollout = dataclasses.replace(spec.rollout, carry_over=False)
    fill = dataclasses.replace(spec.mesh, data=1, fsdp=-1)
    for mesh, words in ((spec.mesh, ()), (fill, ("mesh.data=1", "mesh.fsdp=-1"))):
        try:
            dataclasses.replace(spec, devices=chips, train=dataclasses.replace(spec.train, off_policy_steps=1),
                                mesh=dataclasses.replace(mesh, rollout_devices=r), rollout=rollout)
        except ConfigError:
            continue
        return " ".join(switch + words)
    return None


def one_step_off(phases: list[Phase], topo, chips: int, overrides: Callable[[int], str | None] = lambda r: "") -> str:
    """One step off on split devices (issue 50: ``train.off_policy_steps=1``, ``mesh.rollout_devices``): the
    engine samples step k + 1 on R chips while the learner trains step k on the rest, so a step takes
    the longer of the two, the engine's including the weights' move (the decode layout's bytes a
    device, over one chip's interconnect). Estimated from this slice's phases, not compiled per split:
    the decode step is the same program (a queue on a batch shard's chips), run as many times as the
    longest of the R chips' queues takes for the step's responses (``Phase.split_trips``: a queue's
    tail does not shrink with fewer queues); the prefill and the learner's phases scale with their chips
    (chips / R, chips / (chips - R)). The best R among those the config accepts (``overrides(R)``: the
    mesh overrides it needs, "" none, None refused: ``split_overrides``), or "" without a decode phase
    and a learner phase."""
    decode = next((p for p in phases if p.name == "decode" and p.split_trips), None)
    prefill = sum(p.seconds(topo) for p in phases if p.name == "prefill")
    learner = sum(p.seconds(topo) for p in phases if p.name not in SAMPLER_PHASES)
    if decode is None or not learner:
        return ""
    move = decode.weights / topo.ici_bandwidth if topo.ici_bandwidth else 0.0

    def times(r):
        engine = prefill * chips / r + decode.seconds(topo) * decode.split_trips[r] / decode.trips
        return max(engine + move, learner * chips / (chips - r)), engine, learner * chips / (chips - r)

    needs = {r: overrides(r) for r in decode.split_trips}
    refused = sorted(r for r, words in needs.items() if words is None)
    synchronous = prefill + decode.seconds(topo) + learner
    if len(refused) == len(needs):
        return (f"one step off (train.off_policy_steps=1): no split of the {chips} chips fits the config's mesh and "
                f"batch sizes (mesh.rollout_devices in {refused} refused, also with mesh.data=1 mesh.fsdp=-1)")
    r = min((r for r in needs if needs[r] is not None), key=lambda r: times(r)[0])
    step, engine, learner_r = times(r)
    return (f"one step off (train.off_policy_steps=1; from these phases, not compiled per split): best "
            f"mesh.rollout_devices={r} of {chips}: step {step:.1f} s (engine {engine:.1f} s + weights {move:.2f} s, "
            f"learner {learner_r:.1f} s) against {synchronous:.1f} s synchronous on all {chips}"
            + (f", with {needs[r]}" if needs[r] else "")
            + (f"; the config refuses mesh.rollout_devices in {refused}" if refused else ""))


def main(argv) -> int:
    from absl import app

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from plan_packing import prompt_lengths, response_lengths

    from pacs_jax.training.abstract_step import slice_devices
    from pacs_jax.training.spec import RunSpec

    spec = RunSpec.unplaced(_CONFIG.value)
    say = lambda s: print(f"[plan_step] {s}", flush=True)  # noqa: E731
    names = tuple(n.strip() for n in _PHASES.value.split(",") if n.strip())
    if not names or set(names) - set(PHASES):
        raise app.UsageError(f"--phases: {sorted(set(names) - set(PHASES)) or 'none'}; expected some of {PHASES}")
    budget = spec.rollout.max_new_tokens
    median, words = lengths_median(_LENGTHS.value, _MEDIAN.value, budget)
    topo, spec, devices = slice_devices(spec, _TOPOLOGY.value, say, tool="plan_step")
    rs = np.random.RandomState(_SEED.value)
    B = spec.train.prompts_per_step * spec.rollout.n
    prompts = np.repeat(prompt_lengths(spec.train.prompts_per_step, rs, max(spec.data.prompt_buckets)), spec.rollout.n)
    responses = np.full(B, budget, np.int64) if median is None else np.maximum(response_lengths(B, rs, median, budget), 1)
    say(f"{topo.name}: {len(devices)} compile-only {devices[0].device_kind} devices; peaks a device: "
        f"{topo.bf16_flops / 1e12:.0f} TFLOP/s bf16, HBM {topo.hbm_bandwidth / 1e9:.0f} GB/s, "
        f"interconnect {topo.ici_bandwidth / 1e9:.0f} GB/s")
    say(f"responses: {words}; this step: {B} responses, mean {responses.mean():.0f}, longest {responses.max()} "
        f"tokens, prompts mean {prompts.mean():.0f}")
    phases, memory, left_out = plan_phases(spec, devices, prompts, responses, say, names)
    print(report(phases, topo, spec, len(devices), memory, left_out), flush=True)
    return 0


if __name__ == "__main__":
    from absl import flags

    from pacs_jax.training.abstract_step import plan_tool_flags, run_plan_tool

    _CONFIG, _TOPOLOGY = plan_tool_flags("v5p-64, v6e-64, h200x1, h200x8")
    _LENGTHS = flags.DEFINE_string("lengths", "lognormal", "the step's response lengths: lognormal, budget, or "
                                                           "a finished run's metrics.jsonl")
    _MEDIAN = flags.DEFINE_float("median", 0.0, "--lengths=lognormal: the median response (0: max_new_tokens / 8)")
    _PHASES = flags.DEFINE_string("phases", ",".join(PHASES), "which phases to compile (comma-separated; the "
                                                              "step's time sums only those)")
    _SEED = flags.DEFINE_integer("seed", 0, "seed of the simulated step's prompts and lengths")
    run_plan_tool("plan_step", main)  # bad input: one line, status 78
