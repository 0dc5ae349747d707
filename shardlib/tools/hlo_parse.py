"""Reading compiled-program text: the HLO parser every tool reads programs with.

* ``parse_hlo_module``: computations of instructions (names, shapes, opcodes, attributes) from
  optimised ``as_text()`` or pre-optimisation HLO.
* ``computation_multiplicities``: how many times each computation runs per execution (while-loop
  trip counts multiply through the call graph).
* ``parse_replica_groups`` / ``replica_groups`` / ``replica_group_size``: which devices a
  collective joins, from every printed form (explicit lists, iota, jax's mesh form, implicit).
* ``parameter_bytes_by_memory_space``, ``unfused_dots``: two readings of a whole program.

What the collectives cost is `shardlib.tools.hlo`'s, which reads them through this module.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple, Union

import numpy as np

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


def callees(instr: Instruction) -> list[tuple[str, str]]:
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
        stack.extend(c for i in module.computations[name] for _, c in callees(i))
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
    calls = callees(instr)
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


def hlo_text(program: Any) -> str:
    """HLO text of a string, a ``jax.stages.Compiled`` (optimised) or ``Lowered`` (pre-optimisation)."""
    if isinstance(program, str):
        return program
    if hasattr(program, "compiler_ir") and hasattr(program, "compile"):
        return program.compiler_ir("hlo").as_hlo_text()
    return program.as_text()


__all__ = [
    "ArrayShape",
    "COLLECTIVE_KINDS",
    "HOST_MEMORY_SPACE",
    "HloModule",
    "Instruction",
    "Multiplicity",
    "ReplicaGroups",
    "computation_multiplicities",
    "dtype_bits",
    "hlo_text",
    "parameter_bytes_by_memory_space",
    "parse_hlo_module",
    "parse_replica_groups",
    "parse_shape",
    "permute_pairs",
    "replica_group_size",
    "replica_groups",
    "shape_leaves",
    "unfused_dots",
]
