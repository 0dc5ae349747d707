"""Everything a run builds before its first step: model, mesh, layout, program, and the step compiled.

`prepare` turns a checked `TrainConfig` into a `Prepared` run; each building block names the
flag behind a setting that does not work (`TrainConfigError`). The data it reads is
`shardlib.run.data_setup`'s, the directory it writes `shardlib.run.directory`'s.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardlib.run.config import DEFAULT_SEQ_LEN, PRECISIONS, TrainConfig, TrainConfigError
from shardlib.run.data_setup import batch_shapes, check_vocab_flag, grain_loader, load_data, loaders, own_vocab, tokenizer_for
from shardlib.run.directory import run_directory
from shardlib.run.fits import check_fits, held_output


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
    tokenizer = tokenizer_for(config, model_config)
    no_bytes = np.zeros(0, np.uint8)
    vocab_size = model_config.vocab_size if model is None else own_vocab(config)
    from shardlib.run import epochs, eval_data, packing

    if data is None:
        train_bytes, val_bytes = eval_data.loaded(config, lambda c: load_data(c, vocab_size, tokenizer, main=jax_main()))
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
    loader, val_local = (loaders(config, layout, train_bytes, val_bytes) if data is None
                         else (grain_loader(config, layout, data), []))
    schedule = lr_schedule(config)
    program = build_program(config, model, layout, schedule)
    abstract_batch = program.abstract_batch(batch_shapes(config, masked))
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


def _compiled_peak(config: TrainConfig, model, layout, schedule, masked: bool = False,
                   block_recompute: str = "weights") -> int:
    """Peak bytes a device of ``config``'s step, compiled (for `check_fits`'s other batch sizes)."""
    from shardlib.tools.memory import memory_stats, peak_bytes

    program = build_program(config, model, layout, schedule, block_recompute)
    return peak_bytes(memory_stats(program.compile_step(program.abstract_state(),
                                                        program.abstract_batch(batch_shapes(config, masked)))))


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
        check_vocab_flag(config)
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


def with_model_defaults(config: TrainConfig) -> TrainConfig:
    """``seq_len=None``: DEFAULT_SEQ_LEN, or the model's ``max_seq_len`` when that is shorter
    (``tiny`` is 64), so a bare ``--model`` runs without ``--seq-len``."""
    if config.seq_len is not None:
        return config
    from shardlib.models import CONFIGS

    known = CONFIGS.get(config.model)
    longest = known.max_seq_len if known is not None else DEFAULT_SEQ_LEN
    return dataclasses.replace(config, seq_len=min(DEFAULT_SEQ_LEN, longest))


def jax_main() -> bool:
    import jax

    return jax.process_index() == 0


def _per_device_bytes(abstract: Mapping[str, Any]) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in abstract.values())
