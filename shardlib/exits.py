"""How a shardlib process ends: the exit statuses its commands return, and Ctrl-C's exit.

The bottom layer (docs/design.md, "Layers"): the command line returns these statuses, `shardlib
train` chooses among them, and the elastic launcher reads them to decide whether a restart could
help, so all three import them from here.
"""

from __future__ import annotations

import os
import sys

EXIT_USAGE = 2  # a command-line or configuration error (printed as one line)
EXIT_DIVERGED = 3  # `shardlib train` stopped on non-finite steps (--max-skips)
EXIT_INTERRUPTED = 130  # the shell's status for a process ended by SIGINT

_JAX_DIRS = tuple(os.sep + d + os.sep for d in ("jax", "jaxlib"))


def _raised_inside_jax(err: BaseException) -> bool:
    """True when ``err`` came out of JAX's own code (e.g. an XLA compile that Ctrl-C interrupted)."""
    tb = err.__traceback__
    while tb is not None:
        if any(d in tb.tb_frame.f_code.co_filename for d in _JAX_DIRS):
            return True
        tb = tb.tb_next
    return False


def exit_interrupted(err: BaseException, code: int = EXIT_INTERRUPTED) -> int:
    """``code`` for a Ctrl-C; but exit this process *now* when it interrupted JAX mid-call.

    Ctrl-C during an XLA compile raises KeyboardInterrupt out of the compile while XLA's own
    threads are still compiling; the normal interpreter shutdown then tears the runtime down
    under them and the process dies with SIGSEGV (exit 139) after "interrupted". Everything the
    run had open was closed while the exception unwound, so after flushing the output this
    skips that shutdown (``os._exit``), and the exit status is the ``code`` promised (130).
    """
    if _raised_inside_jax(err):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    return code
