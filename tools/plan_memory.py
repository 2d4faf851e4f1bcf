"""Does a training config fit the accelerator's memory? Compile its programs for the target, don't run them.

    python tools/plan_memory.py --config=configs/paper.py:qwen25_7b,pacs_beta1 --topology=v5p-64 \\
        [--config.train.micro_batches=32 ...]

Builds the config's mesh over compile-only devices of ``--topology`` (pacs_jax/topologies.py: TPU
slices need libtpu, GPU nodes JAX's CUDA plugin, no accelerator needed), the abstract model and
AdamW state, and compiles ahead of time, exactly as the trainer builds them, the three programs of
a step for its largest shapes:

    sampler  engine.lower_sample for the largest prompt bucket, prompts_per_step / rollout.micro_batches prompts
    pi_old   RolloutCollector._prepare for the largest (prompt bucket, response bucket)
    update   training/update_step.make_update_step on the abstract update batch of that bucket pair

and, for PPO (algorithm.objective "ppo"), the critic's two programs (training/critic_step.py) on the
same batch, its parameters and AdamW state abstract and sharded like the actor's:

    critic_values  the critic's values, GAE advantages and returns
    critic_update  the critic's AdamW steps on the clipped value loss

and prints XLA's per-device memory of each (arguments, outputs, aliased, temp, peak) beside the
analytic estimate (pacs_jax/training/memory_plan.py) and the device's HBM, and for the sampler
whether a parameter is all-gathered inside its loops (the decode loop should read its weights from
HBM: docs/design.md section 3.2). A phase's total is the
program's peak plus what stays on the device outside it (the actor's AdamW state during the sampler
and pi_old; PPO: the critic's parameters and AdamW state during the actor's programs, the actor's
parameters and AdamW state during the critic's). The last line is

    peak per device: X GiB of Y GiB (fits)        or        ... (does not fit)

and the exit status is 0 iff it fits (2: the compiler for the topology is not installed).

Attention: "auto" resolves for the target platform (splash on TPU, cudnn on GPU), and JAX's
default backend is reported as the target's while the programs are traced (the model picks
kernels and dot operand dtypes by it). The splash kernel runs sharded in ``shard_map`` under the
mesh the model itself puts in context (models/qwen.py), as in the trainer: nothing else is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import sys
import time
from collections.abc import Callable
from unittest import mock

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GiB = 1 << 30


@dataclasses.dataclass
class ProgramMemory:
    """XLA's per-device memory of one compiled program, and what the phase needs in all."""

    name: str
    shape: str  # the shapes it was compiled for, in words
    argument: int
    output: int
    alias: int
    temp: int
    peak: int
    outside: int  # bytes resident on the device during the phase but not arguments of the program
    estimate: int  # the analytic estimate of the phase (memory_plan), resident state included
    compile_seconds: float
    error: str = ""  # the compiler's refusal (it does not fit), if it refused
    loop_gathers: str = ""  # the sampler: the parameter all-gathers inside its loops (decode), in words

    @property
    def total(self) -> int:
        return self.peak + self.outside


def _per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest shard)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


@contextlib.contextmanager
def _traced_as(platform: str):
    """While tracing for ``platform`` from a host whose default backend differs, make the model's
    ``jax.default_backend()`` checks (attention kernel choice, float32 dot operands on CPU, GPU
    decode path) answer the target's platform; JAX itself never calls that public function."""
    import jax

    if jax.default_backend() == platform:
        yield
        return
    with mock.patch.object(jax, "default_backend", lambda: platform):
        yield


def abstract_optimizer_state(optimizer, abstract_params):
    """AdamW's state for abstract params: mu / nu sharded like the params, the scalars replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    shapes = jax.eval_shape(optimizer.init, abstract_params)
    params_def = jax.tree.structure(abstract_params)
    mesh = jax.tree.leaves(abstract_params)[0].sharding.mesh
    replicated = NamedSharding(mesh, PartitionSpec())

    def like_params(node):
        return jax.tree.structure(node) == params_def

    def place(node):
        if like_params(node):
            return jax.tree.map(lambda o, p: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=p.sharding),
                                node, abstract_params)
        return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=replicated), node)

    return jax.tree.map(place, shapes, is_leaf=like_params)


PROGRAMS = ("sampler", "pi_old", "critic_values", "critic_update", "update")  # in the order a step runs them
CRITIC_PROGRAMS = ("critic_values", "critic_update")  # PPO only


def build_programs(config, devices, *, platform: str, log: Callable[[str], None] = print,
                   programs: tuple[str, ...] = PROGRAMS) -> list[ProgramMemory]:
    """Compile (never run) the programs of a step of ``config`` (those of ``PROGRAMS`` named in
    ``programs``; the critic's only for PPO) on a mesh over ``devices`` (compile-only or real) of
    ``platform``; returns their per-device memory."""
    import jax
    import jax.numpy as jnp

    from pacs_jax import hlo, models
    from pacs_jax.models.attention import resolve_impl
    from pacs_jax.models.value import ValueModel
    from pacs_jax.sampling.engine import lower_sample
    from pacs_jax.sharding import MeshRules, make_mesh
    from pacs_jax.training import memory_plan
    from pacs_jax.training.critic_step import (abstract_critic_batches, config_critic_optimizer,
                                               config_critic_options, critic_programs)
    from pacs_jax.training.loop import config_collector, config_optimizer, config_update_step

    tc, rc, mc = config.train, config.rollout, config.mesh
    attention = resolve_impl(config.model.attention, platform)
    cfg = memory_plan.model_config(config, attention=attention)
    if cfg is None:
        raise ValueError(f"config.model.path={config.model.path!r}: no config.json / model_config.json to read")
    mesh = make_mesh(mc.data, mc.fsdp, mc.tensor, devices=devices)
    plan = memory_plan.estimate_memory(config, len(devices), cfg=cfg)
    log(f"model {config.model.preset or config.model.path or 'custom'}: {cfg.num_hidden_layers} layers, "
        f"dtype {cfg.dtype}, params {cfg.param_dtype}, remat {cfg.remat}, attention {attention}; "
        f"mesh {dict(mesh.shape)} on {len(devices)} {devices[0].device_kind} devices")

    # As rl_train builds them (pacs_jax/training/loop.py).
    graphdef, params = models.abstract_model(cfg, mesh)
    rules = MeshRules(mesh)
    optimizer, _ = config_optimizer(config)
    opt_state = abstract_optimizer_state(optimizer, params)
    shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    eos = cfg.eos_token_id
    stop_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    update = config_update_step(config, graphdef, optimizer, rules, shardings)
    collector = config_collector(config, graphdef, rules, stop_ids, decode=lambda ids: "", reward_pool=None)
    sampling_settings = collector.settings

    num_prompts = tc.prompts_per_step
    p, r = collector.prompt_buckets[-1], collector.response_buckets[-1]
    per_call = num_prompts // rc.micro_batches
    chunk = collector._abstract((per_call, p), jnp.int32)
    prompts = collector._abstract((num_prompts, p), jnp.int32)
    responses = collector._abstract((num_prompts * rc.n, r), jnp.int32)
    batch = collector.abstract_batches(num_prompts)[-1]  # the largest (prompt, response) bucket pair
    opt_bytes = _per_device_bytes(opt_state)
    lp_micro = collector.logprob_micro_batches
    micro_rows = num_prompts * rc.n // tc.mini_batches // tc.micro_batches
    update_shape = (f"{num_prompts * rc.n} rows x {p}+{r} tokens, {tc.mini_batches} mini-batches x "
                    f"{tc.micro_batches} micro-batches of {micro_rows} rows")
    critic_jobs, critic_bytes = [], 0
    if config.algorithm.objective == "ppo":  # as PPOCritic.from_config builds them, on abstract state
        critic_graphdef, critic_params = models.abstract_model(cfg, mesh, cls=ValueModel)
        critic_optimizer = config_critic_optimizer(config)
        critic_opt_state = abstract_optimizer_state(critic_optimizer, critic_params)
        critic_state = (critic_params, critic_opt_state)
        values, critic_update = critic_programs(critic_graphdef, critic_optimizer, rules,
                                                jax.tree.map(lambda x: x.sharding, critic_state),
                                                **config_critic_options(config))
        critic_batch, batch = abstract_critic_batches(batch)  # the actor's batch gains the advantages
        critic_bytes = _per_device_bytes(critic_state)
        actor_bytes = _per_device_bytes((params, opt_state))
        critic_jobs = [
            ("critic_values", f"{num_prompts * rc.n} rows x {p}+{r} tokens in {lp_micro} micro-batches of "
                              f"{num_prompts * rc.n // lp_micro}, then GAE",
             lambda: values.lower(critic_params, batch), (critic_params, batch),
             actor_bytes + _per_device_bytes(critic_opt_state), "critic_values"),
            ("critic_update", update_shape, lambda: critic_update.lower(*critic_state, critic_batch),
             (*critic_state, critic_batch), actor_bytes, "critic_update"),
        ]
    jobs = [
        ("sampler", f"{per_call} prompts x {p} tokens, n={rc.n}: {per_call * rc.n} rows in "
                    f"{sampling_settings.slots or per_call * rc.n} decode slots x {p + rc.max_new_tokens} cache "
                    f"slots per call ({rc.micro_batches} calls)",
         lambda: lower_sample(graphdef, params, chunk, chunk, sampling_settings), (params, chunk, chunk),
         opt_bytes + critic_bytes, "sampler"),
        ("pi_old", f"{num_prompts * rc.n} rows x {p}+{r} tokens in {lp_micro} micro-batches of "
                   f"{num_prompts * rc.n // lp_micro}",
         lambda: collector._prepare.lower(params, prompts, prompts, responses, responses),
         (params, prompts, prompts, responses, responses), opt_bytes + critic_bytes, "pi_old"),
        *critic_jobs,
        ("update", update_shape, lambda: update.lower(params, opt_state, batch), (params, opt_state, batch),
         critic_bytes, "update"),
    ]
    out = []
    for name, shape, lower, args, outside, phase in (job for job in jobs if job[0] in programs):
        log(f"compiling {name} ({shape}) ...")
        t0 = time.perf_counter()
        with _traced_as(platform):
            lowered = lower()
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            seconds = time.perf_counter() - t0
            program = _refused(name, shape, _per_device_bytes(args), str(e), outside, plan.phase_total(phase), seconds)
            log(f"  {name}: the compiler refused it after {seconds:.1f} s: {program.error}")
            out.append(program)
            continue
        seconds = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        program = ProgramMemory(
            name, shape, argument=int(mem.argument_size_in_bytes), output=int(mem.output_size_in_bytes),
            alias=int(mem.alias_size_in_bytes), temp=int(mem.temp_size_in_bytes),
            peak=int(getattr(mem, "peak_memory_in_bytes", 0) or 0), outside=outside,
            estimate=plan.phase_total(phase), compile_seconds=seconds)
        if program.peak == 0:  # a backend that does not report it: arguments + outputs - aliased + temp
            program.peak = program.argument + program.output - program.alias + program.temp
        if name == "sampler":  # a weight gathered inside the decode loop crosses the network every step
            gathers = hlo.gathers_of_shapes_in_loops(compiled.as_text(), hlo.parameter_shapes(params))
            program.loop_gathers = (f"{len(gathers)} parameter all-gathers inside its loops: "
                                    + ", ".join(sorted({str(list(c.shape)) for c in gathers}))
                                    if gathers else "no parameter all-gather inside its loops")
        log(f"  {name} compiled in {seconds:.1f} s: peak {program.peak / GiB:.2f} GiB per device")
        out.append(program)
    return out


_BYTES = re.compile(r"([0-9.]+)\s*([KMGT]i?B?|B)\b")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "B": 1}


def _refused(name, shape, argument, message, outside, estimate, seconds) -> ProgramMemory:
    """A program the compiler refused for lack of memory (XLA:TPU checks at compile time: "the total
    memory required for HLO temporaries (136.86G) exceeds available HBM (95.74G)"). Its peak is
    reported as its arguments plus the temporaries the message names (a lower bound)."""
    line = next((s for s in message.splitlines() if "RESOURCE_EXHAUSTED" in s), message.splitlines()[0])
    line = line[line.index("RESOURCE_EXHAUSTED"):][:300]
    sizes = [float(v) * _UNITS[u[0]] for v, u in _BYTES.findall(line)]
    temp = int(sizes[0]) if sizes else 0
    return ProgramMemory(name, shape, argument=argument, output=0, alias=0, temp=temp, peak=argument + temp,
                         outside=outside, estimate=estimate, compile_seconds=seconds, error=line)


def report(programs: list[ProgramMemory], hbm_bytes: int, device: str) -> tuple[str, bool]:
    """The table of ``programs`` against ``hbm_bytes`` per device; (text, fits)."""
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    lines = [f"per-device memory (GiB) on {device}, {g(hbm_bytes)} GiB HBM each",
             f"{'program':<9}{'args':>8}{'output':>8}{'alias':>8}{'temp':>8}{'peak':>8}{'+outside':>10}"
             f"{'total':>8}{'estimate':>10}{'of HBM':>8}{'compile s':>11}"]
    for p in programs:
        lines.append(f"{p.name:<9}{g(p.argument):>8}{g(p.output):>8}{g(p.alias):>8}{g(p.temp):>8}{g(p.peak):>8}"
                     f"{g(p.outside):>10}{g(p.total):>8}{g(p.estimate):>10}{p.total / hbm_bytes:>8.0%}"
                     f"{p.compile_seconds:>11.1f}")
    lines.append("(total = XLA's peak + resident state outside the program: the AdamW state during the sampler "
                 "and pi_old, PPO's critic state during the actor's programs and the actor's during the critic's; "
                 "estimate = pacs_jax/training/memory_plan.py for the same phase)")
    for p in programs:
        lines.append(f"  {p.name}: {p.shape}")
        if p.error:
            lines.append(f"  {p.name}: NOT COMPILED, {p.error} (its peak above: arguments + those temporaries)")
        if p.loop_gathers:
            lines.append(f"  {p.name}: {p.loop_gathers}")
    peak = max(p.total for p in programs)
    fits = peak <= hbm_bytes
    lines.append(f"peak per device: {peak / GiB:.2f} GiB of {hbm_bytes / GiB:.2f} GiB "
                 f"({'fits' if fits else 'does not fit'})")
    return "\n".join(lines), fits


def main(argv) -> int:
    from absl import app

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from pacs_jax import topologies
    from pacs_jax.training import memory_plan

    config = _CONFIG.value
    topo = topologies.get_topology(_TOPOLOGY.value)
    try:
        devices = topologies.abstract_devices(topo)
    except RuntimeError as e:
        print(f"plan_memory: {e}", file=sys.stderr)
        return 2
    print(f"[plan_memory] {topo.name}: {len(devices)} compile-only {devices[0].device_kind} devices, "
          f"{topo.hbm_bytes / GiB:.0f} GiB HBM each", flush=True)
    plan = memory_plan.estimate_memory(config, len(devices))
    if plan is not None:
        print("[plan_memory] analytic estimate per device:\n" + plan.table(), flush=True)
    names = tuple(n.strip() for n in _PROGRAMS.value.split(",") if n.strip())
    unknown = set(names) - set(PROGRAMS)
    if unknown or not names:
        raise app.UsageError(f"--programs: {sorted(unknown) or 'none'}; expected some of {PROGRAMS}")
    if config.algorithm.objective != "ppo":  # the critic's programs are PPO's
        asked = [n for n in names if n in CRITIC_PROGRAMS]
        names = tuple(n for n in names if n not in CRITIC_PROGRAMS)
        if asked and _PROGRAMS.present:
            print(f"[plan_memory] --programs: {', '.join(asked)} left out: PPO's critic programs, and "
                  f"algorithm.objective is {config.algorithm.objective!r}", flush=True)
        if not names:
            raise app.UsageError(f"--programs: nothing to compile for objective {config.algorithm.objective!r}")
    programs = build_programs(config, devices, platform=topo.platform, programs=names,
                              log=lambda s: print(f"[plan_memory] {s}", flush=True))
    text, fits = report(programs, topo.hbm_bytes, f"{topo.name} ({devices[0].device_kind})")
    if not fits and plan is not None:
        text = text.replace("\npeak per device:", f"\nto shrink: {plan.advice()}\npeak per device:")
    print(text, flush=True)
    return 0 if fits else 1


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file(
        "config", str(REPO / "configs" / "paper.py") + ":qwen25_7b,pacs_beta1",
        "trainer config (as for python -m pacs_jax.train), FILE.py:ARG", lock_config=True)
    _TOPOLOGY = flags.DEFINE_string("topology", "v5p-64", "target: a name of pacs_jax.topologies.TOPOLOGIES "
                                                          "(v5p-64, v6e-64, v5e-16, h100x8, ...)")
    _PROGRAMS = flags.DEFINE_string("programs", ",".join(PROGRAMS), "which programs to compile (comma-separated; "
                                                                   "the verdict covers only those; the critic's "
                                                                   "are compiled for PPO only)")
    app.run(lambda argv: sys.exit(main(argv)))
