"""Host offload of the train state (ZeRO-Offload): which fields live in host memory between steps.

ZeRO-Offload (Ren et al., 2021) keeps Adam's moments in host memory, so the 8 Psi / N bytes of
optimizer state per device leave the accelerator's memory. Here the optimizer state's shardings
carry the memory kind ``pinned_host``; the jitted step moves it to device memory for the optax
update and back to the host for its output, so between steps, and during the forward and
backward passes, the device holds parameters, gradients and activations only.

Parameter offload is refused (see `REFUSED`): the step would have to stream each layer's
parameters in from the host inside the scanned layers, and moving the whole shard in once per
step saves nothing at the step's peak.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

HOST_MEMORY = "pinned_host"
DEVICE_MEMORY = "device"


@dataclasses.dataclass(frozen=True)
class Offload:
    """Which train-state fields live in host memory between steps."""

    name: str
    opt_state: bool  # the optimizer state (Adam's moments and counters)
    description: str

    @property
    def active(self) -> bool:
        return self.opt_state


OFFLOADS: dict[str, Offload] = {o.name: o for o in (
    Offload("none", False, "everything in device memory"),
    Offload("opt_state", True, "optimizer state in pinned host memory, moved to the device for the update"),
)}

REFUSED: dict[str, str] = {
    "params": "parameter offload is not supported: it pays only if each layer's parameters are streamed in "
              "from the host inside the scanned layers, and moving the whole shard in once per step leaves the "
              "step's device peak unchanged; use offload='opt_state' (with zero3 the parameters are already 1/N)",
}


def get_offload(spec: str | Offload | None) -> Offload:
    """The offload for a name (``"none"``, ``"opt_state"``), or a ValueError naming the choices."""
    if isinstance(spec, Offload):
        return spec
    name = "none" if spec is None else str(spec)
    if name in REFUSED:
        raise ValueError(f"offload={name!r} (--offload): {REFUSED[name]}")
    if name not in OFFLOADS:
        raise ValueError(f"unknown offload {name!r} (--offload); choose one of {', '.join(OFFLOADS)}")
    return OFFLOADS[name]


def _listed_kinds(device: Any) -> set[str] | None:
    """The memory kinds ``device`` lists; None when it cannot tell. A device of another process
    lists none (``addressable_memories()`` is empty): every device of a multi-host mesh but the
    local ones, and so half of a ``v5e:2x4`` topology's (2 hosts) when a TPU step is compiled on
    a CPU machine (``jax.experimental.topologies``, jax 0.10.2); some devices raise instead."""
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except (jax.errors.JaxRuntimeError, AttributeError, NotImplementedError):
        return None
    return kinds or None


def check_backend(offload: Offload, devices: Any) -> str | None:
    """The memory kind the offloaded state lives in (None without offload); refuses devices
    without it (offload would silently do nothing).

    A device that lists its memories must list the kind. One that cannot tell (another process's
    device, see `_listed_kinds`) is taken at its backend's word: ``policy_for(devices).host_memory``
    (``pinned_host`` on GPU and TPU, shardlib/backend.py). Devices of a platform without a policy
    that list nothing are refused, as are devices that list other kinds only."""
    if not offload.active:
        return None
    from shardlib.backend import policy_for

    devices = list(devices)
    try:
        policy = policy_for(devices)
    except ValueError:  # a platform shardlib has no policy for (or a mix of platforms)
        policy = None
    kind = policy.host_memory if policy is not None else HOST_MEMORY
    for device in devices:
        kinds = _listed_kinds(device)
        if kinds is None and policy is not None:
            continue  # the backend's policy says it has `kind`; its local devices were checked
        if kind not in (kinds or set()):
            raise ValueError(
                f"offload={offload.name!r} (--offload) needs '{kind}' memory, but device {device} "
                f"offers only {sorted(kinds or ())}; use offload='none' on this backend")
    return kind


def with_memory(shardings: Any, kind: str) -> Any:
    """The same shardings in memory ``kind`` (``pinned_host`` or ``device``)."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def to_memory(tree: Any, shardings: Any, kind: str) -> Any:
    """Inside a jitted function: ``tree`` moved to memory ``kind``, keeping its shardings."""
    return jax.device_put(tree, with_memory(shardings, kind))


__all__ = ["DEVICE_MEMORY", "HOST_MEMORY", "OFFLOADS", "Offload", "REFUSED", "check_backend", "get_offload",
           "to_memory", "with_memory"]
