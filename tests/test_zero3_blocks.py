"""ZeRO-3 one block at a time for models that never call `gather_layer` (`shardlib.model.blocks`).

The adapters find the blocks (the members of each stack of identical sibling submodules) and
gather each one's parameters when its call runs, under remat whose backward gathers the weights
again and keeps the matmuls' outputs. Checked here: which blocks are found; a step equal to plain
jax.jit + optax (NNX and linen, a Python flag through the block's call); dropout streams advancing
as without the per-block gather; and, compiled by the TPU compiler (XLA:CPU does not keep remat's
barriers), the FLOPs of a plain one-chip gradient (what dp runs on each chip) and a peak within 10%
of the state shards, one block's weights and the activations dp keeps, where the whole gather
holds every block's weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import shardlib
from shardlib import build, make_layout, make_mesh
from shardlib.model import blocks as blocks_lib
from tests import zoo
from tests.helpers import tpu_chips


def leaves(*paths_and_sizes):
    return [(tuple(p.split("/")), (n,), n) for p, n in paths_and_sizes]


def test_blocks_are_the_members_of_each_large_stack():
    model = leaves(("embed/w", 100), *((f"blocks/{i}/{k}/w", 50) for i in range(4) for k in "qkv"),
                   *((f"blocks/{i}/mlp/w", 200) for i in range(4)), ("norm_a/s", 4), ("norm_b/s", 4))
    assert blocks_lib.find_blocks(model) == tuple(f"blocks/{i}" for i in range(4))  # not q/k/v, not the norms
    two_stacks = leaves(*((f"enc/{i}/w", 100) for i in range(3)), *((f"dec/{i}/w", 120) for i in range(3)))
    assert blocks_lib.find_blocks(two_stacks) == ("dec/0", "dec/1", "dec/2", "enc/0", "enc/1", "enc/2")
    assert blocks_lib.find_blocks(leaves(("up/w", 300), ("down/w", 200))) == ()  # an MLP: no stack
    assert blocks_lib.resolve(("blocks/1/",), model) == ("blocks/1",)
    with pytest.raises(ValueError, match=r"blocks names 'blok/0', which hold no parameters; submodules that do: "):
        blocks_lib.resolve(("blok/0",), model)
    with pytest.raises(ValueError, match="blocks names 'blocks/0/q' inside 'blocks/0'"):
        blocks_lib.resolve(("blocks/0", "blocks/0/q"), model)
    with pytest.raises(ValueError, match=r"blocks='every': pass 'auto'"):
        blocks_lib.resolve("every", model)


def test_the_adapters_find_the_blocks_and_refuse_blocks_they_cannot_use():
    nnx_model = shardlib.from_nnx(lambda rngs: zoo.NnxTransformer(rngs=rngs, n_layers=3), zoo.nnx_transformer_loss)
    assert nnx_model.gathered_blocks == ("blocks/0", "blocks/1", "blocks/2") and nnx_model.gathers_params
    assert shardlib.from_nnx(lambda rngs: zoo.NnxTransformer(rngs=rngs), zoo.nnx_transformer_loss,
                             blocks=()).gathered_blocks == ()
    linen = shardlib.from_linen(zoo.LinenTransformer(n_layers=3), zoo.linen_transformer_loss, zoo.token_batch(0),
                                inputs=lambda b, train: ((b["tokens"], b["positions"]), {"train": train}))
    assert linen.gathered_blocks == ("LinenBlock_0", "LinenBlock_1", "LinenBlock_2")
    with pytest.raises(ValueError, match=r"gathers its own parameters \(gathers_params=True\) does not use: drop blocks="):
        shardlib.from_nnx(lambda rngs: zoo.NnxTransformer(rngs=rngs), zoo.nnx_transformer_loss,
                          gathers_params=True, blocks=("blocks/0",))


class TwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(64, 64, rngs=rngs), nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x):
        return self.b(self.a(x))

    def first(self, x):
        return self.a(x)


class Peeking(nnx.Module):
    """Calls a block's other method: its weights are read outside the gathered __call__."""

    def __init__(self, rngs):
        self.blocks = nnx.List([TwoLayers(rngs) for _ in range(3)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.blocks[0].first(x)


def test_a_block_used_outside_its_call_fails_with_a_note_naming_the_fix():
    model = shardlib.from_nnx(Peeking, lambda m, b: jnp.mean(m(b["x"]) ** 2))
    assert model.gathered_blocks == ("blocks/0", "blocks/1", "blocks/2")
    program = build(model, optax.sgd(0.1), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    with pytest.raises(TypeError, match="contracting dimensions") as raised:
        program.step(program.init(jax.random.key(0)), {"x": np.ones((16, 64), np.float32)})
    assert any("the blocks of this model ('blocks/0', ...) are gathered when their __call__ runs" in note
               and "blocks=()" in note for note in raised.value.__notes__), raised.value.__notes__


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_zero3_gathering_block_by_block_equals_plain_jit(kind):
    batches = [zoo.token_batch(seed) for seed in range(3)]
    tx = optax.adamw(1e-2)
    if kind == "nnx":
        make = lambda rngs: zoo.NnxTransformer(rngs=rngs, n_layers=3)
        model = shardlib.from_nnx(make, zoo.nnx_transformer_loss)
        params, _, loss = zoo.nnx_functional(make, zoo.nnx_transformer_loss)
        reference = lambda p, b: loss(p, None, b)[0]
    else:  # the block's call takes train=True, a Python flag that must stay one inside the remat
        module = zoo.LinenTransformer(n_layers=3)
        inputs = lambda b, train: ((b["tokens"], b["positions"]), {"train": train})
        model = shardlib.from_linen(module, zoo.linen_transformer_loss, batches[0], inputs=inputs)
        params = None  # the step's own initial values (initialisers round differently on 8 devices)
        reference = lambda p, b: zoo.linen_transformer_loss(module.apply({"params": p}, b["tokens"], b["positions"],
                                                                         train=True), b)
    assert len(model.gathered_blocks) == 3
    program = build(model, tx, make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    state = program.init(jax.random.key(0))
    if params is None:
        params = jax.device_get(state.params)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), params)
    # Losses, not parameters: attention's key bias gets no gradient (softmax ignores a shift along
    # the keys), so AdamW turns rounding noise of ~1e-9 into steps of the learning rate there.
    np.testing.assert_allclose(zoo.program_steps(program, state, batches)[1],
                               zoo.plain_steps(reference, params, tx, batches)[1], rtol=1e-5)


def _per_block_and_whole_losses(make, tx, strategy, mesh, **options):
    """The losses of two steps gathering block by block (blocks="auto") and of the same step
    gathering the whole model (blocks=()), both from one initial state: the blocks change the
    step, not the layout or the init, so the first program's init (compiled once, run twice: the
    step donates its state) starts both."""
    losses, init = [], None
    for blocks in ("auto", ()):
        model = shardlib.from_nnx(make, zoo.nnx_transformer_loss, blocks=blocks)
        program = build(model, tx, make_layout(model, strategy, make_mesh(mesh)), **options)
        init = init or program.init
        losses.append(zoo.program_steps(program, init(jax.random.key(0)), [zoo.token_batch(s) for s in range(2)])[1])
    return losses


@pytest.mark.filterwarnings("ignore::shardlib.step.compute.WholeGatherWarning")  # the blocks=() run gathers the whole model
def test_dropout_draws_as_without_the_per_block_gather():
    """nnx.remat hands the blocks' rng counts back: the masks are those of the whole gather's step."""
    make = lambda rngs: zoo.NnxTransformer(rngs=rngs, n_layers=2, dropout_rate=0.3)
    runs = _per_block_and_whole_losses(make, optax.sgd(0.1), "zero3", {"fsdp": 8})
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-6)
    assert runs[0][0] != runs[0][1]


@pytest.mark.filterwarnings("ignore::shardlib.step.compute.WholeGatherWarning")  # compared with the whole model's gather
@pytest.mark.parametrize("strategy, mesh, options", [("zero3_hpz", {"data": 2, "fsdp": 4}, {}),
                                                     ("zero3", {"fsdp": 8}, {"weight_gather": "int8", "grad_accum": 2})])
def test_the_per_block_gather_composes_with_hpz_quantised_gathers_and_accumulation(strategy, mesh, options):
    """The blocks' gathers are the step's own (hpZ's intra-host specs, ZeRO++'s int8 gather),
    so the losses are those of the same step gathering the whole model."""
    make = lambda rngs: zoo.NnxTransformer(rngs=rngs, n_layers=2)
    losses = _per_block_and_whole_losses(make, optax.adamw(1e-2), strategy, mesh, **options)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


# ---- the peak, compiled by the TPU compiler for a v5e 2x4 slice ----------------------------------

D, FF, HEADS, VOCAB, T, B = 256, 1024, 4, 256, 64, 16


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(D, FF, rngs=rngs), nnx.Linear(FF, D, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class Net(nnx.Module):
    def __init__(self, layers, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
        self.norm, self.head = nnx.LayerNorm(D, rngs=rngs), nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        mask, x = nnx.make_causal_mask(tokens), self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)(
            nn.LayerNorm()(x), mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
        x = x + y
        return x + nn.Dense(D)(nn.gelu(nn.Dense(FF)(nn.LayerNorm()(x))))


class LinenNet(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        for _ in range(self.layers):
            x = LinenBlock()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _model(kind, layers, blocks):
    if kind == "nnx":
        return shardlib.from_nnx(lambda rngs: Net(layers, rngs), lambda m, b: _loss(m(b["inputs"]), b), blocks=blocks)
    example = {k: np.zeros((B, T), np.int32) for k in ("inputs", "targets")}
    return shardlib.from_linen(LinenNet(layers), _loss, example, inputs=lambda b, train: ((b["inputs"],), {}),
                               blocks=blocks)


# Two blocks: the whole gather holds both blocks' weights (6.3 MB) where the bound allows one
# (3.2 MB, more than the bound's 10% slack of ~1 MB), so a step holding two blocks at once fails:
# peak/bound measured 1.015 per block (linen 1.006), 1.26 whole; FLOPs 1.005 x the reference per
# block, 1.22 x rerunning each block. Four blocks measured 1.054 (linen 1.06) and 1.39, the same
# FLOPs ratios, at 1.6 x the TPU compile time (26 against 16 s CPU a step); eight 1.09 and 1.44:
# more blocks add compile time, not a sharper separation.
LAYERS = 2


def _compiled(chips, kind, blocks, recompute="weights"):
    model = _model(kind, LAYERS, blocks)
    program = build(model, optax.adamw(1e-3), make_layout(model, "zero3", make_mesh({"fsdp": 8}, devices=chips)),
                    block_recompute=recompute)
    batch = program.abstract_batch({k: ((B, T), np.int32) for k in ("inputs", "targets")})
    return program.compile_step(program.abstract_state(), batch)


@pytest.fixture(scope="module")
def chips():
    return tpu_chips("v5e:2x4")


@pytest.fixture(scope="module")
def reference(chips):
    """The independent reference: plain jax.jit of the loss's gradient on one chip, nothing
    rematerialised (what dp runs and keeps on each chip), compiled for one chip's rows and for
    twice as many. Returns (the activations: the peak's growth with the rows, as only they grow;
    the FLOPs of one chip's rows, which are dp's less its optimizer update and all-reduce)."""
    from shardlib.tools.memory import memory_stats, peak_bytes

    graphdef, params = nnx.split(nnx.eval_shape(lambda: Net(LAYERS, nnx.Rngs(0))))
    one = jax.sharding.SingleDeviceSharding(chips[0])
    place = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
    grad = jax.jit(jax.grad(lambda p, b: _loss(nnx.merge(graphdef, p)(b["inputs"]), b)))
    compiled = lambda rows: grad.lower(jax.tree.map(lambda x: place(x.shape, x.dtype), params),
                                       {k: place((rows, T), np.int32) for k in ("inputs", "targets")}).compile()
    chip_rows, twice = compiled(B // 8), compiled(2 * B // 8)
    activations = peak_bytes(memory_stats(twice)) - peak_bytes(memory_stats(chip_rows))
    return activations, chip_rows.cost_analysis()["flops"]


@pytest.mark.filterwarnings("ignore::shardlib.step.compute.WholeGatherWarning")  # blocks=(): the whole gather, measured
@pytest.mark.parametrize("kind, blocks", [("nnx", "auto"), ("linen", "auto"), ("nnx", ())])
def test_zero3_per_block_keeps_dps_flops_and_peak_is_the_shards_one_block_and_the_activations(
        chips, reference, kind, blocks):
    """Issue 44's goals, on the TPU compiler: zero3 gathering per block (block_recompute="weights",
    the default) runs at most 1.05 x the FLOPs (`cost_analysis`) of the plain one-chip gradient of
    a chip's rows (dp's less its optimizer update: a stricter reference than dp's whole step), where
    rerunning each block ("block") costs about one more forward pass; its peak is at most 1.1 x
    (state shards + gradient shards + one block's full weights + the activations dp keeps). The
    whole model gathered (blocks=()) holds every block's weights and exceeds that bound. The linen
    network is the NNX one's layers (measured: the same FLOPs to 3 digits), so both compare with
    the NNX reference."""
    from shardlib.tools.memory import memory_stats, peak_bytes

    activations, chip_flops = reference
    size = lambda module: sum(x.size * 4 for x in jax.tree.leaves(nnx.state(nnx.eval_shape(module), nnx.Param)))
    params, block = size(lambda: Net(LAYERS, nnx.Rngs(0))), size(lambda: Block(nnx.Rngs(0)))
    compiled = _compiled(chips, kind, blocks)
    mem = memory_stats(compiled)
    ratio = peak_bytes(mem) / (mem.argument_bytes + params / 8 + block + activations)
    print(f"{kind} blocks={blocks!r}: peak {ratio:.2f}x")
    assert (ratio <= 1.1) == (blocks == "auto"), ratio
    if blocks == "auto":
        flops = lambda c: c.cost_analysis()["flops"]
        assert flops(compiled) <= 1.05 * chip_flops, flops(compiled) / chip_flops
        if kind == "nnx":  # the whole block rerun: the bound above can fail
            assert flops(_compiled(chips, kind, blocks, recompute="block")) > 1.1 * chip_flops


def test_train_keeps_activations_unless_they_do_not_fit_and_its_header_says_which_ran(tmp_path, monkeypatch):
    """`shardlib train` builds the per-block step with block_recompute="weights"; where that step
    does not fit a device it compiles the one that reruns each block, and the header names the mode."""
    from shardlib.run import setup
    from shardlib.run.console import banner
    from shardlib.run.config import TrainConfig

    model = shardlib.from_nnx(lambda rngs: Net(2, rngs), lambda m, b: _loss(m(b["inputs"]), b))
    config = TrainConfig(strategy="zero3", seq_len=16, batch_size=8, steps=1)
    built, build_program = {}, setup.build_program

    def build_once(config, model, layout, schedule, block_recompute="weights"):
        """The weights step that both zero3 runs compile first is one program, compiled once."""
        key = (config.strategy, block_recompute)
        if key not in built:
            built[key] = build_program(config, model, layout, schedule, block_recompute)
        return built[key]

    monkeypatch.setattr(setup, "build_program", build_once)
    run = setup.prepare(config, tmp_path / "keeps", model=model)
    assert run.block_recompute == "weights"
    assert "blocks     2 gathered one call at a time ('blocks/0' ...); the backward gathers each block's weights " \
           "again and keeps its activations (block_recompute=weights)" in banner(run, None)
    monkeypatch.setattr(setup, "_fits", lambda config, mem: False)
    run = setup.prepare(config, tmp_path / "reruns", model=model)
    assert run.block_recompute == "block" and "(block_recompute=block: keeping activations did not fit" in banner(run, None)
    assert setup.prepare(TrainConfig(strategy="dp", seq_len=16, batch_size=8, steps=1), tmp_path / "dp",
                         model=model).block_recompute is None
