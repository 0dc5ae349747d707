"""The strategy contract (README "Strategies", docs/design.md): per-device persistent bytes,
collective bytes per step and an upper bound on temporary bytes, read from the compiled program
itself (memory_analysis and the optimised HLO) and compared with formulas written here from the
model's shapes. Compile only: nothing is run."""

import dataclasses
import itertools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib.models import GPTConfig, trainable
from shardlib import build, make_layout, make_mesh
from shardlib.tools.hlo_parse import parse_shape, shape_leaves
from shardlib.tools.report import collective_stats, memory_stats
from tests.helpers import BATCH, SEQ, TINY, optimizer

N = 8
# tiny's shapes with eight layers, so that one layer is an eighth of the stack and a whole-model
# gather stands out against the one or two layers ZeRO-3 may hold (the temporary-bytes bounds).
CONFIG = dataclasses.replace(TINY, n_layers=8)
# Persistent bytes per device, in units of Psi (fp32 params + two fp32 Adam moments).
MEMORY_CONTRACT = {"dp": 12, "zero1": 4 + 8 / N, "zero2": 4 + 8 / N, "zero3": 12 / N}
CASES = {  # name -> (strategy, mesh)
    "dp": ("dp", {"data": N}), "zero1": ("zero1", {"data": N}), "zero2": ("zero2", {"data": N}),
    "zero3": ("zero3", {"fsdp": N}), "tp": ("tp", {"data": 2, "tensor": 4}),
    "fsdp_tp": ("fsdp_tp", {"fsdp": 4, "tensor": 2}), "hsdp": ("hsdp", {"data": 2, "fsdp": 4}),
    "dp_pipe": ("dp", {"pipe": 2, "data": 4}), "zero3_pipe": ("zero3", {"pipe": 2, "fsdp": 4}),
}
# the logical names tp splits (strategies.TENSOR_RULES)
TENSOR_NAMES = {"heads", "kv_heads", "joined_kv", "mlp", "vocab"}


def _size(shape) -> int:
    return int(np.prod(shape))


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Parameter counts by role, from the model's logical axes."""

    psi: int  # all parameters
    stack: int  # the scanned layers (leading "layers" axis)
    untensored: int  # no dimension tp splits: the norm scales
    stack_untensored: int  # the norm scales of the scanned layers

    @property
    def embed_head(self) -> int:  # embedding, final norm, output head
        return self.psi - self.stack


def _leaves(model):
    layout = make_layout(model, "zero3", make_mesh({"fsdp": N}))
    return jax.tree.leaves(layout.params, is_leaf=lambda x: hasattr(x, "spec"))


def _shapes(model) -> Shapes:
    leaves = _leaves(model)
    stacked = lambda l: l.logical[0] == "layers"
    untensored = lambda l: not TENSOR_NAMES & set(l.logical)
    count = lambda keep: sum(_size(l.shape) for l in leaves if keep(l))
    return Shapes(count(lambda l: True), count(stacked), count(untensored),
                  count(lambda l: stacked(l) and untensored(l)))


def _weight_shapes(model, splits=()) -> set[tuple[int, ...]]:
    """Every shape a weight takes (whole, and one layer of a stack), with each dim divided by any
    product of ``splits`` (mesh axis sizes) that divides it: the weight buffers a collective may move."""
    factors = {int(np.prod(c)) for k in range(len(splits) + 1) for c in itertools.combinations(splits, k)}
    shapes = set()
    for leaf in _leaves(model):
        for base in (leaf.shape, leaf.shape[1:]) if leaf.logical[0] == "layers" else (leaf.shape,):
            options = [[d // f for f in factors if d % f == 0] for d in base]
            shapes.update(itertools.product(*options))
    return shapes


def _compiled(model, strategy, mesh, batch=BATCH, seq=SEQ, **options):
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(mesh)), **options)
    shapes = {"inputs": ((batch, seq), jnp.int32), "targets": ((batch, seq), jnp.int32)}
    rows_split = mesh.get("data", 1) * mesh.get("fsdp", 1)
    batch_bytes = 2 * batch * seq * 4 // rows_split
    return program.compile_step(program.abstract_state(), program.abstract_batch(shapes)), batch_bytes


@pytest.fixture(scope="module")
def contract():
    """Every case compiled once, shared by all assertions."""
    model = trainable(CONFIG)
    return model, _shapes(model), {name: _compiled(model, *CASES[name]) for name in CASES}


def _psi(model) -> int:
    return sum(_size(x.shape) for x in jax.tree.leaves(model.abstract()))


def _ring(bytes_full: float, n: int = N) -> float:
    return bytes_full * (n - 1) / n


def _by_group(compiled) -> dict[tuple[str, int], float]:
    """Bytes sent per step by (kind, devices per group): tells the mesh axes of one case apart."""
    out = defaultdict(float)
    for record in collective_stats(compiled).records:
        out[record.kind, record.group_size] += record.bytes_per_step
    return out


# ---------------------------------------------------------------- persistent bytes


def _persistent(name: str, s: Shapes) -> float:
    """The README table's figure for each case, in bytes (12 bytes per parameter unsharded)."""
    if name in MEMORY_CONTRACT:
        return MEMORY_CONTRACT[name] * s.psi
    if name == "tp":  # T=4: every tensor with a heads/mlp/vocab dim split, the norm scales replicated
        return 12 * ((s.psi - s.untensored) / 4 + s.untensored)
    if name == "fsdp_tp":  # F=4, T=2: the norm scales only over fsdp
        return 12 * ((s.psi - s.untensored) / 8 + s.untensored / 4)
    if name == "hsdp":  # F=4, replicated over data
        return 12 * s.psi / 4
    if name == "dp_pipe":  # S=2: dp's figure for the stage's half of the stack, embedding and head replicated
        return 12 * (s.stack / 2 + s.embed_head)
    assert name == "zero3_pipe"  # S=2, F=4: zero3's figure over fsdp for the stage's half and for the rest
    return 12 * (s.stack / 2 + s.embed_head) / 4


@pytest.mark.parametrize("name", list(CASES))
def test_persistent_bytes(name, contract):
    model, shapes, compiled = contract
    program, batch_bytes = compiled[name]
    persistent = memory_stats(program).argument_bytes - batch_bytes
    assert persistent == pytest.approx(_persistent(name, shapes), rel=0.02)


def test_zero3_offload_moves_the_optimizer_state_to_the_host(contract):
    """README row `zero3` + offload: 4 Psi / N on the device, 8 Psi / N on the host (Adam's count
    aside), zero3's collectives unchanged (the moves are host-device copies, not collectives)."""
    model, shapes, compiled = contract
    offloaded, batch_bytes = _compiled(model, *CASES["zero3"], offload="opt_state")
    mem = memory_stats(offloaded)
    assert mem.device_bytes("argument") - batch_bytes == pytest.approx(4 * shapes.psi / N, rel=0.02)
    assert mem.host_argument_bytes == mem.host_output_bytes == pytest.approx(8 * shapes.psi / N, rel=0.02)
    assert collective_stats(offloaded).bytes_by_kind() == collective_stats(compiled["zero3"][0]).bytes_by_kind()


def test_persistent_bytes_100m_model_compiled_abstractly():
    config = GPTConfig(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_seq_len=256)
    model = trainable(config)
    psi = _psi(model)
    assert psi > 100e6
    for strategy in ("dp", "zero1", "zero3"):  # zero2 has zero1's persistent state (checked above)
        compiled, batch_bytes = _compiled(model, strategy, CASES[strategy][1], batch=N, seq=128)
        persistent = memory_stats(compiled).argument_bytes - batch_bytes
        assert persistent == pytest.approx(MEMORY_CONTRACT[strategy] * psi, rel=0.02), strategy


# ---------------------------------------------------------------- collective bytes


@pytest.mark.parametrize("strategy,psi_factor", [("dp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 3)])
def test_collective_bytes_match_the_zero_paper(strategy, psi_factor, contract):
    model, shapes, compiled = contract
    stats = collective_stats(compiled[strategy][0])
    psi_bytes = shapes.psi * 4
    assert stats.total_bytes == pytest.approx(_ring(psi_factor * psi_bytes), rel=0.10)
    by_kind = stats.bytes_by_kind()
    if strategy == "dp":
        assert by_kind["all-reduce"] == pytest.approx(_ring(2 * psi_bytes), rel=0.01)
        assert by_kind["reduce-scatter"] == by_kind["all-gather"] == 0
    elif strategy in ("zero1", "zero2"):  # reduce-scatter the gradients, all-gather the new params
        assert by_kind["reduce-scatter"] == pytest.approx(_ring(psi_bytes), rel=0.01)
        assert by_kind["all-gather"] == pytest.approx(_ring(psi_bytes), rel=0.01)
    else:
        # Exact accounting: every scanned layer is gathered in the forward and again in the
        # backward pass (remat); the embedding lookup's backward needs no weights, and XLA keeps
        # the output head's gathered weights from the end of the forward to the start of the
        # backward (freeing and re-gathering them there would save no memory). All gradients
        # are reduce-scattered once.
        assert by_kind["reduce-scatter"] == pytest.approx(_ring(psi_bytes), rel=0.01)
        assert by_kind["all-gather"] == pytest.approx(_ring(psi_bytes + 4 * shapes.stack), rel=0.01)


def test_hsdp_traffic_is_zero3_within_fsdp_plus_a_data_all_reduce(contract):
    _, s, compiled = contract
    by = _by_group(compiled["hsdp"][0])  # fsdp groups of 4, data groups of 2
    assert by["reduce-scatter", 4] == pytest.approx(_ring(4 * s.psi, 4), rel=0.01)
    assert by["all-gather", 4] == pytest.approx(_ring(4 * (s.psi + s.stack), 4), rel=0.01)  # as zero3's
    assert by["all-reduce", 2] == pytest.approx(2 * _ring(4 * s.psi / 4, 2), rel=0.01)  # the shards, once
    expected = _ring(4 * (2 * s.psi + s.stack), 4) + 2 * _ring(4 * s.psi / 4, 2)
    assert collective_stats(compiled["hsdp"][0]).total_bytes == pytest.approx(expected, rel=0.10)


def _tp_activation_all_reduces(layers: int) -> int:
    """Megatron over `tensor` with remat, per step: each layer's two row-parallel outputs (attention
    and MLP out-projections) in the forward; in the backward the recomputed attention output (the
    MLP's output is not needed by the backward) and the input gradient of each column-parallel
    projection (wq, wk, wv, w_gate, w_up): 8 per layer. Plus the vocab-split embedding lookup's
    output and the head's input gradient."""
    return 8 * layers + 2


def _tensor_traffic(rows: int, tensor: int) -> dict[str, float]:
    """tp's traffic over `tensor` for ``rows`` rows per model replica: the activation all-reduces
    (`_tp_activation_all_reduces`), the vocab-split softmax's three per-token all-reduces (max, sum,
    label logit; forward and backward), and accuracy's argmax (each shard's max and index gathered)."""
    residual = rows * SEQ * CONFIG.d_model * 4  # one all-reduced activation [rows, seq, d_model]
    token_row = rows * SEQ * 4  # one float per token
    activations = _tp_activation_all_reduces(CONFIG.n_layers) * 2 * _ring(residual, tensor)
    return {"all-reduce": activations + 3 * 2 * _ring(token_row, tensor),
            "all-gather": 2 * _ring(token_row * tensor, tensor)}


def _local_params(s: Shapes, tensor: int, stack: bool = False) -> float:
    """Parameters one tensor device holds of the whole model (or of the scanned stack): those with
    a heads/mlp/vocab dim split T ways, the norm scales whole."""
    total, untensored = (s.stack, s.stack_untensored) if stack else (s.psi, s.untensored)
    return (total - untensored) / tensor + untensored


def test_tp_traffic_is_activation_all_reduces_plus_the_data_gradient_all_reduce(contract):
    _, s, compiled = contract
    data, tensor = 2, 4
    by = _by_group(compiled["tp"][0])
    over_tensor = _tensor_traffic(BATCH // data, tensor)
    assert by["all-reduce", tensor] == pytest.approx(over_tensor["all-reduce"], rel=0.01)
    local_params = 4 * _local_params(s, tensor)
    assert by["all-reduce", data] == pytest.approx(2 * _ring(local_params, data), rel=0.01)
    expected = sum(over_tensor.values()) + 2 * _ring(local_params, data)
    assert collective_stats(compiled["tp"][0]).total_bytes == pytest.approx(expected, rel=0.10)


def test_fsdp_tp_is_zero3_over_the_tensor_shards_plus_tp_over_tensor(contract):
    """F=4, T=2. Over fsdp, zero3's exact figure for the parameters one tensor device holds (each
    layer gathered forward and again for the backward, every gradient reduce-scattered once): the
    gathers keep the tensor split (`hooks.gather_shards`). Over tensor, tp's traffic for the fsdp
    device's rows: the matmuls are split, so only activations cross it."""
    _, s, compiled = contract
    fsdp, tensor = 4, 2
    by = _by_group(compiled["fsdp_tp"][0])
    local, local_stack = 4 * _local_params(s, tensor), 4 * _local_params(s, tensor, stack=True)
    assert by["reduce-scatter", fsdp] == pytest.approx(_ring(local, fsdp), rel=0.01)
    assert by["all-gather", fsdp] == pytest.approx(_ring(local + local_stack, fsdp), rel=0.01)
    over_tensor = _tensor_traffic(BATCH // fsdp, tensor)
    assert by["all-reduce", tensor] == pytest.approx(over_tensor["all-reduce"], rel=0.01)
    assert by["all-gather", tensor] == pytest.approx(over_tensor["all-gather"], rel=0.01)
    expected = _ring(2 * local + local_stack, fsdp) + sum(over_tensor.values())
    assert collective_stats(compiled["fsdp_tp"][0]).total_bytes == pytest.approx(expected, rel=0.10)


@pytest.mark.parametrize("name,splits", [("tp", ()), ("fsdp_tp", (4,))])  # splits: the batch axes that shard weights
def test_no_weight_is_gathered_over_tensor(name, splits, contract):
    """The layers compute with tensor-split weights: no all-gather over `tensor` (groups of T)
    moves a buffer shaped like a weight, whole or split over any of the mesh's axes."""
    model, _, compiled = contract
    tensor = CASES[name][1]["tensor"]
    weights = _weight_shapes(model, splits + (tensor,))
    gathers = [r for r in collective_stats(compiled[name][0]).of_kind("all-gather") if r.group_size == tensor]
    for record in gathers:
        for leaf in shape_leaves(parse_shape(record.shape)):
            assert leaf.dims not in weights, f"{record.name} gathers {record.shape} over tensor, a weight's shape"


def _permute_sends(stages: int, microbatches: int) -> int:
    """1F1B: S-1 warm-up ticks send activations, M steady ticks send activations and cotangents,
    S-1 cool-down ticks send cotangents; the very last send has no reader and XLA drops it."""
    return (stages - 1) + 2 * microbatches + (stages - 1) - 1


@pytest.mark.parametrize("name", ["dp_pipe", "zero3_pipe"])
def test_pipeline_permutes_one_microbatch_per_tick(name, contract):
    stages, microbatches, rows = 2, 4, BATCH // 4  # microbatches: build's default 2 S
    microbatch = rows // microbatches * SEQ * CONFIG.d_model * 4
    by_kind = collective_stats(contract[2][name][0]).bytes_by_kind()
    assert by_kind["collective-permute"] == pytest.approx(_permute_sends(stages, microbatches) * microbatch, rel=0.01)


def test_dp_pipe_traffic(contract):
    _, s, compiled = contract
    stages, data, rows = 2, 4, BATCH // 4
    local_params = 4 * (s.stack / stages + s.embed_head)
    by = _by_group(compiled["dp_pipe"][0])
    assert by["all-reduce", data] == pytest.approx(2 * _ring(local_params, data), rel=0.01)
    # the embedding's gradient lives on stage 0, the head's on the last: summed over pipe
    assert by["all-reduce", stages] == pytest.approx(2 * _ring(4 * s.embed_head, stages), rel=0.01)
    permutes = _permute_sends(stages, 4) * (rows // 4) * SEQ * CONFIG.d_model * 4
    expected = 2 * _ring(local_params, data) + 2 * _ring(4 * s.embed_head, stages) + permutes
    assert collective_stats(compiled["dp_pipe"][0]).total_bytes == pytest.approx(expected, rel=0.10)


def test_fsdp_gathers_weights_never_activations(contract):
    model, _, compiled = contract
    weight_shapes = _weight_shapes(model)
    gathers = collective_stats(compiled["zero3"][0]).of_kind("all-gather")
    assert gathers
    for record in gathers:
        for leaf in shape_leaves(parse_shape(record.shape)):
            assert leaf.dims in weight_shapes, f"{record.name} gathers {record.shape}, which is not a weight"


# ---------------------------------------------------------------- temporary bytes (upper bounds)


def _activations(rows: int, layers: int, split: int = 1) -> int:
    """Activation bytes one device may hold, f32: every layer's input kept for its remat, and one
    block's and the head's intermediates, values and cotangents (q, k, v, attention output,
    scores, probabilities; gate, up, hidden; logits, softmax, their cotangent). ``split``: the
    tensor-parallel degree that divides heads, mlp and vocab."""
    t, d, f, v, h = SEQ, CONFIG.d_model, CONFIG.d_ff, CONFIG.vocab_size, CONFIG.n_heads
    block = rows * t * (4 * d + 3 * f) + 2 * rows * h * t * t
    head = 3 * rows * t * v
    return 4 * (layers * rows * t * d + 2 * (block + head) // split)


def _temp_bound(name: str, s: Shapes) -> float:
    """What the step's temporaries may hold at most, from the shapes (bytes per device)."""
    layer, embed_head, layers = 4 * s.stack / CONFIG.n_layers, 4 * s.embed_head, CONFIG.n_layers
    # ZeRO-3 family: two gathered layers (the one computing, the next one's gather), one layer's
    # whole gradient before its reduce-scatter, the embedding and head gathered and their whole
    # gradients, and three state-layout copies (gradient shards, Adam's update, the new shards).
    zero3 = lambda shards, layer=layer, embed_head=embed_head: 3 * layer + 2 * embed_head + 3 * 4 * s.psi / shards
    if name == "dp":  # the whole gradients and Adam's update (new params and moments land in the donated buffers)
        return 2 * 4 * s.psi + _activations(BATCH // N, layers)
    if name in ("zero1", "zero2"):
        # Why zero1's peak exceeds plain jit's (BENCHMARKS.md) is not a second whole copy here: the
        # temporaries hold the whole local gradients once, as dp's do; the reduce-scattered
        # gradients, Adam's update and the new shards are 1/N each, and the all-gather of the new
        # params writes the donated output. The lax.cond that skips a non-finite step keeps both
        # branches' shards (two more 1/N copies). A whole extra f32 copy of gradients or params
        # (4 Psi) breaks this bound.
        return 4 * s.psi + 5 * 4 * s.psi / N + _activations(BATCH // N, layers)
    if name == "zero3":
        return zero3(N) + _activations(BATCH // N, layers)
    if name == "hsdp":
        return zero3(4) + _activations(BATCH // N, layers)
    if name == "fsdp_tp":  # zero3 over fsdp of the tensor-split layers (gathered 1/T, see the traffic test)
        tensor = 2
        tp_layer = 4 * _local_params(s, tensor, stack=True) / layers
        tp_embed_head = 4 * _local_params(s, tensor) - tp_layer * layers
        return zero3(8, tp_layer, tp_embed_head) + _activations(BATCH // 4, layers, split=tensor)
    if name == "tp":  # gradients and Adam's update of the local (tensor-split) parameters
        return 2 * 4 * ((s.psi - s.untensored) / 4 + s.untensored) + _activations(BATCH // 2, layers, split=4)
    stages, rows = 2, BATCH // 4 // 4  # one microbatch's rows
    stage = 4 * s.stack / stages
    # 1F1B keeps 2S-1 stage inputs of one microbatch and runs one stage's layers at a time
    kept = (2 * stages - 1) * rows * SEQ * CONFIG.d_model * 4 + _activations(rows, layers // stages)
    if name == "dp_pipe":  # the stage's gradient accumulator, one microbatch's gradients, the
        # embedding/head gradients' pipe all-reduce and Adam's update: four copies of the local params
        return 4 * (stage + embed_head) + kept
    assert name == "zero3_pipe"
    # XLA hoists the stage's layer gathers out of the microbatch loop: the stage's whole slice of
    # the stack is gathered once, and its whole gradient accumulated across microbatches.
    return 2 * stage + 2 * embed_head + 3 * (stage + embed_head) / 4 + kept


@pytest.mark.parametrize("name", list(CASES))
def test_temporary_bytes_bounded(name, contract):
    _, shapes, compiled = contract
    assert memory_stats(compiled[name][0]).temp_bytes <= _temp_bound(name, shapes)


@pytest.mark.filterwarnings("ignore::shardlib.step.compute.WholeGatherWarning")  # the whole-model gather is the point
def test_temporary_bound_catches_a_whole_model_gather(contract):
    """The same model gathering every weight before the forward (gathers_params=False) must break
    zero3's bound: all eight layers are alive at once instead of two."""
    model, shapes, _ = contract
    whole = dataclasses.replace(model, gathers_params=False)
    compiled, _ = _compiled(whole, "zero3", CASES["zero3"][1])
    assert memory_stats(compiled).temp_bytes > _temp_bound("zero3", shapes)
