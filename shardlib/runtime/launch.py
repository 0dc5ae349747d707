"""`shardlib launch`: run a command as N local processes of one distributed JAX job (CPU, gloo).

    shardlib launch --processes 2 --devices-per-process 4 -- python -m shardlib.cli train ...

Each process gets ``SHARDLIB_COORDINATOR`` / ``SHARDLIB_NUM_PROCESSES`` / ``SHARDLIB_PROCESS_ID`` /
``SHARDLIB_LOCAL_DEVICES`` (read by ``shardlib.runtime.distributed.initialize``), ``JAX_PLATFORMS=cpu``
and M simulated CPU devices. Output lines are prefixed ``[p0]``, ``[p1]``, ... When a process
fails, the launcher says which one failed first and how, stops the others (SIGTERM, then
SIGKILL after ``--grace`` seconds) and exits with that first failure's code (128+signal for a
signal), so a dead process never leaves the rest waiting in a collective.

This module does not import JAX: the launcher itself starts instantly and holds no devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

from shardlib.runtime.devices import with_cpu_collective_timeout

DEFAULT_GRACE_S = 10.0
_OUTPUT_LOCK = threading.Lock()  # whole lines from different processes never interleave
_FORCE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")


class LaunchError(ValueError):
    """A bad launch request (shown by the CLI as one line, exit code 2)."""

    user_facing = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--processes", "-n", type=int, required=True, metavar="N", help="number of processes to start")
    parser.add_argument("--devices-per-process", "-d", type=int, default=1, metavar="M",
                        help="simulated CPU devices each process sees (default 1)")
    parser.add_argument("--port", type=int, default=None, metavar="P", help="coordinator port on localhost (default: a free one)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="S",
                        help=f"seconds between SIGTERM and SIGKILL when stopping the others (default {DEFAULT_GRACE_S:g})")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_env(base: dict[str, str], index: int, count: int, devices: int, coordinator: str) -> dict[str, str]:
    """The environment of process ``index``: shardlib's variables, CPU platform, M devices."""
    env = dict(base)
    env.update(
        SHARDLIB_COORDINATOR=coordinator,
        SHARDLIB_NUM_PROCESSES=str(count),
        SHARDLIB_PROCESS_ID=str(index),
        SHARDLIB_LOCAL_DEVICES=str(devices),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
    )
    # Plain JAX scripts (no shardlib.runtime.distributed) should see M devices too; drop an inherited count.
    flags = _FORCE_COUNT.sub("", env.get("XLA_FLAGS", "")).split()
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = with_cpu_collective_timeout(" ".join(flags))
    return env


def describe_exit(returncode: int) -> str:
    """'exited with code 3' or 'killed by SIGKILL (signal 9)'."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} (signal {-returncode})"
    return f"exited with code {returncode}"


def exit_code(returncode: int) -> int:
    """A shell-style exit status: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    """Copy lines from a child's pipe to ``out``, each prefixed (whole lines under a lock)."""
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


@dataclasses.dataclass
class _Child:
    index: int
    proc: subprocess.Popen
    pumps: list[threading.Thread]


def _signal_group(child: _Child, sig: int) -> None:
    """Signal the child's whole process group (it may have started processes of its own)."""
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _say(message: str) -> None:
    print(f"shardlib launch: {message}", file=sys.stderr, flush=True)


def launch(command: list[str], processes: int, devices_per_process: int = 1, *, port: int | None = None,
           grace_s: float = DEFAULT_GRACE_S) -> int:
    """Run ``command`` as ``processes`` local processes; the first failure's exit code (0 if none)."""
    if processes < 1 or devices_per_process < 1:
        raise LaunchError(f"--processes ({processes}) and --devices-per-process ({devices_per_process}) must be positive")
    if not command:
        raise LaunchError("no command given; usage: shardlib launch --processes 2 -- python my_script.py")
    coordinator = f"localhost:{port or free_port()}"
    interrupted: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers need the main thread
        previous = {s: signal.signal(s, lambda signum, _frame: interrupted.append(signum))
                    for s in (signal.SIGINT, signal.SIGTERM)}
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    children: list[_Child] = []
    first_failure: tuple[int, int] | None = None
    try:
        for index in range(processes):
            children.append(_start(command, index, processes, devices_per_process, coordinator, exits))
        remaining = processes
        while remaining and first_failure is None and not interrupted:
            try:
                index, code = exits.get(timeout=0.2)
            except queue.Empty:
                continue
            remaining -= 1
            if code != 0:
                first_failure = (index, code)
        if first_failure is not None:
            index, code = first_failure
            _say(f"process {index} (pid {children[index].proc.pid}) failed first: {describe_exit(code)}")
        elif interrupted:
            _say(f"received {signal.Signals(interrupted[0]).name}")
    finally:
        _stop(children, grace_s)  # no-op when all have exited; also runs if starting one failed
        for s, handler in previous.items():
            signal.signal(s, handler)
        for child in children:
            for t in child.pumps:
                t.join(timeout=5)
    if first_failure is not None:
        return exit_code(first_failure[1])
    if interrupted:
        return 128 + interrupted[0]
    return 0


def _start(command: list[str], index: int, count: int, devices: int, coordinator: str,
           exits: queue.Queue[tuple[int, int]]) -> _Child:
    """Start process ``index`` in its own session, with prefixing pumps and an exit watcher."""
    env = process_env(dict(os.environ), index, count, devices, coordinator)
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as err:
        raise LaunchError(f"cannot start {command[0]!r}: {err.strerror or err}; check the command after --") from None
    prefix = f"[p{index}] ".encode()
    pumps = [threading.Thread(target=_pump, args=(pipe, prefix, sink, _OUTPUT_LOCK), daemon=True)
             for pipe, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer))]
    for t in pumps:
        t.start()
    threading.Thread(target=lambda: exits.put((index, proc.wait())), daemon=True).start()
    return _Child(index, proc, pumps)


def _stop(children: list[_Child], grace_s: float) -> None:
    """SIGTERM every live child, SIGKILL what is left after ``grace_s``; report how each ended."""
    alive = [c for c in children if c.proc.poll() is None]
    if not alive:
        return
    _say(f"stopping the other {len(alive)} process(es): SIGTERM, SIGKILL after {grace_s:g} s")
    for child in alive:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in alive:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(child, signal.SIGKILL)
            child.proc.wait()
    for child in alive:
        _say(f"process {child.index} {describe_exit(child.proc.returncode)}")


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    return launch(command, args.processes, args.devices_per_process, port=args.port, grace_s=args.grace)
