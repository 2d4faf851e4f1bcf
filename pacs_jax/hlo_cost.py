"""What a compiled program costs per device, every loop counted as many times as it runs.

XLA's ``compiled.cost_analysis()`` counts a ``while`` body once, so a program whose work sits in
loops (the layer scan, a decode loop, packed passes, the LM head's chunks) reads as one trip of
each. ``program_cost`` reads the compiled HLO text instead and counts each instruction times the
trips of the loops around it:

    cost = program_cost(compiled.as_text(), trips=lambda loop: ...)
    cost.flops, cost.bytes, cost.collective_bytes      # per device, the whole program

A loop's trips are XLA:GPU's ``known_trip_count``, or read from its condition when that compares
the induction variable with a constant (a ``lax.scan``, a ``fori_loop`` of static bounds, XLA:TPU's
windowed einsums: ``i < N``, the counter's start read from the loop's initial tuple when it is a
constant there (else 0) and its step from the body's ``i + c``: XLA:TPU's windowed einsums step by 2,
two shards a trip (else 1)); a loop whose bound only
the device knows (a decode loop, the passes of a packing plan, the LM head chunks of a packed pass)
is a ``Loop`` passed to ``trips``, which returns its trips (its nesting tells which it is:
``Loop.depth``, ``Loop.holds_loops``).

Counted as XLA's HloCostAnalysis counts them, in simplified form: FLOPs of ``dot`` and
``convolution`` (2 x output elements x contracted size; elementwise work is not counted), bytes of
every instruction outside fusions (its operands and output; a fusion's operand that the fusion only
slices counts the slice, also when it slices the operand's sum over a dimension or its conversion (XLA:GPU
fuses a split-K gemm's partials, summed, into each consumer of a slice of them: each reads its own
columns' partials); an operand updated in place counts the update), collective bytes (the
output of an all-gather / all-reduce / reduce-scatter / all-to-all / collective-permute). A
custom call (a Pallas kernel) counts its operands and outputs as bytes and no FLOPs, as XLA does.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
         "after-all", "opt-barrier", "partition-id", "replica-id", "iota"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # op: where its updates start among its operands


def array_bytes(shape: str) -> float:
    """Bytes of an HLO shape (an array or a tuple of them), e.g. ``bf16[8,128]{1,0}``."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _dims(shape: str) -> tuple[int, ...]:
    match = _ARRAY.search(shape)
    return tuple(int(d) for d in match.group(2).split(",") if d) if match else ()


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    args: str  # the text between the op's parentheses: parameter(N)'s N, constant(V)'s V
    attrs: str


def _split_top(text: str) -> tuple[str, str]:
    """``text`` starts after an opening parenthesis: (what is inside it, what follows it)."""
    depth = 1
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[:i], text[i + 1:]
    return text, ""


def _parse_line(line: str) -> _Instr | None:
    match = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
    if not match:
        return None
    rest = line[match.end():]
    if rest.startswith("("):
        inner, rest = _split_top(rest[1:])
        shape = f"({inner})"
    else:
        shape, _, rest = rest.partition(" ")
    op_match = re.match(r"\s*([\w\-]+)\(", rest)
    if not op_match:
        return None
    args, attrs = _split_top(rest[op_match.end():])
    operands = re.findall(r"%([\w.\-]+)", args)
    return _Instr(match.group(1), shape, op_match.group(1), operands, args, attrs)


def _computations(hlo_text: str) -> tuple[dict[str, list[_Instr]], str, dict[str, str]]:
    """({computation: its instructions}, the ENTRY computation's name, {computation: its ROOT's name})."""
    comps: dict[str, list[_Instr]] = {}
    roots: dict[str, str] = {}
    entry, current, name = "", None, ""
    for line in hlo_text.splitlines():
        header = _HEADER.match(line) if line and not line[0].isspace() else None
        if header:
            name = header.group(2)
            current = comps.setdefault(name, [])
            entry = name if header.group(1) else entry
        elif current is not None and line.startswith(" "):
            instr = _parse_line(line)
            if instr:
                current.append(instr)
                if line.lstrip().startswith("ROOT "):
                    roots[name] = instr.name
    return comps, entry, roots


def _integer(instr: _Instr | None) -> int | None:
    """The value of an integer scalar ``constant``, else None."""
    if instr is None or instr.op != "constant" or not re.fullmatch(r"-?\d+", instr.args.strip()):
        return None
    return int(instr.args)


def _tuple_index(instr: _Instr | None) -> int | None:
    """The index of a ``get-tuple-element`` (of the loop's parameter, in a loop's body or condition)."""
    match = re.search(r"index=(\d+)", instr.attrs) if instr is not None and instr.op == "get-tuple-element" else None
    return int(match.group(1)) if match else None


def _through(table: dict[str, _Instr], instr: _Instr | None, op: str) -> _Instr | None:
    """The instruction a chain of ``op`` instructions starts from (``copy``: XLA:TPU copies a scan's
    counter before its increment; ``bitcast``: a fusion's view of its operand), or ``instr`` itself."""
    while instr is not None and instr.op == op and instr.operands:
        instr = table.get(instr.operands[0])
    return instr


def _callee(attrs: str, key: str) -> str | None:
    match = re.search(rf"{key}=%?([\w.\-]+)", attrs)
    return match.group(1) if match else None


@dataclasses.dataclass(frozen=True)
class Loop:
    """A ``while`` whose trip count the compiled program does not hold. depth: the loops around it
    (0: outermost); holds_loops: whether its body runs loops of its own; name: the instruction."""

    name: str
    depth: int
    holds_loops: bool


@dataclasses.dataclass
class Cost:
    """Per device: FLOPs (dots and convolutions), bytes accessed, collective bytes (the outputs of
    collectives; a share of ``bytes``), the loops whose trips came from ``trips``, and those counted
    from their bound whose counter does not step as ``counter + constant`` in the HLO (``unread_steps``,
    by instruction name: taken to step by 1, so their trips may be overstated)."""

    flops: float = 0.0
    bytes: float = 0.0
    collective_bytes: float = 0.0
    asked: tuple[Loop, ...] = ()
    unread_steps: tuple[str, ...] = ()

    def add(self, other: "Cost", times: float) -> None:
        self.flops += other.flops * times
        self.bytes += other.bytes * times
        self.collective_bytes += other.collective_bytes * times


class _Program:
    """A compiled module's computations, costed one at a time with the loops around them."""

    def __init__(self, hlo_text: str, trips: Callable[[Loop], float],
                 custom_call_bytes: Callable[[float, list[float]], float] | None = None,
                 skip_scopes: frozenset[str] = frozenset()):
        self.custom_call_bytes = custom_call_bytes
        self.skip_scopes = skip_scopes
        self.comps, self.entry, self.roots = _computations(hlo_text)
        self.trips_of = trips
        self.asked: list[Loop] = []
        self.unread_steps: list[str] = []
        self.shapes = {c: {i.name: i for i in instrs} for c, instrs in self.comps.items()}

    # -------------------------------------------------------------- FLOPs of one instruction
    def _flops(self, comp: str, instr: _Instr) -> float:
        table = self.shapes[comp]
        out = math.prod(_dims(instr.shape))
        if instr.op == "dot":
            lhs = _dims(table[instr.operands[0]].shape) if instr.operands[0] in table else ()
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
            size = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 1
            return 2.0 * out * size
        if instr.op == "convolution":  # XLA:TPU's dots; a spatial dim takes at most the input's size in taps
            lhs, kernel = (_dims(table[o].shape) if o in table else () for o in instr.operands[:2])
            labels = re.search(r"dim_labels=(\w+)_(\w+)->", instr.attrs)
            if not kernel or not lhs or not labels:
                return 0.0
            lhs_labels, kernel_labels = labels.groups()
            size = math.prod(d if label == "i" else min(d, lhs[lhs_labels.index(label)])
                             for d, label in zip(kernel, kernel_labels) if label != "o")
            groups = re.search(r"feature_group_count=(\d+)", instr.attrs)
            return 2.0 * out * size / (int(groups.group(1)) if groups else 1)
        return 0.0

    def _fused_flops(self, comp: str) -> float:
        total = 0.0
        for instr in self.comps.get(comp, []):
            total += self._flops(comp, instr)
            if instr.op == "fusion":
                total += self._fused_flops(_callee(instr.attrs, "calls") or "")
        return total

    # -------------------------------------------------------------- bytes of a fusion's operands
    def _fusion_bytes(self, instr: _Instr, table: dict[str, _Instr]) -> float:
        """The fusion's output and operands; an operand the fusion only slices (or slices the sum or
        conversion of: ``_read_share``) counts the slices' share of it, and the buffer of an in-place
        dynamic-update-slice or scatter (the root, or an element of a root tuple: XLA:TPU updates the
        K and V pools in one fusion) counts the update, read and written."""
        callee = _callee(instr.attrs, "calls") or ""
        fused, table_in = self.comps.get(callee, []), self.shapes.get(callee, {})
        users: dict[str, list[_Instr]] = {}
        for i in fused:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        root = table_in.get(self.roots.get(callee, ""))
        outputs = [table_in.get(o) for o in root.operands] if root is not None and root.op == "tuple" else [root]
        total, in_place = 0.0 if root is not None else array_bytes(instr.shape), set()
        for out in outputs:
            in_place_op = out is not None and out.op in _IN_PLACE
            buffer = _through(table_in, table_in.get(out.operands[0]), "bitcast") if in_place_op else None
            if buffer is not None and buffer.op == "parameter":  # the fusion's operand, updated where it lies
                in_place.add(out.operands[0])
                total += 2 * sum(array_bytes(table_in[o].shape) for o in out.operands[_IN_PLACE[out.op]:]
                                 if o in table_in)
            elif out is not None:
                total += array_bytes(out.shape)
        params = {int(i.args): i for i in fused if i.op == "parameter"}
        for k, operand in enumerate(instr.operands):
            p = params.get(k)
            if p is not None and (p.name in in_place or in_place & {u.name for u in users.get(p.name, [])
                                                                    if u.op == "bitcast"}):
                continue
            whole = array_bytes(table[operand].shape) if operand in table else 0.0
            share = self._read_share(_callee(instr.attrs, "calls") or "", p) if p is not None else None
            total += whole * min(1.0, share) if share is not None else whole
        return total

    def _read_share(self, comp: str, value: _Instr) -> float | None:
        """The share of ``value``'s elements that the fusion ``comp`` reads, when each of its readers only
        slices it (a slice's elements over its operand's) or reduces or converts it into a value that is
        only sliced in turn (a split-K gemm's partials [S, M, N], reduced and sliced by each consumer: an
        output element reads the S partials of its own (m, n) only); None when a reader reads it whole."""
        share = 0.0
        for u, first, where in self._readers(comp, value.name):
            if u.op in _SLICING and first:
                share += math.prod(_dims(u.shape)) / max(1, math.prod(_dims(value.shape)))
            elif first and (u.op == "convert" or (u.op == "reduce" and len(u.operands) == 2)):
                inner = self._read_share(where, u)
                if inner is None:
                    return None
                share += inner
            else:
                return None
        return share or None

    def _readers(self, comp: str, name: str) -> list[tuple[_Instr, bool, str]]:
        """The instructions of ``comp`` that read value ``name``, looking through bitcasts and into
        nested fusions (to the instructions that read the matching parameter there), each with
        whether ``name`` is its first operand (the array a slice reads from, not an index) and the
        computation that holds it."""
        out = []
        for u in self.comps.get(comp, []):
            if name not in u.operands:
                continue
            if u.op == "bitcast":
                out += self._readers(comp, u.name)
            elif u.op == "fusion":
                inner = _callee(u.attrs, "calls") or ""
                numbers = [k for k, o in enumerate(u.operands) if o == name]
                out += [r for i in self.comps.get(inner, []) if i.op == "parameter" and int(i.args) in numbers
                        for r in self._readers(inner, i.name)]
            else:
                out.append((u, u.operands[0] == name, comp))
        return out

    # -------------------------------------------------------------- a computation, loops multiplied
    def cost(self, comp: str, depth: int = 0) -> Cost:
        total = Cost()
        table = self.shapes.get(comp, {})
        for instr in self.comps.get(comp, []):
            op = instr.op.removesuffix("-start")
            if instr.op == "while":
                body, cond = _callee(instr.attrs, "body"), _callee(instr.attrs, "condition")
                trips = self._trips(instr, body, cond, depth, table)
                total.add(self.cost(body, depth + 1), trips)
                total.add(self.cost(cond, depth + 1), trips + 1)
                continue
            if instr.op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", instr.attrs)
                names = [n.strip().lstrip("%") for n in branches.group(1).split(",")] if branches else [
                    _callee(instr.attrs, "true_computation"), _callee(instr.attrs, "false_computation")]
                names = [n for n in names if n]
                runs = [n for n in names if not self._branch_scopes(n) & self.skip_scopes] or names
                costs = [self.cost(n, depth) for n in runs]
                if costs:  # the costliest branch of those that run
                    total.add(max(costs, key=lambda c: c.bytes + c.flops), 1)
                continue
            if instr.op == "call":
                total.add(self.cost(_callee(instr.attrs, "to_apply") or "", depth), 1)
                continue
            if instr.op in _FREE or instr.op.endswith("-done"):
                continue
            if op in _COLLECTIVES:
                total.collective_bytes += array_bytes(instr.shape)
            if instr.op == "fusion":
                total.flops += self._fused_flops(_callee(instr.attrs, "calls") or "")
                total.bytes += self._fusion_bytes(instr, table)
                continue
            total.flops += self._flops(comp, instr)
            if instr.op == "custom-call" and self.custom_call_bytes is not None:
                total.bytes += self.custom_call_bytes(
                    array_bytes(instr.shape), [array_bytes(table[o].shape) for o in instr.operands if o in table])
            elif instr.op in ("dynamic-slice", "slice"):
                total.bytes += 2 * array_bytes(instr.shape)
            elif instr.op == "dynamic-update-slice":
                total.bytes += 2 * array_bytes(table[instr.operands[1]].shape) if instr.operands[1] in table else 0
            else:
                total.bytes += array_bytes(instr.shape) + sum(
                    array_bytes(table[o].shape) for o in instr.operands if o in table)
        return total

    def _branch_scopes(self, comp: str) -> set[str]:
        """The named scopes (``jax.named_scope``) a conditional's branch computation was traced under:
        the component after the last ``branch_N_fun/`` of its instructions' op_name."""
        scopes = set()
        for i in self.comps.get(comp, []):
            name = re.search(r'op_name="([^"]*)"', i.attrs)
            inner = re.findall(r"branch_\d+_fun/([^/]+)", name.group(1)) if name else []
            scopes.update(inner[-1:])
        return scopes

    def _trips(self, instr: _Instr, body: str, cond: str, depth: int, caller: dict[str, _Instr]) -> float:
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
        if known:
            return float(known.group(1))
        root = self.comps.get(cond, [])[-1:] or []
        table = self.shapes.get(cond, {})
        if root and root[0].op == "compare" and "direction=LT" in root[0].attrs and len(root[0].operands) > 1:
            bound, counter = _integer(table.get(root[0].operands[1])), table.get(root[0].operands[0])
            index = _tuple_index(counter)
            if bound is not None and index is not None:
                start, step = self._counter(instr, body, index, caller)
                if step is None:
                    self.unread_steps.append(instr.name)
                return float(max(0, math.ceil((bound - start) / (step or 1))))
        loop = Loop(instr.name, depth, any(i.op == "while" for i in self._reached(body)))
        self.asked.append(loop)
        return float(self.trips_of(loop))

    def _counter(self, instr: _Instr, body: str, index: int, caller: dict[str, _Instr]) -> tuple[int, int | None]:
        """(start, step) of the loop counter at tuple ``index``: its initial value when the while's
        operand tuple gives a constant there (else 0), and the positive constant the body adds to it
        (XLA:TPU's windowed einsums step by 2: two shards a trip, bidirectionally; scans by 1), or None
        when the body's new counter is not ``counter + constant``."""
        init = caller.get(instr.operands[0]) if instr.operands else None
        start = _integer(caller.get(init.operands[index])) if init is not None and init.op == "tuple" and \
            index < len(init.operands) else None
        table, root = self.shapes.get(body, {}), self.roots.get(body)
        update = table.get(table[root].operands[index]) if root in table and table[root].op == "tuple" and \
            index < len(table[root].operands) else None
        step = None
        if update is not None and update.op == "add" and len(update.operands) == 2:
            a, b = (_through(table, table.get(o), "copy") for o in update.operands)
            if _tuple_index(a) == index:
                step = _integer(b)
            elif _tuple_index(b) == index:
                step = _integer(a)
        return start or 0, step if step and step > 0 else None

    def _reached(self, comp: str) -> list[_Instr]:
        out, todo, seen = [], [comp], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for i in self.comps.get(name, []):
                out.append(i)
                todo += [c for key in ("body", "condition", "to_apply", "calls") if (c := _callee(i.attrs, key))]
        return out


def program_cost(hlo_text: str, trips: Callable[[Loop], float] | None = None, *,
                 custom_call_bytes: Callable[[float, list[float]], float] | None = None,
                 skip_scopes: frozenset[str] = frozenset()) -> Cost:
    """The per-device ``Cost`` of a compiled program's HLO text (``compiled.as_text()``), each loop
    counted ``trips`` times: read from the loop when it compares its counter with a constant, else
    ``trips(loop)`` (default: a ValueError naming the loop). custom_call_bytes: (output bytes, operand
    bytes) -> the bytes a custom call (a Pallas kernel) reads and writes, when not all of them (a
    paged-attention kernel handed the whole page pool reads only a row's pages). A ``conditional``
    counts its costliest branch of those that run: a branch traced under one of ``skip_scopes``
    (``jax.named_scope`` names: ``_branch_scopes``) does not (tools/plan_step.py: a rollout's greedy
    selection never runs, the top-p bisection only when top_p < 1), unless every branch is skipped."""

    def unknown(loop: Loop) -> float:
        raise ValueError(f"loop {loop.name} (depth {loop.depth}): its trip count is known only on the device")

    program = _Program(hlo_text, trips or unknown, custom_call_bytes, skip_scopes)
    cost = program.cost(program.entry)
    cost.asked = tuple(program.asked)
    cost.unread_steps = tuple(dict.fromkeys(program.unread_steps))
    return cost

