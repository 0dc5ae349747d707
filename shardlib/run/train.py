"""`shardlib train`: train a model under a strategy, as a library call (`train`) and a CLI command.

A run is setup, loop and finish. Setup (`shardlib.run.setup`): simulated devices (if asked,
before JAX starts) -> mesh -> layout -> data -> train program, its step compiled once for the
banner's memory figures and reused for every step -> a fresh or restored state. Loop
(`shardlib.run.loop`): each step's record goes through the periodic actions (validation,
examples log, metrics.jsonl and TensorBoard, progress, the non-finite guard); checkpoint saves
and preemption see each dispatched step. Finish: summary table, loss-curve PNG and a text
sample. `train(TrainConfig(...))` is what a notebook calls; the CLI only turns flags into a
`TrainConfig` (`shardlib.run.config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from shardlib.run import console
from shardlib.run.config import (  # noqa: F401  (re-exported: the CLI and notebooks import them from here)
    DEFAULT_CPU_DEVICES,
    PRECISIONS,
    TrainConfig,
    TrainConfigError,
    add_arguments,
    check_numbers,
    flag_errors,
    from_args,
    given_fields,
)
from shardlib.exits import EXIT_DIVERGED, EXIT_INTERRUPTED
from shardlib.run.nonfinite import DivergedError  # light: imports neither JAX nor NumPy
from shardlib.run.sampling import sample_text
from shardlib.runtime.files import write_atomic


@dataclasses.dataclass
class TrainResult:
    """What a run produced: final numbers, where its files are, and the trained state."""

    out_dir: Path | None
    metrics_path: Path | None
    config_path: Path | None
    loss_curve_path: Path | None
    steps: int
    final_loss: float
    final_val_loss: float | None
    tokens_per_s: float
    step_time_s: float
    param_count: int
    state_bytes_per_device: int
    temp_bytes_per_device: int
    collective_bytes_per_step: int
    mfu: float | None
    sample: str | None
    summary: str
    state: Any = dataclasses.field(repr=False)
    program: Any = dataclasses.field(repr=False)
    records: list[dict[str, Any]] = dataclasses.field(repr=False, default_factory=list)
    preempted: bool = False


# --------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------


def setup_devices(cpu_devices: int | None) -> str | None:
    """Join a multi-process job if this process is part of one, else simulate CPU devices.

    Must run before any JAX computation. Multi-process (``shardlib launch``, SLURM, Open MPI,
    a TPU VM; see `shardlib.runtime.distributed`): `shardlib.runtime.distributed.initialize`
    joins the job and the launcher's per-process device count wins. Single process: see
    `_simulate_cpu_devices`. Returns a note for the banner, or None.
    """
    if cpu_devices is not None and cpu_devices < 1:
        raise TrainConfigError("cpu_devices", f"must be a positive device count, got {cpu_devices}")
    from shardlib.runtime import distributed

    plan = distributed.plan()
    if plan.multi_process:
        use_cpu_count = os.environ.get("JAX_PLATFORMS") == "cpu" and plan.local_devices is None
        info = distributed.initialize(local_device_count=cpu_devices if use_cpu_count else None)
        return info.describe()
    if plan.local_devices is not None and os.environ.get("JAX_PLATFORMS") == "cpu":
        cpu_devices = plan.local_devices  # `shardlib launch -n 1 -d M` (an elastic restart onto one process): M wins
    if cpu_devices is None:
        return None
    return _simulate_cpu_devices(cpu_devices)


def _simulate_cpu_devices(n: int) -> str | None:
    """``n`` simulated CPU devices unless an accelerator is present (then a note says so).

    With ``JAX_PLATFORMS=cpu`` this is `shardlib.runtime.devices.simulate_cpu_devices`. Otherwise
    JAX may still find an accelerator, so only the CPU device count is set (with the long
    collective timeout that simulated devices on few cores need). A backend already up (a
    notebook, a test session) with the requested count is accepted; another count is an error.
    """
    from shardlib.runtime import devices

    if os.environ.get("JAX_PLATFORMS") == "cpu":
        try:
            devices.simulate_cpu_devices(n)
        except RuntimeError:
            raise _device_count_error(n) from None
        return None
    devices.raise_cpu_collective_timeout()
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend already started with another setting
        pass
    platform = jax.default_backend()
    if platform != "cpu":
        return f"--cpu-devices {n} ignored: running on {len(jax.devices())} {platform} device(s)"
    if len(jax.devices()) != n:
        raise _device_count_error(n)
    return None


def _set_xla_flags(gpu_overlap: bool) -> str | None:
    """``--xla-gpu-overlap``: XLA's GPU overlap flags, which must be set before JAX starts (a note, or None)."""
    if not gpu_overlap:
        return None
    from shardlib.runtime.xla_flags import set_gpu_overlap_flags

    try:
        return set_gpu_overlap_flags()
    except RuntimeError as err:
        raise TrainConfigError("xla_gpu_overlap", str(err)) from None


def _device_count_error(n: int) -> TrainConfigError:
    import jax

    have = len(jax.devices("cpu"))
    return TrainConfigError("cpu_devices", f"JAX already started with {have} CPU devices in this process, so {n} "
                                           f"cannot be simulated; pass --cpu-devices {have}, or start a fresh process")


# --------------------------------------------------------------------------------------------
# The run: setup, loop, finish
# --------------------------------------------------------------------------------------------


def train(config: TrainConfig, data: Any = None, *, model: Any = None, notes: Sequence[str] = ()) -> TrainResult:
    """Train ``config.model`` under ``config.strategy``; write metrics, plots and a sample.

    ``model``: your own `shardlib.Model` (what `from_nnx`, `from_linen` or `from_functions`
    return) instead of ``config.model``, as ``shardlib train --model package.module:factory`` does;
    its loss reads ``{"inputs": int32[B, T], "targets": int32[B, T]}``.

    ``data``: a Grain pipeline instead of ``config.data`` (docs/data.md): a function
    ``Shard -> grain.IterDataset | grain.DataLoader`` (any process count can resume it), a
    pipeline already sharded by process, or a `GrainBatches`; each example a dict with
    ``inputs`` and ``targets`` of length ``seq_len``. Its state is saved in each checkpoint.

    ``notes``: lines printed (stderr) after the header, once the run has passed its checks (the CLI's
    flags taken from the run's record), so a refused run still says only why.

    Before anything compiles, process 0 claims the run directory (``OUT/.lock``, held until this
    returns): a directory that cannot be written, or that another run is using, stops here.
    """
    import jax

    from shardlib.run.checkpointing import keep_schedule, refuse_silent_restart
    from shardlib.run.directory import check_out_path, claim_run_directory, run_directory
    from shardlib.run.setup import with_model_defaults

    from shardlib.run.outputs import refuse_out_over_sources, refuse_planted_links
    from shardlib.run.trackers import TrackerError, check_trackers

    t_begin = time.perf_counter()
    check_out_path(config)  # before JAX starts: a file in the way costs no start-up
    refuse_out_over_sources(config)
    with flag_errors("log_to", TrackerError):  # before --out is touched: a refused tracker leaves it as it was
        check_trackers(config.log_to)
    xla_note = _set_xla_flags(config.xla_gpu_overlap)
    note = "; ".join(filter(None, (xla_note, setup_devices(config.cpu_devices)))) or None
    config = with_model_defaults(config)
    check_numbers(config)
    out_dir = run_directory(config)
    with claim_run_directory(config, out_dir, main=jax.process_index() == 0):
        # The lock first: a live run is named as live; then what reads --out, under the lock.
        refuse_planted_links(out_dir)
        refuse_silent_restart(config, out_dir)
        # Reading the checkpoints opens them, which sets aside incomplete steps: only under the lock.
        config, schedule_note, resumes = keep_schedule(config, out_dir)
        return _train(config, out_dir, note, t_begin, data, model, (*notes, schedule_note), resumes)


def _train(config: TrainConfig, out_dir: Path, note: str | None, t_begin: float, data: Any = None,
           model: Any = None, notes: Sequence[str | None] = (), resumes: bool = False) -> TrainResult:
    import jax

    from shardlib.run.metrics_io import MetricsLog
    from shardlib.run.setup import prepare
    from shardlib.run.trackers import TrackerError, open_trackers

    # Started before the compile: a tracker that cannot start costs no compile and writes no metrics.
    with flag_errors("log_to", TrackerError):
        trackers = open_trackers(config.log_to, out_dir, dataclasses.asdict(config), enabled=jax.process_index() == 0)
    with contextlib.ExitStack() as closing:
        for tracker in trackers:
            closing.callback(tracker.close)
        run = prepare(config, out_dir, data=data, model=model)
        if run.is_main and config.verbose:
            print(console.banner(run, note, resumes=resumes), flush=True)
        ckpt, state, start, resume_step = _initial_state(run)
        for line in filter(None, notes) if run.is_main and config.verbose else ():  # once resumed: a refused
            print(line, file=sys.stderr, flush=True)  # resume says only why
        log = closing.enter_context(contextlib.closing(
            MetricsLog(run.out_dir, enabled=run.is_main, tensorboard=config.tensorboard, resume_step=resume_step)))
        config_path = _write_config(run)
        evaluate = run.evaluator()
        wall_start = time.perf_counter()
        state, tally, stop = _loop(run, state, (start, resume_step), ckpt, log, evaluate, trackers)
        if not tally.step_times:  # resumed at or past --steps: nothing to train, still report where it stands
            tally.last_val = evaluate(state)
        preempted = stop is not None and stop.stopped_at is not None
        if preempted and run.is_main:
            print(stop.stop_line(), flush=True)
        timing = {"startup": wall_start - t_begin, "wall": time.perf_counter() - wall_start}
        return _finish(run, state, start, tally, log, config_path, preempted=preempted, **timing)


def _initial_state(run):
    """(checkpointer or None, state, steps done, resume step or None): the one place a run resumes."""
    import jax

    from shardlib.run.checkpointing import model_mismatch, open_checkpointer
    from shardlib.runtime.checkpoint import CheckpointMismatchError

    config = run.config
    ckpt, resume = open_checkpointer(config, run.out_dir)
    if not resume and run.pretrained is not None:  # --init-from: each device's shards read from the files
        from shardlib.hf.load import load_params
        from shardlib.run.lora import initial_params

        params = (initial_params(run) if run.model_config.lora is not None
                  else load_params(run.pretrained, run.layout.param_shardings()))
        return ckpt, run.program.init_from(params, key=jax.random.key(config.seed)), 0, None
    if not resume:
        return ckpt, run.program.init(jax.random.key(config.seed)), 0, None
    target = run.program.abstract_state()
    try:
        state, data_state, _ = ckpt.restore(target, fresh=run.program.fresh_transient)
    except CheckpointMismatchError as err:
        raise model_mismatch(config, ckpt, target, err) from None
    run.loader.restore(data_state)
    if run.is_main and config.verbose:
        print(f"resumed    step {run.loader.step} from {ckpt.directory}", flush=True)
    return ckpt, state, run.loader.step, run.loader.step


def saved_config(run) -> dict[str, Any]:
    """The run's settings as saved in config.json and each checkpoint; a run started from a Hugging
    Face model adds that model's config.json (``pretrained``), which `shardlib export --hf` writes back."""
    saved = dataclasses.asdict(run.config)
    if run.pretrained is not None:
        from shardlib.hf.generation_config import read_generation_config

        saved["pretrained"] = {"architecture": run.pretrained.architecture.name, "config": run.pretrained.hf_config,
                               "source": str(run.pretrained.directory),
                               "generation_config": read_generation_config(run.pretrained.directory)}
    lora = getattr(run.model_config, "lora", None)
    if lora is not None:  # what `export --hf / --peft` rebuilds the model from
        saved["lora"] = dataclasses.asdict(lora)
    if run.tokenizer is not None:
        saved["tokenizer_file"] = str(run.tokenizer.path.resolve())
    return saved


def _write_config(run) -> Path | None:
    if not run.is_main:
        return None
    return write_atomic(run.out_dir / "config.json", json.dumps(saved_config(run), indent=2, default=str) + "\n",
                        what="a run's output")


def _step_fn(run):
    """``step(k, state, batch)`` for `run_steps`: the compiled step (the same for every ``k``)."""
    return lambda k, state, batch: run.step_fn(state, batch)


def _loop(run, state, start: tuple[int, int | None], ckpt, log, evaluate, trackers):
    """The steps with their actions; returns (state, the `Tally`, the `Preemption` or None)."""
    import jax

    from shardlib.run.actions import Evaluate, Every, Progress, StepClock, Tally, interactive
    from shardlib.run.checkpointing import SaveCheckpoint, resume_hint
    from shardlib.run.examples import ExampleLog, examples_path
    from shardlib.run.loop import Recorder, run_steps
    from shardlib.run.nonfinite import NonFiniteGuard
    from shardlib.run.preemption import preemption
    from shardlib.run.profile import ProfileSteps
    from shardlib.run.stragglers import straggler_action

    config, (first, resume_step) = run.config, start
    clock, tally = StepClock(), Tally()
    validation = Evaluate(evaluate, Every(config.eval_every, last=config.steps), clock)
    examples = ExampleLog(examples_path(run.out_dir, jax.process_index(), jax.process_count()), run.loader,
                          enabled=config.record_examples, resume_step=resume_step)
    bar = config.progress and interactive()  # in a file: plain lines
    progress = Progress(total=config.steps, initial=first, log_every=config.log_every,
                        bar=run.is_main and bar, lines=run.is_main and config.verbose and not bar)
    # Order matters: validation adds val_loss; the guard raises last, once its step is logged.
    stragglers = straggler_action(config, clock)  # before the log: it adds the window's per-process times
    record = Recorder([validation, tally, stragglers, log, *trackers, progress, NonFiniteGuard(config.max_skips, ckpt)],
                      clock, tokens_per_step=run.tokens_per_step, at_once=validation.due, devices=len(jax.devices()),
                      pad_fraction=getattr(run.loader, "pad_fraction", None))
    profile = ProfileSteps(config.profile, run.out_dir, first, enabled=run.is_main)
    saver = None if ckpt is None else SaveCheckpoint(
        ckpt, Every(config.ckpt_every or 0, last=None if config.ckpt_every == 0 else config.steps),
        seed=run.loader.seed, config=saved_config(run), data_state=getattr(run.loader, "state_at", None))
    try:
        with preemption(saver, config.steps, resume_hint(config, run.out_dir)) as stop:
            state = run_steps(state, first, config.steps, _step_fn(run), run.load, record=record,
                              after_step=[examples, profile, *([saver] if saver is not None else [])], preemption=stop,
                              steps_in_flight=run.steps_in_flight)
    finally:
        for action in (saver, progress, examples, profile):  # the trackers: closed by the caller, who opened them
            if action is not None:
                action.close()
    return state, tally, stop


def _speed(run, step_times: list[float]) -> tuple[float, float, float | None]:
    """Mean step time after the first (compile, warm-up), tokens/s and MFU (None: peak unknown)."""
    import jax
    import numpy as np

    from shardlib.models import flops_per_token
    from shardlib.tools.report import mfu, peak_flops_for

    steady = step_times[1:] if len(step_times) > 1 else step_times
    if not steady:
        return math.nan, math.nan, None
    step_time = float(np.mean(steady))
    peak = peak_flops_for(jax.devices()[0])
    per_token = (flops_per_token(run.model_config, run.config.seq_len) if run.model_config is not None
                 else 6 * run.n_params)  # the user's model: the 6N estimate (attention not counted)
    flops = per_token * run.tokens_per_step
    return step_time, run.tokens_per_step / step_time, mfu(flops, step_time, len(jax.devices()), peak) if peak else None


def _finish(run, state, start: int, tally, log, config_path, *, preempted: bool, startup: float,
            wall: float) -> TrainResult:
    """Summary, loss curve and a text sample (not after a preemption); only process 0 writes."""
    config = run.config
    step_time, tokens_per_s, utilisation = _speed(run, tally.step_times)
    sample = None
    from shardlib.runtime.tokens import is_token_file

    if config.sample_tokens and is_token_file(config.data) and run.tokenizer is None:  # ids of a tokenizer it lacks
        if run.is_main and config.verbose and not preempted:
            print("no text sample: the data are token ids, and decoding them needs their tokenizer", flush=True)
    elif config.sample_tokens and not run.model.apply and not preempted:
        if run.is_main and config.verbose:
            print("no text sample: the model has no apply function (from_functions(..., apply=fn) gives it one); "
                  "--sample-tokens 0 skips this", flush=True)
    elif config.sample_tokens and not preempted:
        sample = sample_text(run.model, state.params, config.prompt, config.sample_tokens,
                             context=config.seq_len, seed=config.seed, temperature=config.sample_temperature,
                             tokenizer=run.tokenizer)
    steps = len(tally.step_times) + start
    summary = console.summary_table(console.summary_rows(
        run, startup=startup, start=start, steps=len(tally.step_times), wall=wall, step_time=step_time,
        tokens_per_s=tokens_per_s, mfu=utilisation, last_loss=tally.last_loss, last_val=tally.last_val))
    curve = _write_outputs(run, log, summary, sample, steps, preempted=preempted) if run.is_main else None
    return TrainResult(
        out_dir=run.out_dir if run.is_main else None, metrics_path=log.path if run.is_main else None,
        config_path=config_path, loss_curve_path=curve, steps=steps, final_loss=tally.last_loss,
        final_val_loss=tally.last_val, tokens_per_s=tokens_per_s, step_time_s=step_time, param_count=run.n_params,
        state_bytes_per_device=run.state_bytes, temp_bytes_per_device=run.mem.temp_bytes,
        collective_bytes_per_step=run.comm.total_bytes, mfu=utilisation, sample=sample, summary=summary,
        state=state, program=run.program, records=log.records, preempted=preempted,
    )


def _write_outputs(run, log, summary: str, sample: str | None, steps: int, *, preempted: bool) -> Path:
    """Process 0: the loss-curve PNG, sample.txt (and its TensorBoard text), the printed summary."""
    from shardlib.run.metrics_io import plot_loss_curve
    from shardlib.sharding.mesh import describe

    config, out_dir = run.config, run.out_dir
    curve = plot_loss_curve(log.records, out_dir / "loss_curve.png",
                            title=f"{run.model_name} / {run.strategy.name} / {describe(run.mesh)}")
    if sample is not None:
        log.add_text("sample", sample, steps)
        write_atomic(out_dir / "sample.txt", sample + "\n", what="a run's output")
    if config.verbose and not preempted:
        print(summary)
        if sample is not None:
            print(f"\nsample (prompt {config.prompt!r}):\n{sample}\n")
        written = ["metrics.jsonl", "config.json"] + (["loss_curve.png"] if curve else []) + \
            (["sample.txt"] if sample is not None else []) + (["TensorBoard events"] if log.writes_events else [])
        print(f"wrote {out_dir}/: {', '.join(written)}", flush=True)
    return curve


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def run(args) -> int:
    """Flags -> TrainConfig (a rerun's unset flags from its run's record) -> train()."""
    from shardlib.run.record import with_recorded

    config, lines = with_recorded(from_args(args), given_fields(args))
    try:
        train(config, notes=lines)
    except DivergedError as err:  # not a usage error (exit 2): one line, its own status
        print(f"shardlib train: error: {err}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except KeyboardInterrupt as err:  # a checkpointing run's loop turns Ctrl-C into a save and a clean stop instead
        if config.ckpt_every == 0 and config.resume_from is None:
            from shardlib.exits import exit_interrupted

            print("shardlib train: interrupted; nothing saved (checkpointing is off, --ckpt-every 0: without it a run "
                  "saves at the end, and Ctrl-C saves before stopping)", file=sys.stderr, flush=True)
            return exit_interrupted(err, EXIT_INTERRUPTED)
        raise
    return 0
