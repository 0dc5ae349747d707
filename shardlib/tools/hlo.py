"""HLO collective accounting: every collective of a compiled program, the bytes one device sends
for it and how many times it runs per step (``collective_stats``), and which reductions wait for
the batch (``reductions_waiting``). The text is read by `shardlib.tools.hlo_parse`.

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
from typing import Any, NamedTuple


from shardlib.text import format_bytes, format_table
from shardlib.tools.hlo_parse import (
    COLLECTIVE_KINDS,
    ArrayShape,
    HloModule,
    Instruction,
    Multiplicity,
    Shape,
    callees,
    computation_multiplicities,
    hlo_text,
    parse_hlo_module,
    parse_replica_groups,
    permute_pairs,
    replica_groups,
    shape_leaves,
    shape_str,
)

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
                out.update(c for _, c in callees(instr))
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
    "CollectiveRecord",
    "CollectiveStats",
    "collective_stats",
    "reductions_waiting",
]
