"""What `shardlib plan` prints: the JSON document (``--json``), the tables and notes, a progress line
per compiled candidate, and the `shardlib train` command that runs the best one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardlib.backend import platform_of
from shardlib.text import format_bytes, format_table
from shardlib.tools import plan_lora
from shardlib.tools.plan_candidates import PlanRow, is_hf_config

# The planner is a `shardlib.tools.plan.Planner`, typed Any here: plan imports this module.
Planner = Any

SCHEMA_VERSION = 1
DEFAULT_TRAIN_BATCH = 32  # shardlib.run.config.DEFAULT_BATCH (run is a layer above; tests/test_tpu_scale.py checks they agree)


def plan_document(planner: Planner, rows: Sequence[PlanRow], advice: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The one JSON document `shardlib plan --json` prints (stable keys, schema_version 1)."""
    best = next((r for r in rows if r.best), None)
    return {
        "schema_version": SCHEMA_VERSION,
        "model": planner.model_name,
        "config": {k: (str(v) if not isinstance(v, (int, float, bool, type(None))) else v)
                   for k, v in dataclasses.asdict(planner.config).items()},
        "params": planner.params,
        "devices": planner.n,
        "batch_size": planner.batch_size,
        "seq_len": planner.seq_len,
        "precision": planner.precision,
        "hbm_bytes": planner.hbm_bytes,
        "hardware": planner.profile.to_dict(),
        "topology": planner.topology,
        "slices": planner.slices,
        "compiler": compiler_versions(platform_of(planner.devices)),
        # which link each domain figure is: one slice's chips share ICI, slices talk over DCN
        "links": ({"intra_domain_bytes": "ICI", "inter_domain_bytes": "DCN"} if planner.topology else
                  {"intra_domain_bytes": "fast domain (NVLink node / ICI slice)", "inter_domain_bytes": "across domains"}),
        "candidates": [r.to_dict() for r in rows],
        "best": None if best is None else {"strategy": best.strategy, "mesh": best.mesh,
                                           "command": train_command(planner, best)},
        "suggestions": list(advice),
        "model_notes": MODEL_NOTES,
    }


def compiler_versions(platform: str) -> dict[str, str | None]:
    """The compiler that produced the plan's programs: the platform, jax and (for TPU) libtpu."""
    import importlib.metadata

    import jax

    try:
        libtpu = importlib.metadata.version("libtpu") if platform == "tpu" else None
    except importlib.metadata.PackageNotFoundError:
        libtpu = None
    return {"platform": platform, "jax": jax.__version__, "libtpu": libtpu}


MODEL_NOTES: dict[str, str] = {
    "persistent_bytes": "params + optimizer state per device in device memory, from the train state's shardings",
    "host_bytes": "state per device in host memory (--offload), from the compiled step's parameter layouts; "
                  "not counted in persistent, args or peak",
    "peak_bytes": "XLA buffer assignment of the compiled step: arguments + outputs - donated + temporaries "
                  "(with --topology: the TPU compiler's own, tiled layouts included; else XLA:CPU's, an estimate "
                  "for GPU/TPU)",
    "collective_bytes": "bytes one device sends per step, ring volumes (all-reduce 2(N-1)/N S, all-gather and "
                        "reduce-scatter (N-1)/N S), from the optimised HLO; bf16 collectives counted at 2 bytes",
    "flops": "model_flops = models.flops_per_token x tokens; flops_per_device adds remat's extra forward (x4/3) / N",
    "step_s": "roofline: max(flops_per_device / peak_flops, sum of collective bytes / link bandwidth); "
              "step_serial_s = their sum (no overlap)",
    "best": "fits in HBM, then shortest step_s, then shortest step_serial_s (each within 1%), then smallest peak",
}


def progress_line(k: int, total: int, row: PlanRow) -> str:
    """``[2/7] zero3 fsdp=8: peak 21.03 GiB, 40.28 GiB/step, fits (96 s)``, or the candidate's error."""
    where = f"[{k}/{total}] {row.strategy} {row.mesh_text if row.mesh else ''}".rstrip()
    if row.error:
        return f"{where}: {row.error[:160]}"
    return (f"{where}: peak {format_bytes(row.peak_bytes)}, {format_bytes(row.collective_total_bytes)}/step, "
            f"attention {row.attention}, {'fits' if row.fits else 'does not fit'} ({row.compile_s:.0f} s)")


def train_command(planner: Planner, row: PlanRow) -> str:
    """The `shardlib train` command that runs ``row``'s candidate: its model, strategy, mesh, batch,
    sequence length, precision and remat (flags a default already gives are left out)."""
    c = planner.config
    model = planner.model_name
    source = ("" if model == "custom" else
              f"--init-from {Path(model).parent if Path(model).name == 'config.json' else model}" if is_hf_config(model)
              else f"--model {model}")
    words = ["shardlib train", source,
             f"--strategy {row.strategy}", f"--mesh {','.join(f'{k}={v}' for k, v in row.mesh.items())}",
             f"--batch-size {row.batch_size}", f"--seq-len {row.seq_len}", f"--precision {row.precision}",
             "" if not c.remat else "" if c.remat_policy == "full" else f"--remat {c.remat_policy}",
             "--remat none" if not c.remat else "", f"--offload {planner.offload}" if planner.offload != "none" else ""]
    if row.pipeline_stages > 1:
        words.append(f"--pipeline-stages {row.pipeline_stages} --microbatches {row.microbatches}")
    words += plan_lora.train_flags(c)
    return " ".join(w for w in words if w)


def render(planner: Planner, rows: Sequence[PlanRow], advice: Sequence[Mapping[str, Any]]) -> str:
    """Human-readable plan: a header, one line per candidate, notes and suggestions."""
    from shardlib.step.stage_balance import format_stage_table

    c, p = planner.config, planner.profile
    lines = [
        f"plan: {planner.model_name} ({planner.params / 1e6:,.1f}M params, {c.n_layers} layers, d={c.d_model}) "
        f"on {planner.n} devices, batch {planner.batch_size} x {planner.seq_len} tokens, {planner.precision}, "
        f"remat {'on' if c.remat else 'off'}, offload {planner.offload}",
        *plan_lora.header(c, planner.params),
        f"hardware: {p.description}; HBM limit {format_bytes(planner.hbm_bytes)} per device",
        *([f"batch: one sequence a device by default, the smallest batch every strategy splits (shardlib train's "
           f"default is {DEFAULT_TRAIN_BATCH}); --batch-size plans another"] if not planner.batch_given else []),
        "",
    ]
    table = []
    for r in rows:
        if r.error:
            table.append({"": "", "strategy": r.strategy, "mesh": r.mesh_text if r.mesh else "-",
                          "persistent": "error: " + r.error[:100]})
            continue
        table.append({
            "": "*" if r.best else "", "strategy": r.strategy, "mesh": r.mesh_text,
            "persistent": format_bytes(r.persistent_bytes), "args": format_bytes(r.argument_bytes),
            "host": format_bytes(r.host_bytes),
            "peak": format_bytes(r.peak_bytes), "comm/step": format_bytes(r.collective_total_bytes),
            "compute ms": r.compute_s * 1e3, "comm ms": r.comm_s * 1e3,
            "step ms": r.step_s * 1e3, "MFU": f"{r.mfu:.0%}" if r.mfu is not None else "-",
            "attention": r.attention or "-", "fits": "yes" if r.fits else "NO",
        })
    lines.append(format_table(table, ["", "strategy", "mesh", "persistent", "args", "host", "peak", "comm/step",
                                      "compute ms", "comm ms", "step ms", "MFU", "attention", "fits"]))
    kinds = [(r.strategy, {k: v for k, v in (r.collective_bytes or {}).items() if v}) for r in rows if not r.error]
    lines += ["", "collective bytes per device per step, by kind:"]
    lines += [f"  {s}: " + (", ".join(f"{k} {format_bytes(v)}" for k, v in d.items()) or "none") for s, d in kinds]
    for r in rows:
        for note in r.notes:
            lines.append(f"  note ({r.strategy}): {note}")
        if r.fits_by_offload:
            lines.append(f"  note ({r.strategy}): fits because of --offload {r.offload}: {format_bytes(r.host_bytes)} "
                         f"per device in host memory; without it ~{format_bytes(r.peak_bytes + r.host_bytes)} > "
                         f"{format_bytes(r.hbm_bytes)}")
    for r in (r for r in rows if r.stage_costs):
        lines += [f"  stage costs ({r.strategy}, one microbatch forward + backward):", *format_stage_table(r.stage_costs)]
    best = next((r for r in rows if r.best), None)
    lines.append("")
    lines.append(f"best: {best.strategy} on {best.mesh_text} (* above)" if best else
                 f"nothing fits in {format_bytes(planner.hbm_bytes)} per device. What would:")
    if best is not None:
        lines.append(f"run it: {train_command(planner, best)}")
    lines += [f"  - {a['text']}" for a in advice]
    lines += ["", "model: " + MODEL_NOTES["step_s"] + "; peak = " + MODEL_NOTES["peak_bytes"]]
    return "\n".join(lines)
