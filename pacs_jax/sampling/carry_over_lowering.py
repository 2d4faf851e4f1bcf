"""Carry-over's six programs (a call's four, a resume's two) lowered and compiled ahead of time on
abstract arguments (``CarryOverSampler.lower``), as ``engine.lower_sample`` the one-call sampler's: the
trainer's warm-up compiles them before step 1 and reads XLA's memory of them."""

from __future__ import annotations

import dataclasses
import types

import jax
from flax import nnx

from pacs_jax.sampling.carry_over_programs import chunk_program, harvest_program, insert_program
from pacs_jax.sampling.carry_over_records import SavedRows
from pacs_jax.sampling.carry_over_resume import reseat_program, restore_program
from pacs_jax.sampling.carry_over_state import CarryOverSpec
from pacs_jax.sampling.seam import abstract_results, device_bytes
from pacs_jax.sampling.selection import Selection


@dataclasses.dataclass(frozen=True)
class CarryOverCompiled:
    """The six compiled programs (init, insert, chunk, harvest; a resume's restore and reseat), read as
    one: ``as_text()`` their HLO, ``memory_analysis()`` that of the fullest. The ``CarryState`` is an
    argument (init: the result) of each, so it is counted in all; the parameters are counted among the
    arguments of the chunk, harvest and reseat programs too (``parameter_bytes`` per device), which run
    while they stay on the device without taking them."""

    programs: tuple[jax.stages.Compiled, ...]
    parameter_bytes: int

    def as_text(self) -> str:
        return "\n".join(program.as_text() for program in self.programs)

    def memory_analysis(self):
        def counted(mem, extra: int):
            peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0) or (
                mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                + mem.temp_size_in_bytes)
            return types.SimpleNamespace(argument_size_in_bytes=mem.argument_size_in_bytes + extra,
                                         output_size_in_bytes=mem.output_size_in_bytes,
                                         alias_size_in_bytes=mem.alias_size_in_bytes,
                                         temp_size_in_bytes=mem.temp_size_in_bytes, peak_memory_in_bytes=peak + extra)
        # init, insert and restore take the parameters; chunk, harvest and reseat run beside them
        outside = (0, 0, self.parameter_bytes, self.parameter_bytes, 0, self.parameter_bytes)
        return max((counted(p.memory_analysis(), extra) for p, extra in zip(self.programs, outside)),
                   key=lambda mem: mem.peak_memory_in_bytes)


@dataclasses.dataclass(frozen=True)
class CarryOverLowered:
    """The init program lowered on abstract arguments (``CarryOverSampler.lower``) and the abstract
    arguments of the others: ``compile()`` compiles it, then insert, chunk, harvest, restore and
    reseat on the abstract results of the one before (their shapes and the shardings the compiled
    programs give them, as a real call's arrays come), the state pinned to the init program's
    shardings as ``CarryOverSampler.step`` pins it, so a real call (or a resume) with these shapes
    finds all six compiled. saved: a generation's ``SavedRows``, slot_rows [C] (a resume's); axes: the
    queues' (``queue_axes``)."""

    init: jax.stages.Lowered
    graphdef: nnx.GraphDef
    params: nnx.State
    prompt_tokens: jax.ShapeDtypeStruct
    prompt_mask: jax.ShapeDtypeStruct
    budgets: jax.ShapeDtypeStruct
    key: jax.ShapeDtypeStruct
    selection: Selection
    stop_ids: jax.ShapeDtypeStruct
    version: jax.ShapeDtypeStruct
    saved: SavedRows
    slot_rows: jax.ShapeDtypeStruct
    spec: CarryOverSpec
    axes: tuple[str, ...]

    def compile(self) -> CarryOverCompiled:
        init = self.init.compile()
        state = abstract_results(self.init, init)
        pinned = dict(spec=self.spec, axes=self.axes, shardings=tuple(leaf.sharding for leaf in jax.tree.leaves(state)))
        insert_lowered = insert_program.lower(self.graphdef, self.params, state, self.prompt_tokens, self.prompt_mask,
                                              self.budgets, self.key, self.selection, self.stop_ids, self.version,
                                              ((self.prompt_tokens, self.prompt_mask),) * (self.spec.generations - 1),
                                              **pinned)
        insert = insert_lowered.compile()
        inserted = abstract_results(insert_lowered, insert)
        chunk_lowered = chunk_program.lower(self.graphdef, inserted.layout, inserted.state, self.selection,
                                            self.stop_ids, **pinned)
        chunk = chunk_lowered.compile()
        state = abstract_results(chunk_lowered, chunk)[0]
        harvest = harvest_program.lower(state, self.version, inserted.dropped, inserted.dropped_version,
                                        inserted.carried, **pinned).compile()
        restore_lowered = restore_program.lower(self.graphdef, self.params, state, self.prompt_tokens,
                                                self.prompt_mask, self.selection, self.stop_ids, self.version,
                                                self.saved, **pinned)
        restore = restore_lowered.compile()
        layout, state = abstract_results(restore_lowered, restore)
        reseat = reseat_program.lower(self.graphdef, layout, state, self.slot_rows, **pinned).compile()
        return CarryOverCompiled((init, insert, chunk, harvest, restore, reseat), device_bytes(self.params))
