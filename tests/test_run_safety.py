"""Nothing lost, nobody in: the coordinator's address, one run per --out, --out checked early, Ctrl-C.

Each test injects its fault into a real process (the launcher, `shardlib train`) and checks the
exit status and the one line that explains it; a run that is only refused (a port or a lock held,
an ``--out`` that cannot be written) is `shardlib.cli.main` in the test process, no start-up of its own:

* the coordinator of ``shardlib launch`` listens on 127.0.0.1 only (read from /proc/net/tcp*
  while the job runs); a ``--port`` in use is refused at once, naming the port; a process
  stopped (SIGSTOP) at start-up fails the job after ``--init-timeout``, naming it;
* a second ``shardlib train`` on a ``--out`` that a running one holds is refused in one line
  naming the holder's host and PID, before any compile; a lock left by a killed run is taken
  over with a note;
* an ``--out`` below a file, or on a read-only file system, is one line (exit 2) before any compile;
* Ctrl-C (SIGINT) during the step's XLA compile exits 130 with no traceback and no segfault.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from shardlib.runtime import distributed, launch
from shardlib.run.config import TrainConfig, TrainConfigError
from shardlib.cli import main
from shardlib.run.checkpointing import refuse_silent_restart
from shardlib.run.metrics_io import MetricsLog, read_metrics
from shardlib.run.directory import LOCK_NAME, claim_run_directory
from tests import compile_flags

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "8", "--cpu-devices", "2", "--no-progress",
        "--no-tensorboard", "--sample-tokens", "0", "--eval-every", "0"]


# `shardlib train` run in this (8-device) process: TINY on the devices it has. A run refused at its
# lock stops before it compiles anything, whatever its devices (the lock comes after them).
HERE = TINY[:TINY.index("--cpu-devices")] + TINY[TINY.index("--cpu-devices") + 2:]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLIB_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = compile_flags.FAST  # the CLI and launcher set their own devices
    env.update(extra)
    return env


def _train(*flags: str) -> list[str]:
    return [sys.executable, "-m", "shardlib.cli", "train", *TINY, *flags]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


# --------------------------------------------------------------------------------------------
# 1. The coordinator
# --------------------------------------------------------------------------------------------


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(what)
    return refuse


def _all_listening() -> set[tuple[str, int]]:
    """(local address, port) of every socket in LISTEN state (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != "0A":  # 0A: TCP_LISTEN
                continue
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
            found.add((socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, raw), int(hex_port, 16)))
    return found


def _listening(port: int) -> list[str]:
    """Local addresses of sockets in LISTEN state on ``port``."""
    return [address for address, p in _all_listening() if p == port]


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1" or address.startswith("::ffff:127.")


JOINS = ("from pathlib import Path; import sys, time; from shardlib.runtime import distributed; "
         "info = distributed.initialize(); print('joined', info.coordinator, flush=True); "
         "deadline = time.time() + 60\n"
         "while not Path(sys.argv[1]).exists() and time.time() < deadline: time.sleep(0.1)")


def test_launch_coordinator_listens_on_loopback_only(tmp_path):
    port, release = launch.free_port(), tmp_path / "release"
    cmd = [sys.executable, "-m", "shardlib.cli", "launch", "-n", "2", "-d", "2", "--port", str(port), "--grace", "5",
           "--", sys.executable, "-c", JOINS, str(release)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        joined = []
        for line in proc.stdout:
            joined += [line] if " joined " in line else []
            if len(joined) == 2:
                break
        assert len(joined) == 2, "the job did not start"
        assert all(f"127.0.0.1:{port}" in line for line in joined), joined
        listening = _listening(port)
        release.touch()
        assert listening, f"nothing listens on port {port}"
        assert all(_is_loopback(a) for a in listening), f"the coordinator listens on {listening}, not loopback only"
        assert proc.wait(timeout=60) == 0
    finally:
        release.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


COLLECTS = ("import sys, time; from pathlib import Path; import numpy as np; from shardlib.runtime import distributed; "
            "distributed.initialize(); from jax.experimental import multihost_utils; "
            "multihost_utils.process_allgather(np.array([1])); print('collected', flush=True); deadline = time.time() + 60\n"
            "while not Path(sys.argv[1]).exists() and time.time() < deadline: time.sleep(0.1)")


def test_launch_collectives_listen_on_loopback_where_the_hostname_is_a_lan_address(tmp_path):
    """JAX's gloo collectives listen where the host name resolves; /etc/hosts is pointed at a LAN address
    of this machine in a mount namespace, as on most machines, and they must still listen on loopback."""
    lan = next((a for a in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
                if "." in a and not a.startswith("127.")), None)
    if lan is None or subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a non-loopback IPv4 address and a mount namespace (unshare --mount, as root)")
    hosts, release = tmp_path / "hosts", tmp_path / "release"
    hosts.write_text(f"127.0.0.1 localhost\n{lan} {socket.gethostname()}\n")
    launch_cmd = [sys.executable, "-m", "shardlib.cli", "launch", "-n", "2", "-d", "1", "--grace", "5", "--",
                  sys.executable, "-c", COLLECTS, str(release)]
    script = f"mount --bind {shlex.quote(str(hosts))} /etc/hosts && exec {shlex.join(launch_cmd)}"
    before = _all_listening()
    proc = subprocess.Popen(["unshare", "--mount", "bash", "-c", script], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen: list[str] = []
        done = (line for line in proc.stdout if seen.append(line) or line.rstrip().endswith("] collected"))
        collected = [line for _, line in zip(range(2), done)]  # range first: zip must not wait for a third
        assert len(collected) == 2, "".join(seen)
        opened = _all_listening() - before
        release.touch()
        assert opened and all(_is_loopback(a) for a, _ in opened), f"the job listens on {sorted(opened)}"
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0, "".join(seen) + rest
    finally:
        release.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_processes_stop_when_the_launcher_is_killed(tmp_path):
    """SIGKILL leaves the launcher no chance to stop the job; each process notices it is gone."""
    cmd = [sys.executable, "-m", "shardlib.cli", "launch", "-n", "2", "-d", "1", "--", sys.executable, "-c",
           JOINS.replace("time.time() + 60", "time.time() + 600"), str(tmp_path / "never")]
    proc = subprocess.Popen(cmd, env=_env(SHARDLIB_HEARTBEAT_TIMEOUT="5"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if sum(" joined " in seen for seen in lines) == 2:
                break
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", "".join(lines))]
        assert len(pids) == 2, "".join(lines)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60  # a timeout, not a speed: without the watch they wait 600 s
        while any(launch.process_state(pid) not in (None, "Z") for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(launch.process_state(pid) in (None, "Z") for pid in pids), "the processes outlived the launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_coordinator_bind_address_follows_the_coordinator_host(monkeypatch):
    assert distributed.coordinator_bind("localhost:1234", {}) == ("127.0.0.1:1234", None)
    assert distributed.coordinator_bind("127.0.0.1:99", {}) == ("127.0.0.1:99", None)
    given = {distributed.ENV_COORDINATOR_BIND: "10.0.0.5:77"}
    assert distributed.coordinator_bind("node0:77", given) == ("10.0.0.5:77", None)
    # an address that is not this machine's (a NAT or service address): every interface, with a warning
    bind, warning = distributed.coordinator_bind("192.0.2.1:5000", {})  # TEST-NET-1: never local
    assert bind == "[::]:5000" and distributed.ENV_COORDINATOR_BIND in warning and "no authentication" in warning


def test_port_in_use_is_named_at_once(capsys):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(distributed.DistributedError, match=f"port {port} is already in use.*another port"):
            distributed.check_port_free(f"127.0.0.1:{port}")
        capsys.readouterr()
        # `shardlib launch` in this process: the refusal is the launcher's own, before it starts any process
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(launch.subprocess, "Popen", _refuse("a process was started before the refusal"))
            code = main(["launch", "-n", "2", "--port", str(port), "--", "true"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and f"--port {port}" in lines[0] and "pick another --port" in lines[0], stderr


def test_stopped_process_fails_start_up_after_the_init_timeout():
    script = ('if [ "$SHARDLIB_PROCESS_ID" = 1 ]; then kill -STOP $$; fi; '
              f'exec {sys.executable} -c "from shardlib.runtime import distributed; distributed.initialize()"')
    cmd = [sys.executable, "-m", "shardlib.cli", "launch", "-n", "2", "-d", "2", "--init-timeout", "4",
           "--grace", "1", "--", "bash", "-c", script]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert took < 45, f"took {took:.0f} s: the 4 s start-up timeout did not apply (the default is 60 s)"
    assert "process 0 gave up waiting for every process to join the job within 4 s (--init-timeout)" in proc.stderr
    assert "process 1 (pid" in proc.stderr and "is stopped (SIGSTOP" in proc.stderr, proc.stderr[-3000:]


def test_a_process_stopped_mid_run_is_named_as_stopped_responding_not_as_never_joined(tmp_path):
    out = tmp_path / "run"
    script = ("import json, os, signal, sys; from pathlib import Path; import numpy as np; "
              "from shardlib.runtime import distributed; from jax.experimental import multihost_utils; "
              "info = distributed.initialize(); multihost_utils.process_allgather(np.array([1])); out = Path(sys.argv[2])\n"
              "if info.process_id == 0: out.mkdir(); (out / 'metrics.jsonl').write_text(json.dumps({'step': 7, 'loss': 1.0}) + '\\n')\n"
              "multihost_utils.process_allgather(np.array([2]))\n"
              "if info.process_id == 1: os.kill(os.getpid(), signal.SIGSTOP)\n"
              "multihost_utils.process_allgather(np.array([3]))")
    cmd = [sys.executable, "-m", "shardlib.cli", "launch", "-n", "2", "-d", "1", "--grace", "1", "--",
           sys.executable, "-c", script, "--out", str(out)]
    proc = subprocess.run(cmd, env=_env(SHARDLIB_HEARTBEAT_TIMEOUT="4"), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "is stopped (SIGSTOP, Ctrl-Z or a debugger), and stopped responding mid-run, after step 7" in proc.stderr, \
        proc.stderr[-3000:]
    assert "never joined" not in proc.stderr


# --------------------------------------------------------------------------------------------
# 3. One run per --out; 4. --out checked before the compile
# --------------------------------------------------------------------------------------------


def test_second_run_on_the_same_out_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    first = subprocess.Popen(_train("--steps", "100000", "--out", str(out)), env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lock = out / LOCK_NAME
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().strip()) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        holder = json.loads(lock.read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        # Paused while the second run starts: a stopped process keeps its flock and its PID, so it
        # holds --out exactly as a compiling one does, without burning the CPU the second run's
        # start-up shares (it resumes below, before the check that it keeps going).
        first.send_signal(signal.SIGSTOP)
        capsys.readouterr()
        try:  # the second run is `shardlib train` in this process (no start-up of its own)
            code = main(["train", *HERE, "--steps", "2", "--out", str(out)])
        finally:
            first.send_signal(signal.SIGCONT)
        second = capsys.readouterr()
        assert code == 2, second.err
        errors = _error_lines(second.err)
        assert len(errors) == 1 and "Traceback" not in second.err, second.err
        assert f"pid {first.pid} on host {socket.gethostname()}" in errors[0] and "--out" in errors[0], errors[0]
        # The lock comes before the header, the data and the compile: nothing of a run is printed.
        assert not second.out.strip(), second.out
        assert first.poll() is None, "the first run must keep going"
    finally:
        first.kill()
        first.wait()
    # The killed run's flock died with it; its lock file still names it: taken over with a note.
    config = TrainConfig(out=str(out))
    with claim_run_directory(config, out, main=True):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert f"took over {lock}, left by a run that is no longer running (pid {first.pid}" in capsys.readouterr().err
    assert lock.read_text() == ""  # released cleanly: the next run has nothing to take over


def test_lock_contention_in_process_keeps_the_holders_name(tmp_path):
    out, config = tmp_path / "run", TrainConfig(out=str(tmp_path / "run"))
    with claim_run_directory(config, out, main=True):
        held = (out / LOCK_NAME).read_text()
        with pytest.raises(TrainConfigError, match=f"--out: .* is in use by another run \\(pid {os.getpid()} on host"):
            with claim_run_directory(config, out, main=True):
                pass
        assert (out / LOCK_NAME).read_text() == held  # the refused claim did not touch the holder's record


def _tree(directory: Path) -> dict[str, bytes | None]:
    """Every path below ``directory`` with its bytes (None for a directory): what "unchanged" compares."""
    return {str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes() for p in sorted(directory.rglob("*"))}


def test_resume_from_a_running_runs_directory_is_refused_and_leaves_it_untouched(tmp_path, capsys):
    """The run saves (sets aside, deletes) in ``--resume-from``'s checkpoints, so it must hold that lock too."""
    a, b = tmp_path / "A", tmp_path / "B"
    (a / "checkpoints" / "4").mkdir(parents=True)  # a save in progress: no commit marker yet
    (a / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()
    (a / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with claim_run_directory(TrainConfig(out=str(a)), a, main=True):  # run A, still going
        before = _tree(a)
        capsys.readouterr()
        code = main(["train", *HERE, "--steps", "4", "--ckpt-every", "2", "--keep", "2", "--out", str(b),
                     "--resume-from", str(a)])  # in this process: the lock is an flock, held per open file
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        errors = _error_lines(err)
        assert len(errors) == 1 and "--resume-from" in errors[0], err
        assert f"{a} is in use by another run (pid {os.getpid()} on host {socket.gethostname()}" in errors[0], errors[0]
        assert _tree(a) == before


def test_a_symlinked_or_special_lock_file_is_refused_and_its_target_untouched(tmp_path):
    out, victim = tmp_path / "run", tmp_path / "precious.txt"
    out.mkdir()
    victim.write_text("keep me\n")
    (out / LOCK_NAME).symlink_to(victim)
    config = TrainConfig(out=str(out))
    with pytest.raises(TrainConfigError, match=f"--out: {out / LOCK_NAME} is a symbolic link \\(to {victim}\\); .*remove it"):
        with claim_run_directory(config, out, main=True):
            pass
    assert victim.read_text() == "keep me\n"
    (out / LOCK_NAME).unlink()
    os.mkfifo(out / LOCK_NAME)
    with pytest.raises(TrainConfigError, match="is not a regular file"):
        with claim_run_directory(config, out, main=True):
            pass


@pytest.mark.parametrize("history", ["metrics", "damaged", "incomplete"])
def test_a_run_directory_with_history_but_nothing_to_resume_is_refused_unless_fresh(tmp_path, capsys, history):
    """No silent start from step 0 over an earlier run; ``--fresh`` does it on purpose, keeping the old metrics."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    old = '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n'
    if history == "metrics":
        (out / "metrics.jsonl").write_text(old)
    else:
        (out / "checkpoints" / ("6.damaged-digest" if history == "damaged" else "6")).mkdir()  # "6": no commit marker
    before = _tree(out)
    flags = ["train", "--model", "tiny", "--steps", "2", "--ckpt-every", "2", "--out", str(out)]
    assert main(flags) == 2
    errors = _error_lines(capsys.readouterr().err)
    named = {"metrics": "metrics.jsonl", "damaged": "6.damaged-digest", "incomplete": "cannot resume from: 6"}[history]
    assert len(errors) == 1 and named in errors[0] and "--fresh" in errors[0], errors
    assert _tree(out) == {**before, LOCK_NAME: b""}  # the lock is taken first (issue 42 §7), released empty
    refuse_silent_restart(TrainConfig(out=str(out), ckpt_every=2, fresh=True), out)  # on purpose: let through


def test_metrics_jsonl_is_never_rewritten_but_moved_aside(tmp_path):
    lines = [{"step": k, "loss": 5.0 - k} for k in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in lines)
    (tmp_path / "metrics.jsonl").write_text(text)
    MetricsLog(tmp_path, tensorboard=False, resume_step=3).close()  # nothing to drop: appended to, as it is
    assert (tmp_path / "metrics.jsonl").read_text() == text and not (tmp_path / "metrics.jsonl.1").exists()
    MetricsLog(tmp_path, tensorboard=False, resume_step=2).close()  # step 3 dropped: the whole file kept aside
    assert (tmp_path / "metrics.jsonl.1").read_text() == text
    assert read_metrics(tmp_path / "metrics.jsonl") == lines[:2]
    MetricsLog(tmp_path, tensorboard=False).close()  # a fresh start (--fresh): never over the first one aside
    assert (tmp_path / "metrics.jsonl.1").read_text() == text
    assert read_metrics(tmp_path / "metrics.jsonl.2") == lines[:2] and read_metrics(tmp_path / "metrics.jsonl") == []


def test_metrics_are_never_written_through_a_planted_link(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(TrainConfigError, match="metrics.jsonl is a symbolic link; .*remove it"):
        MetricsLog(tmp_path / "run", tensorboard=False, resume_step=0).close()
    assert victim.read_text() == "keep me\n"


def test_out_below_a_file_is_one_line_before_the_compile(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory\n")
    capsys.readouterr()
    compiles = []
    count = lambda event, duration, **kwargs: compiles.append(event) if event.endswith("backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        code = main(["train", *TINY, "--steps", "2", "--out", str(blocker / "run")])  # in this process
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    errors = _error_lines(err)
    assert len(errors) == 1 and f"--out: cannot write the run directory {blocker / 'run'}: {blocker} is a file" in errors[0]
    assert compiles == []  # refused before XLA compiled anything


def _read_only_command(directory: Path, command: list[str]) -> list[str]:
    """``command`` with ``directory`` read-only: by mode bits, or (as root, who ignores them) a read-only bind mount."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return command
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("running as root without mount namespaces: no way to make a directory read-only")
    d = str(directory)
    quoted = " ".join(f"'{c}'" for c in command)
    return ["unshare", "-m", "sh", "-c", f"mount --bind '{d}' '{d}' && mount -o remount,ro,bind '{d}' && exec {quoted}"]


def test_read_only_out_is_one_line_before_the_compile(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    out = read_only / "run"
    cmd = _read_only_command(read_only, _train("--steps", "2", "--out", str(out)))
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    read_only.chmod(0o755)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = _error_lines(proc.stderr)
    assert len(errors) == 1 and f"--out: cannot write the run directory {out}: it is not writable" in errors[0], errors


# --------------------------------------------------------------------------------------------
# 6. Ctrl-C during the compile
# --------------------------------------------------------------------------------------------

# The CLI, with a line on stdout as each XLA compile starts (so the test knows when to press
# Ctrl-C). The step's compile is repeated until the signal comes (at most 60 s), so the signal
# lands inside XLA's compile however long the test process takes to wake up on a loaded machine
# (a single compile can finish first, and the run would then reach its loop, where Ctrl-C saves
# and stops).
ANNOUNCE_COMPILES = """
import signal, sys, time
# A Ctrl-C reaches the CLI as from a shell: SIGINT unblocked and Python's handler in place, whatever
# the test worker's own signal state (a child inherits an ignored SIGINT and a blocked mask; the
# state found is printed, so that a worker that passes one on is seen).
blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
print("SIGINT", "blocked" if blocked else "unblocked", signal.getsignal(signal.SIGINT), flush=True)
signal.signal(signal.SIGINT, signal.default_int_handler)
from jax._src import compiler
compile_and_load = compiler.backend_compile_and_load
def announced(backend, module, *args, **kwargs):
    name = str(module.operation.attributes["sym_name"])
    print("COMPILING", name, file=sys.stdout, flush=True)  # stderr is held while the step compiles
    if name != '"jit_step_fn"':
        return compile_and_load(backend, module, *args, **kwargs)
    deadline = time.monotonic() + 60
    while True:
        executable = compile_and_load(backend, module, *args, **kwargs)
        if time.monotonic() > deadline:
            return executable
compiler.backend_compile_and_load = announced
from shardlib.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("checkpoints", [False, True], ids=["no-checkpoints", "ckpt-every"])
def test_ctrl_c_during_the_compile_exits_130_cleanly(tmp_path, checkpoints):
    flags = ["--steps", "3", "--out", str(tmp_path / "run"), "--ckpt-every", "2" if checkpoints else "0"]
    cmd = [sys.executable, "-X", "faulthandler", "-c", ANNOUNCE_COMPILES, "train", *TINY, *flags]
    # as from a shell: none of the test worker's environment beyond what a shell has (an earlier
    # test's variables do not reach the CLI)
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=compile_flags.FAST)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    inherited, seen = proc.stdout.readline().strip(), []
    for line in proc.stdout:
        seen.append(line.strip())
        if line.startswith('COMPILING "jit_step_fn"'):
            time.sleep(0.5)  # the child is inside XLA's compile of the step (repeated until the signal)
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (f"exit {proc.returncode} ({inherited} when it started; compiles announced: "
                                    f"{seen[-5:]}; stdout after: {out[-500:]!r}):\n{err[-3000:]}")
    assert "interrupted" in err and "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
