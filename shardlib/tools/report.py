"""What a compiled program will do, read from the program itself: machine-independent figures.

* ``collective_stats(hlo)``: every collective in an HLO module, the bytes one device sends for it
  (ring-algorithm volumes, as DESIGN.md counts them), and how many times it runs per execution
  (while-loop trip counts multiply through the call graph).
* ``memory_stats(compiled)``: XLA's per-device buffer sizes and peak.
* ``flops_per_step`` / ``mfu`` / ``peak_flops_for``: FLOP counts and model FLOP utilisation.
* ``format_bytes`` / ``format_table``: the text formatting every report and CLI banner uses.

Volumes per device per execution, for a collective whose full (unsharded) buffer is S bytes over
a group of N devices: all-reduce 2(N-1)/N S; all-gather and reduce-scatter (N-1)/N S, where S is
the all-gather output and the reduce-scatter *input* (output x N); all-to-all (N-1)/N S;
collective-permute S. Groups of one device move nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Union

# ----------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------

_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: float) -> str:
    """Human-readable binary size ("512 B", "1.50 MiB"); reports use it so sizes compare at a glance."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{value:.0f} B"
    for unit in _BINARY_UNITS:
        value /= 1024.0
        if value < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{sign}{value:.2f} {unit}"
    raise AssertionError("unreachable")


Column = Union[str, tuple[str, str]]

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _cell(value: Any) -> str:
    """One table cell: None as '-', floats to 4 significant digits, everything else via str."""
    if value is None:
        return "-"
    if isinstance(value, float) and not isinstance(value, bool):
        return f"{value:.4g}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column] | None = None) -> str:
    """Aligned plain-text table; numbers right-aligned, text left-aligned.

    ``columns`` lists row keys, or ``(key, header)`` pairs; by default the first row's keys.
    Plain text (no box drawing) so it survives logs, notebooks and CI output unchanged.
    """
    if columns is None:
        columns = list(rows[0].keys()) if rows else []
    keys = [c if isinstance(c, str) else c[0] for c in columns]
    headers = [c if isinstance(c, str) else c[1] for c in columns]
    cells = [[_cell(row.get(k)) for k in keys] for row in rows]
    numeric = [any(_is_number(row.get(k)) for row in rows) for k in keys]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def format_markdown(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """The same rows as a Markdown table (for BENCHMARKS.md); floats with 3 decimals."""
    columns = list(columns if columns is not None else (rows[0].keys() if rows else []))
    text = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(text(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# HLO shapes
# ----------------------------------------------------------------------------------------------

# Bits per element. Sub-byte and fp8 types are packed; token and opaque types hold no data.
_DTYPE_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "tf32": 32,
    "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "token": 0, "opaque": 0,
}


def dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO element type (fp8/fp6/fp4 variants by their prefix)."""
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    for prefix, bits in (("f8", 8), ("f6", 6), ("f4", 4)):
        if dtype.startswith(prefix):
            return bits
    raise ValueError(f"unknown HLO element type {dtype!r}")


class ArrayShape(NamedTuple):
    """One HLO array shape: element type and dimensions (dynamic dims at their bound)."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.ceil(math.prod(self.dims) * dtype_bits(self.dtype) / 8)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


Shape = Union[ArrayShape, tuple]  # a tuple holds nested Shapes

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_LAYOUT_RE = re.compile(r"\{[^{}]*\}")
_COMMENT_RE = re.compile(r"/\*.*?\*/")


def _parse_dims(text: str) -> tuple[int, ...]:
    dims = []
    for d in filter(None, (t.strip() for t in text.split(","))):
        d = d.removeprefix("<=")
        dims.append(int(d) if d.isdigit() else 0)
    return tuple(dims)


def _parse_shape_at(text: str, i: int) -> tuple[Shape, int]:
    while text[i] == " ":
        i += 1
    if text[i] == "(":
        items: list[Shape] = []
        i += 1
        while True:
            while text[i] == " ":
                i += 1
            if text[i] == ")":
                return tuple(items), i + 1
            item, i = _parse_shape_at(text, i)
            items.append(item)
            while text[i] == " ":
                i += 1
            if text[i] == ",":
                i += 1
    m = _ARRAY_RE.match(text, i)
    if m is None:
        raise ValueError(f"cannot parse HLO shape at {text[i:i + 40]!r}")
    return ArrayShape(m.group(1), _parse_dims(m.group(2))), m.end()


def parse_shape(text: str) -> Shape:
    """Parse an HLO shape such as ``f32[8,16]{1,0}`` or ``(f32[4], (bf16[2]))`` (layouts dropped)."""
    clean = _LAYOUT_RE.sub("", _COMMENT_RE.sub("", text)).strip()
    try:
        shape, _ = _parse_shape_at(clean, 0)
    except IndexError as err:
        raise ValueError(f"cannot parse HLO shape {text!r}") from err
    return shape


def shape_leaves(shape: Shape) -> list[ArrayShape]:
    """The arrays of a (possibly nested) tuple shape, in order."""
    if isinstance(shape, ArrayShape):
        return [shape]
    return [leaf for item in shape for leaf in shape_leaves(item)]


def shape_str(shape: Shape) -> str:
    if isinstance(shape, ArrayShape):
        return str(shape)
    return "(" + ", ".join(shape_str(s) for s in shape) + ")"


# ----------------------------------------------------------------------------------------------
# HLO module text -> computations of instructions
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One parsed HLO instruction: enough to find collectives and the call graph."""

    name: str
    shape: Shape
    opcode: str
    operands: str  # the text between the opcode's parentheses (a constant's literal value)
    attrs: str  # everything after the operand list
    computation: str


@dataclasses.dataclass(frozen=True)
class HloModule:
    """Computations (name -> instructions), the entry computation and module-level counts."""

    computations: dict[str, list[Instruction]]
    entry: str | None
    num_partitions: int | None
    replica_count: int | None


def _matching(text: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index just past the bracket that closes ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_ch}{close_ch} in {text[start:start + 80]!r}")


_INSTR_RE = re.compile(r"^\s+(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_OPCODE_RE = re.compile(r"\s*(?P<op>[a-z][a-z0-9\-]*)\(")


def _parse_instruction(line: str, computation: str) -> Instruction | None:
    m = _INSTR_RE.match(line)
    if m is None:
        return None
    rest = m.group("rest")
    if rest.startswith("("):
        end = _matching(rest, 0, "(", ")")
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    op = _OPCODE_RE.match(rest, end)
    if op is None:
        return None
    operands_end = _matching(rest, op.end() - 1, "(", ")")
    try:
        shape = parse_shape(rest[:end])
    except (ValueError, IndexError) as err:
        if op.group("op").removesuffix("-start") in COLLECTIVE_KINDS:
            raise ValueError(f"cannot read the shape of collective {m.group('name')!r}: {line.strip()}") from err
        shape = ()  # an exotic shape on an instruction whose size nothing here needs
    return Instruction(
        name=m.group("name"),
        shape=shape,
        opcode=op.group("op"),
        operands=rest[op.end():operands_end - 1],
        attrs=rest[operands_end:],
        computation=computation,
    )


def _header_int(header: str, key: str) -> int | None:
    m = re.search(rf"\b{key}=(\d+)", header)
    return int(m.group(1)) if m else None


def _sdy_mesh_devices(header: str) -> int | None:
    """Device count of the Shardy mesh in pre-optimisation HLO headers (no num_partitions there)."""
    m = re.search(r"#sdy\.mesh<\[([^\]]*)\]>", header)
    if m is None:
        return None
    sizes = [int(s) for s in re.findall(r"=\s*(\d+)", m.group(1))]
    return math.prod(sizes) if sizes else None


def parse_hlo_module(text: str) -> HloModule:
    """Split HLO text (optimised ``as_text()`` or pre-optimisation) into computations.

    Only lines inside a computation block are read, so the FileNames/StackFrames tables that
    jax 0.10 prints before the computations are ignored.
    """
    computations: dict[str, list[Instruction]] = {}
    entry = None
    current: str | None = None
    num_partitions = replica_count = None
    for raw in text.splitlines():
        line = _COMMENT_RE.sub("", raw).rstrip()
        if line.startswith("HloModule"):
            num_partitions = _header_int(line, "num_partitions") or _sdy_mesh_devices(line)
            replica_count = _header_int(line, "replica_count")
            continue
        if current is None:
            if line and not line[0].isspace() and line.endswith("{"):
                is_entry = line.startswith("ENTRY")
                name = line.removeprefix("ENTRY").split()[0].lstrip("%")
                current = name
                computations[name] = []
                if is_entry:
                    entry = name
            continue
        if line == "}":
            current = None
            continue
        instr = _parse_instruction(line, current)
        if instr is not None:
            computations[current].append(instr)
    return HloModule(computations, entry, num_partitions, replica_count)


# ----------------------------------------------------------------------------------------------
# Call graph and multiplicities
# ----------------------------------------------------------------------------------------------

_SINGLE_CALL_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|scatter|select|comparator)"
    r"=%?([\w.\-]+)"
)
_LIST_CALL_RE = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


class _Edge(NamedTuple):
    callee: str
    factor: int
    trip_unknown: bool
    trip_inferred: bool
    conditional: bool


def _callees(instr: Instruction) -> list[tuple[str, str]]:
    """(attribute, computation) pairs this instruction calls."""
    found = [(k, v) for k, v in _SINGLE_CALL_RE.findall(instr.attrs)]
    for key, names in _LIST_CALL_RE.findall(instr.attrs):
        found.extend((key, n.strip().lstrip("%")) for n in names.split(",") if n.strip())
    return found


def _reachable(module: HloModule, root: str) -> list[str]:
    seen, stack = [], [root]
    while stack:
        name = stack.pop()
        if name in seen or name not in module.computations:
            continue
        seen.append(name)
        stack.extend(c for i in module.computations[name] for _, c in _callees(i))
    return seen


def _inferred_trip_count(module: HloModule, condition: str) -> int | None:
    """Trip count from a loop condition ``i < K`` (or ``i <= K``) with one integer constant.

    Pre-optimisation HLO carries no ``known_trip_count``; jax's scan/fori_loop conditions are
    ``counter < length`` with the counter starting at 0, which this recognises.
    """
    constants: set[int] = set()
    directions: set[str] = set()
    for comp in _reachable(module, condition):
        for instr in module.computations[comp]:
            if instr.opcode == "compare":
                d = re.search(r"direction=(\w+)", instr.attrs)
                directions.add(d.group(1) if d else "?")
            elif instr.opcode == "constant" and isinstance(instr.shape, ArrayShape):
                value = re.fullmatch(r"\s*(-?\d+)\s*", instr.operands)
                if instr.shape.dims == () and instr.shape.dtype[0] in "su" and value:
                    constants.add(int(value.group(1)))
    if len(constants) != 1 or len(directions) != 1:
        return None
    (k,), (direction,) = constants, directions
    return {"LT": k, "LE": k + 1}.get(direction)


def _edges(module: HloModule, instr: Instruction) -> list[_Edge]:
    """Calls made by one instruction, with how many times each callee runs per call."""
    calls = _callees(instr)
    if instr.opcode != "while":
        conditional = instr.opcode == "conditional"
        return [_Edge(c, 1, False, False, conditional) for _, c in calls]
    m = _TRIP_RE.search(instr.attrs)
    inferred = False
    trip: int | None = int(m.group(1)) if m else None
    condition = next((c for k, c in calls if k == "condition"), None)
    if trip is None and condition is not None:
        trip = _inferred_trip_count(module, condition)
        inferred = trip is not None
    unknown = trip is None
    n = 1 if trip is None else trip
    edges = []
    for key, callee in calls:
        factor = n + 1 if key == "condition" and not unknown else n
        edges.append(_Edge(callee, factor, unknown, inferred, False))
    return edges


class Multiplicity(NamedTuple):
    """Runs of a computation per program execution, and how sure that count is."""

    count: int
    trip_unknown: bool
    trip_inferred: bool
    conditional: bool


def computation_multiplicities(module: HloModule) -> dict[str, Multiplicity]:
    """How many times each computation runs per program execution.

    Roots (the ENTRY computation, or every uncalled computation in a fragment) run once; a callee
    runs (caller runs) x (trip count for while bodies, trip count + 1 for conditions, else 1),
    summed over call sites. Both branches of a ``conditional`` are counted (an upper bound).
    """
    callers: dict[str, list[tuple[str, _Edge]]] = {name: [] for name in module.computations}
    for name, instrs in module.computations.items():
        for instr in instrs:
            for edge in _edges(module, instr):
                if edge.callee in callers:
                    callers[edge.callee].append((name, edge))
    roots = {module.entry} if module.entry else {n for n, c in callers.items() if not c}
    memo: dict[str, Multiplicity] = {}

    def visit(name: str, path: frozenset[str]) -> Multiplicity:
        if name in memo:
            return memo[name]
        if name in roots:
            result = Multiplicity(1, False, False, False)
        else:
            count, unknown, inferred, conditional = 0, False, False, False
            for caller, edge in callers[name]:
                if caller in path:  # defensive: HLO call graphs are acyclic
                    continue
                up = visit(caller, path | {name})
                if up.count == 0:
                    continue
                count += up.count * edge.factor
                unknown |= up.trip_unknown or edge.trip_unknown
                inferred |= up.trip_inferred or edge.trip_inferred
                conditional |= up.conditional or edge.conditional
            result = Multiplicity(count, unknown, inferred, conditional)
        memo[name] = result
        return result

    return {name: visit(name, frozenset()) for name in module.computations}


# ----------------------------------------------------------------------------------------------
# Collectives
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective instruction and the bytes one device sends for it per program execution.

    ``buffer_bytes`` is the full (unsharded) buffer S of the DESIGN.md convention;
    ``bytes_per_call`` the ring volume of one run; ``bytes_per_step`` that times ``multiplicity``.
    ``group_size`` is None when the groups are implicit and the device count is unknown (then no
    bytes are counted). The trip-count flags say how sure the multiplicity is.
    """

    name: str
    kind: str
    dtype: str
    shape: str
    buffer_bytes: int
    group_size: int | None
    multiplicity: int
    bytes_per_call: float
    bytes_per_step: float
    computation: str
    is_async: bool = False
    trip_count_unknown: bool = False
    trip_count_inferred: bool = False
    in_conditional: bool = False


def _bytes_per_call(kind: str, buffer_bytes: int, n: int | None, moves: bool = True) -> float:
    """Ring-algorithm bytes one device sends (DESIGN.md convention)."""
    if kind == "collective-permute":
        return float(buffer_bytes) if moves else 0.0
    if not n or n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * buffer_bytes
    return (n - 1) / n * buffer_bytes


def _braced_after(attrs: str, key: str) -> str | None:
    i = attrs.find(key + "=")
    if i < 0:
        return None
    start = i + len(key) + 1
    if start >= len(attrs) or attrs[start] != "{":
        return None
    return attrs[start:_matching(attrs, start, "{", "}")]


_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[([\d,\s]+)\]<=\[")
_MESH_GROUPS_RE = re.compile(
    r"replica_groups=mesh\[(?P<mesh>[^\]]*)\](?:,\s*device_ids=\([^{}]*?\))?\s*\{(?P<axes>[^}]*)\}"
)


def _mesh_group_size(mesh_text: str, axes_text: str) -> int:
    """Group size of ``mesh['a'=2,'b'=4] {'b'}`` (sub-axes ``'b':(1)2`` count their own size)."""
    sizes = {n: int(s) for n, s in re.findall(r"'?([^',=\s]+)'?\s*=\s*(\d+)", mesh_text)}
    size = 1
    for axis in filter(None, (a.strip() for a in axes_text.split(","))):
        sub = re.match(r"'?([^':]+)'?\s*:\s*\(\d+\)\s*(\d+)", axis)
        size *= int(sub.group(2)) if sub else sizes[axis.strip("'")]
    return size


def replica_group_size(attrs: str, all_devices: int | None) -> int | None:
    """Devices per group from ``replica_groups`` in any of its printed forms.

    ``{{0,1,2,3},{4,5,6,7}}`` (explicit lists), ``[4,2]<=[8]`` / ``[2,4]<=[4,2]T(1,0)`` (iota:
    the last dimension of the first bracket), ``mesh['a'=2,'b'=4] {'b'}`` (mesh axes, what
    jax 0.10's GSPMD path prints), ``{}`` (every device: ``all_devices``).
    """
    m = _MESH_GROUPS_RE.search(attrs)
    if m:
        return _mesh_group_size(m.group("mesh"), m.group("axes"))
    m = _IOTA_GROUPS_RE.search(attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    braced = _braced_after(attrs, "replica_groups")
    if braced is None:
        return all_devices
    groups = re.findall(r"\{([^{}]*)\}", braced[1:-1])
    if not groups:
        return all_devices
    return len([t for t in groups[0].split(",") if t.strip()])


def permute_pairs(attrs: str) -> list[tuple[int, int]]:
    """``source_target_pairs={{0,1},{1,2}}`` as integer pairs."""
    braced = _braced_after(attrs, "source_target_pairs") or ""
    return [(int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", braced)]


def _result_shape(opcode: str, kind: str, shape: Shape) -> Shape:
    """The collective's result inside an async ``*-start`` shape.

    Generic async wrappers print ``((operands), result, context...)``; the dedicated starts
    print ``(operands..., results..., [u32 contexts])`` except all-reduce-start (result only).
    """
    if not opcode.endswith("-start") or isinstance(shape, ArrayShape):
        return shape
    if shape and isinstance(shape[0], tuple):
        return shape[1]
    if kind == "all-reduce":
        return shape
    leaves = [s for s in shape_leaves(shape) if not (s.dims == () and s.dtype in ("u32", "s32"))]
    return tuple(leaves[len(leaves) // 2:])


def _implicit_group(module: HloModule, attrs: str, fallback: int | None) -> int | None:
    """Group size when ``replica_groups={}``: all replicas, times all partitions for channel ops."""
    partitions = module.num_partitions or fallback
    replicas = module.replica_count or 1
    if "channel_id=" in attrs or "use_global_device_ids=true" in attrs:
        return replicas * partitions if partitions else None
    return module.replica_count or (fallback if module.num_partitions is None else 1)


def _collective_record(
    module: HloModule, instr: Instruction, mult: Multiplicity, num_devices: int | None
) -> CollectiveRecord | None:
    op = instr.opcode
    if op.endswith("-done") or op.endswith("-update"):
        return None
    is_async = op.endswith("-start")
    kind = op.removesuffix("-start")
    if kind not in COLLECTIVE_KINDS:
        return None
    if is_async and re.search(r"\bcalls=", instr.attrs):
        return None  # a wrapped collective: counted where it lives, in the called computation
    result = _result_shape(op, kind, instr.shape)
    leaves = shape_leaves(result)
    out_bytes = sum(s.nbytes for s in leaves)
    moves = True
    if kind == "collective-permute":
        pairs = permute_pairs(instr.attrs)
        group = len({d for p in pairs for d in p})
        moves = any(a != b for a, b in pairs)
    else:
        group = replica_group_size(instr.attrs, _implicit_group(module, instr.attrs, num_devices))
    if kind == "reduce-scatter":
        buffer_bytes = out_bytes * group if group else out_bytes
    else:
        buffer_bytes = out_bytes
    per_call = _bytes_per_call(kind, buffer_bytes, group, moves)
    return CollectiveRecord(
        name=instr.name,
        kind=kind,
        dtype=",".join(sorted({s.dtype for s in leaves})),
        shape=shape_str(result),
        buffer_bytes=buffer_bytes,
        group_size=group,
        multiplicity=mult.count,
        bytes_per_call=per_call,
        bytes_per_step=per_call * mult.count,
        computation=instr.computation,
        is_async=is_async,
        trip_count_unknown=mult.trip_unknown,
        trip_count_inferred=mult.trip_inferred,
        in_conditional=mult.conditional,
    )


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
    """All collectives of one program and the bytes each device sends per execution (step)."""

    records: tuple[CollectiveRecord, ...]

    @property
    def total_bytes(self) -> int:
        return round(sum(r.bytes_per_step for r in self.records))

    @property
    def trip_count_unknown(self) -> bool:
        """True if some multiplicity assumed one iteration for a loop of unknown length."""
        return any(r.trip_count_unknown for r in self.records)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes per step for each of the five kinds (zero where absent)."""
        out = {k: 0.0 for k in COLLECTIVE_KINDS}
        for r in self.records:
            out[r.kind] += r.bytes_per_step
        return {k: round(v) for k, v in out.items()}

    def count_by_kind(self, per_step: bool = True) -> dict[str, int]:
        """Executions per step of each kind; ``per_step=False`` counts HLO instructions instead."""
        out = {k: 0 for k in COLLECTIVE_KINDS}
        for r in self.records:
            out[r.kind] += r.multiplicity if per_step else 1
        return out

    def of_kind(self, kind: str) -> list[CollectiveRecord]:
        return [r for r in self.records if r.kind == kind]

    def table(self) -> str:
        """One line per collective, then totals by kind."""
        rows: list[dict[str, Any]] = [
            {
                "name": r.name,
                "kind": r.kind + (" (async)" if r.is_async else ""),
                "shape": r.shape,
                "N": r.group_size,
                "x": f"{r.multiplicity}?" if r.trip_count_unknown else r.multiplicity,
                "buffer": format_bytes(r.buffer_bytes),
                "sent/step": format_bytes(r.bytes_per_step),
            }
            for r in self.records
        ]
        counts = self.count_by_kind()
        for kind, nbytes in self.bytes_by_kind().items():
            if counts[kind]:
                rows.append({"name": "total", "kind": kind, "x": counts[kind],
                             "sent/step": format_bytes(nbytes)})
        rows.append({"name": "total", "kind": "all", "x": sum(counts.values()),
                     "sent/step": format_bytes(self.total_bytes)})
        note = "\n(? = loop trip count unknown, counted once)" if self.trip_count_unknown else ""
        return format_table(rows, ["name", "kind", "shape", "N", "x", "buffer", "sent/step"]) + note


def hlo_text(program: Any) -> str:
    """HLO text of a string, a ``jax.stages.Compiled`` (optimised) or ``Lowered`` (pre-optimisation)."""
    if isinstance(program, str):
        return program
    if hasattr(program, "compiler_ir") and hasattr(program, "compile"):
        return program.compiler_ir("hlo").as_hlo_text()
    return program.as_text()


def collective_stats(hlo: str | Any, num_devices: int | None = None) -> CollectiveStats:
    """Collectives of an HLO module with per-device ring volumes and per-step multiplicities.

    ``hlo``: ``compiled.as_text()`` (optimised; note XLA:CPU upcasts bf16 collectives to f32
    there) or ``lowered.compiler_ir("hlo").as_hlo_text()`` (pre-optimisation, original dtypes),
    or the Compiled/Lowered object itself. ``num_devices`` is used only for ``replica_groups={}``
    when the module header does not say how many partitions there are.
    """
    module = parse_hlo_module(hlo_text(hlo))
    mults = computation_multiplicities(module)
    records = []
    for name, instrs in module.computations.items():
        for instr in instrs:
            record = _collective_record(module, instr, mults[name], num_devices)
            if record is not None and record.multiplicity > 0:
                records.append(record)
    return CollectiveStats(tuple(records))


# ----------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """XLA's buffer assignment for one device (all figures in bytes, per device).

    ``peak_is_estimate`` is True when the runtime gave no peak and ``peak_bytes`` is
    argument + output + temp - alias (an upper-bound-style estimate, not XLA's liveness peak).
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    peak_is_estimate: bool

    def rows(self) -> list[dict[str, str]]:
        peak_label = "peak (estimate)" if self.peak_is_estimate else "peak"
        items = [
            ("arguments", self.argument_bytes), ("outputs", self.output_bytes),
            ("temporaries", self.temp_bytes), ("aliased (donated)", self.alias_bytes),
            ("generated code", self.generated_code_bytes), (peak_label, self.peak_bytes),
        ]
        return [{"buffer": k, "per device": format_bytes(v)} for k, v in items]

    def table(self) -> str:
        return format_table(self.rows(), ["buffer", "per device"])


def memory_stats(compiled: Any) -> MemoryStats:
    """Per-device memory of a compiled program (``jax.jit(f).lower(...).compile()``).

    Reads ``compiled.memory_analysis()``; jax 0.10.2 exposes ``peak_memory_in_bytes`` (it is not
    in the repr); where a backend lacks it the peak is estimated and flagged.
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise ValueError("this backend returned no memory analysis for the compiled program")
    if isinstance(analysis, (list, tuple)):  # older multi-executable form: first program
        analysis = analysis[0]

    def get(attr: str) -> int:
        return int(getattr(analysis, attr, 0) or 0)

    argument, output = get("argument_size_in_bytes"), get("output_size_in_bytes")
    temp, alias = get("temp_size_in_bytes"), get("alias_size_in_bytes")
    peak = getattr(analysis, "peak_memory_in_bytes", None)
    estimate = peak is None or (int(peak) <= 0 and argument + output + temp > 0)
    return MemoryStats(
        argument_bytes=argument,
        output_bytes=output,
        temp_bytes=temp,
        alias_bytes=alias,
        generated_code_bytes=get("generated_code_size_in_bytes"),
        peak_bytes=argument + output + temp - alias if estimate else int(peak),
        peak_is_estimate=estimate,
    )


# ----------------------------------------------------------------------------------------------
# FLOPs and MFU
# ----------------------------------------------------------------------------------------------


def flops_per_step(compiled: Any) -> float | None:
    """XLA's FLOP count for one execution on one device, or None if the backend gives none.

    Caveat (verified on jax 0.10.2 CPU): XLA's cost analysis counts a ``while`` body once, not
    once per iteration, so scanned models are under-counted; use analytic model FLOPs for MFU.
    """
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends raise instead of returning nothing
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    flops = float(cost["flops"])
    return flops if flops >= 0 else None


def mfu(model_flops_per_step: float, step_time_s: float, n_devices: int,
        peak_flops_per_device: float) -> float:
    """Model FLOP utilisation: achieved model FLOP/s over the devices' summed peak.

    ``model_flops_per_step`` is for the whole global batch (all devices together), e.g.
    6 x params x tokens for a transformer step, without remat recomputation.
    """
    if step_time_s <= 0 or n_devices <= 0 or peak_flops_per_device <= 0:
        raise ValueError(
            f"mfu needs positive step time, device count and peak: got step_time_s={step_time_s}, "
            f"n_devices={n_devices}, peak_flops_per_device={peak_flops_per_device}"
        )
    return model_flops_per_step / (step_time_s * n_devices * peak_flops_per_device)


# Dense bf16 peak FLOP/s per device (chip), from the vendors' data sheets (no sparsity).
PEAK_FLOPS: dict[str, float] = {
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6e": 918e12,
}

# ``device.device_kind`` substrings (lower case) -> PEAK_FLOPS key; first match wins, so the
# more specific names come first ("TPU v5 lite" is v5e, plain "TPU v5" is v5p).
_KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    ("h100 pcie", "H100 PCIe"),
    ("h100 nvl", "H100 NVL"),
    ("h100", "H100 SXM"),
    ("h200", "H200"),
    ("a100", "A100"),
    ("v5 lite", "TPU v5e"),
    ("v5litepod", "TPU v5e"),
    ("v5e", "TPU v5e"),
    ("v5p", "TPU v5p"),
    ("v6 lite", "TPU v6e"),
    ("v6e", "TPU v6e"),
    ("tpu v4", "TPU v4"),
)


def peak_flops_for(device: Any) -> float | None:
    """Dense bf16 peak FLOP/s of a ``jax.Device`` (or a device_kind string); None if unknown/CPU."""
    if not isinstance(device, str) and getattr(device, "platform", None) == "cpu":
        return None
    kind = (device if isinstance(device, str) else getattr(device, "device_kind", "")).lower().strip()
    if kind == "tpu v5":
        return PEAK_FLOPS["TPU v5p"]
    for pattern, key in _KIND_PATTERNS:
        if pattern in kind:
            return PEAK_FLOPS[key]
    return None


__all__ = [
    "COLLECTIVE_KINDS",
    "PEAK_FLOPS",
    "ArrayShape",
    "CollectiveRecord",
    "CollectiveStats",
    "HloModule",
    "MemoryStats",
    "Multiplicity",
    "collective_stats",
    "computation_multiplicities",
    "flops_per_step",
    "format_bytes",
    "format_table",
    "hlo_text",
    "memory_stats",
    "mfu",
    "parse_hlo_module",
    "parse_shape",
    "peak_flops_for",
    "replica_group_size",
]
