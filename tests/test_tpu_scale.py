"""TPU at 64 chips: the compiler options of the TPU backend policy, the mesh of a single slice, Cloud
TPU's slice names, and which options a compile (and a plan's cache) sees. The programs are compiled
by the real TPU compiler for a v5p 4x4x4 slice on this CPU host (docs/tpu.md); nothing runs.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from shardlib import backend as backend_lib
from shardlib import build, make_layout, make_mesh
from shardlib.models import GPTConfig, trainable
from shardlib.runtime.devices import TopologyError, cloud_tpu_topology, topology_devices
from shardlib.sharding import staged
from shardlib.tools.hlo import collective_stats
from tests.helpers import tpu_chips

SLICE = "v5p:4x4x4"
N = 64
# Dims that tile: every shard of every kernel is whole (8, 128) tiles over 64 chips. Narrower does
# not pay for the 64-chip step: at d_model 128 it compiles in 0.92x the CPU time, and its all-reduces
# grow to 25% of the reduce-scatters, where the test allows 5% (scripts/benchmark_tpu_scale_width.py).
CONFIG = GPTConfig(vocab_size=512, d_model=512, n_layers=2, n_heads=4, d_ff=1024, max_seq_len=128,
                   compute_dtype="bfloat16")
# The four-slice hsdp plan (16 chips) compiles in 0.6x the CPU time at d_model 128 (4 heads of 128,
# d_ff 512), its DCN bytes still the ring volume to 0.4% (0.04% at CONFIG), against the two-slice
# guess's 0.67x of it (the same script, --hsdp).
HSDP_CONFIG = dataclasses.replace(CONFIG, d_model=128, attention_head_dim=128, d_ff=512)
OFF = {name: "false" for name, _ in backend_lib.TPU_COLLECTIVE_OPTIONS}
TPU = backend_lib.get_policy("tpu")


@pytest.fixture(scope="module")
def chips():
    return tpu_chips(SLICE)


def _zero3_stats(chips, compiler_options=None):
    model = trainable(CONFIG)
    program = build(model, optax.adamw(1e-3), make_layout(model, "zero3", make_mesh({"fsdp": N}, devices=chips)),
                    precision="bf16", compiler_options=compiler_options)
    shape = ((N, 128), jnp.int32)
    batch = program.abstract_batch({"inputs": shape, "targets": shape})
    return collective_stats(program.step.lower(program.abstract_state(), batch).compile().as_text())


def test_zero3_on_64_chips_sends_the_zero_volume_in_gathers_and_reduce_scatters(chips):
    """With the TPU policy XLA:TPU gathers zero3's weights with all-gathers and reduce-scatters the
    gradients in two stages (`shardlib.sharding.staged`): the step sends at most 1.1x the ZeRO volume
    (N-1)/N (2 x 2 + 4) Psi. With the policy's compiler options off (the compiler's defaults) every
    gather is an all-reduce of a zero-filled buffer."""
    gathered = lambda stats: sum(r.bytes_per_step for r in stats.records if r.gathered)
    policy = _zero3_stats(chips)
    by_kind = policy.bytes_by_kind()
    # (the norm scales' 512-element gathers stay an all-reduce: a rounding error beside the weights)
    assert by_kind["all-gather"] > 0 and gathered(policy) < 0.01 * by_kind["all-gather"]
    assert by_kind["reduce-scatter"] > 0 and by_kind["all-reduce"] < 0.05 * by_kind["reduce-scatter"], by_kind
    psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable(CONFIG).abstract()))
    assert sum(by_kind.values()) <= 1.1 * (N - 1) / N * (2 * 2 + 4) * psi, by_kind
    default = _zero3_stats(chips, OFF)
    assert default.bytes_by_kind()["all-gather"] == 0  # every gather became an all-reduce:
    assert default.bytes_by_kind()["all-reduce"] >= by_kind["all-gather"]
    assert gathered(default) > 0


def _scatter_stats(chips, mesh_shape, axes, scatter=None):
    mesh = Mesh(mesh_utils.create_device_mesh(mesh_shape, chips), ("a", "b"))
    scatter = scatter or (lambda x: jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True))
    scatter = jax.jit(jax.shard_map(scatter, mesh=mesh, in_specs=P(), out_specs=P(axes)))
    x = jax.ShapeDtypeStruct((8192, 2048), jnp.float32, sharding=NamedSharding(mesh, P()))
    compiled = scatter.lower(x).compile(compiler_options=backend_lib.step_compiler_options(chips))
    return compiled.as_text()


def test_a_reduce_scatter_over_the_whole_slice_is_an_all_reduce_so_it_goes_in_two_stages(chips):
    """What docs/tpu.md records: over all 64 chips XLA:TPU reduce-scatters with an all-reduce (and a
    slice), with or without the options; over 16 or 4 chips of the torus it keeps a reduce-scatter.
    `staged.psum_scatter` over all 64 (16 then 4 chips; 8 then 8 on one axis) sends reduce-scatters
    only, within 1.1x of the one-stage volume (N-1)/N S; `stages_for` asks the compiler and stages
    only there: v5e:2x4 keeps its one reduce-scatter."""
    size = 8192 * 2048 * 4
    whole = collective_stats(_scatter_stats(chips, (16, 4), ("a", "b"))).bytes_by_kind()
    assert whole["reduce-scatter"] == 0 and whole["all-reduce"] > 0
    for axis in ("a", "b"):
        part = collective_stats(_scatter_stats(chips, (16, 4), axis)).bytes_by_kind()
        assert part["reduce-scatter"] > 0 and part["all-reduce"] == 0
    assert staged.stages_for(make_mesh({"fsdp": N}, devices=chips), [("fsdp",)], TPU) == {("fsdp",): 8}
    v5e = make_mesh({"fsdp": 8}, devices=tpu_chips("v5e:2x4"))
    assert staged.stages_for(v5e, [("fsdp",)], TPU) == {}
    for shape, axes, stage in (((16, 4), ("a", "b"), lambda x: staged.psum_scatter(x, ("a", "b"), 0, 0)),
                               ((64, 1), ("a",), lambda x: staged.psum_scatter(x, ("a",), 0, staged.inner_size(N)))):
        two = collective_stats(_scatter_stats(chips, shape, axes, stage)).bytes_by_kind()
        assert two["all-reduce"] == 0 and two["reduce-scatter"] > 0, two
        assert sum(two.values()) <= 1.1 * (N - 1) / N * size, two


def test_a_single_slice_mesh_follows_the_torus(chips):
    """The 16 hosts of a v5p-128 share its ICI torus: the mesh orders the chips as the torus does
    (`mesh_utils.create_device_mesh`), not host by host; two slices stay slice-major."""
    mesh = make_mesh({"data": 4, "fsdp": 16}, devices=chips)
    expected = mesh_utils.create_device_mesh((4, 1, 16, 1, 1, 1), chips, allow_split_physical_axes=True)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in expected.flat]
    assert len({d.process_index for d in chips}) > 1  # the case that used to group by host
    sliced = make_mesh({"data": 2, "fsdp": N}, devices=topology_devices(SLICE, 2))
    assert [{d.slice_index for d in sliced.devices[i].flat} for i in range(2)] == [{0}, {1}]


@pytest.mark.parametrize("name, expected", [("v5p-128", "v5p:4x4x4"), ("v5p-8", "v5p:2x2x1"), ("v5p-512", "v5p:4x8x8"),
                                            ("v4-32", "v4:2x2x4"), ("v5e-8", "v5e:2x4"), ("v5litepod-16", "v5e:4x4"),
                                            ("v6e-256", "v6e:16x16"), ("v5p:4x4x4", "v5p:4x4x4")])
def test_cloud_tpu_slice_names(name, expected):
    assert cloud_tpu_topology(name)[0] == expected


def test_a_slice_name_that_does_not_exist_suggests_the_nearest():
    with pytest.raises(TopologyError, match="did you mean v5p-128 or v5p-64"):
        cloud_tpu_topology("v5p-100")
    with pytest.raises(TopologyError, match="did you mean v5p-128"):
        cloud_tpu_topology("v5q-128")


def test_which_options_a_step_compiles_with(chips, monkeypatch):
    """The policy's options, less those LIBTPU_INIT_ARGS sets (libtpu reads them itself), under
    the user's; CPU and GPU steps get none of the TPU's."""
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_enable_async_all_gather=false --xla_tpu_foo=1")
    options = backend_lib.step_compiler_options(chips, None, {"xla_tpu_overlap_compute_collective_tc": False})
    assert "xla_enable_async_all_gather" not in options
    assert options["xla_tpu_overlap_compute_collective_tc"] == "false"
    assert options["xla_tpu_enable_async_collective_fusion"] == "true"
    assert backend_lib.step_compiler_options(jax.devices("cpu")) is None
    assert backend_lib.parse_options("a=1, b=true") == {"a": "1", "b": "true"}
    with pytest.raises(ValueError, match="name=value"):
        backend_lib.parse_options("xla_tpu_enable_async_collective_fusion")


def test_the_plan_cache_key_includes_the_options(monkeypatch):
    """A plan with other options, XLA_FLAGS or LIBTPU_INIT_ARGS never reads another's compile."""
    from shardlib.tools.plan import Planner

    keys = {Planner("tiny", 8)._compiler, Planner("tiny", 8, compiler_options={"xla_foo": "1"})._compiler}
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_foo=1")
    keys.add(Planner("tiny", 8)._compiler)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/none")
    keys.add(Planner("tiny", 8)._compiler)
    assert len(keys) == 4 and all(json.loads(k) for k in keys)


def test_plan_names_its_default_batch_and_ends_with_the_command_that_runs_its_pick(capsys):
    from shardlib.cli import main
    from shardlib.run.config import DEFAULT_BATCH
    from shardlib.tools.plan_report import DEFAULT_TRAIN_BATCH

    assert DEFAULT_TRAIN_BATCH == DEFAULT_BATCH
    assert main(["plan", "--model", "tiny", "--devices", "8", "--strategy", "zero3", "dp", "--remat",
                 "save_dots"]) == 0
    captured = capsys.readouterr()
    assert "one sequence a device by default" in captured.out
    progress = [line for line in captured.err.splitlines() if line.startswith("shardlib plan: [")]
    assert [line.split()[3] for line in progress] == ["zero3", "dp"]  # one line per candidate, as it compiles
    command = next(line for line in captured.out.splitlines() if line.startswith("run it: "))[len("run it: "):]
    assert command.startswith("shardlib train --model tiny --strategy ") and "--remat save_dots" in command
    from shardlib.cli import _Parser
    from shardlib.run.config import add_arguments, from_args

    parser = _Parser(prog="shardlib train")
    add_arguments(parser)
    config = from_args(parser.parse_args(command.split()[2:]))  # the command parses as train's flags
    assert config.remat == "save_dots" and config.model == "tiny"


def test_four_slices_put_hsdp_replica_all_reduce_on_dcn_at_the_ring_volume():
    """Four v5e 2x2 slices: hsdp's data axis (4) crosses them. Only all-reduces cross (no all-gather
    whose send/recv sizes show the count), so the reader takes K = 4 from the topology: DCN bytes
    are 2 (K-1)/K of a chip's f32 gradient shard (4 Psi / F), not the 2-slice guess's 2/3 of that."""
    from shardlib.tools.plan import Planner

    planner = Planner(HSDP_CONFIG, topology="v5e:2x2", slices=4, precision="bf16", batch_size=16)
    row = planner.candidate("hsdp", {"data": 4, "fsdp": 4})
    assert row.error is None, row.error
    psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable(HSDP_CONFIG).abstract()))
    assert row.inter_domain_bytes == pytest.approx(2 * 3 / 4 * 4 * psi / 4, rel=0.01)


def test_a_gpu_plan_builds_the_gpu_step(monkeypatch):
    """`plan --hardware h100` on simulated devices builds zero3 as the GPU backend does: bf16 weights
    cast before the gather, so the all-gathers carry 2 bytes an element, at most half of what the
    CPU policy's step (gather in f32, then cast) sends; the reduce-scatters stay f32 in both."""
    import contextlib

    from shardlib.tools.plan import Planner

    gpu = Planner("tiny", 8, precision="bf16", hardware="h100").candidate("zero3", {"fsdp": 8})
    monkeypatch.setattr(Planner, "_hardware_policy", lambda self: contextlib.nullcontext())
    cpu = Planner("tiny", 8, precision="bf16", hardware="h100").candidate("zero3", {"fsdp": 8})
    # (at most half: a bf16 gather is half an f32 one, and the GPU step gathers no tensor more often)
    assert 0.4 * cpu.collective_bytes["all-gather"] <= gpu.collective_bytes["all-gather"] <= 0.5 * cpu.collective_bytes["all-gather"]
    assert gpu.collective_bytes["reduce-scatter"] == cpu.collective_bytes["reduce-scatter"]
    assert any("cuDNN" in note for note in gpu.notes)
