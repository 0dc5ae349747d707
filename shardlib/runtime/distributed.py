"""Joining a multi-process JAX job (over 600 lines: every cluster's way to join, and leaving together).

Explicit arguments, shardlib's env vars, or the cluster's own.

Call :func:`initialize` first thing in ``main``, before anything touches a JAX device. Where the
settings come from, first match wins:

1. explicit arguments (``coordinator_address``, ``num_processes``, ``process_id``);
2. ``SHARDLIB_COORDINATOR`` / ``SHARDLIB_NUM_PROCESSES`` / ``SHARDLIB_PROCESS_ID`` (set by
   ``shardlib launch``, or by hand); ``SHARDLIB_NUM_PROCESSES=1`` alone forces one process;
3. SLURM (``SLURM_JOB_ID`` with ``SLURM_NTASKS`` > 1), Open MPI (``OMPI_COMM_WORLD_SIZE`` > 1),
   a Cloud TPU pod (``TPU_WORKER_HOSTNAMES`` / ``TPU_PROCESS_ADDRESSES`` naming several hosts,
   ``MEGASCALE_COORDINATOR_ADDRESS``, or a Cloud TPU VM): ``jax.distributed.initialize()``
   detects the rest itself;
4. otherwise one process, and nothing to join.

``SHARDLIB_LOCAL_DEVICES`` (or ``local_device_count``) is how many devices each process must
drive: on CPU it *sets* the simulated device count, on GPU/TPU it is checked (and under
SLURM / Open MPI picks the GPUs, see :func:`cluster_device_choice`). Either way the
run stops with an error naming the processes when they disagree, instead of hanging in the
first collective or silently training on fewer devices.

Failure bound. Every process sends heartbeats to the coordinator (process 0). When a process
dies, the others abort within ``SHARDLIB_HEARTBEAT_TIMEOUT`` seconds (default 30, measured
here at ~timeout + 1 s); when process 0 dies they abort at once (its socket closes). A process
that raises is made to exit at once (see :func:`finish`), so it counts as dead rather than
waiting at JAX's shutdown barrier while its peers wait in a collective. Under ``shardlib launch``
the launcher notices a death at once and SIGKILLs the rest after ``--grace`` (10 s).

Where the coordinator listens. JAX's coordinator has no authentication: whatever reaches its
port can join the job or abort it. Process 0 therefore binds it to the coordinator host's own
address (loopback for ``localhost`` / ``127.0.0.1``, which is what ``shardlib launch`` uses), not
to every interface as JAX does by default; ``SHARDLIB_COORDINATOR_BIND=host:port`` overrides it
(see :func:`coordinator_bind`). A port already in use is named before JAX would crash on it.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import re
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from shardlib import compat
from shardlib.runtime.devices import raise_cpu_collective_timeout

ENV_COORDINATOR = "SHARDLIB_COORDINATOR"
ENV_NUM_PROCESSES = "SHARDLIB_NUM_PROCESSES"
ENV_PROCESS_ID = "SHARDLIB_PROCESS_ID"
ENV_LOCAL_DEVICES = "SHARDLIB_LOCAL_DEVICES"
ENV_HEARTBEAT_TIMEOUT = "SHARDLIB_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "SHARDLIB_INIT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "SHARDLIB_SHUTDOWN_TIMEOUT"
ENV_COORDINATOR_BIND = "SHARDLIB_COORDINATOR_BIND"
ENV_LAUNCHER_PID = "SHARDLIB_LAUNCHER_PID"
ENV_COLLECTIVES_INTERFACE = "SHARDLIB_COLLECTIVES_INTERFACE"  # multi-host CPU jobs: the NIC gloo listens on

# Seconds. Heartbeat: a dead process is noticed within this; 30 s rides out GC pauses and network
# blips on a real cluster yet frees a failed allocation quickly (JAX's default is 100 s).
HEARTBEAT_TIMEOUT_S = 30
# How long processes wait for each other to start (nodes and TPU workers start staggered).
INIT_TIMEOUT_S = 300
# How long a process that finished waits for the others at exit (e.g. one still saving).
SHUTDOWN_TIMEOUT_S = 300

# How long a failing process 0 waits before exiting (see finish).
COORDINATOR_EXIT_DELAY_S = 2.0


class DistributedError(ValueError):
    """A multi-process setup that cannot work: called too late, missing settings, device mismatch."""

    user_facing = True


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where this process's distributed settings come from, before JAX is touched."""

    source: str  # "explicit", "env", "slurm", "ompi", "tpu", "single" (or "existing": already joined)
    coordinator: str | None = None
    num_processes: int | None = None  # None: the cluster integration decides
    process_id: int | None = None
    local_devices: int | None = None  # devices each process must drive (None: whatever it sees)
    device_ids: tuple[int, ...] | None = None  # accelerator ids for jax (None: all it can see)
    keep_jax_device_choice: bool = False  # SLURM/MPI with several tasks a node: JAX's one GPU per task

    @property
    def multi_process(self) -> bool:
        return self.source != "single"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """What this process joined: for the train banner and for checks."""

    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int
    platform: str
    source: str
    coordinator: str | None

    def describe(self) -> str:
        where = f" via {self.source}" + (f" (coordinator {self.coordinator})" if self.coordinator else "")
        if self.num_processes == 1:
            return f"1 process, {self.local_devices} {self.platform} device(s)"
        return (
            f"process {self.process_id} of {self.num_processes}{where}: {self.local_devices} local / "
            f"{self.global_devices} global {self.platform} devices"
        )


# --------------------------------------------------------------------------------------------
# Deciding, from arguments and environment only (pure; unit-tested with fake environments)
# --------------------------------------------------------------------------------------------


def _int(value: Any, name: str, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{name}={value!r} is not an integer") from None
    if number < minimum:
        raise DistributedError(f"{name}={number} must be at least {minimum}")
    return number


def _explicit_plan(
    source: str, coordinator: str | None, num_processes: Any, process_id: Any, local_devices: int | None, names: Sequence[str]
) -> Plan:
    """Plan from explicit values (arguments or SHARDLIB_* vars); ``names`` are what to tell the user."""
    n = _int(num_processes, names[1], 1) if num_processes is not None else None
    if n == 1 and process_id in (None, 0, "0"):
        return Plan("single", local_devices=local_devices)
    missing = [name for name, value in zip(names, (coordinator, num_processes, process_id)) if value is None]
    if missing:
        raise DistributedError(
            f"multi-process settings are incomplete: {', '.join(missing)} not given; set all of "
            f"{', '.join(names)} (e.g. {names[0]}=host0:12345 {names[1]}=2 {names[2]}=0 on the first process)"
        )
    pid = _int(process_id, names[2], 0)
    if pid >= n:
        raise DistributedError(f"{names[2]}={pid} is outside [0, {n}) for {names[1]}={n}")
    if ":" not in coordinator:
        raise DistributedError(f"{names[0]}={coordinator!r} must be host:port, e.g. {coordinator}:12345")
    return Plan(source, coordinator, n, pid, local_devices)


def _tasks_per_node(env: Mapping[str, str]) -> int | None:
    """Most tasks any node runs: SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE ('8(x2),4') or Open MPI's."""
    for key in ("SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if env.get(key, "").isdigit():
            return int(env[key])
    counts = [int(m) for m in re.findall(r"(\d+)(?:\(x\d+\))?", env.get("SLURM_TASKS_PER_NODE", ""))]
    return max(counts) if counts else None


def _visible_accelerators(env: Mapping[str, str]) -> int | None:
    """How many GPUs the scheduler left visible to this task (None: no restriction set)."""
    for key in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if key in env:
            return len([x for x in env[key].split(",") if x.strip()])
    return None


def cluster_device_choice(env: Mapping[str, str], local_devices: int | None, local_rank: int) -> tuple[tuple[int, ...] | None, bool]:
    """Which GPUs a SLURM / Open MPI task drives: (device ids or None for all visible, keep JAX's rule).

    JAX's own rule there is "one GPU per task, the one at the local rank", which is wrong for one
    task per node (it then sees 1 GPU, not 8) and for schedulers that already bound each task's
    GPUs (local rank 3 but only one visible GPU). shardlib instead: an expected count M splits
    the node's GPUs by local rank unless exactly M are visible; one task per node, or fewer GPUs
    visible than tasks on the node (bound by the scheduler), uses every visible GPU; otherwise
    (several tasks all seeing all GPUs) it keeps JAX's one-GPU-per-task rule.
    """
    visible, tasks = _visible_accelerators(env), _tasks_per_node(env)
    if local_devices is not None:
        if visible == local_devices:
            return tuple(range(local_devices)), False
        return tuple(range(local_rank * local_devices, (local_rank + 1) * local_devices)), False
    if tasks == 1 or (visible is not None and tasks is not None and visible < tasks):
        return None, False
    return None, True


def _slurm_plan(env: Mapping[str, str], local_devices: int | None) -> Plan:
    ntasks = env["SLURM_NTASKS"]
    missing = [k for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST") if k not in env]
    if missing:
        raise DistributedError(
            f"this is a SLURM job with SLURM_NTASKS={ntasks}, but {', '.join(missing)} is unset: the process was "
            "not started by srun. Start one copy per task with `srun python -m shardlib.cli train ...` "
            f"(see scripts/slurm_train.sbatch), or set {ENV_NUM_PROCESSES}=1 to run a single process"
        )
    ids, keep = cluster_device_choice(env, local_devices, int(env["SLURM_LOCALID"]))
    return Plan("slurm", local_devices=local_devices, device_ids=ids, keep_jax_device_choice=keep)


def _ompi_plan(env: Mapping[str, str], local_devices: int | None) -> Plan:
    if "OMPI_MCA_orte_hnp_uri" not in env:  # Open MPI 5 (PRRTE) no longer exports it
        raise DistributedError(
            f"Open MPI started {env['OMPI_COMM_WORLD_SIZE']} processes but OMPI_MCA_orte_hnp_uri, which JAX's "
            "Open MPI detection reads, is unset (Open MPI 5). Pass the settings explicitly: "
            f"{ENV_COORDINATOR}=<rank-0 host>:<port> {ENV_NUM_PROCESSES}=$OMPI_COMM_WORLD_SIZE "
            f"{ENV_PROCESS_ID}=$OMPI_COMM_WORLD_RANK"
        )
    ids, keep = cluster_device_choice(env, local_devices, int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    return Plan("ompi", local_devices=local_devices, device_ids=ids, keep_jax_device_choice=keep)


def _on_cloud_tpu_vm() -> bool:
    return compat.on_cloud_tpu_vm()


def _tpu_pod(env: Mapping[str, str]) -> bool:
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    return len([h for h in hosts.split(",") if h.strip()]) > 1 or "MEGASCALE_COORDINATOR_ADDRESS" in env


def _expected_local(local_device_count: int | None, env: Mapping[str, str]) -> int | None:
    """Devices per process: the argument, else SHARDLIB_LOCAL_DEVICES, else no expectation."""
    if local_device_count is not None:
        return _int(local_device_count, "local_device_count", 1)
    if env.get(ENV_LOCAL_DEVICES):
        return _int(env[ENV_LOCAL_DEVICES], ENV_LOCAL_DEVICES, 1)
    return None


def plan(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    on_tpu_vm: bool | None = None,
) -> Plan:
    """Decide where the settings come from (see the module docstring for the order); touches no device."""
    env = os.environ if environ is None else environ
    local_device_count = _expected_local(local_device_count, env)
    args = (coordinator_address, num_processes, process_id)
    if any(a is not None for a in args):
        return _explicit_plan("explicit", *args, local_device_count, ("coordinator_address", "num_processes", "process_id"))
    env_args = tuple(env.get(k) or None for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID))
    if any(a is not None for a in env_args):
        return _explicit_plan("env", *env_args, local_device_count, (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID))
    if "SLURM_JOB_ID" in env and env.get("SLURM_NTASKS", "1").isdigit() and int(env.get("SLURM_NTASKS", "1")) > 1:
        return _slurm_plan(env, local_device_count)
    if env.get("OMPI_COMM_WORLD_SIZE", "1").isdigit() and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return _ompi_plan(env, local_device_count)
    if _tpu_pod(env) or (_on_cloud_tpu_vm() if on_tpu_vm is None else on_tpu_vm):
        return Plan("tpu", local_devices=local_device_count)
    return Plan("single", local_devices=local_device_count)


# --------------------------------------------------------------------------------------------
# Joining
# --------------------------------------------------------------------------------------------


def backend_started() -> bool:
    """True once anything in this process started a JAX backend (jax.devices(), an array, jit...)."""
    from shardlib.compat import backends_initialized

    return backends_initialized()


def _timeout(env: Mapping[str, str], name: str, default: int) -> int:
    return _int(env[name], name, 1) if env.get(name) else default


def _add_cpu_flags(local_devices: int | None) -> None:
    """Simulated CPU device count and the CPU collective watchdog, before the backend reads them."""
    if local_devices is not None:
        jax.config.update("jax_num_cpu_devices", local_devices)
    raise_cpu_collective_timeout()


def _too_late(p: Plan) -> DistributedError:
    devices = jax.devices()
    return DistributedError(
        f"shardlib.runtime.distributed.initialize() was called after the JAX backend started (it already sees "
        f"{len(devices)} {devices[0].platform} device(s) as a single process), so this process cannot join the "
        f"{p.num_processes or 'multi'}-process job found via {p.source}. Call it first thing in main, before "
        "jax.devices(), any jnp array, jit, or a library that creates arrays at import"
    )


# --------------------------------------------------------------------------------------------
# Where the coordinator listens
# --------------------------------------------------------------------------------------------

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def _split_host_port(address: str) -> tuple[str, str]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def _join_host_port(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _can_bind(ip: str) -> bool:
    """True when ``ip`` is an address of this machine (a socket can be bound to it)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((ip, 0))
        return True
    except OSError:
        return False


def coordinator_bind(coordinator: str, environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """Where process 0's coordinator listens: (bind address, a warning or None).

    JAX's default is every interface (``[::]:port``), and its coordinator has no
    authentication: anything that reaches the port can join or abort the job. So, unless
    ``SHARDLIB_COORDINATOR_BIND`` (or JAX's ``JAX_COORDINATOR_BIND_ADDRESS``) says otherwise, it
    listens only on the coordinator host's own address, as resolved from the coordinator
    address (``localhost`` / ``127.0.0.1``: loopback only). When that address is not one of
    this machine's (a NAT or service address), or a host name resolves to loopback here but
    not elsewhere (Debian's ``127.0.1.1`` line in /etc/hosts), listening there would shut the
    other hosts out: then every interface, with a warning naming the variable to set.
    """
    env = os.environ if environ is None else environ
    given = env.get(ENV_COORDINATOR_BIND) or env.get("JAX_COORDINATOR_BIND_ADDRESS")
    if given:
        return given, None
    host, port = _split_host_port(coordinator)
    everywhere = f"[::]:{port}"
    try:
        ips = list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))
    except (OSError, UnicodeError):
        ips = []
    ips.sort(key=lambda ip: ":" in ip)  # IPv4 first: what "localhost" clients try most often
    loopback_name = _is_loopback(host)
    for ip in ips:
        if ipaddress.ip_address(ip.split("%")[0]).is_loopback and not loopback_name:
            continue  # e.g. node0 -> 127.0.1.1 on node0 itself: the other hosts could not connect there
        if _can_bind(ip):
            return _join_host_port(ip, port), None
    why = (f"here it resolves to {', '.join(ips)}: loopback, or not an address of this machine"
           if ips else "it does not resolve here")
    return everywhere, (
        f"shardlib: warning: the coordinator listens on every interface (port {port}) because {host!r} cannot be "
        f"used as its address ({why}); set {ENV_COORDINATOR_BIND}=<this host's address on the job's network>:{port} "
        "to restrict it. JAX's coordinator has no authentication: keep the job on a private network"
    )


def check_port_free(bind: str) -> None:
    """A `DistributedError` naming the port when something already listens there.

    JAX would otherwise crash (SIGSEGV, or "Failed to start RPC server") without naming it.
    SO_REUSEADDR as gRPC sets it: a port left in TIME_WAIT by a finished job is free.
    """
    host, port = _split_host_port(bind)
    if not port.isdigit():
        return
    family = socket.AF_INET6 if ":" in host or host in ("", "::") else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host or "::", int(port)))
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            return  # not ours to judge (an address JAX may still handle): let it try
        raise DistributedError(
            f"the coordinator cannot listen on {bind}: port {port} is already in use (another job, or another "
            f"program; `ss -ltnp 'sport = :{port}'` shows which). Pick another port (shardlib launch --port, or the "
            f"port in {ENV_COORDINATOR} / coordinator_address) or free this one"
        ) from None


def _cluster_coordinator(ids: list[int] | None, init_s: int) -> str | None:
    """The coordinator address JAX's SLURM / Open MPI detection will use (None: unknown)."""
    try:
        address, *_ = compat.cluster_env().auto_detect_unset_distributed_params(None, None, None, ids, None, init_s)
        return address
    except Exception:  # a private API: when it moves, JAX's own default applies
        return None


def _bind_for(coordinator: str | None) -> str | None:
    """Process 0's bind address (checked free, warning printed), or None for JAX's default."""
    if coordinator is None or ":" not in coordinator:
        return None
    bind, warning = coordinator_bind(coordinator)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    check_port_free(bind)
    return bind


def _process_id_of_cluster(source: str) -> int | None:
    env = os.environ
    key = {"slurm": "SLURM_PROCID", "ompi": "OMPI_COMM_WORLD_RANK"}.get(source)
    value = env.get(key, "") if key else ""
    return int(value) if value.isdigit() else None


def _bind_collectives(coordinator: str | None) -> None:
    """Where the CPU collectives (gloo) listen: the interface ``SHARDLIB_COLLECTIVES_INTERFACE``
    names; else loopback when the coordinator is (a local job, as ``shardlib launch`` runs); else
    JAX's default, the address this host's name resolves to."""
    interface = os.environ.get(ENV_COLLECTIVES_INTERFACE) or None
    local = coordinator is not None and _is_loopback(_split_host_port(coordinator)[0])
    if interface or local:
        compat.bind_cpu_collectives(None if interface else "127.0.0.1", interface)


def _join(p: Plan, heartbeat_s: int, init_s: int, shutdown_s: int) -> None:
    timeouts = dict(
        initialization_timeout=init_s, heartbeat_timeout_seconds=heartbeat_s, shutdown_timeout_seconds=shutdown_s
    )
    if p.source in ("explicit", "env"):
        bind = _bind_for(p.coordinator) if p.process_id == 0 else None
        jax.distributed.initialize(p.coordinator, p.num_processes, p.process_id, coordinator_bind_address=bind,
                                   **timeouts)
        _bind_collectives(p.coordinator)
        return
    ids = list(p.device_ids) if p.device_ids is not None else None
    bind = None
    if _process_id_of_cluster(p.source) == 0:
        bind = _bind_for(_cluster_coordinator(ids, init_s))
    jax.distributed.initialize(local_device_ids=ids, coordinator_bind_address=bind, **timeouts)
    _bind_collectives(None)
    if p.source in ("slurm", "ompi") and ids is None and not p.keep_jax_device_choice:
        # JAX narrowed this task to the GPU at its local rank; shardlib's rule is "all visible".
        jax.config.update("jax_cuda_visible_devices", "all")
        jax.config.update("jax_rocm_visible_devices", "all")


def check_devices(expected_local: int | None = None) -> tuple[int, int]:
    """Every process must drive the same number of devices (and ``expected_local``, if given).

    Reads the global device list, which every process receives in full when the backend starts,
    so this needs no collective and works exactly when counts differ (``process_allgather``
    cannot: it reshapes the devices into processes x local count and fails with a bare
    reshape error there).
    """
    devices = jax.devices()
    per_process = Counter(d.process_index for d in devices)
    platform = devices[0].platform
    if len(set(per_process.values())) > 1:
        listing = ", ".join(f"process {p} has {n}" for p, n in sorted(per_process.items()))
        raise DistributedError(
            f"processes disagree about their {platform} device count: {listing}. Every process must drive the "
            "same number of devices; check CUDA_VISIBLE_DEVICES / SLURM_GPUS_PER_TASK per task, "
            f"{ENV_LOCAL_DEVICES}, and that every node has the same accelerators (docs/multihost.md)"
        )
    local = jax.local_device_count()
    if expected_local is not None and local != expected_local:
        raise DistributedError(
            f"process {jax.process_index()} drives {local} {platform} device(s) but {expected_local} were expected "
            f"({ENV_LOCAL_DEVICES} / local_device_count); check CUDA_VISIBLE_DEVICES, SLURM_GPUS_PER_TASK "
            "or --gpus-per-task, and JAX_PLATFORMS (docs/multihost.md)"
        )
    return local, len(devices)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
    *,
    platform: str | None = None,
    heartbeat_timeout_s: int | None = None,
    init_timeout_s: int | None = None,
    shutdown_timeout_s: int | None = None,
) -> ProcessInfo:
    """Join the job this process belongs to (or do nothing for one process); then check devices.

    Must run before anything starts the JAX backend. ``platform`` ("cpu", "gpu", "tpu") pins
    ``jax_platforms``; ``local_device_count`` is per process (CPU: sets it; else: checked). Starts
    the backend itself (to check device counts), so configure JAX before calling it. Calling it
    again, or after ``jax.distributed.initialize``, only re-checks and returns the same info.
    """
    env = os.environ
    joined = jax.distributed.is_initialized()
    if joined:  # by an earlier call, or by the user with jax.distributed directly: check only
        p = Plan("existing", local_devices=_expected_local(local_device_count, env))
    else:
        p = plan(coordinator_address, num_processes, process_id, local_device_count)
        if backend_started():
            if p.multi_process:
                raise _too_late(p)
        else:
            if platform is not None:
                jax.config.update("jax_platforms", platform)
            _add_cpu_flags(p.local_devices)
            if p.multi_process:
                _join(
                    p,
                    heartbeat_timeout_s or _timeout(env, ENV_HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_S),
                    init_timeout_s or _timeout(env, ENV_INIT_TIMEOUT, INIT_TIMEOUT_S),
                    shutdown_timeout_s or _timeout(env, ENV_SHUTDOWN_TIMEOUT, SHUTDOWN_TIMEOUT_S),
                )
    if jax.distributed.is_initialized():
        install_fail_fast()  # before the device check, so a process that fails it does not linger
        watch_launcher()
    local, total = check_devices(p.local_devices)
    return ProcessInfo(
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        local_devices=local,
        global_devices=total,
        platform=jax.devices()[0].platform,
        source=p.source,
        coordinator=p.coordinator,
    )


# --------------------------------------------------------------------------------------------
# Failing fast instead of waiting at the shutdown barrier
# --------------------------------------------------------------------------------------------


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def finish(exit_code: int) -> int:
    """Return ``exit_code``; but in a multi-process job, exit *now* when it is non-zero.

    A normal interpreter exit runs JAX's shutdown barrier, which waits up to the shutdown
    timeout for every other process, while they wait in their next collective for this one:
    the whole job would stall for minutes. Exiting immediately (skipping atexit) makes this
    process count as dead, so its peers abort within the heartbeat timeout. Use as
    ``return distributed.finish(code)`` at the end of a command's main.
    """
    if exit_code and jax.distributed.is_initialized() and jax.process_count() > 1:
        print(
            f"shardlib: process {jax.process_index()} failed (exit code {exit_code}); exiting now so the other "
            "processes stop instead of waiting for it",
            file=sys.stderr,
        )
        _flush()
        if jax.process_index() == 0:
            # Process 0 hosts the coordination service: its exit aborts every peer at once. A
            # moment's wait lets peers that hit the same error (a config error usually hits all)
            # print their own message first.
            time.sleep(COORDINATOR_EXIT_DELAY_S)
        os._exit(exit_code)
    return exit_code


LAUNCHER_POLL_S = 1.0


def watch_launcher(environ: Mapping[str, str] | None = None) -> None:
    """Under ``shardlib launch``: stop this process once the launcher is gone. A launcher killed
    with SIGKILL cannot stop its processes, and they would wait in a collective for minutes.
    The process gets SIGTERM (a checkpointing run saves and stops), then exits after the
    heartbeat timeout if it has not. Polls the launcher's pid: a parent-death signal would not
    reach processes that a wrapper (``bash -c``) started."""
    from shardlib.runtime.launch import process_state

    text = (os.environ if environ is None else environ).get(ENV_LAUNCHER_PID, "")
    if not text.isdigit() or process_state(os.getpid()) is None:  # no /proc to read it from
        return
    import signal
    import threading

    pid, grace = int(text), _timeout(os.environ, ENV_HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_S)

    def watch() -> None:
        while process_state(pid) not in (None, "Z", "X"):
            time.sleep(LAUNCHER_POLL_S)
        try:  # its output went to the launcher: the pipe is likely broken
            print(f"shardlib: process {jax.process_index()}: the launcher (pid {pid}) is gone; stopping "
                  f"(SIGTERM, exit in {grace} s at the latest)", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os._exit(1)

    threading.Thread(target=watch, name="shardlib-launcher-watch", daemon=True).start()


_installed = False


def install_fail_fast() -> None:
    """An uncaught exception prints its traceback, then exits this process at once (see finish)."""
    global _installed
    if _installed:
        return
    previous: Callable[..., Any] = sys.excepthook

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        finish(1)

    sys.excepthook = hook
    _installed = True


# --------------------------------------------------------------------------------------------
# Which process owns which part of a mesh
# --------------------------------------------------------------------------------------------


def _span(values: Sequence[int]) -> str:
    values = sorted(set(values))
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    return ",".join(map(str, values))


def device_map(mesh: jax.sharding.Mesh) -> str:
    """Which process owns which mesh coordinates, and which axes cross processes.

    e.g. for ``data=2,fsdp=4`` over 2 processes x 4 devices::

        mesh data=2 fsdp=4 over 2 processes; across processes: data; within: fsdp
          process 0: data=0 fsdp=0..3  (devices 0,1,2,3)
          process 1: data=1 fsdp=0..3  (devices 2048,2049,2050,2051)
    """
    names, devices = mesh.axis_names, mesh.devices
    owner = np.vectorize(lambda d: d.process_index, otypes=[int])(devices)
    shown = [i for i, n in enumerate(names) if devices.shape[i] > 1]
    crossing = [names[i] for i in shown if np.any(np.diff(owner, axis=i) != 0)]
    within = [names[i] for i in shown if names[i] not in crossing]
    processes = sorted(set(owner.flat))
    axes = " ".join(f"{names[i]}={devices.shape[i]}" for i in shown) or "single device"
    head = f"mesh {axes} over {len(processes)} process(es)"
    if len(processes) > 1:
        head += f"; across processes: {', '.join(crossing) or 'none'}; within: {', '.join(within) or 'none'}"
    lines = [head]
    for proc in processes:
        coords = np.argwhere(owner == proc)
        spans = [(names[i], sorted(set(coords[:, i]))) for i in shown]
        n_box = int(np.prod([len(v) for _, v in spans])) if spans else 1
        if n_box == len(coords):
            where = " ".join(f"{n}={_span(v)}" for n, v in spans) or "all"
        else:  # not a box: list every coordinate
            where = " ".join("(" + ",".join(str(c[i]) for i in shown) + ")" for c in coords)
        ids = ",".join(str(devices[tuple(c)].id) for c in coords)
        lines.append(f"  process {proc}: {where}  (devices {ids})")
    return "\n".join(lines)
