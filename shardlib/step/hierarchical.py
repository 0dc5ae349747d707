"""hpZ, ZeRO++'s hierarchical partitioning: a secondary weight shard within each host.

Under ZeRO-3 every layer's weights are all-gathered over all data-parallel devices in the
forward pass and again in the backward pass (remat), so on a multi-host mesh each of those
gathers crosses the slow inter-host links. hpZ (Wang et al., "ZeRO++", 2023, section 3.2) keeps a
second copy of the weights sharded only within a host, so that the per-layer gathers run over
the fast intra-host links.

Here the parameter layout differs from the compute layout in two stages. Storage stays ZeRO-3
over (``fsdp``, ``data``), ``fsdp`` major (`strategies.HPZ_RULES`). Once per step, before the
model runs, `SecondaryPartition.gather` all-gathers every sharded weight over the inter-host axis
``data`` only: each device then holds 1/F of each weight (F = fsdp size), the same block on every
host. The model's own per-layer gathers (`hooks.gather_layer`) and their remat re-gathers in the
backward pass read specs over ``fsdp`` only. Autodiff's transpose gives a per-layer
reduce-scatter within the host and one inter-host reduce-scatter per step.

The cost is the secondary partition itself: Psi / F more weight elements per device, held from
the first gather to the end of the backward pass (and their gradient, before the inter-host
reduce-scatter).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np

from shardlib.model import hooks
from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout
from shardlib.sharding.mesh import describe


class HpzError(ValueError):
    """hpZ asked for on a mesh or layout where it cannot keep the layer gathers within a host."""


@dataclasses.dataclass(frozen=True)
class SecondaryPartition:
    """The two stages of an hpZ gather, as specs over the manual batch axes."""

    inter_specs: Any  # over the inter-host axis only: gathered once per step
    intra_specs: Any  # over the intra-host batch axes: what the model's per-layer gathers read

    def gather(self, params: Any, auto_specs: Any) -> Any:
        """The secondary partition: every weight gathered over the inter-host axis (keeping any
        split over the GSPMD axes, as the layer gathers do). qgZ's int8 residuals do not ride it:
        `shardlib.step.options` refuses grad_compression='int8' under hpZ when the step is built."""
        return jax.tree.map(hooks.gather_shards, params, self.inter_specs, auto_specs)


def for_layout(layout: Layout, gathers_params: bool) -> SecondaryPartition | None:
    """The secondary partition of ``layout``'s strategy (None without hpZ), after checking that the
    mesh has a host split to exploit and that the storage order gives contiguous blocks."""
    inter = layout.strategy.secondary_axis
    if inter is None:
        return None
    intra = tuple(a for a in layout.batch_axes if a != inter)
    _check_mesh(layout, inter, intra)
    manual = layout.manual(layout.params)
    _check_order(layout, manual, inter, intra)
    if not gathers_params:
        warnings.warn(
            f"strategy {layout.strategy.name!r}: this model does not gather its own weights per layer "
            "(gathers_params=False), so the step gathers them whole once and the backward pass never "
            "re-gathers; hpZ then only adds the secondary partition's memory. Use zero3, or a model that "
            "calls shardlib.gather_layer per layer", UserWarning, stacklevel=3)
    return SecondaryPartition(layout.manual(layout.params, (inter,)), layout.manual(layout.params, intra))


def _check_mesh(layout: Layout, inter: str, intra: tuple[str, ...]) -> None:
    """Refuse a mesh without an inter-host split, and one whose intra-host groups span processes."""
    mesh, name = layout.mesh, layout.strategy.name
    if mesh.shape[inter] == 1 or all(mesh.shape[a] == 1 for a in intra):
        raise HpzError(
            f"strategy {name!r} needs mesh axis {inter!r} > 1 (the hosts) and {'x'.join(intra)} > 1 (the devices "
            f"of one host), got {describe(mesh)}; use --mesh {inter}=<hosts>,{intra[0]}=<devices per host>, "
            "or zero3 on a single host")
    groups = np.moveaxis(np.vectorize(lambda d: d.process_index)(mesh.devices),
                         [mesh.axis_names.index(a) for a in intra], range(-len(intra), 0))
    groups = groups.reshape(-1, int(np.prod([mesh.shape[a] for a in intra])))
    if any(len(set(row)) > 1 for row in groups):
        raise HpzError(
            f"strategy {name!r}: the devices of one {'x'.join(intra)} group lie on several processes on the mesh "
            f"{describe(mesh)}, so the per-layer gathers would still cross hosts; put the processes on "
            f"{inter!r} (make_mesh's default across_hosts) with {'x'.join(intra)} = the devices per process")


def _check_order(layout: Layout, manual: Any, inter: str, intra: tuple[str, ...]) -> None:
    """Every dim split over the inter-host axis must have it minor, after an intra-host axis: only then
    is a gather over it alone a contiguous block of the intra-host split."""
    leaves = jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout)
    for leaf, spec in zip(leaves, jax.tree.leaves(manual)):
        for entry in spec:
            axes = rules_lib.as_axes(entry)
            if inter in axes and (axes[-1] != inter or not set(axes) & set(intra)):
                raise HpzError(
                    f"strategy {layout.strategy.name!r}: {leaf.path} is stored over {axes}; hpZ needs each "
                    f"sharded dim split over ({', '.join(intra)}, {inter}) with {inter!r} last, so that its "
                    f"gather over {inter!r} alone yields a contiguous block (use strategies.HPZ_RULES)")

