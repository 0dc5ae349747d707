"""Every file and directory a shardlib command writes, created without following a link.

A symbolic link planted where an output goes (``OUT/loss_curve.png``, ``OUT/checkpoints``,
``--out link.npz``) would send the write, a truncation or a rotation to whatever it points at.
`refuse_links` says so in one line before any work; `AtomicFile` / `write_atomic` write a
file under a temporary name opened with ``O_NOFOLLOW | O_EXCL`` in the real directory and
rename it onto its name (whole or absent), `AtomicDir` a directory of files the same way; `make_dir` creates a directory that is not a link;
`remove_stale_partials` deletes what a killed writer left behind, and nothing else.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import stat
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any


class LinkedOutputError(ValueError):
    """An output path that is a symbolic link (or not what the command writes): one line, exit 2."""

    user_facing = True


def no_follow(path: str | os.PathLike[str], flags: int) -> int:
    """An ``opener`` for `open`: fails with ELOOP instead of writing through a symbolic link."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def refuse_link(path: str | os.PathLike[str], what: str = "an output") -> None:
    """Raise `LinkedOutputError` when ``path`` is a symbolic link (its target is never written)."""
    path = Path(path)
    if path.is_symlink():
        raise LinkedOutputError(f"{path} is a symbolic link (to {os.readlink(path)}), where shardlib writes {what}; "
                                "it never writes through a link: remove the link or pick another path")


def refuse_links(directory: str | os.PathLike[str], names: Iterable[str], what: str = "its outputs") -> None:
    """`refuse_link` of the directory itself and of each name in it: checked before any work."""
    directory = Path(directory)
    refuse_link(directory, what)
    for name in names:
        refuse_link(directory / name, what)


def make_dir(path: str | os.PathLike[str], what: str = "an output directory") -> Path:
    """Create ``path`` (and its parents) as a real directory; a link at ``path`` is refused."""
    path = Path(path)
    refuse_link(path, what)
    path.mkdir(parents=True, exist_ok=True)
    refuse_link(path, what)  # planted between the check and the mkdir
    return path


def partial_path(path: Path) -> Path:
    """The temporary name beside ``path`` that a writer of this process uses: ``.NAME.<pid>.<hex>.partial``."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")


def remove_stale_partials(path: str | os.PathLike[str], ours: Callable[[Path], bool] = Path.is_file) -> list[Path]:
    """Delete the ``.partial`` files (or staging directories ``ours`` accepts) that writers of
    ``path`` left when killed; a partial of a process still running is its write in progress,
    and a link is never followed nor removed. Returns what was removed."""
    path = Path(path)
    removed = []
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        pid = stale.name[len(path.name) + 2:].split(".")[0]
        if not pid.isdigit() or stale.is_symlink() or not ours(stale):
            continue
        try:
            os.kill(int(pid), 0)
            continue
        except ProcessLookupError:
            pass
        except OSError:  # running, as another user
            continue
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        print(f"shardlib: note: removed {stale}, left by a write that was killed (pid {pid})", file=sys.stderr)
        removed.append(stale)
    return removed


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicFile:
    """A temporary file beside ``path`` that becomes ``path`` (fsync, then ``os.replace``) only on
    `commit`: a write that fails (a full disk, a kill) leaves the previous file, if any, whole and
    no partial file behind (`discard`; a killed process's is removed by the next writer). The
    temporary file is created in the directory itself (not through a link to it), never over an
    existing name, and ``path`` must not be a link (`LinkedOutputError`)."""

    def __init__(self, path: str | os.PathLike[str], mode: str = "wb", *, what: str = "an output") -> None:
        self.path = Path(path)
        refuse_link(self.path, what)
        refuse_link(self.path.parent, what)
        remove_stale_partials(self.path)
        self.tmp = partial_path(self.path)
        # 0o666 less the umask, as open() would give the final file (mkstemp would leave it 0o600)
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        self.file: IO[Any] = os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.path.is_symlink():  # planted while writing: the link is not replaced either
            self.discard()
            refuse_link(self.path)
        os.replace(self.tmp, self.path)  # replaces the name itself; never writes through it
        _fsync_dir(self.path.parent)  # make the rename itself durable

    def discard(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> IO[Any]:
        return self.file

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, what: str = "an output") -> Path:
    """``path`` holding ``data``, whole or not at all, never through a link (`AtomicFile`)."""
    with AtomicFile(path, "wb" if isinstance(data, bytes) else "w", what=what) as f:
        f.write(data)
    return Path(path)


class AtomicDir:
    """A directory that appears at ``path`` whole (an export of several files): a fresh staging
    directory beside it (`partial_path`: created, never an existing name nor a link) takes the
    files, each created new and never through a link (`open`, `write`, `copy`); `commit` fsyncs
    them and renames the staging directory onto ``path``; `discard` removes it. ``ours``: what a
    killed writer's staging directory may hold, so the next writer removes it (`remove_stale_partials`)."""

    def __init__(self, path: str | os.PathLike[str], *, what: str = "an output directory",
                 ours: Callable[[Path], bool] | None = None) -> None:
        self.path, self.what = Path(path), what
        refuse_link(self.path, what)
        make_dir(self.path.parent, what)
        if ours is not None:
            remove_stale_partials(self.path, ours)
        self.tmp = partial_path(self.path)
        self.tmp.mkdir()

    def open(self, name: str, mode: str = "wb") -> IO[Any]:
        """A new file ``name`` in the staging directory (``x``: never over one, nor through a link)."""
        return open(self.tmp / name, mode.replace("w", "x"), opener=no_follow,
                    **({} if "b" in mode else {"encoding": "utf-8"}))

    def write(self, name: str, data: bytes | str) -> None:
        with self.open(name, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)

    def copy(self, source: str | os.PathLike[str], name: str) -> None:
        with open(source, "rb") as src, self.open(name) as dst:
            shutil.copyfileobj(src, dst)

    def commit(self) -> Path | None:
        """Make every file durable, then rename the staging directory onto ``path``. A directory
        already there is set aside first, under ``.NAME.<pid>.replaced``, and returned for the
        caller to empty of what it owns (None when there was none)."""
        for entry in self.tmp.iterdir():
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(self.tmp)
        refuse_link(self.path, self.what)  # planted while writing: never replaced
        old = None
        if self.path.exists():
            old = self.path.with_name(f".{self.path.name}.{os.getpid()}.replaced")
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        return old

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


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
