"""Text for people: byte sizes, plain-text and Markdown tables, and the multiples a refusal suggests.

The bottom layer (docs/design.md, "Layers"): every layer's messages, reports and banners format
with it, so it imports nothing from shardlib.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

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


def nearest_multiples(n: int, k: int) -> str:
    """The multiples of ``k`` either side of ``n`` ("8 or 16" for 12 and 8), for refusal messages."""
    below, above = n // k * k, -(-n // k) * k
    return f"{below} or {above}" if 0 < below < above else str(max(above, k))


__all__ = ["Column", "format_bytes", "format_markdown", "format_table", "nearest_multiples"]
