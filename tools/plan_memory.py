"""Does a training config fit the accelerator's memory? Compile its programs for the target, don't run them.

    python tools/plan_memory.py --config=configs/paper.py:qwen25_7b,pacs_beta1 --topology=v5p-64 \\
        [--config.train.micro_batches=32 ...]

Builds the config's mesh over compile-only devices of ``--topology`` (pacs_jax/topologies.py: TPU
slices need libtpu, GPU nodes JAX's CUDA plugin, no accelerator needed), the abstract model and
AdamW state, and compiles ahead of time the programs of a step for its largest buckets: the
trainer's own (training/step_programs.py ``StepPrograms.programs``, the list the trainer's warm-up
compiles before step 1):

    sampler  the sampler for the largest prompt bucket, prompts_per_step / rollout.micro_batches prompts
             (rollout.carry_over: the carry-over engine's six programs, a call's four and a resume's
             two, 2 x prompts_per_step prompts a call, its state of max_staleness + 1 generations'
             rows and page pool)
    pi_old   pi_old for the largest (prompt bucket, response bucket)
    update   the actor's update on the abstract update batch of that bucket pair

and the supervised warm-start's step before them (``warmstart``, when ``warmstart.steps`` > 0: its
batch of ``warmstart.batch_size`` prompts, its own AdamW state), and, for PPO (algorithm.objective
"ppo"), the critic's two programs (training/learner/critic_step.py) on the
same batch, its parameters and AdamW state abstract and sharded like the actor's:

    critic_values  the critic's values, GAE advantages and returns
    critic_update  the critic's AdamW steps on the clipped value loss

and prints XLA's per-device memory of each (arguments, outputs, aliased, temp, peak) against the
device's HBM (training/memory_check.py, the trainer's own check before step 1), and for the sampler
whether a parameter is all-gathered inside its loops (the decode loop should read its weights from
HBM: docs/design.md section 3.2). A phase's total is the
program's peak plus what stays on the device outside it (the actor's AdamW state during the sampler
and pi_old; PPO: the critic's parameters and AdamW state during the actor's programs, the actor's
parameters and AdamW state during the critic's). The last line is

    to shrink the fullest (PROGRAM): the config fields that shrink it
    peak per device: X GiB of Y GiB (fits)        or        ... (does not fit)

and the exit status is 0 iff it fits (2: the compiler for the topology is not installed). Before
anything compiles, the config passes the trainer's check (training/config_check.py ``check_for_slice``:
its values, the mesh against the topology's devices, the data and model files on this machine; a
preset without model.path plans as ``model.random_init``): a refusal is one line naming the field and
exit status 78 (pacs_jax/errors.py).

The mesh over the compile-only devices is set as the context (``jax.set_mesh``), as the trainer's CLI
sets its own: attention "auto" resolves for the platform of its devices (splash on TPU, cudnn on
GPU), dot operand dtypes follow it too, and the splash kernel runs sharded in ``shard_map`` under
it. Nothing is patched: the programs are the ones the trainer compiles on that slice.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# in the order a run needs them; sampler_as_pi_old stands for pi_old in the rollout correction's bypass mode,
# rollout_correction runs after pi_old when the correction is on (docs/design.md 6.7), weight_sync (the casts of the
# weights' move to the engine's mesh) with train.off_policy_steps=1 (3.2c): each only where it exists
PROGRAMS = ("warmstart", "weight_sync", "sampler", "pi_old", "sampler_as_pi_old", "rollout_correction", "critic_values",
            "critic_update", "update")
CRITIC_PROGRAMS = ("critic_values", "critic_update")  # PPO only


def build_programs(spec, devices, *, log: Callable[[str], None] = print,
                   programs: tuple[str, ...] = PROGRAMS) -> list:
    """Compile (never run) the programs of a step of ``spec`` (a ``RunSpec``) for its largest buckets (those of
    ``PROGRAMS`` named in ``programs``; the critic's only for PPO), as the trainer makes them
    (training/step_programs.py) on abstract state, on a mesh over ``devices`` (compile-only or real)
    set as the context, as the trainer's CLI sets it; returns their memory_check.ProgramMemory."""
    from pacs_jax.training.abstract_step import abstract_step

    with abstract_step(spec, devices, log=log) as step:
        return step.compile(largest_only=True, with_warmstart=True, names=programs, progress=False, read_loops=True,
                            log=log)


def main(argv) -> int:
    from absl import app

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from pacs_jax.training import memory_check
    from pacs_jax.training.abstract_step import slice_devices
    from pacs_jax.training.spec import RunSpec

    spec = RunSpec.unplaced(_CONFIG.value)
    topo, spec, devices = slice_devices(spec, _TOPOLOGY.value, lambda s: print(f"[plan_memory] {s}", flush=True), tool="plan_memory")
    print(f"[plan_memory] {topo.name}: {len(devices)} compile-only {devices[0].device_kind} devices, "
          f"{topo.hbm_bytes / memory_check.GiB:.0f} GiB HBM each", flush=True)
    names = tuple(n.strip() for n in _PROGRAMS.value.split(",") if n.strip())
    unknown = set(names) - set(PROGRAMS)
    if unknown or not names:
        raise app.UsageError(f"--programs: {sorted(unknown) or 'none'}; expected some of {PROGRAMS}")
    if spec.critic is None:  # the critic's programs are PPO's
        asked = [n for n in names if n in CRITIC_PROGRAMS]
        names = tuple(n for n in names if n not in CRITIC_PROGRAMS)
        if asked and _PROGRAMS.present:
            print(f"[plan_memory] --programs: {', '.join(asked)} left out: PPO's critic programs, and "
                  f"algorithm.objective is {spec.algorithm.objective!r}", flush=True)
        if not names:
            raise app.UsageError(f"--programs: nothing to compile for objective {spec.algorithm.objective!r}")
    programs = build_programs(spec, devices, programs=names,
                              log=lambda s: print(f"[plan_memory] {s}", flush=True))
    text, fits = memory_check.report(programs, topo.hbm_bytes, f"{topo.name} ({devices[0].device_kind})")
    print(text, flush=True)
    from pacs_jax.models import kernels

    print("kernels: " + "; ".join(map(str, kernels.chosen())), flush=True)
    return 0 if fits else 1


if __name__ == "__main__":
    from absl import flags

    from pacs_jax.training.abstract_step import plan_tool_flags, run_plan_tool

    _CONFIG, _TOPOLOGY = plan_tool_flags("v5p-64, v6e-64, v5e-16, h100x8")
    _PROGRAMS = flags.DEFINE_string("programs", ",".join(PROGRAMS), "which programs to compile (comma-separated; "
                                                                   "the verdict covers only those; the critic's "
                                                                   "are compiled for PPO only)")
    run_plan_tool("plan_memory", main)  # config errors: one line, status 78
