"""What a training run prints: the start banner and the summary table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardlib.run.checkpointing import saves_to

if TYPE_CHECKING:
    from pathlib import Path

    from shardlib.run.config import TrainConfig
    from shardlib.run.setup import Prepared


def plural(n: int, word: str) -> str:
    """``1 step``, ``3 steps``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


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


def banner(run: Prepared, note: str | None, *, resumes: bool = False) -> str:
    """The lines printed before the first step; one line per fact, so a new one is one more entry.
    ``resumes``: the weights and optimizer state come from the run's checkpoint, not the import."""
    import jax

    from shardlib.run import lora as lora_lib
    from shardlib.sharding.mesh import describe
    from shardlib.step.pipeline import bubble_fraction
    from shardlib.text import format_bytes

    config, mesh, microbatches = run.config, run.mesh, run.program.step.microbatches
    name = run.model_name if run.pretrained is None else run.pretrained.architecture.name
    lines = [
        f"shardlib train: {name} ({run.n_params / 1e6:.2f}M params, compute {config.precision}) "
        f"for {plural(config.steps, 'step')}",
        *([f"weights    {run.pretrained.describe()}; "
           + ("resumed: weights and optimizer state from the checkpoint" if resumes else "optimizer state fresh")]
          if run.pretrained is not None else []),
        *([trains] if (trains := lora_lib.describe(run)) is not None else []),
        *([f"tokenizer  {run.tokenizer.path} ({run.tokenizer.vocab_size:,} ids)"] if run.tokenizer is not None else []),
        device_line(note),
    ]
    if jax.process_count() > 1:
        from shardlib.runtime.distributed import device_map

        lines.append(device_map(mesh))
    lines += [
        f"mesh       {describe(mesh)}",
        f"strategy   {run.strategy.name}: {run.strategy.summary}",
        f"sharding   {run.layout.replication_summary()}",
        *([_blocks_line(run)] if run.block_recompute is not None else []),
        f"batch      {config.batch_size} sequences x {config.seq_len} tokens (global)"
        + (f", {microbatches} microbatches" if microbatches > 1 else ""),
        *([f"pipeline   {mesh.shape['pipe']} stages, {config.pipeline_schedule}, bubble "
           f"{bubble_fraction(mesh.shape['pipe'], microbatches):.1%} = (S-1)/(M+S-1)"] if mesh.shape["pipe"] > 1 else []),
        f"memory     {format_bytes(run.state_bytes)} params+optimizer state + {format_bytes(run.mem.temp_bytes)} "
        "temporaries per device (compiled step)",
        ("data       a Grain pipeline (its state saved in each checkpoint; no validation split)"
         if hasattr(run.loader, "state_at") else data_line(config.data, *run.data_bytes, tokenized=run.tokenizer is not None)
         + (f"; validation from --eval-data {config.eval_data}" if config.eval_data else "")),
        f"checkpoint {checkpoint_setting(config, run.out_dir)}",
        f"output     {run.out_dir}",
    ]
    return "\n".join(lines)


def _blocks_line(run: Prepared) -> str:
    """Which per-block ZeRO-3 mode ran (`build(block_recompute=)`): what its backward recomputes."""
    blocks = run.model.gathered_blocks
    what = ("the backward gathers each block's weights again and keeps its activations (block_recompute=weights)"
            if run.block_recompute == "weights" else
            "the backward reruns each block (block_recompute=block: keeping activations did not fit a device)")
    return f"blocks     {len(blocks)} gathered one call at a time ({blocks[0]!r} ...); {what}"


def data_line(path: str | None, train_bytes: int, val_bytes: int, *, tokenized: bool = False) -> str:
    from pathlib import Path

    from shardlib.text import format_bytes

    from shardlib.runtime.tokens import is_token_file

    if tokenized and Path(path or "").suffix.lower() == ".jsonl":
        return f"data       {path}: {train_bytes:,} train + {val_bytes:,} validation examples (loss on completions)"
    if is_token_file(path) or tokenized:
        return f"data       {path}: {train_bytes:,} train + {val_bytes:,} validation token ids"
    name = "built-in pydoc corpus (--data PATH for your own text)" if path is None else path
    return (f"data       {name}: {train_bytes:,} train + {val_bytes:,} validation bytes "
            f"({format_bytes(train_bytes + val_bytes)})")


def checkpoint_setting(config: TrainConfig, out_dir: Path) -> str:
    """Where checkpoints go, how often, how many are kept; or off, and the flag that turns them on."""
    directory = saves_to(config, out_dir)
    if directory is None:
        return "off (--ckpt-every 0; without it a run saves at the end, and on Ctrl-C or SIGTERM)"
    when = (f"every {plural(config.ckpt_every, 'step')} and at the end" if config.ckpt_every
            else "at the end (--ckpt-every N: also every N steps)" if config.ckpt_every is None
            else "on Ctrl-C or SIGTERM only (--ckpt-every 0)")
    return f"{directory}, {when}, keep {config.keep}"


def summary_rows(run: Prepared, *, startup: float, start: int, steps: int, wall: float, step_time: float,
                 tokens_per_s: float, mfu: float | None, last_loss: float, last_val: float | None) -> list[tuple[str, Any]]:
    """The end-of-run table: layout, memory and traffic, then speed and the final losses.

    ``start``: the step the run resumed at; ``steps``: how many it ran. A run that ran none (a
    finished run started again) has no speed or train loss, and says why instead of printing nan.
    """
    import jax

    from shardlib.sharding.mesh import describe
    from shardlib.text import format_bytes

    device = jax.devices()[0]
    idle = f"n/a (no steps run: resumed at step {start} of {run.config.steps}; raise --steps to train on)"
    return [
        ("strategy", run.strategy.name),
        ("mesh", describe(run.mesh)),
        ("devices", f"{len(jax.devices())} x {device.platform}"),
        ("parameters", f"{run.n_params:,}"),
        ("params+optimizer / device", format_bytes(run.state_bytes)),
        ("temporaries / device", format_bytes(run.mem.temp_bytes)),
        ("collective bytes / step / device", format_bytes(run.comm.total_bytes)),
        *pipeline_rows(run.layout.pipeline_stages, run.program.step.microbatches, run.comm),
        ("startup (build, compile, init)", f"{startup:.1f} s"),
        ("steps", f"{steps} in {wall:.1f} s"),
        ("step time (mean, after the first)", f"{step_time:.3f} s" if steps else idle),
        ("tokens / s", f"{tokens_per_s:,.0f}" if steps else "n/a (no steps run)"),
        ("MFU", "n/a (no steps run)" if not steps else f"{mfu:.1%}" if mfu is not None else
         f"n/a (peak FLOP/s of {device.device_kind} unknown)"),
        ("final train loss", f"{last_loss:.4f}" if steps else "n/a (no steps run)"),
        ("final val loss", f"{last_val:.4f}" if last_val is not None else "-"),
    ]


def pipeline_rows(stages: int, microbatches: int, comm) -> list[tuple[str, Any]]:
    """Summary rows of a pipelined run: its bubble and the activation traffic between stages."""
    if stages <= 1:
        return []
    from shardlib.step.pipeline import bubble_fraction
    from shardlib.text import format_bytes

    return [("pipeline bubble (S-1)/(M+S-1)", f"{bubble_fraction(stages, microbatches):.1%} "
                                               f"({stages} stages, {microbatches} microbatches)"),
            ("collective-permute bytes / step", format_bytes(comm.bytes_by_kind()["collective-permute"]))]


def summary_table(rows: list[tuple[str, Any]]) -> str:
    from shardlib.text import format_table

    return format_table([{"what": k, "value": v} for k, v in rows], [("what", "summary"), ("value", "")])
