"""`shardlib` command line: a thin dispatcher; each subcommand lives in its own module.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Modules are
imported only when their command runs, so ``shardlib --help`` is instant and simulated CPU
devices can be configured before JAX starts.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("shardlib.train", "train a model (default: a small byte-level GPT on a built-in corpus)"),
    "plan": ("shardlib.plan", "compile a step for N virtual devices and report memory and communication"),
    "inspect": ("shardlib.inspect_cmd", "per-parameter sharding table for a model, strategy and device count"),
    "launch": ("shardlib.launch", "run a command as N local processes of one distributed JAX job"),
    "export": ("shardlib.export", "write consolidated weights from a checkpoint"),
}


class UsageError(Exception):
    """A bad flag: printed as one line, exit code 2, no traceback."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="shardlib", description="Sharded training for JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}")
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    command_parser = argparse.ArgumentParser(prog=f"shardlib {name}", description=COMMANDS[name][1])
    module.add_arguments(command_parser)
    args = command_parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except (UsageError, ValueError) as err:
        if isinstance(err, ValueError) and not _is_user_facing(err):
            raise
        print(f"shardlib {name}: error: {err}", file=sys.stderr)
        return 2


def _is_user_facing(err: ValueError) -> bool:
    """shardlib's own input errors (mesh, rules, data, batch) are shown as one line."""
    from shardlib.mesh import MeshError
    from shardlib.rules import RuleError

    return isinstance(err, (MeshError, RuleError)) or getattr(err, "user_facing", False)


if __name__ == "__main__":
    sys.exit(main())
