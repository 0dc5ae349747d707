"""`shardlib launch`: run a command as N local processes of one distributed JAX job (CPU, gloo).

    shardlib launch --processes 2 --devices-per-process 4 -- python -m shardlib.cli train ...

Each process gets ``SHARDLIB_COORDINATOR`` / ``SHARDLIB_NUM_PROCESSES`` / ``SHARDLIB_PROCESS_ID`` /
``SHARDLIB_LOCAL_DEVICES`` (read by ``shardlib.runtime.distributed.initialize``), ``JAX_PLATFORMS=cpu``
and M simulated CPU devices. Output lines are prefixed ``[p0]``, ``[p1]``, ... When a process
fails, the launcher says which one failed first and how, stops the others (SIGTERM, then
SIGKILL after ``--grace`` seconds) and exits with that first failure's code (128+signal for a
signal), so a dead process never leaves the rest waiting in a collective.

The coordinator listens on 127.0.0.1 only (JAX's coordinator has no authentication, and by
default listens on every interface); ``--port`` in use is refused before anything starts. Every
process must join within ``--init-timeout`` seconds (default 60): a process stopped or hung at
start-up fails the job after that, naming it, instead of after JAX's 5 minutes.

This module does not import JAX: the launcher itself starts instantly and holds no devices.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
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

from shardlib.runtime import elastic
from shardlib.runtime.devices import with_cpu_collective_timeout
from shardlib.runtime.elastic import Elastic

DEFAULT_GRACE_S = 10.0
# Seconds every process has to join the job at start-up. JAX's default (300 s, plus its retries) held a job
# with a stopped process for over 5 minutes; local processes start together, so a minute is ample.
DEFAULT_INIT_TIMEOUT_S = 60
ENV_INIT_TIMEOUT = "SHARDLIB_INIT_TIMEOUT"  # read by shardlib.runtime.distributed (not imported: it imports JAX)
LOOPBACK = "127.0.0.1"
TAIL_LINES = 200  # output lines kept per process, for telling a dead process from one stopped by a peer's death
_OUTPUT_LOCK = threading.Lock()  # whole lines from different processes never interleave
_FORCE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")
# Gloo's connection chatter (about 8 lines per process per job start); shown only with --verbose.
_CHATTER = re.compile(rb"^\[Gloo\]")


class LaunchError(ValueError):
    """A bad launch request (shown by the CLI as one line, exit code 2)."""

    user_facing = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--processes", "-n", type=int, required=True, metavar="N", help="number of processes to start")
    parser.add_argument("--devices-per-process", "-d", type=int, default=1, metavar="M",
                        help="simulated CPU devices each process sees (default 1)")
    parser.add_argument("--port", type=int, default=None, metavar="P",
                        help="coordinator port, on 127.0.0.1 only (default: a free one)")
    parser.add_argument("--init-timeout", type=int, default=None, metavar="S",
                        help=f"seconds every process has to join the job at start-up before it fails (default "
                             f"${ENV_INIT_TIMEOUT} if set, else {DEFAULT_INIT_TIMEOUT_S})")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="S",
                        help=f"seconds between SIGTERM and SIGKILL when stopping the others (default {DEFAULT_GRACE_S:g})")
    parser.add_argument("--elastic", action="store_true",
                        help="when a process dies or hangs, restart the job on the processes left, from the last "
                             "complete checkpoint of the command's --out (docs/multihost.md)")
    parser.add_argument("--min-processes", type=int, default=None, metavar="K",
                        help="with --elastic: stop instead of restarting when fewer than K processes are left "
                             "(default 1)")
    parser.add_argument("--max-restarts", type=int, default=None, metavar="R",
                        help=f"with --elastic: restart at most R times (default {Elastic.max_restarts})")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="also print the processes' [Gloo] connection lines (hidden by default)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def check_port(port: int) -> None:
    """A `LaunchError` naming ``port`` when something already listens on it (JAX would segfault instead)."""
    if not 0 < port < 65536:
        raise LaunchError(f"--port {port} is not a TCP port (1..65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a port in TIME_WAIT is free
        try:
            sock.bind((LOOPBACK, port))
        except OSError as err:
            raise LaunchError(f"--port {port}: the coordinator cannot listen on {LOOPBACK}:{port} ({err.strerror}); "
                              f"pick another --port, leave it out for a free one, or free this port (`ss -ltnp "
                              f"'sport = :{port}'` shows who holds it)") from None


def init_timeout(flag: int | None, environ: dict[str, str] | None = None) -> int:
    """The start-up timeout: ``--init-timeout``, else $SHARDLIB_INIT_TIMEOUT, else the default (60 s)."""
    env = os.environ if environ is None else environ
    value: object = flag if flag is not None else env.get(ENV_INIT_TIMEOUT) or DEFAULT_INIT_TIMEOUT_S
    try:
        seconds = int(value)  # type: ignore[arg-type]
    except ValueError:
        raise LaunchError(f"{ENV_INIT_TIMEOUT}={value!r} is not a whole number of seconds") from None
    if seconds < 1:
        raise LaunchError(f"--init-timeout {seconds} must be at least 1 second")
    return seconds


def process_env(base: dict[str, str], index: int, count: int, devices: int, coordinator: str) -> dict[str, str]:
    """The environment of process ``index``: shardlib's variables, CPU platform, M devices."""
    env = dict(base)
    env.update(
        SHARDLIB_COORDINATOR=coordinator,
        SHARDLIB_NUM_PROCESSES=str(count),
        SHARDLIB_PROCESS_ID=str(index),
        SHARDLIB_LOCAL_DEVICES=str(devices),
        SHARDLIB_LAUNCHER_PID=str(os.getpid()),  # each process stops when the launcher dies (distributed.watch_launcher)
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


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock,
          tail: collections.deque[str], verbose: bool = False) -> None:
    """Copy lines from a child's pipe to ``out``, each prefixed (whole lines under a lock), less Gloo's
    chatter unless ``verbose``; keep the last lines in ``tail`` (an elastic restart reads which peer a
    survivor saw die)."""
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            if verbose or not _CHATTER.match(line):
                out.write(prefix + line)
                out.flush()
            tail.append(line.decode(errors="replace"))
    stream.close()


@dataclasses.dataclass
class _Child:
    index: int
    proc: subprocess.Popen
    pumps: list[threading.Thread]
    tail: collections.deque[str]


def _signal_group(child: _Child, sig: int) -> None:
    """Signal the child's whole process group (it may have started processes of its own)."""
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _say(message: str) -> None:
    print(f"shardlib launch: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class JobEnd:
    """How one start of the job ended: the first failure (index, returncode), a signal received, output tails."""

    first_failure: tuple[int, int] | None
    interrupted: int | None
    tails: dict[int, list[str]]

    @property
    def exit_code(self) -> int:
        if self.first_failure is not None:
            return exit_code(self.first_failure[1])
        return 128 + self.interrupted if self.interrupted else 0


def launch(command: list[str], processes: int, devices_per_process: int = 1, *, port: int | None = None,
           grace_s: float = DEFAULT_GRACE_S, elastic: Elastic | None = None, init_timeout_s: int | None = None,
           verbose: bool = False) -> int:
    """Run ``command`` as ``processes`` local processes; the first failure's exit code (0 if none).

    With ``elastic``, a failure restarts the job on the processes left instead (`run_elastic`).
    """
    if processes < 1 or devices_per_process < 1:
        raise LaunchError(f"--processes ({processes}) and --devices-per-process ({devices_per_process}) must be positive")
    if not command:
        raise LaunchError("no command given; usage: shardlib launch --processes 2 -- python my_script.py")
    if port is not None:
        check_port(port)
    timeout_env = {ENV_INIT_TIMEOUT: str(init_timeout(init_timeout_s))}
    if elastic is not None:
        return run_elastic(command, processes, devices_per_process, elastic, port=port, grace_s=grace_s,
                           extra_env=timeout_env, verbose=verbose)
    return run_job(command, processes, devices_per_process, port=port, grace_s=grace_s,
                   extra_env=timeout_env, verbose=verbose).exit_code


def run_job(command: list[str], processes: int, devices_per_process: int, *, port: int | None, grace_s: float,
            extra_env: dict[str, str] | None = None, verbose: bool = False) -> JobEnd:
    """Start the processes, wait for all to succeed or the first to fail, stop the rest."""
    # Loopback: JAX's coordinator has no authentication. Process 0 binds the coordinator's own address
    # (shardlib.runtime.distributed.coordinator_bind), so this keeps it off every other interface.
    coordinator = f"{LOOPBACK}:{port or free_port()}"
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
            children.append(_start(command, index, processes, devices_per_process, coordinator, exits, extra_env,
                                   verbose=verbose))
        _say("started " + ", ".join(f"process {c.index} (pid {c.proc.pid})" for c in children))
        first_failure = _wait_first_failure(exits, processes, interrupted)
        if first_failure is not None:
            index, code = first_failure
            _say(f"process {index} (pid {children[index].proc.pid}) failed first: {describe_exit(code)}")
            for line in _diagnose(children, index, coordinator, (extra_env or {}).get(ENV_INIT_TIMEOUT),
                                  elastic.command_logged_step(command)):
                _say(line)
        elif interrupted:
            _say(f"received {signal.Signals(interrupted[0]).name}")
    finally:
        _stop(children, grace_s)  # no-op when all have exited; also runs if starting one failed
        for s, handler in previous.items():
            signal.signal(s, handler)
        for child in children:
            for t in child.pumps:
                t.join(timeout=5)
    return JobEnd(first_failure, interrupted[0] if interrupted else None, {c.index: list(c.tail) for c in children})


def _wait_first_failure(exits: queue.Queue[tuple[int, int]], processes: int, interrupted: list[int]):
    """(index, returncode) of the first process to fail; None when all succeeded or a signal came."""
    remaining = processes
    while remaining and not interrupted:
        try:
            index, code = exits.get(timeout=0.2)
        except queue.Empty:
            continue
        remaining -= 1
        if code != 0:
            return index, code
    return None


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (``R``, ``S``, ``T`` stopped, ``Z`` dead, not yet reaped);
    None when there is no such process (or no /proc: not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _stopped(pid: int) -> bool:
    """True when ``pid`` is stopped (SIGSTOP, Ctrl-Z, a debugger): state T or t (Linux only)."""
    return process_state(pid) in ("T", "t")


def _diagnose(children: list[_Child], failed: int, coordinator: str, init_timeout_s: str | None,
              step: int | None = None) -> list[str]:
    """What the first failure's output and the others' states say, in words (JAX's are a C++ abort);
    ``step``: the last one the run logged, where a process stopped mid-run stopped responding."""
    lines, joining = [], False
    tail = "".join(children[failed].tail)
    if "Failed to add port" in tail or "Failed to start RPC server" in tail:
        port = coordinator.rpartition(":")[2]
        lines.append(f"the coordinator could not listen on {coordinator}: port {port} is in use; pick another "
                     "--port (or leave it out for a free one), or free this port")
    elif "RegisterTask" in tail or ("DEADLINE_EXCEEDED" in tail and "Connect" in tail):
        joining = True
        within = f" within {init_timeout_s} s" if init_timeout_s else ""
        lines.append(f"process {failed} gave up waiting for every process to join the job{within} (--init-timeout)")
    for child in children:
        if child.index != failed and child.proc.poll() is None and _stopped(child.proc.pid):
            why = ("so it never joined" if joining else "and stopped responding mid-run"
                   + (f", after step {step}" if step is not None else ""))
            lines.append(f"process {child.index} (pid {child.proc.pid}) is stopped (SIGSTOP, Ctrl-Z or a debugger), "
                         f"{why}; continue it (kill -CONT) or find what stopped it")
    return lines


def run_elastic(command: list[str], processes: int, devices_per_process: int, policy: Elastic, *,
                port: int | None, grace_s: float, extra_env: dict[str, str] | None = None, verbose: bool = False) -> int:
    """Run the job; after each failure, restart it on the processes left (see `shardlib.runtime.elastic`)."""
    try:
        out_dir = elastic.run_directory(command)
    except ValueError as err:
        raise LaunchError(str(err)) from None
    base_env = dict(extra_env or {})
    restarts, extra_env = 0, dict(base_env)
    while True:
        end = run_job(command, processes, devices_per_process, port=port, grace_s=grace_s, extra_env=extra_env,
                      verbose=verbose)
        if end.first_failure is None:
            return end.exit_code
        index, code = end.first_failure
        dead = elastic.dead_processes(index, end.tails)
        how = describe_exit(code) if dead == [index] else "stopped sending heartbeats"
        died_at = elastic.last_logged_step(out_dir)
        _say(f"process {', '.join(map(str, dead))} {how}" + (f" after step {died_at}" if died_at is not None else ""))
        decision = elastic.decide(processes, dead, exit_code=exit_code(code), min_processes=policy.min_processes,
                                  max_restarts=policy.max_restarts, restarts=restarts)
        _say(decision.reason)
        if not decision.restart:
            return end.exit_code
        restarts, processes = restarts + 1, decision.processes
        resume = elastic.latest_checkpoint(out_dir)
        elastic.trim_examples(out_dir, resume or 0)
        note = elastic.restart_note(restart=restarts, dead=dead, how=how, died_at=died_at, resume_step=resume,
                                    processes=processes, devices_per_process=devices_per_process)
        source = f"checkpoint step {resume} in {out_dir / 'checkpoints'}" if resume is not None else "the start"
        _say(f"restart {restarts}: {processes} process(es) x {devices_per_process} device(s), from {source}")
        extra_env = {**base_env, elastic.ENV_RESTART: json.dumps(note)}
        port = None  # a fresh coordinator port: the old one may still be held by the stopped job


def _start(command: list[str], index: int, count: int, devices: int, coordinator: str,
           exits: queue.Queue[tuple[int, int]], extra_env: dict[str, str] | None = None, *,
           verbose: bool = False) -> _Child:
    """Start process ``index`` in its own session, with prefixing pumps and an exit watcher."""
    env = process_env({**os.environ, **(extra_env or {})}, index, count, devices, coordinator)
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as err:
        raise LaunchError(f"cannot start {command[0]!r}: {err.strerror or err}; check the command after --") from None
    prefix = f"[p{index}] ".encode()
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    pumps = [threading.Thread(target=_pump, args=(pipe, prefix, sink, _OUTPUT_LOCK, tail, verbose), daemon=True)
             for pipe, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer))]
    for t in pumps:
        t.start()
    threading.Thread(target=lambda: exits.put((index, proc.wait())), daemon=True).start()
    return _Child(index, proc, pumps, tail)


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
    return launch(command, args.processes, args.devices_per_process, port=args.port, grace_s=args.grace,
                  elastic=_elastic_policy(args), init_timeout_s=args.init_timeout, verbose=args.verbose)


def _elastic_policy(args: argparse.Namespace) -> Elastic | None:
    """``--elastic``'s settings; the elastic flags without ``--elastic`` would do nothing, so they are refused."""
    given = {flag: value for flag, value in (("--min-processes", args.min_processes),
                                             ("--max-restarts", args.max_restarts)) if value is not None}
    if not args.elastic:
        if given:
            raise LaunchError(f"{', '.join(given)} only apply with --elastic; add --elastic or drop them")
        return None
    policy = Elastic(min_processes=given.get("--min-processes", Elastic.min_processes),
                     max_restarts=given.get("--max-restarts", Elastic.max_restarts))
    if not 1 <= policy.min_processes <= args.processes or policy.max_restarts < 0:
        raise LaunchError(f"--min-processes {policy.min_processes} must be 1..--processes ({args.processes}) and "
                          f"--max-restarts {policy.max_restarts} must be >= 0")
    return policy
