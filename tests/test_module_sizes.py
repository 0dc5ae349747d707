"""One concern a file (CONTRIBUTING.md; docs/design.md, "Layers"): no module of shardlib/ or models/
is over 800 lines, and one over 600 says why in its first docstring line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT, EXPLAIN = 800, 600


def _modules() -> list[Path]:
    return sorted([*ROOT.glob("shardlib/**/*.py"), *ROOT.glob("models/**/*.py")])


def test_no_module_is_over_800_lines_and_one_over_600_says_why():
    too_long, unexplained = [], []
    for path in _modules():
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        name = f"{path.relative_to(ROOT)} ({lines} lines)"
        if lines > LIMIT:
            too_long.append(name)
        elif lines > EXPLAIN:
            first = (ast.get_docstring(ast.parse(text)) or "").splitlines()[:1]
            if not first or "over 600 lines" not in first[0]:
                unexplained.append(name)
    assert _modules() and not too_long, f"split these by concern: {too_long}"
    assert not unexplained, f"say why in the first docstring line ('over 600 lines: ...'): {unexplained}"
