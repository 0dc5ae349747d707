"""Named presets (strategies, precisions, schedules, compression methods) are tables; one lookup
gives every table the same behaviour: an object passes through, a name is looked up, and an
unknown name is an error that lists the known ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def lookup(table: Mapping[str, T], name: str | T, kind: type, what: str) -> T:
    """``name`` itself if it is already a ``kind``, else ``table[name]``; ``what`` names the table in errors."""
    if isinstance(name, kind):
        return name
    try:
        return table[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(str(name), list(table), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(table)}{hint}") from None
