"""Per-device memory of a compiled program, read from XLA's buffer assignment (see docs/design.md, "Memory per device")."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from shardlib.tools.hlo_parse import dtype_bits
from shardlib.text import format_bytes, format_table


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """XLA's buffer assignment for one device (all figures in bytes, per device).

    ``peak_is_estimate`` is True when the runtime gave no peak, or one below what the buffer
    assignment holds (XLA:CPU reports the arguments alone), and ``peak_bytes`` is then
    argument + output + temp - alias (an upper-bound-style estimate, not XLA's liveness peak).

    ``host_*`` are the arguments and outputs in host memory (offloaded state). Where XLA reports
    them separately they are its figures; XLA:CPU reports none and counts host buffers inside
    ``argument_bytes`` (its device memory is host RAM), so they are then read from the memory
    space of each entry parameter in the compiled module's layout (``S(5)``), and
    ``host_counted_as_device`` says the device figures must have them taken out (`device_bytes`).
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    peak_is_estimate: bool
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_alias_bytes: int = 0
    host_counted_as_device: bool = False

    def device_bytes(self, field: str) -> int:
        """``argument``, ``output`` or ``alias`` bytes in device memory only."""
        total = getattr(self, f"{field}_bytes")
        return total - getattr(self, f"host_{field}_bytes") if self.host_counted_as_device else total

    def rows(self) -> list[dict[str, str]]:
        peak_label = "peak (estimate)" if self.peak_is_estimate else "peak"
        items = [
            ("arguments", self.argument_bytes), ("outputs", self.output_bytes),
            ("temporaries", self.temp_bytes), ("aliased (donated)", self.alias_bytes),
            ("generated code", self.generated_code_bytes), (peak_label, self.peak_bytes),
        ]
        if self.host_argument_bytes or self.host_output_bytes:
            items += [("host arguments", self.host_argument_bytes), ("host outputs", self.host_output_bytes)]
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
    # XLA:CPU's peak leaves the temporaries out (669,192 bytes beside 6,581,992 of temporaries):
    # the buffer assignment's sum is reported instead, flagged. The TPU compiler's peak is its heap
    # simulation of device memory, below that sum, whose temporaries include the allocations in the
    # chip's alternate memory (VMEM, layouts marked S(1)): 22.2 MiB where the sum says 34.8 MiB
    # (docs/your-model.md, "ZeRO-3 one block at a time").
    assigned = argument + output + temp - alias
    estimate = peak is None or (compiled_platform(compiled) in ("cpu", None) and int(peak) < assigned)
    host = {"host_argument_bytes": get("host_argument_size_in_bytes"),
            "host_output_bytes": get("host_output_size_in_bytes"), "host_alias_bytes": get("host_alias_size_in_bytes")}
    if not any(host.values()) and has_host_inputs(compiled):
        host = host_layout_bytes(compiled.as_text())
        host["host_counted_as_device"] = any(host.values())
    return MemoryStats(**host,
        argument_bytes=argument,
        output_bytes=output,
        temp_bytes=temp,
        alias_bytes=alias,
        generated_code_bytes=get("generated_code_size_in_bytes"),
        peak_bytes=assigned if estimate else int(peak),
        peak_is_estimate=estimate,
    )



def compiled_platform(compiled: Any) -> str | None:
    """The platform a compiled program is for (its shardings' devices: a topology's chips for a
    TPU program compiled on a CPU host), or None when it says nothing. A program read back from
    the plan cache has no shardings and answers what was recorded when it was compiled."""
    import jax

    from shardlib.backend import platform_of

    recorded = getattr(compiled, "recorded_traits", None)
    if recorded is not None:
        return recorded["platform"]
    for attr in ("input_shardings", "output_shardings"):
        for sharding in jax.tree.leaves(getattr(compiled, attr, None)):
            devices = getattr(sharding, "device_set", None)
            if devices:
                return platform_of(list(devices))
    return None


def peak_bytes(mem: MemoryStats) -> int:
    """Per-device peak in device memory: XLA's own figure where it has one, else the buffer assignment.

    The TPU and GPU compilers report the peak of their heap simulation; XLA:CPU's
    ``peak_memory_in_bytes`` is only the arguments (`memory_stats` flags it as an estimate), so
    there the buffer assignment (arguments + outputs - donated + temporaries) stands in: what the
    program holds at most. `shardlib plan` and the benchmarks judge fit by this figure. Offloaded
    (host) buffers are not counted.
    """
    host = mem.host_argument_bytes if mem.host_counted_as_device else 0
    if not mem.peak_is_estimate:
        return mem.peak_bytes - host
    assigned = mem.device_bytes("argument") + mem.device_bytes("output") - mem.device_bytes("alias")
    return assigned + mem.temp_bytes


def device_capacity() -> tuple[int, str] | None:
    """(bytes one local device can hold, in words) to judge a compiled step against; None where
    the backend does not say. Simulated CPU devices share the host's RAM; an accelerator reports
    its own limit (``memory_stats()["bytes_limit"]``)."""
    import os

    import jax

    from shardlib.backend import platform_of

    devices = jax.local_devices()
    if platform_of(devices) == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // len(devices), f"{len(devices)} CPU device(s) sharing {format_bytes(total)} of host RAM"
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    return (int(limit), f"{format_bytes(int(limit))} on each {devices[0].device_kind}") if limit else None


def has_host_inputs(compiled: Any) -> bool:
    """Whether any argument of ``compiled`` was placed in host memory (so reading the HLO is worth
    it); for a program read back from the plan cache, what was recorded when it was compiled."""
    import jax

    recorded = getattr(compiled, "recorded_traits", None)
    if recorded is not None:
        return recorded["host_inputs"]
    shardings = jax.tree.leaves(getattr(compiled, "input_shardings", None))
    return any(getattr(s, "memory_kind", None) in _HOST_KINDS for s in shardings)


_HOST_KINDS = ("pinned_host", "unpinned_host")
_HOST_MEMORY_SPACE = "S(5)"  # XLA's memory space of host buffers in a layout, e.g. f32[8]{0:S(5)}
_LAYOUT_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\](?:\{([^{}]*)\})?")
_ALIAS_RE = re.compile(r"\{(\d+)\}:\s*\((\d+),")


def _entry_arrays(text: str) -> list[tuple[int, bool]]:
    """(bytes, in host memory) of every array in a layout list such as ``f32[2,8]{1,0:S(5)}, s32[]``."""
    out = []
    for dtype, dims, layout in _LAYOUT_ARRAY_RE.findall(text):
        elements = 1
        for d in filter(None, dims.split(",")):
            elements *= int(d)
        out.append((elements * dtype_bits(dtype) // 8, _HOST_MEMORY_SPACE in (layout or "")))
    return out


def _braced(text: str, start: int) -> str:
    """The text inside the braces that open at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return text[start + 1:]


def host_layout_bytes(hlo_text: str) -> dict[str, int]:
    """Per-device bytes of the entry parameters and results XLA placed in host memory, and of the
    donated ones among them, from the compiled module's header (``entry_computation_layout`` and
    ``input_output_alias``): what XLA:CPU's memory analysis does not report separately."""
    header = hlo_text.split("\n", 1)[0]
    key = "entry_computation_layout="
    start = header.find(key)
    if start < 0:
        return {"host_argument_bytes": 0, "host_output_bytes": 0, "host_alias_bytes": 0}
    params_text, _, result_text = _braced(header, start + len(key)).partition(")->")
    params, results = _entry_arrays(params_text), _entry_arrays(result_text)
    aliased = {int(o): int(p) for o, p in _ALIAS_RE.findall(header.split("entry_computation_layout", 1)[0])}
    return {"host_argument_bytes": sum(b for b, host in params if host),
            "host_output_bytes": sum(b for b, host in results if host),
            "host_alias_bytes": sum(results[o][0] for o, p in aliased.items()
                                    if o < len(results) and p < len(params) and params[p][1] and results[o][1])}


__all__ = ["MemoryStats", "device_capacity", "host_layout_bytes", "memory_stats", "peak_bytes"]
