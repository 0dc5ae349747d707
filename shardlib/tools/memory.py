"""Per-device memory of a compiled program, read from XLA's buffer assignment (see docs/design.md, "Memory per device")."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardlib.tools.tables import format_bytes, format_table


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



def peak_bytes(mem: MemoryStats) -> int:
    """Per-device peak: XLA's own figure, or its buffer assignment if larger.

    The buffer assignment (arguments + outputs - donated + temporaries) is what the program
    holds at most; XLA:CPU's ``peak_memory_in_bytes`` reports only the argument bytes, so
    `shardlib plan` and the benchmarks judge fit by this figure.
    """
    return max(mem.peak_bytes, mem.argument_bytes + mem.output_bytes - mem.alias_bytes + mem.temp_bytes)


__all__ = ["MemoryStats", "memory_stats", "peak_bytes"]
