"""Module boundaries lint-imports cannot see: private names, import circles inside a layer."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``models/`` installs as ``shardlib.models``)."""
    found = {}
    for root in ("shardlib", "models"):
        for path in (REPO / root).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            parts = ["shardlib", *parts] if parts[0] == "models" else parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, tree: ast.Module) -> list[tuple[int, str, str | None]]:
    """(line, module, imported name or None) of every import in ``tree``, anywhere in it."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            out += [(node.lineno, base, a.name) for a in node.names]
    return [(line, "shardlib." + m if m.split(".")[0] == "models" else m, n) for line, m, n in out]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(modules: dict[str, Path]) -> list[str]:
    """``from x import _y`` and ``x._y`` on a name bound to a package module, each as ``file:line``."""
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        bound = {}  # local name -> module it names (or a module's attribute)
        for line, module, imported in _imports(name, path, tree):
            if not module.startswith("shardlib"):
                continue
            if imported is not None and _private(imported):
                found.append(f"{path.parent.name}/{path.name}:{line}: from {module} import {imported}")
            if imported is not None:
                bound[imported] = f"{module}.{imported}"
        for node in ast.walk(tree):
            if isinstance(node, ast.alias) and node.asname and node.name.startswith(("shardlib", "models")):
                bound[node.asname] = node.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in bound):
                found.append(f"{path.parent.name}/{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_imports_another_modules_private_name():
    assert private_imports(_modules()) == []


def test_the_private_name_check_sees_both_spellings(tmp_path):
    # The check must fail on what it forbids: a from-import and an attribute of an imported module.
    (tmp_path / "shardlib").mkdir()
    planted = tmp_path / "shardlib" / "planted.py"
    planted.write_text("from shardlib.run.config import _step_range\nfrom shardlib.model import hooks\n"
                       "import shardlib.text as text\nhooks._CONTEXT\ntext.table\n")
    found = private_imports({"shardlib.planted": planted})
    assert [f.split(": ", 1)[1] for f in found] == ["from shardlib.run.config import _step_range", "hooks._CONTEXT"]


def test_no_two_modules_import_each_other():
    # A package's __init__ re-exports its modules, which may import siblings through it: not a circle.
    modules = _modules()
    plain = {n for n, p in modules.items() if p.name != "__init__.py"}
    edges = {name: set() for name in plain}
    for name in plain:
        tree = ast.parse(modules[name].read_text())
        for _, module, imported in _imports(name, modules[name], tree):
            for target in (module, f"{module}.{imported}"):
                if target in plain and target != name:
                    edges[name].add(target)
    circles = sorted(f"{a} <-> {b}" for a in plain for b in edges[a] if a < b and a in edges[b])
    assert circles == []


def test_the_preemption_guard_is_none_where_signals_cannot_reach():
    # Off the main thread, without JAX's preemption service, the run keeps SIGTERM's default.
    from shardlib.run.preemption import preemption_guard
    from shardlib.runtime.checkpoint import PreemptionGuard

    seen = []

    def enter():
        with preemption_guard(True) as guard:
            seen.append(guard)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    enter()
    assert seen[0] is None and isinstance(seen[1], PreemptionGuard)
