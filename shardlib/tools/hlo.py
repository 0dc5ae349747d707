"""HLO accounting: the one parser of compiled-program text that every tool reads collectives with.

* ``parse_hlo_module``: computations of instructions (names, shapes, opcodes, attributes) from
  optimised ``as_text()`` or pre-optimisation HLO.
* ``computation_multiplicities``: how many times each computation runs per execution (while-loop
  trip counts multiply through the call graph).
* ``parse_replica_groups`` / ``replica_groups`` / ``replica_group_size``: which devices a
  collective joins, from every printed form (explicit lists, iota, jax's mesh form, implicit).
* ``collective_stats``: every collective, the bytes one device sends for it and how many times
  it runs per step.

Volumes per device per execution follow the ring convention of docs/design.md ("Collective
volumes (ring convention)"), for a collective whose full (unsharded) buffer is S bytes over a
group of N devices: all-reduce 2(N-1)/N S; all-gather and reduce-scatter (N-1)/N S, where S is
the all-gather output and the reduce-scatter *input* (output x N); all-to-all (N-1)/N S;
collective-permute S. Groups of one device move nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple, Union

import numpy as np

from shardlib.text import format_bytes, format_table

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

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
    """One HLO array shape: element type, dimensions (dynamic dims at their bound) and the memory
    space its layout names (``S(n)`` in ``{1,0:T(8,128)S(5)}``; 0 when none: device memory).
    XLA numbers host memory 5 (`HOST_MEMORY_SPACE`); TPU layouts also name on-chip spaces."""

    dtype: str
    dims: tuple[int, ...]
    memory_space: int = 0

    @property
    def nbytes(self) -> int:
        return math.ceil(math.prod(self.dims) * dtype_bits(self.dtype) / 8)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


Shape = Union[ArrayShape, tuple]  # a tuple holds nested Shapes

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^{}]*\})?")
_MEMORY_SPACE_RE = re.compile(r"S\((\d+)\)")
HOST_MEMORY_SPACE = 5  # XLA's memory space of host memory (pinned_host) in a layout
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
    space = _MEMORY_SPACE_RE.search(m.group(3) or "")
    return ArrayShape(m.group(1), _parse_dims(m.group(2)), int(space.group(1)) if space else 0), m.end()


def parse_shape(text: str) -> Shape:
    """Parse an HLO shape such as ``f32[8,16]{1,0}``, ``bf16[64,128]{1,0:T(8,128)(2,1)S(1)}`` (a TPU
    tiled layout in memory space 1) or ``(f32[4], (bf16[2]))``; of a layout only the memory space is kept."""
    clean = _COMMENT_RE.sub("", text).strip()
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
    root: bool = False  # the computation's ROOT (its result)


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


_INSTR_RE = re.compile(r"^\s+(?P<root>ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
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
        root=m.group("root") is not None,
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


def parameter_bytes_by_memory_space(hlo: str | Any) -> dict[int, int]:
    """Bytes of the entry computation's parameters (one device's arguments) by the memory space
    their layouts name: 0 device memory, `HOST_MEMORY_SPACE` pinned host memory (offloaded state).
    Logical bytes: a TPU layout's tile padding is not counted."""
    module = parse_hlo_module(hlo_text(hlo))
    out: dict[int, int] = {}
    for instr in module.computations.get(module.entry, []):
        if instr.opcode == "parameter":
            for leaf in shape_leaves(instr.shape):
                out[leaf.memory_space] = out.get(leaf.memory_space, 0) + leaf.nbytes
    return out


def unfused_dots(hlo: str | Any) -> int:
    """Dot instructions run per execution outside any fusion (loop trips counted). On XLA:CPU a
    fused dot is one YNNPACK kernel; an unfused one runs as an Eigen contraction split into tasks
    on the intra-op thread pool, which costs more on a few cores shared by many simulated devices."""
    module = parse_hlo_module(hlo_text(hlo))
    fused = {name for instrs in module.computations.values() for instr in instrs if instr.opcode == "fusion"
             for name in re.findall(r"calls=%?([\w.\-]+)", instr.attrs)}
    runs = computation_multiplicities(module)
    return sum(runs[name].count for name, instrs in module.computations.items() if name not in fused
               for instr in instrs if instr.opcode == "dot")


# ----------------------------------------------------------------------------------------------
# Replica groups: which devices a collective joins
# ----------------------------------------------------------------------------------------------


def _braced_after(attrs: str, key: str) -> str | None:
    i = attrs.find(key + "=")
    if i < 0:
        return None
    start = i + len(key) + 1
    if start >= len(attrs) or attrs[start] != "{":
        return None
    return attrs[start:_matching(attrs, start, "{", "}")]


def permute_pairs(attrs: str) -> list[tuple[int, int]]:
    """``source_target_pairs={{0,1},{1,2}}`` as integer pairs."""
    braced = _braced_after(attrs, "source_target_pairs") or ""
    return [(int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", braced)]


class ReplicaGroups(NamedTuple):
    """A collective's ``replica_groups`` attribute, read once for both byte counts and link placement.

    ``groups``: the device ids of every group where the printed form gives them (None for mesh
    sub-axes, an iota list that is not two-dimensional, implicit groups or an unknown form).
    ``size``: devices per group (None when implicit or unknown). ``implicit``: no groups printed
    (``{}`` or no attribute), so the group is every device.
    """

    groups: tuple[tuple[int, ...], ...] | None
    size: int | None
    implicit: bool = False


_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_MESH_GROUPS_RE = re.compile(
    r"replica_groups=mesh\[(?P<mesh>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?)\))?"
    r"\s*\{(?P<axes>[^}]*)\}"
)
_SUB_AXIS_RE = re.compile(r"'?([^':]+)'?\s*:\s*\(\d+\)\s*(\d+)")


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _as_groups(ids: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(row) for row in ids.tolist())


def _iota(dims_text: str, perm_text: str | None) -> np.ndarray:
    """``[4,2]T(1,0)``-style device order: iota over dims, transposed by perm."""
    dims = _ints(dims_text)
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(_ints(perm_text)) if perm_text else ids


def _iota_groups(m: re.Match[str]) -> ReplicaGroups:
    """``[G,N]<=[dims]T(perm)``: G groups of N devices, read row by row from the permuted iota."""
    shape = _ints(m.group(1))
    if len(shape) != 2:  # XLA prints two dimensions; of anything else only the group size is read
        return ReplicaGroups(None, shape[-1])
    return ReplicaGroups(_as_groups(_iota(m.group(2), m.group(3)).reshape(shape)), shape[1])


def _mesh_device_order(ids_text: str | None, sizes: list[int]) -> np.ndarray:
    """Device ids laid over the mesh: ``device_ids=([2,4]T(1,0))``, an explicit list, or in order."""
    ids_text = (ids_text or "").strip()
    order = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids_text)
    if order:
        flat = _iota(order.group(1), order.group(2)).ravel()
    elif ids_text:
        flat = np.asarray(_ints(ids_text))
    else:
        flat = np.arange(math.prod(sizes))
    return flat.reshape(sizes)


def _mesh_groups(m: re.Match[str]) -> ReplicaGroups:
    """``mesh['a'=2,'b'=4] {'b'}`` (jax 0.10's GSPMD form): one group per index of the other axes.

    Sub-axes (``'b':(1)2``) give their own size; their device sets are not needed by shardlib's
    meshes, so only the size is read.
    """
    names, sizes = [], []
    for item in filter(None, (p.strip() for p in m.group("mesh").split(","))):
        name, _, size = item.partition("=")
        names.append(name.strip("' "))
        sizes.append(int(size))
    axes = [a.strip() for a in m.group("axes").split(",") if a.strip()]
    subs = [_SUB_AXIS_RE.fullmatch(a) for a in axes]
    unknown = [a for a, s in zip(axes, subs) if s is None and a.strip("'") not in names]
    if unknown:
        raise ValueError(f"replica_groups names mesh axes {unknown} that are not in mesh[{m.group('mesh')}]")
    if any(subs):
        return ReplicaGroups(None, math.prod(int(s.group(2)) if s else sizes[names.index(a.strip("'"))]
                                             for a, s in zip(axes, subs)))
    dims = [names.index(a.strip("'")) for a in axes]
    other = [d for d in range(len(sizes)) if d not in dims]
    size = math.prod(sizes[d] for d in dims)
    ids = _mesh_device_order(m.group("ids"), sizes)
    return ReplicaGroups(_as_groups(ids.transpose(other + dims).reshape(-1, size)), size)


def _explicit_groups(attrs: str) -> ReplicaGroups | None:
    """``{{0,1,2,3},{4,5,6,7}}``; ``{}`` is implicit (every device); None if not this form."""
    braced = _braced_after(attrs, "replica_groups")
    if braced is None:
        return None
    groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", braced[1:-1]))
    if not groups:
        return ReplicaGroups(None, None, implicit=True)
    return ReplicaGroups(groups, len(groups[0]))


def parse_replica_groups(attrs: str) -> ReplicaGroups:
    """The ``replica_groups`` of an instruction's attributes, in any of its printed forms.

    ``{{0,1,2,3},{4,5,6,7}}`` (explicit lists), ``[4,2]<=[8]`` / ``[2,4]<=[4,2]T(1,0)`` (iota),
    ``mesh['a'=2,'b'=4] {'b'}`` (mesh axes, what jax 0.10's GSPMD path prints), ``{}`` or no
    attribute (implicit: every device).
    """
    m = _MESH_GROUPS_RE.search(attrs)
    if m:
        return _mesh_groups(m)
    m = _IOTA_GROUPS_RE.search(attrs)
    if m:
        return _iota_groups(m)
    explicit = _explicit_groups(attrs)
    if explicit is not None:
        return explicit
    return ReplicaGroups(None, None, implicit="replica_groups=" not in attrs)


def replica_group_size(attrs: str, all_devices: int | None) -> int | None:
    """Devices per group; ``all_devices`` where the groups are implicit (or printed in an unknown form)."""
    size = parse_replica_groups(attrs).size
    return all_devices if size is None else size


def replica_groups(attrs: str, n_devices: int) -> list[list[int]] | None:
    """Every group of a collective as device ids, or None for a form that gives only a size.

    Implicit groups are all ``n_devices``; ``source_target_pairs`` become one two-device group
    per pair.
    """
    if "source_target_pairs=" in attrs:
        return [[a, b] for a, b in permute_pairs(attrs)]
    parsed = parse_replica_groups(attrs)
    if parsed.implicit:
        return [list(range(n_devices))]
    return None if parsed.groups is None else [list(g) for g in parsed.groups]


# ----------------------------------------------------------------------------------------------
# Collectives
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective instruction and the bytes one device sends for it per program execution.

    ``buffer_bytes`` is the full (unsharded) buffer S of the ring convention;
    ``bytes_per_call`` the ring volume of one run; ``bytes_per_step`` that times ``multiplicity``.
    ``group_size`` is None when the groups are implicit and the device count is unknown (then no
    bytes are counted). The trip-count flags say how sure the multiplicity is. ``replica_groups``
    holds the device ids of every group (pairs for a collective-permute), or None where the
    printed form gives only a size; `hardware.link_bytes` places the bytes on links with it.
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
    # An all-reduce whose result every device only slices its 1/N of: the program reduces the
    # full buffer (what is counted), where a reduce-scatter would send half (XLA:TPU decomposes
    # some bf16 reduce-scatters so; docs/backends.md).
    scattered: bool = False
    # An all-reduce of a zero-filled buffer each device wrote its own shard into: an all-gather
    # the program runs as an all-reduce (the full buffer is reduced; XLA:TPU does so on larger
    # slices, docs/tpu.md).
    gathered: bool = False
    # A multi-slice TPU transfer over DCN (`send` to the Megascale runtime): between slices, over
    # ``group_size`` slices; `hardware.link_bytes` puts it on the inter-domain link.
    dcn: bool = False
    replica_groups: tuple[tuple[int, ...], ...] | None = dataclasses.field(default=None, repr=False, compare=False)


def _bytes_per_call(kind: str, buffer_bytes: int, n: int | None, moves: bool = True) -> float:
    """Ring-algorithm bytes one device sends (docs/design.md, ring convention)."""
    if kind == "collective-permute":
        return float(buffer_bytes) if moves else 0.0
    if not n or n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * buffer_bytes
    return (n - 1) / n * buffer_bytes


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


class _Participants(NamedTuple):
    size: int | None
    groups: tuple[tuple[int, ...], ...] | None
    moves: bool  # False for a collective-permute whose every pair sends to itself


def _participants(module: HloModule, instr: Instruction, kind: str, num_devices: int | None) -> _Participants:
    """Who joins one collective: devices per group, the groups where printed, and whether data moves."""
    if kind == "collective-permute":
        pairs = permute_pairs(instr.attrs)
        return _Participants(len({d for p in pairs for d in p}), tuple(pairs), any(a != b for a, b in pairs))
    parsed = parse_replica_groups(instr.attrs)
    if parsed.size is not None:
        return _Participants(parsed.size, parsed.groups, True)
    size = _implicit_group(module, instr.attrs, num_devices)
    return _Participants(size, (tuple(range(size)),) if parsed.implicit and size else None, True)


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
    who = _participants(module, instr, kind, num_devices)
    group = who.size
    if kind == "reduce-scatter":
        buffer_bytes = out_bytes * group if group else out_bytes
    else:
        buffer_bytes = out_bytes
    per_call = _bytes_per_call(kind, buffer_bytes, group, who.moves)
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
        replica_groups=who.groups,
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


def collective_stats(hlo: str | Any, num_devices: int | None = None, num_slices: int | None = None) -> CollectiveStats:
    """Collectives of an HLO module with per-device ring volumes and per-step multiplicities.

    ``hlo``: ``compiled.as_text()`` (optimised; note XLA:CPU upcasts bf16 collectives to f32
    there) or ``lowered.compiler_ir("hlo").as_hlo_text()`` (pre-optimisation, original dtypes),
    or the Compiled/Lowered object itself. ``num_devices`` is used only for ``replica_groups={}``
    when the module header does not say how many partitions there are. ``num_slices``: the TPU
    slices a multi-slice program spans (the topology's), for its DCN transfers; without it the
    count is read from the transfers' send/recv sizes, where an all-gather shows it (else 2).
    """
    module = parse_hlo_module(hlo_text(hlo))
    mults = computation_multiplicities(module)
    counted = _chain_copies_counted(module)
    users = _Users(module)
    fused_scatters = _reduce_scatter_fusions(module)
    records = []
    for name, instrs in module.computations.items():
        for instr in instrs:
            if counted.get(_chain_key(instr), instr) is not instr:
                continue  # another copy of the same async collective is counted
            record = _collective_record(module, instr, mults[name], num_devices)
            if record is None or record.multiplicity == 0:
                continue
            if record.kind == "all-reduce" and name in fused_scatters:
                record = _as_reduce_scatter(record)
            elif record.kind == "all-reduce" and users.only_sliced(instr, record.group_size):
                record = dataclasses.replace(record, scattered=True)
            elif record.kind == "all-reduce" and users.zero_filled(instr):
                record = dataclasses.replace(record, gathered=True)
            records.append(record)
    records += _dcn_transfers(module, mults, num_slices)
    return CollectiveStats(tuple(records))


_MEGASCALE_TYPE_RE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_RENDEZVOUS_RE = re.compile(r'_xla_host_transfer_rendezvous="([^"]+)"')
_MEGASCALE_KINDS = {"ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter", "ALL_REDUCE": "all-reduce",
                    "ALL_TO_ALL": "all-to-all"}


def _dcn_transfers(module: HloModule, mults: dict[str, Multiplicity], num_slices: int | None = None
                   ) -> list[CollectiveRecord]:
    """A multi-slice TPU program's collectives across slices: XLA:TPU compiles each slice's part of
    a collective over ICI and hands the part between slices to the Megascale runtime over DCN, as
    a ``send`` / ``recv`` pair named by ``_xla_megascale_transfer_type``. Each send is counted as
    that collective over the slices (the group), with the ring volume of its buffer: an all-gather's
    buffer is K sends, a reduce-scatter's and an all-reduce's the send itself."""
    sends, recvs = [], {}
    for name, instrs in module.computations.items():
        for instr in instrs:
            kind = _MEGASCALE_TYPE_RE.search(instr.attrs)
            key = _RENDEZVOUS_RE.search(instr.attrs)
            if kind is None or key is None or instr.opcode not in ("send", "recv"):
                continue
            data = shape_leaves(instr.shape)[0]
            if instr.opcode == "recv":
                recvs[key.group(1)] = data
            else:
                sends.append((name, instr, kind.group(1), key.group(1), data))
    ratios = [round(max(a, b) / min(a, b)) for _, _, _, k, d in sends if k in recvs
              for a, b in [(math.prod(d.dims), math.prod(recvs[k].dims))] if min(a, b) > 0 and a != b]
    # Every transfer of one program spans the same slices: the topology's count when known, else
    # what an all-gather's recv / send size ratio says (all-reduces alone show no ratio: 2).
    slices = num_slices or max(ratios, default=2)
    out = []
    for name, instr, transfer, _, data in sends:
        kind = _MEGASCALE_KINDS.get(transfer, "collective-permute")
        buffer = data.nbytes * slices if kind == "all-gather" else data.nbytes
        per_call = _bytes_per_call(kind, buffer, slices)
        mult = mults[name]
        out.append(CollectiveRecord(
            name=instr.name, kind=kind, dtype=data.dtype, shape=str(data), buffer_bytes=buffer, group_size=slices,
            multiplicity=mult.count, bytes_per_call=per_call, bytes_per_step=per_call * mult.count,
            computation=name, is_async=True, trip_count_unknown=mult.trip_unknown,
            trip_count_inferred=mult.trip_inferred, in_conditional=mult.conditional, dcn=True))
    return [r for r in out if r.multiplicity > 0]


# ----------------------------------------------------------------------------------------------
# Accelerator HLO: async chains and all-reduces that are sliced
# ----------------------------------------------------------------------------------------------

_SCATTER_FUSION_RE = re.compile(r'"emitter"\s*:\s*"[^"]*AllReduceScatter')


def _reduce_scatter_fusions(module: HloModule) -> set[str]:
    """Computations XLA:TPU emits as one reduce-scatter: a fusion whose body is an all-reduce and
    the slice each device keeps (``calls=%all-reduce-scatter.N``, emitter ``...AllReduceScatterFusion``).
    The all-reduce inside is how the fusion is written, not what runs."""
    out = set()
    for instrs in module.computations.values():
        for instr in instrs:
            if instr.opcode == "fusion" and _SCATTER_FUSION_RE.search(instr.attrs):
                out.update(c for _, c in _callees(instr))
    return out


def _as_reduce_scatter(record: CollectiveRecord) -> CollectiveRecord:
    """An all-reduce of a reduce-scatter fusion as the reduce-scatter it runs as: the same full
    buffer S (padded to whole tiles where XLA padded it), (N-1)/N S sent."""
    per_call = _bytes_per_call("reduce-scatter", record.buffer_bytes, record.group_size)
    return dataclasses.replace(record, kind="reduce-scatter", bytes_per_call=per_call,
                               bytes_per_step=per_call * record.multiplicity)


_CHAIN_RE = re.compile(r'\bchain_id="?([\w.\-]+)"?')
_CHANNEL_RE = re.compile(r"\bchannel_id=(\d+)")
_START_TARGET = 'custom_call_target="AsyncCollectiveStart"'


def _chain_key(instr: Instruction) -> tuple[str, str] | None:
    """(chain_id, channel_id) of a collective XLA:TPU split over an async chain, else None."""
    chain = _CHAIN_RE.search(instr.attrs)
    if chain is None or instr.opcode.removesuffix("-start") not in COLLECTIVE_KINDS:
        return None
    channel = _CHANNEL_RE.search(instr.attrs)
    return chain.group(1), channel.group(1) if channel else ""


def _chain_copies_counted(module: HloModule) -> dict[tuple[str, str], Instruction]:
    """The one copy counted of each async chain.

    XLA:TPU runs a collective as a chain of fusions: one whose ROOT is the ``AsyncCollectiveStart``
    custom call, continuation fusions that overlap it with compute, and one ending in
    ``AsyncCollectiveDone``. Each holds a copy of the collective instruction with the same
    ``chain_id``; the collective runs once per run of the start. A chain with no start counts its
    first copy.
    """
    chosen: dict[tuple[str, str], Instruction] = {}
    for name, instrs in module.computations.items():
        starts = any(i.root and _START_TARGET in i.attrs for i in instrs)
        for instr in instrs:
            key = _chain_key(instr)
            if key is not None and (starts or key not in chosen):
                chosen[key] = instr
    return chosen


class _Users:
    """Who reads each instruction's result, per computation, built on first use."""

    _PASS = {"get-tuple-element", "bitcast", "copy", "reshape"}  # keep the elements as they are
    _NAME_RE = re.compile(r"%([\w.\-]+)")

    def __init__(self, module: HloModule) -> None:
        self.module = module
        self._by_computation: dict[str, dict[str, list[Instruction]]] = {}

    def of(self, instr: Instruction) -> list[Instruction]:
        table = self._by_computation.get(instr.computation)
        if table is None:
            table = {}
            for user in self.module.computations[instr.computation]:
                for operand in set(self._NAME_RE.findall(user.operands)):
                    table.setdefault(operand, []).append(user)
            self._by_computation[instr.computation] = table
        return table.get(instr.name, [])

    def only_sliced(self, instr: Instruction, group: int | None, depth: int = 0) -> bool:
        """Whether every use of ``instr`` (through tuple elements, bitcasts and fusions) is a
        dynamic-slice keeping at most 1/``group`` of it: a reduce-scatter run as all-reduce + slice."""
        if not group or group <= 1 or depth > 6:
            return False
        users = self.of(instr)
        return bool(users) and all(self._slices(instr, user, group, depth) for user in users)

    def _slices(self, value: Instruction, user: Instruction, group: int, depth: int) -> bool:
        if user.opcode == "dynamic-slice":
            whole = sum(math.prod(s.dims) for s in shape_leaves(value.shape))
            part = sum(math.prod(s.dims) for s in shape_leaves(user.shape))
            return part * group <= whole
        if user.opcode in self._PASS:
            return self.only_sliced(user, group, depth + 1)
        if user.opcode == "fusion":
            callee = re.search(r"calls=%?([\w.\-]+)", user.attrs)
            positions = [k for k, name in enumerate(self._NAME_RE.findall(user.operands)) if name == value.name]
            if callee is None or callee.group(1) not in self.module.computations or not positions:
                return False
            params = {int(m.group(1)): i for i in self.module.computations[callee.group(1)]
                      if i.opcode == "parameter" and (m := re.fullmatch(r"\s*(\d+)\s*", i.operands))}
            return all(p in params and self._param_sliced(params[p], value, group, depth) for p in positions)
        return False

    def zero_filled(self, instr: Instruction) -> bool:
        """Whether every operand of ``instr`` is a shard written into zeros: a dynamic-update-slice
        of a broadcast, as it is or as the root of a fusion (an all-gather as an all-reduce)."""
        names = self._NAME_RE.findall(instr.operands)
        table = {i.name: i for i in self.module.computations[instr.computation]}
        return bool(names) and all(name in table and self._writes_into_zeros(table[name], table) for name in names)

    def _writes_into_zeros(self, instr: Instruction, scope: dict[str, Instruction]) -> bool:
        if instr.opcode == "dynamic-update-slice":
            first = self._NAME_RE.findall(instr.operands)[:1]
            return bool(first) and first[0] in scope and scope[first[0]].opcode == "broadcast"
        if instr.opcode != "fusion":
            return False
        callee = re.search(r"calls=%?([\w.\-]+)", instr.attrs)
        body = self.module.computations.get(callee.group(1)) if callee else None
        root = next((i for i in body or [] if i.root), None)
        if root is None or root.opcode != "dynamic-update-slice":
            return False
        inner = {i.name: i for i in body}
        first = self._NAME_RE.findall(root.operands)[:1]
        target = inner.get(first[0]) if first else None
        if target is not None and target.opcode == "parameter":  # the zeros come from the caller
            index = int(target.operands.strip() or -1)
            outer = self._NAME_RE.findall(instr.operands)
            target = scope.get(outer[index]) if 0 <= index < len(outer) else None
        return target is not None and target.opcode == "broadcast"

    def _param_sliced(self, param: Instruction, value: Instruction, group: int, depth: int) -> bool:
        """A fusion parameter standing for ``value``: sliced to 1/group by every use inside."""
        users = self.of(param)
        if not users:
            return False
        stand_in = dataclasses.replace(param, shape=value.shape)
        return all(self._slices(stand_in, user, group, depth + 1) for user in users)


_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_REDUCTIONS = ("all-reduce", "reduce-scatter")


def reductions_waiting(hlo: str, first_batch_input: int, min_bytes: int = 1024) -> tuple[list[str], list[str]]:
    """The overlap, read from optimised HLO text: -> (the entry computation's all-reduces and
    reduce-scatters of at least ``min_bytes``, those that depend on an entry parameter numbered
    ``first_batch_input`` or more: the batch, so they wait for this step's forward and backward).

    Under staleness none does: the reduction can start with the step and run beside its compute.
    In the synchronous step every one of them does (`shardlib.step.staleness`; tests/test_staleness.py).
    """
    module = parse_hlo_module(hlo)
    instructions = module.computations[module.entry]
    entry = {i.name: i for i in instructions}
    reductions = [i.name for i in instructions if i.opcode.removesuffix("-start") in _REDUCTIONS
                  and sum(leaf.nbytes for leaf in shape_leaves(i.shape)) >= min_bytes]

    def reads_batch(name: str) -> bool:
        todo, seen = [name], set()
        while todo:
            instr = entry.get(todo.pop())
            if instr is None or instr.name in seen:
                continue
            seen.add(instr.name)
            if instr.opcode == "parameter" and int(instr.operands) >= first_batch_input:
                return True
            todo.extend(_OPERAND_RE.findall(instr.operands))
        return False

    return reductions, [r for r in reductions if reads_batch(r)]


__all__ = [
    "COLLECTIVE_KINDS",
    "ArrayShape",
    "CollectiveRecord",
    "CollectiveStats",
    "HOST_MEMORY_SPACE",
    "HloModule",
    "Instruction",
    "Multiplicity",
    "ReplicaGroups",
    "collective_stats",
    "computation_multiplicities",
    "dtype_bits",
    "hlo_text",
    "parameter_bytes_by_memory_space",
    "parse_hlo_module",
    "parse_replica_groups",
    "parse_shape",
    "permute_pairs",
    "reductions_waiting",
    "replica_group_size",
    "replica_groups",
    "shape_leaves",
    "unfused_dots",
]
