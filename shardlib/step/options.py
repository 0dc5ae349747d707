"""`build`'s options and which of them combine: one table, checked once, before anything is traced.

`OPTIONS` names every keyword `build` takes, with its group and the ``shardlib train`` flag that
sets it. `REFUSALS` is every combination `build` refuses: an option (when it is taken: staleness
above 0, int8 compression, ``layerwise=True``, ...) against a strategy, a precision, a pipeline,
the model, or another option, each with why and what to do instead. `check` raises the first row
that holds as an `OptionError` naming the option, so the CLI names its flag. `conflicts` gives
the rows that hold whether or not the option was asked for: ``layerwise=None`` applies where none
does.

The communication options group into one value, `Communication`; `build` takes it
(``communication=``) or its four keywords, not both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from shardlib.model import Model
from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout, spec_axes
from shardlib.sharding.mesh import describe
from shardlib.step import compression as compression_lib
from shardlib.step import layerwise as layerwise_lib
from shardlib.step import precision as precision_lib
from shardlib.step import zeropp
from shardlib.step.reduce import DEFAULT_BUCKET_BYTES, Reducer

__all__ = ["Chosen", "Communication", "OPTIONS", "Option", "OptionError", "REFUSALS", "Refusal", "check", "conflicts",
           "merged"]


@dataclasses.dataclass(frozen=True)
class Communication:
    """How the step's collectives send: the gradient reductions (compressed, bucketed, in which
    dtype) and ZeRO-3's weight gathers. ``build(..., communication=Communication(...))`` takes it
    in place of the keywords of the same names; ``reduce_dtype`` None: the precision's."""

    grad_compression: str | compression_lib.Compression = "none"
    weight_gather: str | zeropp.WeightGather = "none"
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    gather_bucket_bytes: int | None = 0
    reduce_dtype: Any = None

    def __post_init__(self) -> None:
        if self.reduce_dtype is not None:
            object.__setattr__(self, "reduce_dtype", precision_lib.parse_reduce_dtype(self.reduce_dtype))


_LOOSE = ("grad_compression", "weight_gather", "bucket_bytes", "gather_bucket_bytes")  # build's own keywords


def merged(communication: Communication | None, **keywords: Any) -> tuple[Communication, str]:
    """(the communication options, those of ``keywords`` set beside ``communication``: `check` refuses them)."""
    if communication is None:
        return Communication(**keywords), ""
    if not isinstance(communication, Communication):
        raise TypeError(f"communication takes a shardlib.step.options.Communication, got {type(communication).__name__}")
    default = Communication()
    loose = ", ".join(f"{name}={value!r}" for name, value in keywords.items() if value != getattr(default, name))
    return communication, loose


@dataclasses.dataclass(frozen=True)
class Chosen:
    """`build`'s options, parsed, beside what they meet: the model, the layout and its reducer."""

    model: Model
    layout: Layout
    reducer: Reducer
    precision: precision_lib.Precision
    communication: Communication
    grad_accum: int = 1
    microbatches: int | None = None
    staleness: int = 0
    stage_layers: Any = None
    layerwise: bool | None = None
    loose: str = ""  # communication keywords given beside communication= (not at their defaults)

    @property
    def grad_compression(self) -> compression_lib.Compression:
        return compression_lib.get_compression(self.communication.grad_compression)

    @property
    def weight_gather(self) -> zeropp.WeightGather:
        return zeropp.get_weight_gather(self.communication.weight_gather)

    @property
    def reduce_dtype(self) -> Any:
        given = self.communication.reduce_dtype
        return self.precision.reduce_dtype if given is None else given

    @property
    def strategy(self) -> str:
        return self.layout.strategy.name

    @property
    def mesh(self) -> str:
        return describe(self.layout.mesh)

    @property
    def pipe(self) -> int:
        return self.layout.pipeline_stages

    @property
    def tensor(self) -> int:
        return self.layout.mesh.shape.get("tensor", 1)

    def stored_over(self, axes: tuple[str, ...]) -> list[str]:
        """Parameters whose storage is split over one of ``axes``."""
        leaves = jax.tree.leaves(self.layout.params, is_leaf=rules_lib.is_layout)
        return [leaf.path for leaf in leaves if spec_axes(leaf.spec) & set(axes)]

    @property
    def gathers(self) -> bool:
        """Some parameter is stored over a batch axis: the step all-gathers it (ZeRO-3)."""
        return bool(self.stored_over(self.layout.batch_axes))

    @property
    def qgz(self) -> bool:
        """The gradient compression runs in ZeRO-3's gather backward (ZeRO++'s qgZ)."""
        return self.reducer.compresses_gathers

    @property
    def int8(self) -> bool:
        return self.grad_compression.needs_residual


def _shown(value: Any) -> str:
    if isinstance(value, Communication):
        return "Communication(...)"
    return repr(getattr(value, "name", value))


@dataclasses.dataclass(frozen=True)
class Option:
    """One keyword of `build`: its group, its ``shardlib train`` flag (the `TrainConfig` field;
    None: library only), and when it counts as taken (None: it combines with everything)."""

    group: str
    flag: str | None = None
    taken: Callable[[Chosen], bool] | None = None


OPTIONS: dict[str, Option] = {
    "lr_schedule": Option("optimizer"),
    "precision": Option("precision", "precision"),
    "grad_accum": Option("accumulation", "grad_accum", lambda c: c.grad_accum > 1),
    "communication": Option("communication", None, lambda c: bool(c.loose) or c.communication.reduce_dtype is not None),
    "grad_compression": Option("communication", "grad_compression", lambda c: c.grad_compression.name != "none"),
    "weight_gather": Option("communication", "weight_gather", lambda c: c.weight_gather.block_size is not None),
    "bucket_bytes": Option("communication", "bucket_mb"),
    "gather_bucket_bytes": Option("communication"),
    "microbatches": Option("pipeline", "microbatches", lambda c: c.microbatches not in (None, c.grad_accum)),
    "schedule": Option("pipeline", "pipeline_schedule"),
    "stage_layers": Option("pipeline", "stage_layers", lambda c: c.stage_layers is not None),
    "donate": Option("memory"),
    "offload": Option("memory", "offload"),
    "block_recompute": Option("memory"),  # `shardlib train` picks it: "weights" where it fits, else "block"
    "staleness": Option("overlap", "staleness", lambda c: c.staleness > 0),
    "layerwise": Option("overlap", None, lambda c: c.layerwise is True),
    "axis_name": Option("model"),
    "compiler_options": Option("compiler", "xla_options"),
}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """``option`` (when taken) cannot run with ``against`` while ``when`` holds. ``against``,
    ``reason`` and ``fix`` are format strings over the `Chosen` as ``c``."""

    option: str
    against: str
    when: Callable[[Chosen], bool]
    reason: str
    fix: str

    @property
    def id(self) -> str:
        return f"{self.option} / {self.against}"

    def message(self, c: Chosen) -> str:
        said = f"{self.option}={_shown(getattr(c, self.option, None))}"
        text = lambda s: s.format(c=c)
        return f"{said} cannot run with {text(self.against)}: {text(self.reason)}; {text(self.fix)}"


_F32 = np.dtype(np.float32)

REFUSALS: tuple[Refusal, ...] = (
    # -- the communication value and its keywords
    Refusal("communication", "the keywords {c.loose}", lambda c: bool(c.loose),
            "both say how the step communicates",
            "set them in Communication(...), or drop communication= and pass the keywords"),
    Refusal("communication", "precision {c.precision.name!r} (reduce_dtype={c.precision.reduce_dtype.name})",
            lambda c: c.communication.reduce_dtype is not None
            and c.precision.reduce_dtype not in (_F32, c.communication.reduce_dtype),
            "both name the dtype gradients are reduced in",
            "set reduce_dtype in one of them"),
    # -- gradient compression
    Refusal("grad_compression", "reduce_dtype={c.reduce_dtype.name}",
            lambda c: c.reduce_dtype != _F32,
            "it sends {c.grad_compression.comm_dtype} and sums in float32, where reduce_dtype asks for sums in "
            "{c.reduce_dtype.name}: pick one",
            "for half the bytes with float32 sums keep reduce_dtype float32 (the default) with "
            "grad_compression='bf16'; to reduce in bf16 itself use reduce_dtype=bf16 with grad_compression='none'"),
    Refusal("grad_compression", "a pipeline (pipe={c.pipe})", lambda c: c.pipe > 1 and c.int8,
            "it keeps per-device error-feedback residuals, which the pipelined step does not carry",
            "use grad_compression='bf16' or 'none', or pipe=1"),
    Refusal("grad_compression", "{c.strategy} in a pipeline (pipe={c.pipe})", lambda c: c.pipe > 1 and c.qgz,
            "{c.strategy}'s gradient reduce-scatter is its weight gather's backward, and ZeRO++'s compressed "
            "gather backward (qgZ) runs in unpipelined steps only",
            "use pipe=1, precision='bf16', or a strategy that keeps parameters unsharded (dp, zero1, zero2)"),
    Refusal("grad_compression", "{c.strategy} with tensor={c.tensor}", lambda c: c.tensor > 1 and c.qgz,
            "ZeRO++'s compressed gather backward (qgZ) runs without tensor parallelism (tensor=1) only",
            "use zero3 or hsdp on a mesh with tensor=1, or grad_compression='none'"),
    Refusal("grad_compression", "{c.strategy} and grad_accum={c.grad_accum}",
            lambda c: c.qgz and c.int8 and c.grad_accum > 1,
            "it keeps its error-feedback residual in the gather's backward, once per step",
            "use grad_accum=1, or grad_compression='bf16'"),
    Refusal("grad_compression", "strategy {c.strategy!r} (hpZ)",
            lambda c: c.layout.strategy.secondary_axis is not None and c.qgz and c.int8,
            "zero3_hpz does not carry qgZ's error-feedback residuals through its secondary gather",
            "use grad_compression='bf16' or 'none', or zero3"),
    # -- ZeRO++'s int8 weight gather (qwZ)
    Refusal("weight_gather", "strategy {c.strategy!r}", lambda c: not c.gathers,
            "it quantises ZeRO-3's parameter all-gather, and {c.strategy} gathers no parameter over the batch axes",
            "use zero3, fsdp_tp or hsdp, or weight_gather='none'"),
    Refusal("weight_gather", "a pipeline (pipe={c.pipe})", lambda c: c.pipe > 1,
            "ZeRO++'s quantised gather runs without pipelining (pipe=1) only",
            "use pipe=1, or weight_gather='none'"),
    Refusal("weight_gather", "tensor={c.tensor}", lambda c: c.tensor > 1,
            # the gather runs in a nested shard_map over `tensor` (hooks.gather_shards), where the
            # quantised one does not lower yet (jaxlib 0.10.2: Shardy's manual-axis order check)
            "ZeRO++'s quantised gather runs without tensor parallelism (tensor=1) only",
            "use zero3 or hsdp on a mesh with tensor=1, or weight_gather='none'"),
    # -- accumulation and the pipeline
    Refusal("grad_accum", "a pipeline (pipe={c.pipe})", lambda c: c.pipe > 1,
            "a pipelined step accumulates over its microbatches",
            "pass microbatches=K, not grad_accum=K"),
    Refusal("microbatches", "an unpipelined mesh (pipe=1)", lambda c: c.pipe == 1,
            "microbatches applies to a pipelined mesh (pipe > 1)",
            "without one, pass grad_accum={c.microbatches}"),
    Refusal("stage_layers", "an unpipelined mesh (pipe=1)", lambda c: c.pipe == 1,
            "stage_layers splits the layers of a pipeline",
            "use a mesh with pipe > 1 (--pipeline-stages S), or drop stage_layers"),
    # -- staleness: only reductions the step writes can move
    Refusal("staleness", "precision={c.precision.name!r}", lambda c: c.precision.dynamic_loss_scale,
            "fp16's dynamic loss scale changes between a gradient's computation and its application",
            "use precision='bf16' or 'f32'"),
    Refusal("staleness", "strategy {c.strategy!r} on mesh {c.mesh}", lambda c: not c.reducer.axes,
            "no batch axis has more than one device, so there is no gradient reduction to overlap",
            "use staleness=0"),
    Refusal("staleness", "strategy {c.strategy!r}", lambda c: bool(c.stored_over(c.reducer.axes)),
            "it stores parameters over the batch axes {c.reducer.axes}, so their gradient reduce-scatter is "
            "autodiff's, inside the backward pass, and cannot be deferred",
            "use 'dp', 'zero1', 'zero2' or 'tp'"),
    Refusal("staleness", "a pipeline (pipe={c.pipe})", lambda c: c.pipe > 1,
            "its schedule reduces inside the stages",
            "use pipeline_stages=1"),
    Refusal("staleness", "grad_accum={c.grad_accum} under {c.strategy!r}",
            lambda c: c.grad_accum > 1 and c.layout.strategy.shard_grad_buffer,
            "it reduce-scatters every microbatch inside the step",
            "use grad_accum=1 or 'zero1'"),
    # -- layerwise reduction: where it is exact (None applies it where no row holds)
    Refusal("layerwise", "this model",
            lambda c: not c.model.gathers_params or (bool(c.model.gathered_blocks) and not c.model.gathers_on_read),
            "the model does not pass its parameters through gather_layer itself (gathers_params=False; its blocks "
            "are gathered per call only where they are stored split)",
            "use layerwise=None (where it applies) or False"),
    Refusal("layerwise", "grad_compression={c.grad_compression.name!r}", lambda c: c.grad_compression.name != "none",
            "grad_compression={c.grad_compression.name!r} compresses the reductions after the backward pass",
            "use layerwise=None (where it applies) or False"),
    Refusal("layerwise", "a pipeline (pipe={c.pipe})", lambda c: c.pipe > 1,
            "a pipelined step reduces after its schedule",
            "use layerwise=None (where it applies) or False"),
    Refusal("layerwise", "staleness={c.staleness}", lambda c: c.staleness > 0,
            "staleness defers the reduction to a later step",
            "use layerwise=None (where it applies) or False"),
    Refusal("layerwise", "grad_accum={c.grad_accum} under {c.strategy}",
            lambda c: c.grad_accum > 1 and not c.layout.strategy.shard_grad_buffer,
            "{c.strategy} adds whole gradients over grad_accum={c.grad_accum} microbatches and reduces them once",
            "use layerwise=None (where it applies) or False"),
    Refusal("layerwise", "strategy {c.strategy!r}", lambda c: not layerwise_lib.has_twins(c.layout, c.reducer),
            "{c.strategy} reduces no gradient of a parameter kept whole over the batch axes (dp, zero1 and zero2 do)",
            "use layerwise=None (where it applies) or False"),
)


class OptionError(ValueError):
    """A combination of `build`'s options it refuses: ``option`` names the keyword, ``refusal`` the row."""

    def __init__(self, refusal: Refusal, chosen: Chosen) -> None:
        self.option, self.refusal = refusal.option, refusal
        super().__init__(refusal.message(chosen))


def conflicts(chosen: Chosen, option: str) -> list[Refusal]:
    """The rows of ``option`` that hold for ``chosen``, whether or not the option was taken."""
    return [row for row in REFUSALS if row.option == option and row.when(chosen)]


def check(chosen: Chosen) -> None:
    """Raise the first row whose option ``chosen`` takes and whose condition holds."""
    for row in REFUSALS:
        if OPTIONS[row.option].taken(chosen) and row.when(chosen):
            raise OptionError(row, chosen)
