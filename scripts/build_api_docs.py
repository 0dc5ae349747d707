"""Build the API reference from the docstrings with pdoc, failing on any warning.

    python scripts/build_api_docs.py            # writes build/api/ (git-ignored); open build/api/index.html
    python scripts/build_api_docs.py --out DIR

Every module of the package is rendered, the internals included: subpackages whose `__all__`
lists only their public names (`shardlib.step`, `shardlib.model`) would otherwise hide their
modules. A warning from pdoc (a name in `__all__` that does not resolve, a docstring it cannot
read) fails the build, so CI (.ci/run) catches a broken reference.
"""

from __future__ import annotations

import argparse
import os
import pkgutil
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_names() -> list[str]:
    """The modules to hand pdoc: it walks a package's submodules itself unless the package has an
    `__all__`, which then hides the rest; those submodules are named here one by one."""
    import importlib

    import shardlib
    import shardlib.models

    found = ["shardlib.models"] + [m.name for m in pkgutil.walk_packages(shardlib.__path__, "shardlib.")]
    hidden = [name for name in found
              if hasattr(importlib.import_module(name.rpartition(".")[0]), "__all__")]
    return ["shardlib", *sorted(hidden)]


def materialise_lazy_exports() -> None:
    """`import shardlib` loads Orbax and the planner on first use (a module `__getattr__`), which
    pdoc cannot see: fetch each exported name once so it is an attribute like the others."""
    import shardlib

    for name in shardlib.__all__:
        if name not in vars(shardlib):
            setattr(shardlib, name, getattr(shardlib, name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "build" / "api"), help="output folder (default build/api)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))

    import pdoc
    import pdoc.render

    materialise_lazy_exports()
    pdoc.render.configure(docformat="markdown", footer_text="shardlib API reference", search=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*module_names(), output_directory=Path(args.out))
    problems = [w for w in caught if "pdoc" in Path(w.filename).parts or issubclass(w.category, UserWarning)]
    for w in problems:
        print(f"error: {w.message} ({w.filename}:{w.lineno})", file=sys.stderr)
    if problems:
        print(f"API reference: {len(problems)} warning(s), treated as errors", file=sys.stderr)
        return 1
    pages = sum(1 for _ in Path(args.out).rglob("*.html"))
    print(f"API reference: {pages} pages in {args.out} (open index.html), no warnings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
