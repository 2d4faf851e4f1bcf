"""Every program of a training step, made in one place from the run's spec (docs/design.md section 3.6),
by role: the rollout engine's (training/engine/sampler_programs.py: the sampler calls, the assembly, dynamic
sampling's selection) and the learner's (training/learner/learner_programs.py: pi_old, the rollout checks,
the update, PPO's critic, the warm-start). The learner's are made on its mesh (that of the parameters,
or ``mesh``); the engine's on it too, or on a mesh of their own (``rollout_mesh``: one step off on split
devices), where they sample from a copy of the weights that ``weight_sync`` (training/engine/weight_sync.py)
moves there.

    programs = StepPrograms(spec, graphdef, params, stop_token_ids, critic=...)   # PPO: the critic's abstract state
    opt_state = programs.learner.init_optimizer(params)
    programs.compile()          # before step 1: every bucket's programs; XLA's memory of each, checked
    programs.sampler.sample(...), programs.learner.pi_old(...), programs.learner.update(...)   # a step runs them

``programs()`` is the one list of a step's programs and their abstract arguments, in the order a
step runs them (for each bucket): the trainer's warm-up compiles all of them, plan_memory the
largest bucket's, and both read XLA's memory of each (training/memory_check.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from pacs_jax import console
from pacs_jax.training import memory_check
from pacs_jax.training.engine.sampler_programs import SamplerPrograms
from pacs_jax.training.engine.weight_sync import WeightSync
from pacs_jax.training.learner.critic_step import CriticState
from pacs_jax.training.learner.learner_programs import LearnerPrograms
from pacs_jax.training.program import Program
from pacs_jax.training.spec import RunSpec

if TYPE_CHECKING:
    from pacs_jax.sampling.engine import SamplerCompiled


class StepPrograms:
    """The programs of one training step of ``spec``: ``sampler`` (``SamplerPrograms``) and ``learner``
    (``LearnerPrograms``), made on ``mesh`` (default: the mesh ``params`` are placed on); ``rollout_mesh``:
    the engine's on that mesh instead (``split``). PPO: ``critic``, the critic's state (abstract will do:
    ``critic_step.abstract_critic``). One step off (``train.off_policy_steps=1``), the engine samples from a
    copy of the weights that ``weight_sync`` makes on its mesh (None otherwise)."""

    def __init__(self, spec: RunSpec, graphdef: nnx.GraphDef, params,
                 stop_token_ids: Sequence[int], *, mesh: Mesh | None = None, critic: CriticState | None = None,
                 chunk_size: int | None = None, rollout_mesh: Mesh | None = None):
        mesh = mesh or placed_on(params)
        self.spec, self.split = spec, rollout_mesh is not None
        self.learner = LearnerPrograms(spec, graphdef, params, mesh, critic=critic, chunk_size=chunk_size)
        engine_mesh = rollout_mesh or mesh
        self.weight_sync = (WeightSync(params, engine_mesh, spec.model.dtype, adapters_only=spec.model.lora_rank > 0)
                            if spec.train.off_policy_steps else None)
        self.sampler = SamplerPrograms(spec, graphdef, params if self.weight_sync is None else self.weight_sync.abstract,
                                       stop_token_ids, engine_mesh, resident=self._engine_resident())

    def _engine_resident(self) -> int:
        """What stays on the engine's devices between its programs (bytes a device): the learner's state
        when the roles share the devices, and the engine's copy of the weights one step off."""
        copy = 0 if self.weight_sync is None else self.weight_sync.copy_bytes()
        return copy + (0 if self.split else self.learner.resident_bytes())

    def programs(self, largest_only: bool = False, with_warmstart: bool = False) -> list[Program]:
        """Every program of a step, for every bucket (``largest_only``: the largest prompt and response
        buckets), in the order a step runs them: one step off, the weights' move (``weight_sync``: the
        cast of each shape of parameter); the engine's (sampler, select_groups, assemble), then the
        learner's (pi_old, PPO's critic_values and critic_update, update, rollout_consistency,
        rollout_correction); ``with_warmstart``: the warm-start's step first."""
        sampler, learner = self.sampler, self.learner
        prompt_buckets = sampler.prompt_buckets[-1:] if largest_only else sampler.prompt_buckets
        response_buckets = sampler.response_buckets[-1:] if largest_only else sampler.response_buckets
        learner_programs = learner.programs(prompt_buckets, response_buckets, with_warmstart)
        warm = [p for p in learner_programs if p.name == "warmstart"]
        engine = sampler.programs(largest_only)
        if self.weight_sync is not None:  # the move's casts, a parameter at a time, on the learner's devices
            resident = learner.resident_bytes()
            engine[:0] = [Program("weight_sync", f"a parameter {list(p.shape)} cast to {self.weight_sync.dtype} for the "
                                  "engine's copy", lambda p=p: self.weight_sync.cast.lower(p), (p,),
                                  resident - memory_check.per_device_bytes(p), learner.mesh)
                          for p in self.weight_sync.casts]
        learner_programs = [p for p in learner_programs if p.name != "warmstart"]
        if self.weight_sync is not None and not self.split:  # the engine's copy stays beside the learner's programs
            learner_programs = [dataclasses.replace(p, outside=p.outside + self.weight_sync.copy_bytes())
                                for p in learner_programs]
        return warm + engine + learner_programs

    def compile(self, *, largest_only: bool = False, with_warmstart: bool = False, names: Collection[str] | None = None,
                progress: bool = True, read_loops: bool = False, log: Callable[[str], None] | None = None,
                on_compiled: Callable[[Program, jax.stages.Compiled | SamplerCompiled], None] | None = None,
                ) -> list[memory_check.ProgramMemory]:
        """Compile (ahead of time, nothing runs) ``programs()`` and read XLA's memory of each; a program
        XLA refuses for lack of memory comes back with its ``error`` (``memory_check.refused``).
        names: only the programs of these names. read_loops: also read the sampler's HLO for parameter
        all-gathers inside its loops. on_compiled: called with each program XLA compiled (tools/plan_step.py
        costs them). Carry-over: the engine's state (its rows and page pool: the init
        program's result) stays on the devices between calls, so every program after the sampler's
        counts it outside itself (when the sampler is among those compiled)."""
        out = []
        carry_state = 0  # bytes a device, once carry-over's sampler is compiled
        programs = [p for p in self.programs(largest_only, with_warmstart) if names is None or p.name in names]
        for program in console.bar(programs, desc="compiling programs", leave=False, disable=not progress):
            if log is not None:
                log(f"compiling {program.name} ({program.shape}) ...")
            t0 = time.perf_counter()
            try:
                compiled = program.compile()
            except jax.errors.JaxRuntimeError as e:
                if not memory_check.is_out_of_memory(e):
                    raise
                out.append(memory_check.refused(program.name, program.shape, memory_check.per_device_bytes(program.args),
                                                str(e), program.outside + (carry_state if program.name != "sampler" else 0),
                                                time.perf_counter() - t0))
                continue
            outside = program.outside + (carry_state if program.name not in ("sampler", "warmstart") else 0)
            memory = memory_check.program_memory(program.name, program.shape, compiled, outside, time.perf_counter() - t0)
            if program.name == "sampler" and self.sampler.carry_over is not None:  # its init program makes the state
                carry_state = memory_check.per_device_bytes(compiled.programs[0].out_info)
            if read_loops and program.name == "sampler":
                memory.loop_facts = self.sampler.loop_facts(compiled.as_text(), program.args[1].shape[1])
            if on_compiled is not None:
                on_compiled(program, compiled)
            if log is not None:
                log(f"  {program.name} compiled in {memory.compile_seconds:.1f} s: peak {memory.peak / memory_check.GiB:.2f} "
                    f"GiB per device")
            out.append(memory)
        return out


def placed_on(params) -> Mesh:
    """The mesh the parameters ``params`` (arrays or ``jax.ShapeDtypeStruct``s) are placed on."""
    sharding = jax.tree.leaves(params)[0].sharding
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"the parameters are placed by a {type(sharding).__name__}, not on a mesh: pass mesh=")
    return sharding.mesh
