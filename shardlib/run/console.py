"""What a training run prints: the start banner and the summary table."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardlib.run.train import TrainConfig


def device_line(note: str | None) -> str:
    import jax

    devices = jax.devices()
    platform = devices[0].platform
    kinds = sorted({d.device_kind for d in devices} - {platform})
    line = f"devices    {len(devices)} x {platform}" + (f" ({', '.join(kinds)})" if kinds else "")
    line += f", {jax.process_count()} process(es)"
    if platform == "cpu" and len(devices) > 1:
        line += " [simulated]"
    return line + (f"\n           note: {note}" if note else "")


def banner(config: TrainConfig, model_config, strategy, mesh, n_params: int, mem, state_bytes: int,
           out_dir: Path, note: str | None, microbatches: int = 1) -> str:
    import jax

    from shardlib.sharding.mesh import describe
    from shardlib.step.pipeline import bubble_fraction
    from shardlib.tools.report import format_bytes

    lines = [
        f"shardlib train: {config.model} ({n_params / 1e6:.2f}M params, compute {config.precision}) "
        f"for {config.steps} steps",
        device_line(note),
    ]
    if jax.process_count() > 1:
        from shardlib.runtime.distributed import device_map

        lines.append(device_map(mesh))
    lines += [
        f"mesh       {describe(mesh)}",
        f"strategy   {strategy.name}: {strategy.summary}",
        f"batch      {config.batch_size} sequences x {config.seq_len} bytes (global)"
        + (f", {microbatches} microbatches" if microbatches > 1 else ""),
        *([f"pipeline   {mesh.shape['pipe']} stages, {config.pipeline_schedule}, bubble "
           f"{bubble_fraction(mesh.shape['pipe'], microbatches):.1%} = (S-1)/(M+S-1)"] if mesh.shape["pipe"] > 1 else []),
        f"memory     {format_bytes(state_bytes)} params+optimizer state + {format_bytes(mem.temp_bytes)} "
        "temporaries per device (compiled step)",
        f"output     {out_dir}",
    ]
    return "\n".join(lines)


def pipeline_rows(stages: int, microbatches: int, comm) -> list[tuple[str, Any]]:
    """Summary rows of a pipelined run: its bubble and the activation traffic between stages."""
    if stages <= 1:
        return []
    from shardlib.step.pipeline import bubble_fraction
    from shardlib.tools.report import format_bytes

    return [("pipeline bubble (S-1)/(M+S-1)", f"{bubble_fraction(stages, microbatches):.1%} "
                                               f"({stages} stages, {microbatches} microbatches)"),
            ("collective-permute bytes / step", format_bytes(comm.bytes_by_kind()["collective-permute"]))]


def summary_table(rows: list[tuple[str, Any]]) -> str:
    from shardlib.tools.report import format_table

    return format_table([{"what": k, "value": v} for k, v in rows], [("what", "summary"), ("value", "")])
