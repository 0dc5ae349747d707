"""The run directory: where a run writes (``--out``, or the run it resumes), and one run per
directory, checked and claimed before anything compiles."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from shardlib.run.checkpointing import checkpoint_dir
from shardlib.run.config import TrainConfig, TrainConfigError
from shardlib.runtime.files import make_dir


def check_out_path(config: TrainConfig) -> None:
    """``--out`` below or at an existing file cannot become a run directory: one line, before JAX starts."""
    if config.out is None:
        return
    out_dir = Path(config.out).expanduser()
    if _blocking_file(out_dir) is not None:
        raise _unusable(config, out_dir, FileExistsError(errno.EEXIST, "a file is in the way", str(out_dir)))


def run_directory(config: TrainConfig) -> Path:
    """Where the run writes: ``--out``; a resumed run without ``--out`` keeps writing into the run it resumes."""
    if config.resume_from is not None and config.out is None:
        return checkpoint_dir(config.resume_from).parent
    return _out_dir(config)


def _out_dir(config: TrainConfig) -> Path:
    """``--out`` or ``runs/<timestamp>``; every process agrees on the name (process 0's clock)."""
    if config.out:
        return Path(config.out).expanduser()
    import jax
    import numpy as np

    stamp = int(time.time())
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        stamp = int(multihost_utils.broadcast_one_to_all(np.int64(stamp)))
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.localtime(stamp))


# --------------------------------------------------------------------------------------------
# One run per directory, and a directory that can be written, before anything compiles
# --------------------------------------------------------------------------------------------

LOCK_NAME = ".lock"


def _out_field(config: TrainConfig) -> str:
    return "resume_from" if config.out is None and config.resume_from is not None else "out"


def _blocking_file(path: Path) -> Path | None:
    """The first part of ``path`` that exists but is not a directory (so nothing can be created below it)."""
    for part in reversed([path, *path.parents]):
        if part.exists() and not part.is_dir():
            return part
    return None


def _unusable(config: TrainConfig, out_dir: Path, err: OSError) -> TrainConfigError:
    blocker = _blocking_file(out_dir)
    if blocker is not None:
        why = f"{blocker} is a file, not a directory"
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "it is not writable (" + ("read-only file system" if err.errno == errno.EROFS else "permission denied") + ")"
    else:
        why = err.strerror or str(err)
    hint = "pick another --out" if config.out is not None or config.resume_from is None else "pass --out DIR"
    return TrainConfigError(_out_field(config), f"cannot write the run directory {out_dir}: {why}; {hint}")


def _holder(text: str) -> dict:
    try:
        found = json.loads(text)
        return found if isinstance(found, dict) else {}
    except ValueError:
        return {}


def _describe_holder(holder: dict) -> str:
    started = holder.get("started")
    since = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if isinstance(started, (int, float)) else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}"


def _resumed_run(config: TrainConfig, out_dir: Path) -> Path | None:
    """The run directory of ``--resume-from`` when it is not ``out_dir``: its checkpoints are
    where this run saves, sets aside and deletes (`saves_to`), so it needs the same lock."""
    if config.resume_from is None:
        return None
    resumed = checkpoint_dir(config.resume_from).parent
    return None if resumed.resolve() == out_dir.expanduser().resolve() else resumed


def _open_lock(lock: Path) -> int:
    """``lock`` opened for reading and writing, never through a symbolic link (a planted
    ``.lock -> file`` would otherwise be truncated) and only if it is a regular file."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(errno.EISDIR, "not a regular file", str(lock))
    return fd


def _lock_refused(field: str, lock: Path, err: OSError) -> TrainConfigError | None:
    """The error for a ``.lock`` that is a symbolic link or no regular file; None for other errors."""
    if err.errno == errno.ELOOP:
        what = f"a symbolic link (to {os.readlink(lock)})"
    elif err.errno == errno.EISDIR:
        what = "not a regular file"
    else:
        return None
    return TrainConfigError(field, f"{lock} is {what}; shardlib writes its lock only into a regular file in the run "
                                   "directory, never through a link: remove it and run again")


@contextlib.contextmanager
def claim_run_directory(config: TrainConfig, out_dir: Path, *, main: bool) -> Iterator[None]:
    """Create ``out_dir`` and, on process 0, hold ``OUT/.lock`` for the whole run; and the lock of
    the ``--resume-from`` run directory when that is another one, since the run saves there.

    Two runs writing one directory interleave ``metrics.jsonl`` and delete each other's
    checkpoints, so a second run stops at once, naming the holder's host and PID (a
    `TrainConfigError`: one line, exit 2). ``flock`` is released by the kernel when its
    process dies, so a lock file that still names a holder but is not locked was left by a
    dead run: it is taken over with a note. A directory that cannot be created or written is
    reported here too, before anything compiles. Other processes only create the directory
    when they write into it (``--record-examples``). A resumed directory is never created.
    """
    resumed = _resumed_run(config, out_dir)
    with contextlib.ExitStack() as held:
        held.enter_context(_claim(config, _out_field(config), out_dir, main=main))
        if resumed is not None and main and resumed.is_dir():
            held.enter_context(_claim(config, "resume_from", resumed, main=True))
        yield


@contextlib.contextmanager
def _claim(config: TrainConfig, field: str, out_dir: Path, *, main: bool) -> Iterator[None]:
    """`claim_run_directory` of one directory; ``field`` is the flag that named it."""
    if not main and not config.record_examples:
        yield
        return
    lock = out_dir / LOCK_NAME
    try:
        make_dir(out_dir, "a run")
        if not main and not os.access(out_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "permission denied", str(out_dir))
        fd = _open_lock(lock) if main else None
    except OSError as err:
        raise (_lock_refused(field, lock, err) or _unusable(config, out_dir, err)) from None
    if fd is None:  # another process: checked, nothing to hold
        yield
        return
    ours = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            raise TrainConfigError(
                field,
                f"{out_dir} is in use by another run ({_describe_holder(holder)}): two runs in one directory mix their "
                "metrics and delete each other's checkpoints; wait for that run to finish, stop it, or pick another "
                + ("--out" if field == "out" else "--resume-from (a run that has stopped)"),
            ) from None
        except OSError as err:  # a file system without locks (some network mounts): run unguarded, say so
            print(f"shardlib: note: cannot lock {lock} ({err.strerror}); nothing stops a second run from writing "
                  f"{out_dir} at the same time", file=sys.stderr, flush=True)
        ours = True
        left = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        if left:
            print(f"shardlib: note: took over {lock}, left by a run that is no longer running "
                  f"({_describe_holder(left)})", file=sys.stderr, flush=True)
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": round(time.time(), 3)})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (me + "\n").encode(), 0)
        except OSError as err:
            raise _unusable(config, out_dir, err) from None
        yield
    finally:
        if ours:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # an empty lock file: released cleanly (a named holder means it died)
        os.close(fd)  # releases the flock
