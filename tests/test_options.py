"""build's options table (`shardlib.step.options`): every keyword has an entry, and every refused
combination is exercised through `build`, from an example per row, so a new option or row without
one fails here. Each example must raise that row's `OptionError` (no tracing: build refuses before
it), and the same build without the refused option must succeed."""

from __future__ import annotations

import dataclasses
import inspect
import re

import jax
import jax.numpy as jnp
import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.models import get_config, trainable
from shardlib.run.config import TrainConfig
from shardlib.step.options import OPTIONS, REFUSALS, Communication, OptionError
from shardlib.step.precision import Precision, get_precision
from tests.helpers import batches, optimizer

FOUR_LAYERS = dataclasses.replace(get_config("tiny"), n_layers=4)  # splits into 2 pipeline stages
BF16_REDUCE = Precision("bf16", compute_dtype=jnp.bfloat16, reduce_dtype="bf16")
PIPE = {"data": 2, "pipe": 2}

# row id -> (strategy, mesh, build keywords); the row's own option is dropped for the build that must pass
EXAMPLES = {
    "communication / the keywords {c.loose}":
        ("dp", {"data": 8}, {"communication": Communication(grad_compression="bf16"), "grad_compression": "int8"}),
    "communication / precision {c.precision.name!r} (reduce_dtype={c.precision.reduce_dtype.name})":
        ("dp", {"data": 8}, {"communication": Communication(reduce_dtype="f32"), "precision": BF16_REDUCE}),
    "grad_compression / reduce_dtype={c.reduce_dtype.name}":
        ("zero1", {"data": 8}, {"grad_compression": "bf16", "precision": BF16_REDUCE}),
    "grad_compression / a pipeline (pipe={c.pipe})": ("dp", PIPE, {"grad_compression": "int8"}),
    "grad_compression / {c.strategy} in a pipeline (pipe={c.pipe})":
        ("zero3", {"fsdp": 2, "pipe": 2}, {"grad_compression": "bf16"}),
    "grad_compression / {c.strategy} with tensor={c.tensor}":
        ("fsdp_tp", {"fsdp": 4, "tensor": 2}, {"grad_compression": "bf16"}),
    "grad_compression / {c.strategy} and grad_accum={c.grad_accum}":
        ("zero3", {"fsdp": 8}, {"grad_compression": "int8", "grad_accum": 2}),
    "grad_compression / strategy {c.strategy!r} (hpZ)":
        ("zero3_hpz", {"data": 2, "fsdp": 4}, {"grad_compression": "int8"}),
    "weight_gather / strategy {c.strategy!r}": ("dp", {"data": 8}, {"weight_gather": "int8"}),
    "weight_gather / a pipeline (pipe={c.pipe})": ("zero3", {"fsdp": 2, "pipe": 2}, {"weight_gather": "int8"}),
    "weight_gather / tensor={c.tensor}": ("fsdp_tp", {"fsdp": 4, "tensor": 2}, {"weight_gather": "int8"}),
    "grad_accum / a pipeline (pipe={c.pipe})": ("dp", PIPE, {"grad_accum": 2}),
    "microbatches / an unpipelined mesh (pipe=1)": ("dp", {"data": 8}, {"microbatches": 4}),
    "stage_layers / an unpipelined mesh (pipe=1)": ("dp", {"data": 8}, {"stage_layers": (3, 1)}),
    "staleness / precision={c.precision.name!r}": ("dp", {"data": 8}, {"staleness": 1, "precision": "fp16"}),
    "staleness / strategy {c.strategy!r} on mesh {c.mesh}": ("tp", {"tensor": 4}, {"staleness": 1}),
    "staleness / strategy {c.strategy!r}": ("zero3", {"fsdp": 8}, {"staleness": 1}),
    "staleness / a pipeline (pipe={c.pipe})": ("dp", PIPE, {"staleness": 1}),
    "staleness / grad_accum={c.grad_accum} under {c.strategy!r}": ("zero2", {"data": 8}, {"staleness": 1, "grad_accum": 2}),
    "layerwise / this model": ("zero1", {"data": 8}, {"layerwise": True, "gathers_params": False}),
    "layerwise / grad_compression={c.grad_compression.name!r}":
        ("zero1", {"data": 8}, {"layerwise": True, "grad_compression": "int8"}),
    "layerwise / a pipeline (pipe={c.pipe})": ("dp", PIPE, {"layerwise": True}),
    "layerwise / staleness={c.staleness}": ("dp", {"data": 8}, {"layerwise": True, "staleness": 1}),
    "layerwise / grad_accum={c.grad_accum} under {c.strategy}":
        ("zero1", {"data": 8}, {"layerwise": True, "grad_accum": 2}),
    "layerwise / strategy {c.strategy!r}": ("zero3", {"data": 8}, {"layerwise": True}),
}


@pytest.fixture(scope="module")
def model():
    return trainable(FOUR_LAYERS)


def _build(model, strategy, sizes, kwargs):
    if "gathers_params" in kwargs:  # a model property, not a keyword
        model = dataclasses.replace(model, gathers_params=kwargs.pop("gathers_params"))
    n = 1
    for size in sizes.values():
        n *= size
    layout = make_layout(model, strategy, make_mesh(sizes, devices=jax.devices()[:n]))
    return build(model, optimizer(), layout, **kwargs)


def _words(template: str) -> str:
    """The fixed text of a row's reason or fix before its first field."""
    return template.split("{")[0]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("row", REFUSALS, ids=[row.id for row in REFUSALS])
def test_every_refusal_is_raised_by_build_with_its_reason_and_fix(model, row):
    assert row.id in EXAMPLES, f"add an example of {row.id!r} to EXAMPLES"
    strategy, sizes, kwargs = EXAMPLES[row.id]
    with pytest.raises(OptionError) as caught:
        _build(model, strategy, sizes, dict(kwargs))
    err = caught.value
    assert err.refusal is row and err.option == row.option, str(err)
    message = str(err)
    assert message.startswith(f"{row.option}=") and " cannot run with " in message, message
    assert _words(row.reason) in message and _words(row.fix) in message, message
    _build(model, strategy, sizes, {k: v for k, v in kwargs.items() if k != row.option})  # without it: builds


def test_every_example_is_a_row():
    assert set(EXAMPLES) == {row.id for row in REFUSALS}
    assert len({row.id for row in REFUSALS}) == len(REFUSALS)  # ids name one row each


def test_every_build_keyword_is_in_the_table():
    keywords = {name for name, p in inspect.signature(build).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == set(OPTIONS)
    for row in REFUSALS:  # a row refuses an option that can be taken
        assert OPTIONS[row.option].taken is not None, row.id
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {option.flag for option in OPTIONS.values() if option.flag} <= fields  # the CLI names real flags


def test_communication_defaults_are_builds():
    defaults = {name: p.default for name, p in inspect.signature(build).parameters.items()}
    for field in dataclasses.fields(Communication):
        if field.name in defaults:
            assert getattr(Communication(), field.name) == defaults[field.name], field.name


def test_one_communication_value_builds_the_step_its_keywords_build(model):
    """weight_gather, bucket_bytes and a bf16 reduce_dtype as one value lower to the same step as
    the keywords (and the precision's reduce_dtype) give, not the default step."""
    layout = make_layout(model, "zero3", make_mesh({"fsdp": 8}))
    rows = batches(1)[0]

    def lowered(**kwargs):
        program = build(model, optimizer(), layout, **kwargs)
        batch = program.abstract_batch({k: (v.shape, v.dtype) for k, v in rows.items()})
        return program.step.lower(program.abstract_state(), batch).as_text()

    grouped = lowered(communication=Communication(weight_gather="int8", bucket_bytes=2**16, reduce_dtype="bf16"))
    loose = lowered(weight_gather="int8", bucket_bytes=2**16,
                    precision=dataclasses.replace(get_precision("f32"), reduce_dtype=jnp.bfloat16))
    assert grouped == loose
    assert re.search(r"stablehlo.all_gather.*xi8>", grouped)  # qwZ's int8 codes are gathered
    assert re.search(r'"stablehlo.reduce_scatter".*\n\s*\^bb0\(%\w+: tensor<bf16>', grouped)  # summed in bf16


def test_layerwise_none_applies_exactly_where_no_row_refuses_it(model):
    """``layerwise=None`` reads the same rows ``layerwise=True`` is refused by: zero1 lowers the
    layerwise step; with grad_accum=2 (a row holds) the step of layerwise=False."""
    layout = make_layout(model, "zero1", make_mesh({"data": 8}))
    rows = batches(1)[0]

    def lowered(**kwargs):
        program = build(model, optimizer(), layout, **kwargs)
        batch = program.abstract_batch({k: (v.shape, v.dtype) for k, v in rows.items()})
        return program.step.lower(program.abstract_state(), batch).as_text()

    applies = lowered(layerwise=None)
    assert applies == lowered(layerwise=True) and applies != lowered(layerwise=False)
    assert lowered(layerwise=None, grad_accum=2) == lowered(layerwise=False, grad_accum=2)
