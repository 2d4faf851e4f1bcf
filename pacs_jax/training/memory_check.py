"""Does a training step fit the devices? XLA's own figure for every compiled program of the step.

The trainer compiles every program of a step before step 1 (training/step_programs.py); for each,
``compiled.memory_analysis()`` gives the per-device bytes of its arguments, outputs, aliased
buffers and temporaries, and its peak. A phase of the step holds that program's peak plus the
training state that stays on the device outside it (the AdamW state during the sampler and pi_old;
PPO: the critic's state during the actor's programs and the actor's during the critic's).
``check_fits`` refuses a step whose fullest phase exceeds what a device has, naming the config
fields that shrink that program; tools/plan_memory.py prints the same table for a TPU or GPU
target compiled ahead of time on any machine.

XLA:TPU refuses, at compile time, a program whose temporaries exceed the HBM ("RESOURCE_EXHAUSTED:
... the total memory required for HLO temporaries (136.86G) exceeds available HBM (95.74G)");
``refused`` keeps that as a program whose peak is its arguments plus the temporaries named.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import jax
import numpy as np

from pacs_jax.training.config_check import ConfigError

if TYPE_CHECKING:
    from pacs_jax.sampling.engine import SamplerCompiled

GiB = 1 << 30

# The config fields that shrink each program's memory, most effective first.
FIELDS = {
    "sampler": "rollout.slots / rollout.pages / rollout.micro_batches",
    "assemble": "train.prompts_per_step",
    "pi_old": "train.logprob_micro_batches",
    "critic_values": "train.logprob_micro_batches",
    "critic_update": "train.micro_batches / model.remat",
    "update": "train.micro_batches / model.remat",
    "warmstart": "warmstart.batch_size / model.remat",
    "rollout_consistency": "train.prompts_per_step",
    "rollout_correction": "train.prompts_per_step",
    "sampler_as_pi_old": "train.prompts_per_step",
    "reference_logprobs": "train.logprob_micro_batches",
    "select_groups": "train.prompts_per_step",
    "weight_sync": "mesh.rollout_devices / model.dtype",
}


@dataclasses.dataclass
class ProgramMemory:
    """XLA's per-device memory of one compiled program (bytes), and what its phase needs in all."""

    name: str  # a key of FIELDS
    shape: str  # the shapes it was compiled for, in words
    argument: int
    output: int
    alias: int
    temp: int
    peak: int
    outside: int  # resident on the device during the phase but not an argument of the program
    compile_seconds: float
    error: str = ""  # the compiler's refusal (it does not fit), if it refused
    loop_facts: tuple[str, ...] = ()  # the sampler: what runs inside its loops (parameter all-gathers, K/V copies), in words

    @property
    def total(self) -> int:
        return self.peak + self.outside


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs with shardings (the largest
    shard of each)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def program_memory(name: str, shape: str, compiled: jax.stages.Compiled | SamplerCompiled, outside: int,
                   seconds: float) -> ProgramMemory:
    """The ProgramMemory of a compiled program (``outside``: resident bytes not among its arguments)."""
    mem = compiled.memory_analysis()
    program = ProgramMemory(
        name, shape, argument=int(mem.argument_size_in_bytes), output=int(mem.output_size_in_bytes),
        alias=int(mem.alias_size_in_bytes), temp=int(mem.temp_size_in_bytes),
        peak=int(getattr(mem, "peak_memory_in_bytes", 0) or 0), outside=outside, compile_seconds=seconds)
    if program.peak == 0:  # a backend that does not report it: arguments + outputs - aliased + temp
        program.peak = program.argument + program.output - program.alias + program.temp
    return program


_BYTES = re.compile(r"([0-9.]+)\s*([KMGT]i?B?|B)\b")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "B": 1}


def is_out_of_memory(error: Exception) -> bool:
    """Whether a compile error is XLA's refusal for lack of device memory."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def refused(name: str, shape: str, argument: int, message: str, outside: int, seconds: float) -> ProgramMemory:
    """A program the compiler refused for lack of memory; its peak is its arguments plus the
    temporaries the message names (a lower bound)."""
    line = next((s for s in message.splitlines() if "RESOURCE_EXHAUSTED" in s), message.splitlines()[0])
    line = line[line.index("RESOURCE_EXHAUSTED"):][:300] if "RESOURCE_EXHAUSTED" in line else line[:300]
    sizes = [float(v) * _UNITS[u[0]] for v, u in _BYTES.findall(line)]
    temp = int(sizes[0]) if sizes else 0
    return ProgramMemory(name, shape, argument=argument, output=0, alias=0, temp=temp, peak=argument + temp,
                         outside=outside, compile_seconds=seconds, error=line)


def device_memory_limit() -> int | None:
    """Bytes of memory one device offers (``memory_stats()["bytes_limit"]``), or None where the
    devices do not say (CPU)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 -- unsupported on this backend
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def check_fits(programs: list[ProgramMemory], limit: int | None) -> None:
    """Raise ConfigError naming the config fields of the fullest program when its phase needs more
    than ``limit`` bytes per device (None: the devices do not say; nothing is checked)."""
    if not limit or not programs:
        return
    worst = fullest(programs)
    if fits(worst, limit):
        return
    fields = FIELDS[worst.name]
    how = f"the compiler refused it: {worst.error}" if worst.error else (
        f"XLA's peak {worst.peak / GiB:.2f} GiB + {worst.outside / GiB:.2f} GiB of state resident outside it")
    raise ConfigError(
        f"config.{fields.split(' / ')[0]}: the step's {worst.name} program ({worst.shape}) needs "
        f"{worst.total / GiB:.2f} GiB per device ({how}) but a device has {limit / GiB:.2f} GiB; change "
        f"{fields} (check a target with tools/plan_memory.py)")


def report(programs: list[ProgramMemory], hbm_bytes: int, device: str) -> tuple[str, bool]:
    """The table of ``programs`` against ``hbm_bytes`` per device; (text, fits)."""
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    width = max([14] + [len(p.name) + 1 for p in programs])
    lines = [f"per-device memory (GiB) on {device}, {g(hbm_bytes)} GiB HBM each",
             f"{'program':<{width}}{'args':>8}{'output':>8}{'alias':>8}{'temp':>8}{'peak':>8}{'+outside':>10}"
             f"{'total':>8}{'of HBM':>8}{'compile s':>11}"]
    for p in programs:
        lines.append(f"{p.name:<{width}}{g(p.argument):>8}{g(p.output):>8}{g(p.alias):>8}{g(p.temp):>8}{g(p.peak):>8}"
                     f"{g(p.outside):>10}{g(p.total):>8}{p.total / hbm_bytes:>8.0%}{p.compile_seconds:>11.1f}")
    lines.append("(total = XLA's peak + resident state outside the program: the AdamW state during the sampler "
                 "and pi_old, PPO's critic state during the actor's programs and the actor's during the critic's)")
    for p in programs:
        lines.append(f"  {p.name}: {p.shape}")
        if p.error:
            lines.append(f"  {p.name}: NOT COMPILED, {p.error} (its peak above: arguments + those temporaries)")
        lines += [f"  {p.name}: {fact}" for fact in p.loop_facts]
    worst = fullest(programs)
    lines.append(f"to shrink the fullest ({worst.name}): {FIELDS[worst.name]}")
    lines.append(f"peak per device: {peak_words(worst, hbm_bytes)}")
    return "\n".join(lines), fits(worst, hbm_bytes)


def fullest(programs: list[ProgramMemory]) -> ProgramMemory:
    """The program whose phase needs the most memory a device."""
    return max(programs, key=lambda p: p.total)


def fits(program: ProgramMemory, hbm_bytes: int) -> bool:
    """Whether ``program``'s phase fits a device of ``hbm_bytes``."""
    return program.total <= hbm_bytes


def peak_words(program: ProgramMemory, hbm_bytes: int) -> str:
    """"X GiB of Y GiB (fits)" (or "does not fit"): what ``program``'s phase needs a device, against ``hbm_bytes``."""
    return (f"{program.total / GiB:.2f} GiB of {hbm_bytes / GiB:.2f} GiB "
            f"({'fits' if fits(program, hbm_bytes) else 'does not fit'})")
