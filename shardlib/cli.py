"""`shardlib` command line: a thin dispatcher; each subcommand lives in its own module.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Modules are
imported only when their command runs, so ``shardlib --help`` is instant and simulated CPU
devices can be configured before JAX starts.

Mistakes in the command line (an unknown flag or choice, a mesh that does not fit, a missing
data file) print ONE line, ``shardlib CMD: error: ...`` naming the flag and the fix, and exit
with status 2; no usage dump, no traceback. Bugs still raise with a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

from shardlib.backend import quiet_libtpu
from shardlib.compat import backends_initialized
from shardlib.exits import EXIT_USAGE, exit_interrupted

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("shardlib.run.train", "train a model (default: a small byte-level GPT on a built-in corpus)"),
    "plan": ("shardlib.tools.plan_cli", "compile a step for N virtual devices and report memory and communication"),
    "inspect": ("shardlib.tools.inspect", "per-parameter sharding table for a model, strategy and device count"),
    "launch": ("shardlib.runtime.launch", "run a command as N local processes of one distributed JAX job"),
    "export": ("shardlib.tools.export", "write consolidated weights from a checkpoint"),
    "generate": ("shardlib.tools.generate", "continue a prompt with a run's checkpoint or a Hugging Face model (KV cache)"),
}


class UsageError(Exception):
    """A bad flag: printed as one line, exit code 2, no traceback."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message}{self._did_you_mean(message)} (see '{self.prog} --help')")

    def _did_you_mean(self, message: str) -> str:
        """``; did you mean --strategy?`` for a mistyped flag, or ``--strategy zero3`` for a mistyped choice."""
        import difflib
        import re

        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = [o for o in self._option_string_actions if o.startswith("--")]
            for word in unknown.group(1).split():
                close = difflib.get_close_matches(word.split("=")[0], flags, n=1, cutoff=0.7)
                if word.startswith("--") and close:
                    return f"; did you mean {close[0]}?"
            return ""
        choice = re.match(r"argument (\S+): invalid choice: '?([^'\s]*)'?", message)
        action = self._option_string_actions.get(choice.group(1).split("/")[0]) if choice else None
        close = _close(choice.group(2), [str(c) for c in action.choices or ()]) if action else []
        return f"; did you mean {choice.group(1).split('/')[0]} {close[0]}?" if close else ""


def _close(word: str, options: list[str]) -> list[str]:
    """The option ``word`` most likely meant: the same word in another case (``FSDP``), else a near spelling."""
    import difflib

    same = [o for o in options if o.lower() == word.lower()]
    return same or difflib.get_close_matches(word, options, n=1, cutoff=0.6)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(command: str, err: BaseException) -> int:
    prog = f"shardlib {command}" if command else "shardlib"
    print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """The ``shardlib`` command (``argv``: its arguments; None reads ``sys.argv``, as the installed
    command does, and then prints Python warnings as notes too: `warnings_as_notes`)."""
    if argv is None:
        with warnings_as_notes():
            return _main(sys.argv[1:])
    return _main(list(argv))


@contextlib.contextmanager
def warnings_as_notes() -> Iterator[None]:
    """Inside, a Python warning prints as one ``shardlib: note: ...`` line, not as Python's file,
    line number and source line. Only the command's entry installs it: a library user, and a
    caller of ``main([...])`` (tests recording warnings), keep Python's own."""
    import warnings

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        kind = "" if category is UserWarning or category.__module__.startswith("shardlib") else f" ({category.__name__})"
        try:
            print(f"shardlib: note: {_one_line(message)}{kind}", file=file or sys.stderr)
        except OSError:  # stderr closed: a warning is not worth a crash
            pass

    previous = warnings.showwarning
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardlib", description="Sharded training for JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = _close(name, list(COMMANDS))
        hint = f"; did you mean 'shardlib {close[0]}'?" if close else ""
        return _fail("", UsageError(f"unknown command {name!r} (the commands: {', '.join(COMMANDS)}){hint}"))
    try:  # Ctrl-C while the command's modules import (JAX takes seconds) is as quiet as during its run
        if not backends_initialized():  # the command chooses the devices: no libtpu noise without TPUs
            quiet_libtpu()
        return _dispatch(name, rest)
    except KeyboardInterrupt as err:
        print(f"shardlib {name}: interrupted", file=sys.stderr)
        return _finish(exit_interrupted(err))


def _dispatch(name: str, rest: list[str]) -> int:
    """Import the command, parse its flags and run it; its errors as one line (bugs excepted)."""
    try:
        module = importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as err:
        if err.name != COMMANDS[name][0]:
            raise
        return _fail(name, UsageError(f"the {name!r} command is not available in this install ({err.name} is missing)"))
    command_parser = _Parser(prog=f"shardlib {name}", description=COMMANDS[name][1])
    module.add_arguments(command_parser)
    try:
        args = command_parser.parse_args(rest)
    except UsageError as err:
        return _fail(name, err)
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    try:
        return _finish(int(module.run(args) or 0))
    except UsageError as err:
        return _finish(_fail(name, err))
    except ValueError as err:
        if not _is_user_facing(err):
            return _crash()
        return _finish(_fail(name, err))
    except Exception:
        return _crash()


def _in_multiprocess_job() -> bool:
    if "jax" not in sys.modules:
        return False
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def _finish(code: int) -> int:
    """In a multi-process job a failing process exits at once, so its peers stop waiting for it."""
    if code and _in_multiprocess_job():
        from shardlib.runtime.distributed import finish

        return finish(code)
    return code


def _crash() -> int:
    """A bug: re-raise (full traceback); in a multi-process job print it and exit at once instead."""
    if not _in_multiprocess_job():
        raise
    import traceback

    traceback.print_exc()
    return _finish(1)


def _is_user_facing(err: ValueError) -> bool:
    """shardlib's own input errors (mesh, rules, data, batch) are shown as one line."""
    from shardlib.sharding.mesh import MeshError
    from shardlib.sharding.rules import RuleError

    return isinstance(err, (MeshError, RuleError)) or getattr(err, "user_facing", False)


if __name__ == "__main__":
    sys.exit(main())
