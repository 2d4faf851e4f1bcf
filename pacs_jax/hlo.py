"""Reading compiled HLO text: which instructions run inside loops (every trip) and on what shapes.

Compile-time facts the tests and tools/plan_memory.py check, e.g. that no decode step all-gathers
a parameter or copies the K/V page pool (an instruction inside a ``while`` body runs on every trip
of the loop). A text may hold several modules (the sampler's programs, sampling/engine.py
``SamplerCompiled``): each is read on its own, its computations named "k/name" (k its place).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|branch_computations|true_computation|false_computation)=\{?([^,}\s]+(?:, *%[^,}\s]+)*)\}?")
_OP = re.compile(r"= *\w+\[([\d,]*)\][^ ]* (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ANY_OP = re.compile(r"= *\w+\[([\d,]*)\][^ ]* ([\w-]+)\(")


class Instruction(NamedTuple):
    """One array-valued instruction: its computation, op name and output shape."""

    computation: str
    op: str
    shape: tuple[int, ...]


def _modules(hlo_text: str) -> list[str]:
    """The modules of an HLO text, one text each."""
    return [m for m in re.split(r"\n(?=HloModule )", hlo_text) if m.strip()] or [hlo_text]


def _qualified(hlo_text: str, per_module) -> dict:
    """``per_module(module text)`` -> {name: value} of each module, its names "k/name" when there are
    several."""
    modules = _modules(hlo_text)
    if len(modules) == 1:
        return per_module(modules[0])
    return {f"{k}/{name}": value for k, module in enumerate(modules) for name, value in per_module(module).items()}


def computations(hlo_text: str) -> dict[str, str]:
    """{computation name: its text} of the HLO modules (the ENTRY computations included)."""
    return _qualified(hlo_text, _computations)


def _computations(hlo_text: str) -> dict[str, str]:
    out = {}
    for block in re.split(r"\n(?=\S)", hlo_text):
        header = block.split("\n", 1)[0]
        match = re.match(r"(?:ENTRY )?%?([\w.\-]+)", header)
        if match and header.rstrip().endswith("{"):
            out[match.group(1)] = block
    return out


def _callees(text: str) -> set[str]:
    names = set()
    for group in _CALLS.findall(text):
        names.update(name.strip().lstrip("%") for name in group.split(","))
    return names


def loop_computations(hlo_text: str) -> set[str]:
    """The computations that run inside some ``while`` loop: every loop body and condition, and what
    they call, transitively."""
    return set(_qualified(hlo_text, lambda module: dict.fromkeys(_loop_computations(module))))


def _loop_computations(hlo_text: str) -> set[str]:
    comps = _computations(hlo_text)
    todo = []
    for text in comps.values():
        for body, cond in re.findall(r"while\([^\n]*?condition=%?([\w.\-]+), body=%?([\w.\-]+)", text):
            todo += [body, cond]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += _callees(comps[name].split("\n", 1)[1] if "\n" in comps[name] else "")
    return seen


def collectives(hlo_text: str, *, in_loops: bool = False) -> list[Instruction]:
    """Every collective of the module (only those inside loops when ``in_loops``); an async pair's
    ``-start`` counts as its collective."""
    comps = computations(hlo_text)
    return _instructions(comps, loop_computations(hlo_text) if in_loops else set(comps), _OP)


def loop_instructions(hlo_text: str, ops: tuple[str, ...] | None = None) -> list[Instruction]:
    """Every array-valued instruction inside loops (only those whose op is in ``ops`` when given),
    loop-carried values read out of the carry (get-tuple-element) included."""
    found = _instructions(computations(hlo_text), loop_computations(hlo_text), _ANY_OP)
    return [i for i in found if ops is None or i.op in ops]


def _instructions(comps: dict[str, str], names, pattern: re.Pattern) -> list[Instruction]:
    """The instructions ``pattern`` (groups: output dims, op) finds in the computations ``names``."""
    return [Instruction(name, op, tuple(int(d) for d in dims.split(",") if d))
            for name in names for dims, op in pattern.findall(comps.get(name, ""))]


def gathers_of_shapes_in_loops(hlo_text: str, shapes) -> list[Instruction]:
    """The all-gathers inside loops whose output has one of ``shapes`` (dims of size 1 left out on
    both sides), e.g. every parameter's shape and one layer's slice of it: a weight gathered in every
    trip of a decode loop."""
    squeeze = lambda shape: tuple(d for d in shape if d != 1)  # noqa: E731
    wanted = {squeeze(shape) for shape in shapes}
    return [c for c in collectives(hlo_text, in_loops=True) if c.op == "all-gather" and squeeze(c.shape) in wanted]


def parameter_shapes(tree) -> set[tuple[int, ...]]:
    """Every array's shape in ``tree`` and its shape without the leading axis (one layer of a
    stacked [L, ...] parameter)."""
    shapes = set()
    for leaf in jax.tree.leaves(tree):
        shapes |= {tuple(leaf.shape), tuple(leaf.shape[1:])}
    return shapes


_LINE_OP = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = .*? ([\w\-]+)\((.*)$")
_CONTROL = re.compile(r"(?:condition|body|branch_computations|true_computation|false_computation|to_apply)=\{?(%?[\w.\-]+(?:, *%[\w.\-]+)*)\}?")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind":"([\w]+)"')


class LoopProfile(NamedTuple):
    """What a compiled program runs inside its loops, at the level of launched work (the computations
    fused into a kernel are not entered), each loop body counted once; and its loops.

    fusions: fused kernels inside loops; custom_calls: {target or library fusion kind: count} inside
    loops (Pallas Triton kernels, cuDNN, cuBLAS / Triton gemms); copies: ``copy`` instructions inside
    loops; loops: every ``while`` of the program; unknown_trip_loops: those XLA cannot count ahead (no
    ``known_trip_count``: on XLA:GPU each trip copies the loop's condition to the host);
    conditionals: ``conditional`` inside loops (on GPU one host round trip each, to pick the branch)."""

    fusions: int
    custom_calls: dict
    copies: int
    loops: int
    unknown_trip_loops: int
    conditionals: int

    def describe(self) -> str:
        calls = ", ".join(f"{n} {t}" for t, n in sorted(self.custom_calls.items())) or "none"
        return (f"{self.fusions} fusions, library kernels: {calls}; {self.copies} copies; {self.loops} loops "
                f"({self.unknown_trip_loops} with a trip count only the device knows); {self.conditionals} conditionals")


def program_profile(hlo_text: str) -> LoopProfile:
    """What one run of a compiled module launches, inside loops or not (e.g. one decode step compiled
    alone), as a ``LoopProfile``: fusions, library kernels, copies and conditionals each times the
    known trips of the loops around it (a loop whose trips only the device knows: once; every branch
    of a conditional counted), and its loops."""
    profiles = []
    for module in _modules(hlo_text):
        comps = _computations(module)
        fusions = copies = loops = unknown = conditionals = 0
        calls: dict[str, int] = {}
        for name, (times, _) in _launched(comps).items():
            for line in comps[name].split("\n")[1:]:
                match = _LINE_OP.match(line)
                if not match:
                    continue
                op, rest = match.groups()
                launch = _launch(op, rest)
                if launch == "fusion":
                    fusions += times
                elif launch:
                    calls[launch] = calls.get(launch, 0) + times
                copies += times * (op == "copy")
                conditionals += times * (op == "conditional")
                loops += op == "while"
                unknown += op == "while" and "known_trip_count" not in rest
        profiles.append(LoopProfile(fusions, calls, copies, loops, unknown, conditionals))
    return _sum_profiles(profiles)


def _launch(op: str, rest: str) -> str | None:
    """What an instruction launches: "fusion", a library kernel's name (a custom call's target, a
    library fusion's kind), or None."""
    if op == "fusion":
        kind = _FUSION_KIND.search(rest)
        return kind.group(1) if kind and kind.group(1).startswith("__") else "fusion"
    if op == "custom-call":
        target = _TARGET.search(rest)
        return target.group(1) if target else "custom-call"
    return None


_HLO_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int32": "s32"}
_ARRAY_OUT = re.compile(r"(\w+)\[([\d,]*)\]")
# a fusion of one of these at its root (a tuple: several slices at once) writes a new buffer
_MATERIALIZING = ("copy", "slice", "dynamic-slice", "tuple")


def weight_copies(hlo_text: str, weights: dict[str, jax.ShapeDtypeStruct], *,
                  device_trip_loops_only: bool = False) -> dict[str, int]:
    """How many times a run of a compiled module writes one layer's slice of a stacked weight to a
    buffer of its own: {weight name: count} over ``weights`` ({name: its stacked [L, ...] shape and
    dtype}), those never copied left out; an instruction in a loop counts its loop's known trips (a
    loop whose trips only the device knows: one). A copy is a ``copy`` or a fusion whose root copies
    or slices (XLA:GPU's slice of a stacked weight for a gemm that cannot read it in place), of the
    shape [1, ...] or [...] of one layer's slice, in the weight's dtype (each such output of a fusion
    of several); weights of the same slice shape share a count (named together, "a/b").
    device_trip_loops_only: only those inside a loop whose trips only the device knows (a sampler's
    decode loops: a copy there runs every decode step)."""
    names: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for name, w in weights.items():
        dtype = _HLO_DTYPES.get(jax.numpy.dtype(w.dtype).name, jax.numpy.dtype(w.dtype).name)
        for shape in ((1, *w.shape[1:]), tuple(w.shape[1:])):
            names.setdefault((dtype, shape), []).append(name)
    counts: dict[str, int] = {}
    for module in _modules(hlo_text):
        comps = _computations(module)
        for name, (times, in_device_loop) in _launched(comps).items():
            if device_trip_loops_only and not in_device_loop:
                continue
            for line in comps[name].split("\n")[1:]:
                match = _LINE_OP.match(line)
                if not match:
                    continue
                op, rest = match.groups()
                if op not in ("copy", "fusion"):
                    continue
                callee = re.search(r"calls=%?([\w.\-]+)", rest)
                if op == "fusion" and (not callee or _root_op(comps.get(callee.group(1), "")) not in _MATERIALIZING):
                    continue
                for dtype, dims in _ARRAY_OUT.findall(line.split(" = ", 1)[1].split(f" {op}(", 1)[0]):
                    shape = tuple(int(d) for d in dims.split(",") if d)
                    if (dtype, shape) in names:
                        key = "/".join(sorted(set(names[(dtype, shape)])))
                        counts[key] = counts.get(key, 0) + times
    return counts


def _root_op(computation: str) -> str | None:
    """The op of a computation's ROOT instruction."""
    root = re.search(r"^\s*ROOT %[\w.\-]+ = .*? ([\w\-]+)\(", computation, re.M)
    return root.group(1) if root else None


def _launched(comps: dict[str, str]) -> dict[str, tuple[int, bool]]:
    """The computations a module's ENTRY runs, each with how many times a run runs it and whether it
    is inside a loop whose trips only the device knows: itself and the loop bodies, conditions,
    branches and calls it reaches (not the computations fused into kernels); a loop's body times its
    known trip count (one when only the device knows it)."""
    entry = next((name for name, text in comps.items() if text.startswith("ENTRY")), None)
    todo, launched = [(entry, 1, False)], {}
    while todo:
        name, n, in_device_loop = todo.pop()
        if name in launched or name not in comps:
            continue
        launched[name] = (n, in_device_loop)
        for line in comps[name].split("\n")[1:]:
            match = _LINE_OP.match(line)
            if match and match.group(1) in ("while", "conditional", "call"):
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', match.group(2))
                inner = n * (int(trips.group(1)) if trips else 1)
                device = in_device_loop or (match.group(1) == "while" and not trips)
                todo += [(c.strip().lstrip("%"), inner, device) for group in _CONTROL.findall(match.group(2))
                         for c in group.split(",")]
    return launched


def loop_profile(hlo_text: str, *, device_trip_loops_only: bool = False) -> LoopProfile:
    """The ``LoopProfile`` of a compiled module (of several: their sum): its ENTRY computation, the
    loops and branches it runs and those inside them, down to (not into) fused kernels.
    device_trip_loops_only: only the outermost loops whose trip count only the device knows (a
    sampler's decode loops, one per decode width), and what runs inside them (not, e.g., the
    prefill's layer scan)."""
    return _sum_profiles([_loop_profile(module, device_trip_loops_only) for module in _modules(hlo_text)])


def _sum_profiles(profiles: list[LoopProfile]) -> LoopProfile:
    calls: dict[str, int] = {}
    for profile in profiles:
        for target, count in profile.custom_calls.items():
            calls[target] = calls.get(target, 0) + count
    return LoopProfile(sum(p.fusions for p in profiles), calls, *(sum(p[i] for p in profiles) for i in range(2, 6)))


def _loop_profile(hlo_text: str, device_trip_loops_only: bool) -> LoopProfile:
    comps = _computations(hlo_text)
    entry = next((name for name, text in comps.items() if text.startswith("ENTRY")), None)
    todo, seen = [(entry, False)], set()
    fusions = copies = loops = unknown = conditionals = 0
    calls: dict[str, int] = {}
    while todo:
        name, in_loop = todo.pop()
        if (name, in_loop) in seen or name not in comps:
            continue
        seen.add((name, in_loop))
        for line in comps[name].split("\n")[1:]:
            match = _LINE_OP.match(line)
            if not match:
                continue
            op, rest = match.groups()
            if op == "while" and device_trip_loops_only and not in_loop and "known_trip_count" in rest:
                continue  # a counted loop outside the decode loops
            if op == "while":
                loops += 1
                unknown += "known_trip_count" not in rest
            if op in ("while", "conditional", "call"):
                todo += [(n.strip().lstrip("%"), in_loop or op == "while")
                         for group in _CONTROL.findall(rest) for n in group.split(",")]
            if not in_loop:
                continue
            launch = _launch(op, rest)  # a library kernel may be emitted as a fusion
            if launch == "fusion":
                fusions += 1
            elif launch:
                calls[launch] = calls.get(launch, 0) + 1
            elif op == "copy":
                copies += 1
            elif op == "conditional":
                conditionals += 1
    return LoopProfile(fusions, calls, copies, loops, unknown, conditionals)
