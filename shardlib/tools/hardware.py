"""Accelerator profiles and the roofline that turns a compiled step into an estimated step time.

`shardlib plan` compiles the real step for N simulated CPU devices, so memory and communication
volumes are exact properties of the program; *time* needs a target machine. A profile holds the
few figures a roofline needs, each from a public data sheet (``sources``):

  peak_flops        dense matmul FLOP/s per device, per compute precision
  hbm_bytes         memory per device
  domain_size       devices joined by the fast interconnect (an NVLink node, a TPU ICI slice)
  intra_bandwidth   bytes/s one device can send in a ring collective inside its domain
  inter_bandwidth   bytes/s one device can send to another domain (InfiniBand NIC, TPU DCN)

The time model (deliberately simple, stated in every plan):

  compute_s = hardware FLOPs per device / peak_flops[precision]
  comm_s    = sum over collectives of (bytes this device sends per step) / bandwidth of the link
              the collective's replica group uses (inter-domain if the group spans domains)
  step_s    = max(compute_s, comm_s)         (collectives fully overlapped with compute)
  serial_s  = compute_s + comm_s             (no overlap: an upper bound)

Device i of the mesh (row-major over data, pipe, fsdp, tensor) is placed in domain
i // domain_size, which is how shardlib lays meshes over hosts: outer axes cross hosts first. The
devices each collective joins come from `shardlib.tools.hlo_parse` (the one replica-group parser).

The profiles are also the one table of peak FLOP/s: ``profile_for_device`` maps a
``jax.Device.device_kind`` to its profile for MFU (`shardlib.tools.flops.peak_flops_for`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardlib.tools.hlo import CollectiveRecord
from shardlib.tools.hlo_parse import replica_groups

GB = 1e9
GIB = 2**30


class HardwareError(ValueError):
    """An unknown profile or unreadable size (shown as one line by the CLI)."""

    user_facing = True


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator type as the roofline sees it (all rates per device)."""

    name: str
    description: str
    hbm_bytes: int
    peak_flops: Mapping[str, float]  # "bf16" / "f32" -> dense FLOP/s with JAX's default matmul precision
    domain_size: int
    intra_bandwidth: float
    inter_bandwidth: float | None  # None: crossing a domain is not modelled for this profile
    sources: tuple[str, ...]
    notes: str = ""

    @property
    def backend(self) -> str:
        """The backend this hardware is: "tpu" for the tpu-* profiles, else "gpu"."""
        return "tpu" if self.name.startswith("tpu-") else "gpu"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "hbm_bytes": self.hbm_bytes,
            "peak_flops": dict(self.peak_flops),
            "domain_size": self.domain_size,
            "intra_bandwidth": self.intra_bandwidth,
            "inter_bandwidth": self.inter_bandwidth,
            "sources": list(self.sources),
            "notes": self.notes,
        }


_NVIDIA_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM column)"
_NVIDIA_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM column)"
_NVIDIA_H100_PCIE = "https://www.nvidia.com/en-us/data-center/h100/ (H100 PCIe column; dense = half the sparsity figure)"
_NVIDIA_H100_NVL = "https://www.nvidia.com/en-us/data-center/h100/ (H100 NVL column; dense = half the sparsity figure)"
_NVIDIA_A100 = "https://www.nvidia.com/en-us/data-center/a100/ (A100 80GB SXM column)"
_DGX_H100 = "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html (8x ConnectX-7 400 Gb/s)"
_DGX_A100 = "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html (8x ConnectX-6 200 Gb/s HDR)"

# The roofline's figures per profile, one row each (dense peaks: no sparsity). Bandwidths are
# what one device sends in a ring, each way: NVLink figures are quoted bidirectional (900 GB/s =
# 450 GB/s each way through NVSwitch); a TPU ring along one torus axis sends over two ports, one
# each way. f32 matmuls run as TF32 on NVIDIA GPUs and as one bf16 pass on TPUs (JAX defaults).
#   name         HBM bytes      bf16 FLOP/s f32 FLOP/s domain  intra (B/s)  inter (B/s; None: not modelled)
_FIGURES = (
    ("h100",      int(80 * GB),  989e12, 494e12, 8,    450 * GB, 50 * GB),
    ("h200",      int(141 * GB), 989e12, 494e12, 8,    450 * GB, 50 * GB),
    ("a100",      int(80 * GB),  312e12, 156e12, 8,    300 * GB, 25 * GB),
    ("h100-pcie", int(80 * GB),  756e12, 378e12, 2,    300 * GB, 64 * GB),  # NVLink bridge; PCIe Gen5 x16
    ("h100-nvl",  int(94 * GB),  835e12, 417e12, 2,    300 * GB, 64 * GB),  # NVLink bridge; PCIe Gen5 x16
    ("tpu-v5p",   95 * GIB,      459e12, 459e12, 8960, 200 * GB, 50e9 / 8),  # 6 ports of 100 GB/s; 50 Gb/s DCN
    ("tpu-v5e",   int(16 * GB),  197e12, 197e12, 256,  100 * GB, 2 * 100e9 / 8 / 8),  # 2 x 100 Gb/s NICs per 8 chips
    ("tpu-v4",    32 * GIB,      275e12, 275e12, 4096, 100 * GB, None),  # ~50 GB/s per ICI link each way
    ("tpu-v6e",   int(32 * GB),  918e12, 918e12, 256,  200 * GB, 4 * 200e9 / 8 / 8),  # 4 x 200 Gb/s NICs per 8 chips
)

# What each profile is and where its figures come from: (description, sources, notes).
_ABOUT: dict[str, tuple[str, tuple[str, ...], str]] = {
    "h100": ("NVIDIA H100 SXM 80GB, 8 per NVLink node, 400 Gb/s InfiniBand per GPU", (_NVIDIA_H100, _DGX_H100),
             "dense (no sparsity) tensor-core peaks; NVLink 4 900 GB/s bidirectional"),
    "h200": ("NVIDIA H200 SXM 141GB, 8 per NVLink node, 400 Gb/s InfiniBand per GPU", (_NVIDIA_H200, _DGX_H100),
             "same compute and NVLink as H100 SXM; more and faster HBM"),
    "a100": ("NVIDIA A100 SXM 80GB, 8 per NVLink node, 200 Gb/s InfiniBand per GPU", (_NVIDIA_A100, _DGX_A100),
             "NVLink 3 600 GB/s bidirectional"),
    "h100-pcie": ("NVIDIA H100 PCIe 80GB, pairs joined by an NVLink bridge, PCIe Gen5 beyond the pair",
                  (_NVIDIA_H100_PCIE,), "NVLink bridge 600 GB/s bidirectional; PCIe Gen5 x16 128 GB/s bidirectional"),
    "h100-nvl": ("NVIDIA H100 NVL 94GB, pairs joined by an NVLink bridge, PCIe Gen5 beyond the pair",
                 (_NVIDIA_H100_NVL,), "NVLink bridge 600 GB/s bidirectional; PCIe Gen5 x16 128 GB/s bidirectional"),
    "tpu-v5p": ("Cloud TPU v5p chip, 3D torus ICI within a slice (up to 8960 chips), DCN across slices",
                ("https://cloud.google.com/tpu/docs/v5p",), "ICI 1200 GB/s bidirectional over 6 ports"),
    "tpu-v5e": ("Cloud TPU v5e chip, 2D torus ICI within a slice (up to 256 chips), DCN across slices",
                ("https://cloud.google.com/tpu/docs/v5e",), "ICI 400 GB/s bidirectional over 4 ports"),
    "tpu-v4": ("Cloud TPU v4 chip, 3D torus ICI within a slice (up to 4096 chips)",
               ("https://cloud.google.com/tpu/docs/v4",
                "Jouppi et al., TPU v4: An Optically Reconfigurable Supercomputer for ML, ISCA 2023"),
               "multi-slice (DCN) traffic is not modelled for v4"),
    "tpu-v6e": ("Cloud TPU v6e (Trillium) chip, 2D torus ICI within a slice (up to 256 chips), DCN across slices",
                ("https://cloud.google.com/tpu/docs/v6e",), "ICI 800 GB/s bidirectional over 4 ports"),
}


def _profile(name: str, hbm: int, bf16: float, f32: float, domain: int, intra: float, inter: float | None):
    description, sources, notes = _ABOUT[name]
    return HardwareProfile(name=name, description=description, hbm_bytes=hbm, peak_flops={"bf16": bf16, "f32": f32},
                           domain_size=domain, intra_bandwidth=intra, inter_bandwidth=inter, sources=sources,
                           notes=notes)


HARDWARE: dict[str, HardwareProfile] = {row[0]: _profile(*row) for row in _FIGURES}


def get_hardware(name: str | HardwareProfile) -> HardwareProfile:
    """The named profile; an unknown name lists the known ones."""
    if isinstance(name, HardwareProfile):
        return name
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise HardwareError(f"unknown hardware {name!r} (--hardware); choose one of {', '.join(HARDWARE)}") from None


# ``device.device_kind`` substrings (lower case) -> profile; first match wins, so the more specific
# names come first ("TPU v5 lite" is v5e; plain "TPU v5" is v5p, matched exactly below).
_DEVICE_KINDS: tuple[tuple[str, str], ...] = (
    ("h100 pcie", "h100-pcie"),
    ("h100 nvl", "h100-nvl"),
    ("h100", "h100"),
    ("h200", "h200"),
    ("a100", "a100"),
    ("v5 lite", "tpu-v5e"),
    ("v5litepod", "tpu-v5e"),
    ("v5e", "tpu-v5e"),
    ("v5p", "tpu-v5p"),
    ("v6 lite", "tpu-v6e"),
    ("v6e", "tpu-v6e"),
    ("tpu v4", "tpu-v4"),
)


# JAX's TPU topology names start with the generation: v5e:2x4, v5p:4x4x4, v6e:8x8, v4:2x2x2.
_TOPOLOGY_GENERATIONS = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5litepod": "tpu-v5e", "v5p": "tpu-v5p",
                         "v6e": "tpu-v6e"}


def profile_for_topology(name: str) -> HardwareProfile:
    """The profile of a TPU topology name's generation (``v5p:4x4x4`` -> tpu-v5p)."""
    generation = name.split(":", 1)[0].lower()
    if generation not in _TOPOLOGY_GENERATIONS:
        raise HardwareError(f"no hardware profile for the TPU generation {generation!r} of --topology {name}; "
                            f"known: {', '.join(_TOPOLOGY_GENERATIONS)}")
    return HARDWARE[_TOPOLOGY_GENERATIONS[generation]]


def profile_for_device(device: Any) -> HardwareProfile | None:
    """The profile of a ``jax.Device`` (or a ``device_kind`` string); None for CPU or an unknown kind."""
    if not isinstance(device, str) and getattr(device, "platform", None) == "cpu":
        return None
    kind = (device if isinstance(device, str) else getattr(device, "device_kind", "")).lower().strip()
    if kind == "tpu v5":
        return HARDWARE["tpu-v5p"]
    return next((HARDWARE[name] for pattern, name in _DEVICE_KINDS if pattern in kind), None)


_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` -> 80e9, ``"16GiB"`` -> 16 * 2**30, ``12345`` -> 12345 (for ``--hbm``).

    A string needs its unit: a bare ``"80"`` is refused, since it almost always means 80 GB.
    """
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", text.lower())
    if not m:
        raise HardwareError(f"cannot read {text!r} as a size (--hbm); write e.g. 80GB, 16GiB or 1.5TB")
    if m.group(2) is None:
        raise HardwareError(f"size {text!r} has no unit (--hbm); write e.g. --hbm {m.group(1)}GB or "
                            f"--hbm {m.group(1)}GiB (or {m.group(1)}B for bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


# ----------------------------------------------------------------------------------------------
# Which link a collective uses: its replica groups (read by shardlib.tools.hlo_parse)
# ----------------------------------------------------------------------------------------------


def crosses_domains(groups: Sequence[Sequence[int]] | None, group_size: int | None, domain_size: int) -> bool:
    """True if some group has devices in two domains (unknown groups: judged by their size)."""
    if groups is None:
        return (group_size or 1) > domain_size
    return any(len({d // domain_size for d in g}) > 1 for g in groups)


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """Bytes one device sends per step, split by the link they travel on. ``intra_priced``: the
    intra-domain bytes divided by the links each collective's group can drive at once (`link_bytes`
    with ``links_of``), what the roofline times; None: one link for every collective."""

    intra: float
    inter: float
    unknown_groups: int  # collectives whose replica-group form was not understood
    intra_priced: float | None = None

    @property
    def total(self) -> float:
        return self.intra + self.inter


def link_bytes(records: Sequence[CollectiveRecord], n_devices: int, domain_size: int,
               scale: Mapping[str, float] | None = None,
               links_of: Callable[[Sequence[Sequence[int]]], int] | None = None) -> LinkBytes:
    """Split collective ``records`` into intra/inter-domain bytes by the devices their groups join.

    ``scale`` optionally multiplies each record's bytes by name (used for the bf16 correction).
    ``links_of(replica_groups)``: how many links a chip can drive at once for such a group
    (`torus_links`); the intra-domain bytes are then also priced per link (``intra_priced``).
    """
    intra = inter = priced = 0.0
    unknown = 0
    for r in records:
        nbytes = r.bytes_per_step * (scale or {}).get(r.name, 1.0)
        if nbytes <= 0:
            continue
        unknown += r.replica_groups is None
        if getattr(r, "dcn", False) or (n_devices > domain_size
                                         and crosses_domains(r.replica_groups, r.group_size, domain_size)):
            inter += nbytes
        else:
            intra += nbytes
            priced += nbytes / (links_of(r.replica_groups) if links_of and r.replica_groups else 1)
    return LinkBytes(intra, inter, unknown, priced if links_of else None)


def torus_links(coords: Sequence[Sequence[int]]) -> Callable[[Sequence[Sequence[int]]], int]:
    """For chips at ``coords`` (indexed by the program's device ids, a mesh's flat order): a
    group's link count is the number of torus dimensions its chips span. A ring along one
    dimension drives that dimension's links; a collective over a 2-D or 3-D block of the torus can
    run a ring along each of them at once (the bucket / multi-dimensional algorithms of TPU and
    NCCL's trees), so it is priced at that many times the one-dimension bandwidth. An assumption
    of the roofline, not a measurement (docs/tpu.md)."""
    def links(groups: Sequence[Sequence[int]]) -> int:
        group = groups[0]
        spans = sum(len({coords[i][d] for i in group}) > 1 for d in range(len(coords[group[0]])))
        return max(1, spans)
    return links


# ----------------------------------------------------------------------------------------------
# Roofline
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Roofline estimate of one training step on one device (seconds)."""

    compute_s: float
    comm_s: float

    @property
    def overlapped_s(self) -> float:
        return max(self.compute_s, self.comm_s)

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.comm_s


def step_time(profile: HardwareProfile, flops_per_device: float, links: LinkBytes, precision: str) -> StepTime:
    """Compute time at peak FLOP/s plus communication time at link bandwidth (see module doc)."""
    if precision not in profile.peak_flops:
        raise HardwareError(f"hardware {profile.name} has no peak for precision {precision!r}; "
                         f"known: {', '.join(profile.peak_flops)}")
    compute = flops_per_device / profile.peak_flops[precision]
    comm = (links.intra if links.intra_priced is None else links.intra_priced) / profile.intra_bandwidth
    if links.inter:
        if profile.inter_bandwidth is None:
            raise HardwareError(
                f"the plan spans more than one {profile.name} domain ({profile.domain_size} devices) and the "
                "profile has no inter-domain bandwidth; plan at most that many devices or pick another --hardware"
            )
        comm += links.inter / profile.inter_bandwidth
    return StepTime(compute, comm)


__all__ = [
    "HARDWARE",
    "HardwareError",
    "HardwareProfile",
    "LinkBytes",
    "StepTime",
    "crosses_domains",
    "get_hardware",
    "link_bytes",
    "torus_links",
    "parse_bytes",
    "profile_for_device",
    "profile_for_topology",
    "replica_groups",  # from shardlib.tools.hlo_parse: the one replica-group parser
    "step_time",
]
