"""Writing inside a run or checkpoint directory without following a link planted there.

A symbolic link named like a file shardlib writes (``metrics.jsonl``, ``DAMAGED.txt``) would
send the write, or a truncation, to whatever it points at; these open the name itself only.
"""

from __future__ import annotations

import os
import stat


def no_follow(path: str | os.PathLike[str], flags: int) -> int:
    """An ``opener`` for `open`: fails with ELOOP instead of writing through a symbolic link."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def write_new_file(directory: str | os.PathLike[str], name: str, text: str) -> None:
    """Create ``directory/name`` holding ``text``, only in ``directory`` itself: not when it is a
    link to a directory elsewhere, and never over an existing file (OSError then)."""
    parent = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=parent)
    finally:
        os.close(parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


_KINDS = ((stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a FIFO (named pipe)"),
          (stat.S_ISCHR, "is a character device"), (stat.S_ISBLK, "is a block device"), (stat.S_ISSOCK, "is a socket"))


def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a regular file a run can read ("does not exist", "is a FIFO (named
    pipe)", ...), or None when it is one: a device or pipe is not a corpus that can be re-read."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "is not a regular file")
