"""Device meshes with named axes.

Every shardlib mesh has the same axes, outermost (slowest links) first, so rule tables can
always name them; axes a run does not use have size 1:

  data    pure data parallelism (replicas), crosses hosts first
  pipe    pipeline stages
  fsdp    data parallelism with sharded parameters / optimizer state (ZeRO)
  expert  expert parallelism: an MoE layer's experts split over it, its tokens dispatched to
          them by all-to-all; the batch is split over it too (docs/moe.md)
  context context (sequence) parallelism: every sequence split over it, attention by a ring of
          K/V blocks or an all-gather of them (docs/context-parallel.md); its K/V traffic every
          layer wants fast links, so it sits inside expert, next to tensor
  tensor  Megatron-style tensor parallelism, needs the fastest links
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from shardlib.backend import platform_of, quiet_libtpu
from shardlib.compat import backends_initialized

MESH_AXES: tuple[str, ...] = ("data", "pipe", "fsdp", "expert", "context", "tensor")

# The axis an MoE layer dispatches its tokens over (`shardlib.model.experts`).
EXPERT_AXIS = "expert"

# The axis every sequence is split over (`shardlib.model.attention`, docs/context-parallel.md).
CONTEXT_AXIS = "context"


class MeshError(ValueError):
    """A mesh that cannot be built on the visible devices."""


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,fsdp=-1"`` -> ``{"data": 2, "fsdp": -1}``; spaces separate too (``"fsdp=4 tensor=2"``, as
    `describe` and the run header write a mesh)."""
    import re

    sizes: dict[str, int] = {}
    for item in filter(None, re.split(r"[,\s]+", re.sub(r"\s*=\s*", "=", text))):
        name, sep, value = item.partition("=")
        if not sep:
            raise MeshError(f"mesh entry {item!r} is not of the form axis=size (e.g. --mesh data=2,fsdp=4)")
        try:
            sizes[name.strip()] = int(value)
        except ValueError:
            raise MeshError(f"mesh axis {name.strip()!r} has size {value!r}, which is not an integer") from None
    return sizes


def resolve_axis_sizes(sizes: Mapping[str, int], n_devices: int) -> dict[str, int]:
    """Fill in the one ``-1`` axis and check the product equals the device count."""
    unknown = [name for name in sizes if name not in MESH_AXES]
    if unknown:
        raise MeshError(f"unknown mesh axis {unknown[0]!r}; shardlib meshes have axes {', '.join(MESH_AXES)}")
    full = {name: int(sizes.get(name, 1)) for name in MESH_AXES}
    fill = [name for name, size in full.items() if size == -1]
    if len(fill) > 1:
        raise MeshError(f"only one mesh axis may be -1, got {', '.join(fill)}")
    bad = [name for name, size in full.items() if size == 0 or size < -1]
    if bad:
        raise MeshError(f"mesh axis {bad[0]!r} has size {full[bad[0]]}; sizes must be positive (or -1 for 'the rest')")
    known = math.prod(size for size in full.values() if size != -1)
    if fill:
        if n_devices % known:
            raise MeshError(
                f"cannot fill mesh axis {fill[0]!r}: the other axes use {known} devices, "
                f"which does not divide the {n_devices} available"
            )
        full[fill[0]] = n_devices // known
    if math.prod(full.values()) != n_devices:
        described = ",".join(f"{k}={v}" for k, v in full.items() if v != 1) or "all axes 1"
        raise MeshError(
            f"mesh {described} needs {math.prod(full.values())} devices but {n_devices} are available; "
            f"make the sizes multiply to {n_devices} or use -1 for one axis"
        )
    return full


def make_mesh(
    sizes: Mapping[str, int] | str,
    devices: Sequence[jax.Device] | None = None,
    *,
    across_hosts: Mapping[str, int] | None = None,
) -> Mesh:
    """A mesh over ``devices`` (default: all) with Auto axis types (classic GSPMD propagation).

    ``across_hosts`` gives, per axis, how many of its slices lie on different processes (the
    DCN part of a hybrid mesh). By default the outermost axes absorb the process count, so
    ``data`` (then ``pipe``, then ``fsdp``) crosses hosts and ``tensor`` stays within one. With a
    single process the layout is the plain device order.
    """
    if isinstance(sizes, str):
        sizes = parse_mesh(sizes)
    if devices is None and not backends_initialized():
        quiet_libtpu()  # the first device query loads libtpu where it is installed
    devices = list(devices if devices is not None else jax.devices())
    full = resolve_axis_sizes(sizes, len(devices))
    shape = tuple(full[name] for name in MESH_AXES)
    from jax.experimental import mesh_utils

    # The slow-link granule: TPU slices when there are several (multi-slice); else, off TPU, the
    # processes (hosts joined by a network). The hosts of one TPU slice share its ICI torus, so
    # there the devices follow the torus (create_device_mesh), not the hosts. (create_hybrid_device_mesh
    # groups by slice_index by default, and CPU / single-slice devices all share one slice, so
    # without process_is_granule it fails with "Number of slices 1".)
    slices = {getattr(d, "slice_index", 0) for d in devices}
    by_slice = len(slices) > 1
    on_tpu = platform_of(devices) == "tpu"
    n_granules = len(slices) if by_slice else 1 if on_tpu else len({d.process_index for d in devices})
    if n_granules > 1:
        dcn = host_axis_sizes(full, n_granules, across_hosts)
        ici = tuple(full[name] // dcn[name] for name in MESH_AXES)
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici, tuple(dcn[name] for name in MESH_AXES), devices,
            process_is_granule=not by_slice, allow_split_physical_axes=True,
        )
    elif on_tpu and len(devices) > 1:
        device_array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def host_axis_sizes(full: Mapping[str, int], n_processes: int, across_hosts: Mapping[str, int] | None = None) -> dict[str, int]:
    """How each axis splits across processes: explicit, or outermost axes first."""
    if across_hosts is not None:
        dcn = {name: int(across_hosts.get(name, 1)) for name in MESH_AXES}
        if math.prod(dcn.values()) != n_processes:
            raise MeshError(f"across_hosts {dict(across_hosts)} multiplies to {math.prod(dcn.values())}, not to the {n_processes} processes")
    else:
        dcn, left = {}, n_processes
        for name in MESH_AXES:
            take = math.gcd(full[name], left)
            dcn[name], left = take, left // take
        if left != 1:
            raise MeshError(f"cannot lay the mesh {dict(full)} across {n_processes} processes; give across_hosts explicitly")
    for name in MESH_AXES:
        if full[name] % dcn[name]:
            raise MeshError(f"mesh axis {name!r} of size {full[name]} cannot span {dcn[name]} processes")
    return dcn


def axis_size(mesh: Mesh, axes: str | Sequence[str] | None) -> int:
    """Number of devices along one axis or a tuple of axes (1 for None)."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def describe(mesh: Mesh) -> str:
    """``data=2 fsdp=4`` (axes of size 1 left out)."""
    return " ".join(f"{n}={s}" for n, s in mesh.shape.items() if s > 1) or "single device"
