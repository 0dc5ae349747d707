"""Everything a run builds before its first step: model, data, mesh, layout, program, loaders.

`prepare` turns a checked `TrainConfig` into a `Prepared` run; each building block names the
flag behind a setting that does not work (`TrainConfigError`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import socket
import stat
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from shardlib.run.checkpointing import checkpoint_dir
from shardlib.run.config import DEFAULT_SEQ_LEN, PRECISIONS, TrainConfig, TrainConfigError
from shardlib.run.fits import check_fits, held_output
from shardlib.runtime.files import make_dir


@dataclasses.dataclass
class Prepared:
    """A run ready to step: the program, its compiled step and that step's memory and traffic."""

    config: TrainConfig
    strategy: Any
    model_config: Any  # None for the user's own model (`shardlib.run.user_model`)
    model: Any
    model_name: str
    mesh: Any
    layout: Any
    out_dir: Path
    loader: Any
    val_local: list
    schedule: Any
    program: Any
    abstract_batch: dict[str, Any]
    step_fn: Any
    mem: Any
    comm: Any
    state_bytes: int
    n_params: int
    data_bytes: tuple[int, int]  # (train, validation) bytes of the corpus (token ids, examples)
    pretrained: Any = None  # the Hugging Face model directory the weights start from (`shardlib.hf.load.Pretrained`)
    tokenizer: Any = None  # `shardlib.hf.tokenizer.Tokenizer` of --tokenizer
    # What the backward of the blocks gathered per call recomputes ("weights" / "block", `build`);
    # None: no block is gathered per call
    block_recompute: str | None = None

    @property
    def is_main(self) -> bool:
        import jax

        return jax.process_index() == 0

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.config.seq_len

    @property
    def steps_in_flight(self) -> int:
        """Steps the loop dispatches ahead of the one it records: the backend policy's, as the
        program's step read it when it was built (`shardlib.backend`)."""
        return self.program.step.steps_in_flight

    def load(self, index: int) -> dict[str, Any]:
        """Training batch ``index`` (0-based) as global arrays, placed on the devices in the step's
        batch sharding (the loop loads it while the step before it runs, so the copy overlaps it)."""
        from shardlib.runtime.data import to_global

        return to_global(self.loader.batch(index), self.abstract_batch["inputs"].sharding, rows=self.loader.rows)

    def evaluator(self):
        """``evaluate(state) -> float``: the mean validation loss over this run's windows (the model in
        eval mode, with the state's running statistics when it keeps any)."""
        import jax
        import numpy as np

        from shardlib.runtime.data import to_global

        sharding = self.abstract_batch["inputs"].sharding
        val_global = [to_global(b, sharding, rows=self.loader.rows) for b in self.val_local]

        def evaluate(state) -> float:
            if not val_global:  # a Grain pipeline brings no validation split: the val loss is NaN, said in docs/data.md
                return float("nan")
            losses = [self.program.evaluate(state.params, b, state.model_state)["loss"] for b in val_global]
            return float(np.mean(jax.device_get(losses)))

        return evaluate


def prepare(config: TrainConfig, out_dir: Path | None = None, *, data: Any = None, model: Any = None) -> Prepared:
    """Build the run of ``config``; the step is compiled once (memory figures come from it).

    ``data``: a Grain pipeline read instead of ``config.data`` (`shardlib.run.train.train`).
    ``model``: a `shardlib.Model` trained instead of ``config.model``; a ``config.model`` of the
    form ``package.module:factory`` is one too (`shardlib.run.user_model`).

    ``out_dir``: the run directory when the caller already chose (and claimed) it; else
    `run_directory`'s choice.
    """
    import numpy as np

    from shardlib.sharding.layout import make_layout
    from shardlib.models import param_count, trainable
    from shardlib.run import user_model
    from shardlib.tools.report import collective_stats, memory_stats

    config = with_model_defaults(config)
    strategy = _strategy(config)
    pretrained = _pretrained(config)  # refuses --init-from beside a --model of any kind
    model, model_name = _own_model(config, model)
    model_config = _model_config(config, pretrained) if model is None else None
    tokenizer = _tokenizer(config, model_config)
    no_bytes = np.zeros(0, np.uint8)
    vocab_size = model_config.vocab_size if model is None else _own_vocab(config)
    from shardlib.run import epochs, eval_data, packing

    if data is None:
        train_bytes, val_bytes = eval_data.loaded(config, lambda c: _load_data(c, vocab_size, tokenizer))
        train_bytes, val_bytes = packing.apply(config, train_bytes, val_bytes, main=jax_main())
        config = epochs.apply(config, train_bytes, main=jax_main())  # --epochs: the steps that read the data N times
    else:  # a Grain pipeline brings its own data
        for refuse in (eval_data.refuse_with_pipeline, epochs.refuse_with_pipeline):
            refuse(config)
        train_bytes, val_bytes = no_bytes, no_bytes
    masked = isinstance(train_bytes, tuple)  # instruction rows: the loss counts the completions (a mask)
    mesh = _mesh(config, strategy)
    _note_collapse(strategy, mesh)
    _check_pipeline_flags(config, mesh)
    if model is None:
        model = trainable(model_config)
    layout = _with_context_options(config, make_layout(model, strategy, mesh))
    packing.refuse(config, model_config, layout, pipeline=data is not None)
    if out_dir is None:
        out_dir = run_directory(config)
    _record_restart(out_dir, mesh)
    loader, val_local = (_loaders(config, layout, train_bytes, val_bytes) if data is None
                         else (_grain_loader(config, layout, data), []))
    schedule = lr_schedule(config)
    program = build_program(config, model, layout, schedule)
    abstract_batch = program.abstract_batch(_batch_shapes(config, masked))
    _check_batch_split(layout, program, abstract_batch)
    recompute = "weights" if _gathers_per_block(model, layout) else None
    with held_output():  # XLA's logs while compiling a step it then refuses would bury the one line
        step_fn = program.compile_step(program.abstract_state(), abstract_batch)
        mem = memory_stats(step_fn)
        if recompute is not None and not _fits(config, mem):  # rerun each block in the backward: less memory
            program = build_program(config, model, layout, schedule, block_recompute="block")
            step_fn, recompute = program.compile_step(program.abstract_state(), abstract_batch), "block"
            mem = memory_stats(step_fn)
        check_fits(config, mem, layout.batch_size_multiple, program.step.microbatches, layout.pipeline_stages > 1,
                   lambda other: _compiled_peak(other, model, layout, schedule, masked, recompute or "weights"))
    return Prepared(config=config, strategy=strategy, model_config=model_config, model=model, model_name=model_name,
                    mesh=mesh,
                    layout=layout, out_dir=out_dir, loader=loader, val_local=val_local, schedule=schedule,
                    program=program, abstract_batch=abstract_batch, step_fn=step_fn, mem=mem,
                    comm=collective_stats(step_fn),
                    n_params=param_count(model_config) if model_config is not None else user_model.param_count(model),
                    state_bytes=mem.argument_bytes - _per_device_bytes(abstract_batch),
                    data_bytes=(len(train_bytes[0] if isinstance(train_bytes, tuple) else train_bytes),
                                len(val_bytes[0] if isinstance(val_bytes, tuple) else val_bytes)),
                    pretrained=pretrained, tokenizer=tokenizer, block_recompute=recompute)


def _gathers_per_block(model: Any, layout: Any) -> bool:
    """Whether the step gathers ``model``'s blocks one call at a time (`shardlib.model.blocks`):
    it has blocks and the layout stores some of their parameters split over the batch axes."""
    from shardlib.model import blocks as blocks_lib
    from shardlib.sharding.layout import spec_axes
    from shardlib.sharding.rules import is_layout

    import jax

    blocks = getattr(model, "gathered_blocks", ())
    stored = {leaf.path: tuple(sorted(spec_axes(leaf.spec) & set(layout.batch_axes)))
              for leaf in jax.tree.leaves(layout.params, is_leaf=is_layout)}
    return bool(blocks) and blocks_lib.sharded(blocks, stored)


def _fits(config: TrainConfig, mem: Any) -> bool:
    """Whether the compiled step's peak fits a device (unknown capacity: it does)."""
    from shardlib.tools.memory import device_capacity, peak_bytes

    capacity = device_capacity()
    return config.force or capacity is None or peak_bytes(mem) <= capacity[0]


def _own_model(config: TrainConfig, model: Any) -> tuple[Any, str]:
    """(the user's `Model` or None, the name the header prints): ``train(model=...)`` or ``--model pkg.mod:make``."""
    from shardlib.run import user_model

    if model is not None:
        return model, user_model.LIBRARY_MODEL
    if user_model.is_factory(config.model):
        return user_model.load(config.model), config.model
    return None, config.model


def _own_vocab(config: TrainConfig) -> int:
    """The vocabulary a token file is checked against: only ``--vocab-size`` knows it for the user's model."""
    from shardlib.runtime.tokens import is_token_file

    if config.vocab_size is not None:
        _check_vocab_flag(config)
        return config.vocab_size
    if is_token_file(config.data):
        raise TrainConfigError("vocab_size", "with your own --model and a token file, give the tokenizer's vocabulary "
                                             "size (--vocab-size V), which every token id is checked against")
    return 256


def _check_vocab_flag(config: TrainConfig) -> None:
    """``--vocab-size`` sets a token file's vocabulary: refused with text, or below 2."""
    from shardlib.runtime.tokens import is_token_file

    if not is_token_file(config.data):
        raise TrainConfigError("vocab_size", "sets the vocabulary of a token file (--data FILE.bin or .npy); text "
                                             "is read as bytes (256 ids), so drop --vocab-size or pass a token file")
    if config.vocab_size < 2:
        raise TrainConfigError("vocab_size", f"must be at least 2, got {config.vocab_size}")


def _batch_shapes(config: TrainConfig, masked: bool = False) -> dict[str, Any]:
    """The batch the loader yields: inputs and targets, and with instruction rows a ``loss_mask``
    (packed: with ``segment_ids`` and ``positions``)."""
    import numpy as np

    keys = ("inputs", "targets") + (("segment_ids", "positions") if masked and config.pack else ())
    shapes = {k: ((config.batch_size, config.seq_len), np.int32) for k in keys}
    if masked:
        shapes["loss_mask"] = ((config.batch_size, config.seq_len), np.float32)
    return shapes


def _compiled_peak(config: TrainConfig, model, layout, schedule, masked: bool = False,
                   block_recompute: str = "weights") -> int:
    """Peak bytes a device of ``config``'s step, compiled (for `check_fits`'s other batch sizes)."""
    from shardlib.tools.memory import memory_stats, peak_bytes

    program = build_program(config, model, layout, schedule, block_recompute)
    return peak_bytes(memory_stats(program.compile_step(program.abstract_state(),
                                                        program.abstract_batch(_batch_shapes(config, masked)))))


def _with_context_options(config: TrainConfig, layout):
    """--no-cp-balance / --cp-attention on the layout; refused without a context axis to act on."""
    if layout.context_size == 1 and (not config.cp_balance or config.cp_attention != "auto"):
        raise TrainConfigError("cp_balance" if not config.cp_balance else "cp_attention",
                          "--no-cp-balance and --cp-attention act on a context mesh axis, and this mesh has none: "
                          "add one (--mesh data=2,context=4) or drop the flag")
    return dataclasses.replace(layout, context_balance=config.cp_balance, context_attention=config.cp_attention)


def _strategy(config: TrainConfig):
    from shardlib.sharding.strategies import ALIASES, get_strategy

    if config.strategy in ALIASES:
        print(f"shardlib: note: --strategy {config.strategy} is {ALIASES[config.strategy]} here (parameters, gradients "
              "and optimizer state sharded over the data-parallel devices)", file=sys.stderr, flush=True)
    try:
        return get_strategy(config.strategy)
    except ValueError as err:
        raise TrainConfigError("strategy", str(err)) from None


def _pretrained(config: TrainConfig):
    """``--init-from``'s model directory, opened and checked (nothing read yet), or None."""
    if config.init_from is None:
        return None
    from shardlib.hf.architectures import UnsupportedModel
    from shardlib.hf.load import PretrainedError, open_pretrained
    from shardlib.hf.safetensors_io import SafetensorsFileError

    if config.model != TrainConfig.model:
        raise TrainConfigError("init_from", f"takes the model from {config.init_from}/config.json, and --model "
                                            f"{config.model} names another: drop --model")
    from shardlib.hf.hub_cache import resolve

    try:
        directory, cached = resolve(config.init_from)  # org/name: its snapshot in the local Hugging Face cache
        if cached is not None and config.verbose and jax_main():
            print(f"init-from  {cached}", flush=True)
        return open_pretrained(directory, seq_len=config.seq_len)
    except (PretrainedError, UnsupportedModel, SafetensorsFileError, OSError) as err:
        raise TrainConfigError("init_from", str(err)) from None


def _tokenizer(config: TrainConfig, model_config):
    """``--tokenizer``, checked against the model's vocabulary, or None."""
    from shardlib.runtime.tokens import is_token_file

    if config.tokenizer is None:
        if config.init_from is not None and not is_token_file(config.data):  # bytes are not the model's ids
            raise TrainConfigError("init_from", f"{config.init_from}'s vocabulary is its tokenizer's, not bytes: pass "
                                                "--tokenizer (its tokenizer.json or directory) and --data (text or "
                                                ".jsonl), or --data a token file of its ids")
        return None
    from shardlib.hf.tokenizer import TokenizerError, check_vocab, load_tokenizer

    if is_token_file(config.data):
        raise TrainConfigError("tokenizer", "tokenizes text, and --data is a token file (already ids): drop one")
    if model_config is None:
        raise TrainConfigError("tokenizer", "checks its vocabulary against a reference decoder's (--init-from or a "
                                            "config name); with your own --model pass a token file and --vocab-size")
    try:
        tokenizer = load_tokenizer(config.tokenizer)
        check_vocab(tokenizer, model_config.vocab_size, config.init_from or f"model {config.model!r}")
    except TokenizerError as err:
        raise TrainConfigError("tokenizer", str(err)) from None
    return tokenizer


def _model_config(config: TrainConfig, pretrained=None):
    from shardlib.models import get_config

    try:
        model_config = pretrained.model_config if pretrained is not None else get_config(config.model)
    except ValueError as err:
        raise TrainConfigError("model", str(err)) from None
    if config.precision not in PRECISIONS:
        raise TrainConfigError("precision", f"unknown precision {config.precision!r}; "
                                            f"choose one of {', '.join(PRECISIONS)}")
    if config.seq_len > model_config.max_seq_len:
        raise TrainConfigError(
            "seq_len",
            f"{config.seq_len} exceeds {config.init_from or repr(config.model)}'s max_seq_len {model_config.max_seq_len}; "
            "use at most that",
        )
    if config.vocab_size is not None:
        if config.init_from is not None:
            raise TrainConfigError("vocab_size", f"the vocabulary is {config.init_from}'s; drop --vocab-size")
        _check_vocab_flag(config)
        model_config = dataclasses.replace(model_config, vocab_size=config.vocab_size)
    from shardlib.models import MoEConfig

    if isinstance(model_config, MoEConfig) and config.remat not in ("full", "none"):
        raise TrainConfigError("remat", f"the MoE decoder rematerialises whole blocks; {config.remat} applies to the "
                                        "dense decoders: use --remat full or none")
    remat = {"remat": False} if config.remat == "none" else {"remat": True, "remat_policy": config.remat}
    from shardlib.run.lora import lora_config

    return dataclasses.replace(model_config, compute_dtype=PRECISIONS[config.precision],
                               lora=lora_config(config, model_config), **remat)


def _mesh(config: TrainConfig, strategy):
    from shardlib.sharding.mesh import MeshError, make_mesh, parse_mesh

    sizes = dict(strategy.default_mesh) if config.mesh is None else config.mesh
    try:
        sizes = parse_mesh(sizes) if isinstance(sizes, str) else dict(sizes)
        if config.pipeline_stages > 1:
            if sizes.get("pipe", config.pipeline_stages) != config.pipeline_stages:
                raise TrainConfigError("pipeline_stages", f"{config.pipeline_stages} stages but the mesh says "
                                                          f"pipe={sizes['pipe']}; give one or make them agree")
            sizes["pipe"] = config.pipeline_stages
        return make_mesh(sizes)
    except MeshError as err:
        hint = "" if config.mesh is not None else f" (the default mesh of strategy {strategy.name}; pass --mesh)"
        raise TrainConfigError("mesh", f"{err}{hint}") from None


def _note_collapse(strategy, mesh) -> None:
    """``--strategy hsdp --mesh fsdp=8`` is zero3: say so (`Strategy.collapses`)."""
    import jax

    if strategy.collapses and mesh.shape[strategy.collapses[0]] == 1 and jax.process_index() == 0:
        axis, other = strategy.collapses
        print(f"shardlib: note: --strategy {strategy.name} with {axis}=1 is {other} (nothing to replicate over "
              f"{axis}); give --mesh a {axis} axis, e.g. {axis}=2, or say --strategy {other}", file=sys.stderr, flush=True)


def _record_restart(out_dir: Path, mesh) -> None:
    """After an elastic restart (`shardlib launch --elastic`), process 0 says who died and the new
    mesh, and records it in ``metrics.jsonl`` (before the log opens, which keeps it)."""
    import jax

    from shardlib.run.metrics_io import append_record
    from shardlib.runtime.elastic import describe_restart, restart_from_env
    from shardlib.sharding.mesh import describe

    note = restart_from_env()
    if note is None or jax.process_index() != 0:
        return
    print(describe_restart(note, describe(mesh)), flush=True)
    append_record(out_dir / "metrics.jsonl", {**note, "mesh": describe(mesh)})


def _check_pipeline_flags(config: TrainConfig, mesh) -> None:
    """``--schedule`` and ``--microbatches`` shape a pipeline; without one they would be ignored, so refuse them."""
    if mesh.shape["pipe"] > 1:
        return
    if config.pipeline_schedule != TrainConfig.pipeline_schedule:
        raise TrainConfigError("pipeline_schedule", f"{config.pipeline_schedule} schedules a pipeline, and this run has "
                                                    "none; add --pipeline-stages S (S >= 2), or drop --schedule")
    if config.microbatches is not None:
        raise TrainConfigError("microbatches", "splits the batch of a pipelined run, and this run has none; add "
                                               "--pipeline-stages S (S >= 2), or use --grad-accum K to split the batch "
                                               "without a pipeline")


def _check_batch_split(layout, program, abstract_batch: Mapping[str, Any]) -> None:
    """Before the compile: the batch must split over the data-parallel devices times the microbatches."""
    try:
        layout.check_batch(abstract_batch, microbatches=program.step.microbatches)
    except ValueError as err:
        flag = "--microbatches" if layout.pipeline_stages > 1 else "--grad-accum"
        raise TrainConfigError("batch_size", f"{err} (the microbatches are {flag})") from None


def lr_schedule(config: TrainConfig):
    """Linear warmup from 10% of ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``schedule_steps``
    (default ``steps``), and that rate after."""
    import optax

    steps = config.schedule_steps or config.steps
    warmup = config.warmup_steps if config.warmup_steps is not None else max(1, steps // 10)
    warmup = min(warmup, steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=config.lr * 0.1,
        peak_value=config.lr,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),
        end_value=config.lr * config.min_lr_ratio,
    )


def optimizer(config: TrainConfig, model, schedule):
    """AdamW with clipping; weight decay only on matrices (not norm scales)."""
    import jax
    import optax

    def decay_mask(params):
        is_axes = lambda x: x is None or isinstance(x, tuple)  # None: a user's model left it unannotated
        flags = jax.tree.map(lambda axes: axes is not None and sum(a != "layers" for a in axes) >= 2,
                             model.logical_axes, is_leaf=is_axes)
        return jax.tree.map(lambda flag, _: flag, flags, params)

    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip) if config.grad_clip > 0 else optax.identity(),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay, mask=decay_mask),
    )


def build_program(config: TrainConfig, model, layout, schedule, block_recompute: str = "weights"):
    """The train program of ``config``'s options; a refused combination names its flag."""
    from shardlib.step.program import build
    from shardlib.step.options import OPTIONS, OptionError
    from shardlib.step.stage_balance import parse_stage_layers

    from shardlib.backend import check_options, parse_options

    if config.bucket_mb < 0:
        raise TrainConfigError("bucket_mb", f"--bucket-mb must be >= 0 (0: one collective per tensor), got {config.bucket_mb}")
    try:
        compiler_options = parse_options(config.xla_options) or None
        check_options(compiler_options or {})  # before the step's compile, which would name it only after
    except ValueError as err:
        raise TrainConfigError("xla_options", str(err)) from None
    try:
        return build(model, optimizer(config, model, schedule), layout, lr_schedule=schedule,
                     precision=_precision(config), grad_accum=config.grad_accum,
                     grad_compression=config.grad_compression, microbatches=config.microbatches,
                     schedule=config.pipeline_schedule, bucket_bytes=int(config.bucket_mb * 2**20),
                     offload=config.offload, weight_gather=config.weight_gather, staleness=config.staleness,
                     stage_layers=parse_stage_layers(config.stage_layers), compiler_options=compiler_options,
                     block_recompute=block_recompute)
    except OptionError as err:  # a refused combination: the flag of the option its row names
        raise TrainConfigError(OPTIONS[err.option].flag or "strategy", str(err)) from None
    except ValueError as err:
        field = ("offload" if "(--offload)" in str(err) else
                 "staleness" if "staleness" in str(err) else
                 "weight_gather" if "weight_gather=" in str(err) else
                 "stage_layers" if "stage_layers" in str(err) or "--stage-layers" in str(err) else
                 "pipeline_stages" if layout.pipeline_stages > 1 else
                 "grad_compression" if config.grad_compression != "none" else "grad_accum")
        raise TrainConfigError(field, str(err)) from None


def _precision(config: TrainConfig):
    """``--precision`` with ``--reduce-dtype``: the dtype its gradients are reduced in."""
    from shardlib.step.precision import get_precision

    return dataclasses.replace(get_precision(config.precision), reduce_dtype=config.reduce_dtype)


def _loaders(config: TrainConfig, layout, train_bytes, val_bytes):
    """This process's rows of each training batch, and its validation windows, checked against the mesh."""
    import jax

    from shardlib.run.packing import loaders
    from shardlib.runtime.data import ByteBatches, val_batches

    geometry = dict(data_parallel_size=layout.batch_size_multiple,
                    process_index=jax.process_index(), process_count=jax.process_count())
    if isinstance(train_bytes, tuple):  # instruction rows (tokens, mask)
        if config.record_examples:
            raise TrainConfigError("record_examples", "records window offsets of a text corpus; instruction examples "
                                                      "are whole rows: drop --record-examples")
        try:
            return loaders(config, train_bytes, val_bytes, geometry)
        except ValueError as err:
            raise TrainConfigError("batch_size", str(err)) from None
    try:
        loader = ByteBatches(train_bytes, config.batch_size, config.seq_len, seed=config.seed, **geometry)
        val_local = val_batches(val_bytes, config.batch_size, config.seq_len, None, **geometry)
        if len(val_local) > config.eval_batches:  # fewer windows, still spread over the whole split
            val_local = val_batches(val_bytes, config.batch_size, config.seq_len, config.eval_batches, **geometry)
    except ValueError as err:
        field = "batch_size" if "batch size" in str(err) else "seq_len" if "seq_len" in str(err) else "data"
        raise TrainConfigError(field, str(err)) from None
    return loader, val_local


def _grain_loader(config: TrainConfig, layout, data):
    """A Grain pipeline (or a `GrainBatches`) as the loop's loader, its state saved with each checkpoint."""
    import jax

    from shardlib.run.grain_source import GrainLoader
    from shardlib.runtime.grain_data import GrainBatches

    if config.record_examples:
        raise TrainConfigError("record_examples", "records window offsets of the built-in loader; a Grain pipeline has "
                                                  "none: drop --record-examples and log an id field in the pipeline")
    try:
        batches = data if isinstance(data, GrainBatches) else GrainBatches(
            data, config.batch_size, data_parallel_size=layout.batch_size_multiple,
            process_index=jax.process_index(), process_count=jax.process_count())
    except ValueError as err:
        raise TrainConfigError("batch_size", str(err)) from None
    if batches.global_batch_size != config.batch_size:
        raise TrainConfigError("batch_size", f"is {config.batch_size}, but the GrainBatches given make batches of "
                                             f"{batches.global_batch_size}; make them agree")
    return GrainLoader(batches, seed=config.seed)


def with_model_defaults(config: TrainConfig) -> TrainConfig:
    """``seq_len=None``: DEFAULT_SEQ_LEN, or the model's ``max_seq_len`` when that is shorter
    (``tiny`` is 64), so a bare ``--model`` runs without ``--seq-len``."""
    if config.seq_len is not None:
        return config
    from shardlib.models import CONFIGS

    known = CONFIGS.get(config.model)
    longest = known.max_seq_len if known is not None else DEFAULT_SEQ_LEN
    return dataclasses.replace(config, seq_len=min(DEFAULT_SEQ_LEN, longest))


def check_out_path(config: TrainConfig) -> None:
    """``--out`` below or at an existing file cannot become a run directory: one line, before JAX starts."""
    if config.out is None:
        return
    out_dir = Path(config.out).expanduser()
    if _blocking_file(out_dir) is not None:
        raise _unusable(config, out_dir, FileExistsError(errno.EEXIST, "a file is in the way", str(out_dir)))


def run_directory(config: TrainConfig) -> Path:
    """Where the run writes: ``--out``; a resumed run without ``--out`` keeps writing into the run it resumes."""
    if config.resume_from is not None and config.out is None:
        return checkpoint_dir(config.resume_from).parent
    return _out_dir(config)


# --------------------------------------------------------------------------------------------
# One run per directory, and a directory that can be written, before anything compiles
# --------------------------------------------------------------------------------------------

LOCK_NAME = ".lock"


def _out_field(config: TrainConfig) -> str:
    return "resume_from" if config.out is None and config.resume_from is not None else "out"


def _blocking_file(path: Path) -> Path | None:
    """The first part of ``path`` that exists but is not a directory (so nothing can be created below it)."""
    for part in reversed([path, *path.parents]):
        if part.exists() and not part.is_dir():
            return part
    return None


def _unusable(config: TrainConfig, out_dir: Path, err: OSError) -> TrainConfigError:
    blocker = _blocking_file(out_dir)
    if blocker is not None:
        why = f"{blocker} is a file, not a directory"
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "it is not writable (" + ("read-only file system" if err.errno == errno.EROFS else "permission denied") + ")"
    else:
        why = err.strerror or str(err)
    hint = "pick another --out" if config.out is not None or config.resume_from is None else "pass --out DIR"
    return TrainConfigError(_out_field(config), f"cannot write the run directory {out_dir}: {why}; {hint}")


def _holder(text: str) -> dict:
    try:
        found = json.loads(text)
        return found if isinstance(found, dict) else {}
    except ValueError:
        return {}


def _describe_holder(holder: dict) -> str:
    started = holder.get("started")
    since = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if isinstance(started, (int, float)) else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}"


def _resumed_run(config: TrainConfig, out_dir: Path) -> Path | None:
    """The run directory of ``--resume-from`` when it is not ``out_dir``: its checkpoints are
    where this run saves, sets aside and deletes (`saves_to`), so it needs the same lock."""
    if config.resume_from is None:
        return None
    resumed = checkpoint_dir(config.resume_from).parent
    return None if resumed.resolve() == out_dir.expanduser().resolve() else resumed


def _open_lock(lock: Path) -> int:
    """``lock`` opened for reading and writing, never through a symbolic link (a planted
    ``.lock -> file`` would otherwise be truncated) and only if it is a regular file."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(errno.EISDIR, "not a regular file", str(lock))
    return fd


def _lock_refused(field: str, lock: Path, err: OSError) -> TrainConfigError | None:
    """The error for a ``.lock`` that is a symbolic link or no regular file; None for other errors."""
    if err.errno == errno.ELOOP:
        what = f"a symbolic link (to {os.readlink(lock)})"
    elif err.errno == errno.EISDIR:
        what = "not a regular file"
    else:
        return None
    return TrainConfigError(field, f"{lock} is {what}; shardlib writes its lock only into a regular file in the run "
                                   "directory, never through a link: remove it and run again")


@contextlib.contextmanager
def claim_run_directory(config: TrainConfig, out_dir: Path, *, main: bool) -> Iterator[None]:
    """Create ``out_dir`` and, on process 0, hold ``OUT/.lock`` for the whole run; and the lock of
    the ``--resume-from`` run directory when that is another one, since the run saves there.

    Two runs writing one directory interleave ``metrics.jsonl`` and delete each other's
    checkpoints, so a second run stops at once, naming the holder's host and PID (a
    `TrainConfigError`: one line, exit 2). ``flock`` is released by the kernel when its
    process dies, so a lock file that still names a holder but is not locked was left by a
    dead run: it is taken over with a note. A directory that cannot be created or written is
    reported here too, before anything compiles. Other processes only create the directory
    when they write into it (``--record-examples``). A resumed directory is never created.
    """
    resumed = _resumed_run(config, out_dir)
    with contextlib.ExitStack() as held:
        held.enter_context(_claim(config, _out_field(config), out_dir, main=main))
        if resumed is not None and main and resumed.is_dir():
            held.enter_context(_claim(config, "resume_from", resumed, main=True))
        yield


@contextlib.contextmanager
def _claim(config: TrainConfig, field: str, out_dir: Path, *, main: bool) -> Iterator[None]:
    """`claim_run_directory` of one directory; ``field`` is the flag that named it."""
    if not main and not config.record_examples:
        yield
        return
    lock = out_dir / LOCK_NAME
    try:
        make_dir(out_dir, "a run")
        if not main and not os.access(out_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "permission denied", str(out_dir))
        fd = _open_lock(lock) if main else None
    except OSError as err:
        raise (_lock_refused(field, lock, err) or _unusable(config, out_dir, err)) from None
    if fd is None:  # another process: checked, nothing to hold
        yield
        return
    ours = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            raise TrainConfigError(
                field,
                f"{out_dir} is in use by another run ({_describe_holder(holder)}): two runs in one directory mix their "
                "metrics and delete each other's checkpoints; wait for that run to finish, stop it, or pick another "
                + ("--out" if field == "out" else "--resume-from (a run that has stopped)"),
            ) from None
        except OSError as err:  # a file system without locks (some network mounts): run unguarded, say so
            print(f"shardlib: note: cannot lock {lock} ({err.strerror}); nothing stops a second run from writing "
                  f"{out_dir} at the same time", file=sys.stderr, flush=True)
        ours = True
        left = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        if left:
            print(f"shardlib: note: took over {lock}, left by a run that is no longer running "
                  f"({_describe_holder(left)})", file=sys.stderr, flush=True)
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": round(time.time(), 3)})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (me + "\n").encode(), 0)
        except OSError as err:
            raise _unusable(config, out_dir, err) from None
        yield
    finally:
        if ours:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # an empty lock file: released cleanly (a named holder means it died)
        os.close(fd)  # releases the flock


def _out_dir(config: TrainConfig) -> Path:
    """``--out`` or ``runs/<timestamp>``; every process agrees on the name (process 0's clock)."""
    if config.out:
        return Path(config.out).expanduser()
    import jax
    import numpy as np

    stamp = int(time.time())
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        stamp = int(multihost_utils.broadcast_one_to_all(np.int64(stamp)))
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.localtime(stamp))


def _load_data(config: TrainConfig, vocab_size: int, tokenizer=None):
    """(train, validation) arrays: the bytes of text, or the ids of a token file (each below
    ``vocab_size``); with a tokenizer, text's ids (cached) or instruction rows, each a (tokens, mask)."""
    from shardlib.runtime.data import load_text, split_train_val
    from shardlib.runtime.tokens import check_vocab, is_token_file, load_tokens

    if tokenizer is not None:
        return _tokenized_data(config, tokenizer)
    if Path(config.data or "").suffix.lower() == ".jsonl":
        raise TrainConfigError("data", "a .jsonl file is read as instruction examples, which need a tokenizer: add "
                                       "--tokenizer (the model's tokenizer.json or its directory)")

    if config.token_dtype != TrainConfig.token_dtype and Path(config.data or "").suffix.lower() != ".bin":
        raise TrainConfigError("token_dtype", "sets the element type of a raw .bin token file (a .npy file carries "
                                              "its own, text is bytes); drop it or pass a .bin file")
    try:
        if not is_token_file(config.data):
            return split_train_val(load_text(config.data))
        tokens = load_tokens(config.data, config.token_dtype)
        check_vocab(tokens, vocab_size, config.data)
        return split_train_val(tokens)
    except (ValueError, OSError) as err:
        field = "vocab_size" if "--vocab-size" in str(err) else "data"
        raise TrainConfigError(field, str(err)) from None


def _tokenized_data(config: TrainConfig, tokenizer):
    """--data through --tokenizer: instruction rows from a .jsonl, else text as cached token ids."""
    from shardlib.hf.tokenizer import TokenizerError, instruction_rows, tokenize_text
    from shardlib.runtime.data import split_train_val
    from shardlib.runtime.rows import split_rows

    if config.data is None:
        raise TrainConfigError("tokenizer", "tokenizes --data, and none was given: pass --data TEXT_OR_JSONL")
    try:
        if Path(config.data).suffix.lower() == ".jsonl":
            rows = instruction_rows(tokenizer, config.data, config.seq_len)
            if rows.truncated:
                print(f"shardlib: note: {rows.truncated} of {len(rows.tokens)} examples are longer than --seq-len "
                      f"{config.seq_len} + 1 tokens and were cut", file=sys.stderr, flush=True)
            return split_rows(rows.tokens, rows.mask, rows.lengths)
        tokens, cache, cached = tokenize_text(tokenizer, config.data)
        if jax_main():
            print(f"tokens     {len(tokens):,} ids {'read from' if cached else 'cached in'} {cache}", flush=True)
        return split_train_val(tokens)
    except (TokenizerError, ValueError, OSError) as err:
        raise TrainConfigError("data", str(err)) from None


def jax_main() -> bool:
    import jax

    return jax.process_index() == 0


def _per_device_bytes(abstract: Mapping[str, Any]) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in abstract.values())
