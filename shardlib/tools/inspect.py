"""`shardlib inspect`: where every parameter of a model lives under a strategy on N devices.

Nothing is compiled or allocated: the layout is resolved from the model's abstract parameters and
the strategy's rule tables. Prints the storage layout of each parameter (path, shape, logical axes,
PartitionSpec, bytes per device), the optimizer-state layout where it differs (ZeRO-1/2), every
tensor that stayed replicated although the strategy shards (its rules or its ZeRO fallback), with
the reason, and their total. A strategy the mesh cannot apply (``--strategy tp --mesh fsdp=8``)
is refused with the mesh to use.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardlib.tools.plan_candidates import (
    PlanError,
    check_strategy,
    default_mesh,
    resolve_config,
    select_devices,
    setup_devices,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model config name (models.CONFIGS), e.g. llama-7b")
    from shardlib.sharding.strategies import STRATEGIES

    parser.add_argument("--strategy", required=True, help=f"one of {', '.join(STRATEGIES)}")
    parser.add_argument("--devices", type=int, required=True, help="number of devices (simulated)")
    parser.add_argument("--mesh", help="mesh, e.g. data=2,fsdp=4 (default: the strategy's default for N)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


def _rows(layouts: Any, mesh: Any) -> list[dict[str, Any]]:
    from shardlib.sharding.rules import is_layout

    import jax

    return [
        {
            "path": leaf.path,
            "shape": list(leaf.shape),
            "logical": None if leaf.logical is None else [str(n) for n in leaf.logical],
            "spec": [None if e is None else e if isinstance(e, str) else list(e) for e in leaf.spec],
            "bytes": leaf.bytes(),
            "bytes_per_device": leaf.bytes_per_device(mesh),
            "notes": list(leaf.notes),
        }
        for leaf in jax.tree.leaves(layouts, is_leaf=is_layout)
    ]


def inspect_layout(model: str, strategy: str, devices: int, mesh: str | None = None) -> dict[str, Any]:
    """The layout of ``model`` under ``strategy`` on ``devices`` devices, as plain data."""
    from shardlib.models import trainable
    from shardlib.sharding.layout import make_layout
    from shardlib.sharding.mesh import describe, make_mesh, parse_mesh, resolve_axis_sizes
    from shardlib.sharding.strategies import get_strategy

    strat = get_strategy(check_strategy(strategy))
    config = resolve_config(model)
    sizes = resolve_axis_sizes(parse_mesh(mesh), devices) if mesh else default_mesh(strat.name, devices, config)
    device_mesh = make_mesh(sizes, devices=select_devices(devices))
    layout = make_layout(trainable(config), strat, device_mesh)
    params, state = _rows(layout.params, device_mesh), _rows(layout.state, device_mesh)
    tree_name = "params" if strat.shards_params else "state"  # dp: nothing is replicated against it
    replicated = [{"tree": tree_name, "path": leaf.path, "shape": list(leaf.shape),
                   "bytes": leaf.bytes(), "reason": "; ".join(leaf.notes)} for leaf in layout.replicated()]
    return {
        "model": model,
        "strategy": strat.name,
        "devices": devices,
        "mesh": {k: v for k, v in device_mesh.shape.items()},
        "mesh_text": describe(device_mesh),
        "params": params,
        "state": state,
        "state_differs": strat.state_differs,
        "replicated": replicated,
        "replicated_bytes": layout.replicated_bytes(),
        "replicated_summary": layout.replication_summary(),
        "params_bytes_per_device": sum(r["bytes_per_device"] for r in params),
        "state_param_bytes_per_device": sum(r["bytes_per_device"] for r in state),
    }


def render(doc: dict[str, Any]) -> str:
    from shardlib.text import format_bytes, format_table

    def table(rows: list[dict[str, Any]]) -> str:
        return format_table([
            {"path": r["path"], "shape": "x".join(map(str, r["shape"])) or "scalar",
             "logical": ",".join(map(str, r["logical"])) if r["logical"] is not None else "-",
             "spec": "(" + ", ".join(str(tuple(e)) if isinstance(e, list) else str(e) for e in r["spec"]) + ")",
             "per device": format_bytes(r["bytes_per_device"]), "note": "; ".join(r["notes"])}
            for r in rows], ["path", "shape", "logical", "spec", "per device", "note"])

    lines = [f"{doc['model']} under {doc['strategy']} on {doc['devices']} devices ({doc['mesh_text']})", "",
             f"parameters (storage layout; {format_bytes(doc['params_bytes_per_device'])} per device):",
             table(doc["params"])]
    if doc["state_differs"]:
        lines += ["", "optimizer state and reduced gradients (per moment; "
                      f"{format_bytes(doc['state_param_bytes_per_device'])} per device):", table(doc["state"])]
    lines.append("")
    if doc["replicated"]:
        lines.append(f"{len(doc['replicated'])} tensor(s) stay replicated although a rule wanted them sharded:")
        lines += [f"  [{r['tree']}] {r['path']} {'x'.join(map(str, r['shape']))} ({format_bytes(r['bytes'])}): {r['reason']}"
                  for r in doc["replicated"]]
    lines.append(doc["replicated_summary"])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.devices < 1:
        raise PlanError(f"--devices must be at least 1, got {args.devices}")
    setup_devices(args.devices)
    doc = inspect_layout(args.model, args.strategy, args.devices, args.mesh)
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(render(doc))
    return 0
