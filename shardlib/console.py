"""What a training run prints: the start banner and the summary table."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardlib.train import TrainConfig


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
           out_dir: Path, note: str | None) -> str:
    import jax

    from shardlib.mesh import describe
    from shardlib.report import format_bytes

    lines = [
        f"shardlib train: {config.model} ({n_params / 1e6:.2f}M params, compute {config.precision}) "
        f"for {config.steps} steps",
        device_line(note),
    ]
    if jax.process_count() > 1:
        from shardlib.distributed import device_map

        lines.append(device_map(mesh))
    lines += [
        f"mesh       {describe(mesh)}",
        f"strategy   {strategy.name}: {strategy.summary}",
        f"batch      {config.batch_size} sequences x {config.seq_len} bytes (global)",
        f"memory     {format_bytes(state_bytes)} params+optimizer state + {format_bytes(mem.temp_bytes)} "
        "temporaries per device (compiled step)",
        f"output     {out_dir}",
    ]
    return "\n".join(lines)


def summary_table(rows: list[tuple[str, Any]]) -> str:
    from shardlib.report import format_table

    return format_table([{"what": k, "value": v} for k, v in rows], [("what", "summary"), ("value", "")])
