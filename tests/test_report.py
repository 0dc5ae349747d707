"""report.py: collective volumes and multiplicities from HLO, memory, FLOPs, formatting.

Programs are only lowered and compiled (never run): every figure here is a property of the
compiled program, identical on any machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.tools import hardware, report

F32 = 4


def mesh_1d():
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def mesh_2d():
    return jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)


def compile_shard_map(body, mesh, in_specs, out_specs, *args):
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(fn).lower(*args).compile()


def ring(n: int) -> float:
    return (n - 1) / n


# ---------------------------------------------------------------- compiled programs (8 devices)


def test_psum_is_one_all_reduce_of_2_n_minus_1_over_n_bytes():
    x = jnp.ones((8 * 1024,), jnp.float32)  # f32[1024] per device
    compiled = compile_shard_map(lambda a: jax.lax.psum(a, "x"), mesh_1d(), P("x"), P(), x)
    stats = report.collective_stats(compiled.as_text())
    (rec,) = stats.records
    assert (rec.kind, rec.dtype, rec.shape) == ("all-reduce", "f32", "f32[1024]")
    assert (rec.group_size, rec.multiplicity, rec.buffer_bytes) == (8, 1, 1024 * F32)
    assert rec.bytes_per_step == 2 * 7 / 8 * 4096
    assert stats.total_bytes == 7168
    assert stats.bytes_by_kind()["all-reduce"] == 7168
    assert stats.count_by_kind() == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0,
                                     "all-to-all": 0, "collective-permute": 0}


def test_reduce_scatter_and_all_gather_count_the_full_buffer():
    x = jnp.ones((8 * 1024,), jnp.float32)  # f32[1024] per device

    def body(a):
        scattered = jax.lax.psum_scatter(a, "x", tiled=True)  # f32[128] out, f32[1024] in
        gathered = jax.lax.all_gather(a[:128], "x", tiled=True)  # f32[128] in, f32[1024] out
        return scattered, gathered

    compiled = compile_shard_map(body, mesh_1d(), P("x"), (P("x"), P("x")), x)
    stats = report.collective_stats(compiled)
    (rs,) = stats.of_kind("reduce-scatter")
    (ag,) = stats.of_kind("all-gather")
    assert rs.shape == "f32[128]" and rs.buffer_bytes == 1024 * F32  # input = output x N
    assert ag.shape == "f32[1024]" and ag.buffer_bytes == 1024 * F32
    assert rs.bytes_per_step == ag.bytes_per_step == ring(8) * 4096 == 3584
    assert stats.total_bytes == 2 * 3584


def test_scan_multiplies_by_trip_count_and_nested_scans_multiply():
    x = jnp.ones((8 * 256,), jnp.float32)  # f32[256] per device
    per_call = 2 * ring(8) * 256 * F32

    def single(a):
        return jax.lax.scan(lambda c, _: (c + jax.lax.psum(c, "x"), None), a, None, length=5)[0]

    def nested(a):
        def outer(c, _):
            inner = lambda c2, _: (c2 + jax.lax.psum(c2, "x"), None)
            return jax.lax.scan(inner, c, None, length=3)[0], None

        return jax.lax.scan(outer, a, None, length=5)[0]

    for fn, times in ((single, 5), (nested, 15)):
        compiled = compile_shard_map(fn, mesh_1d(), P("x"), P("x"), x)
        (rec,) = report.collective_stats(compiled.as_text()).records
        assert rec.multiplicity == times and not rec.trip_count_unknown
        assert rec.bytes_per_step == times * per_call

    # Pre-optimisation HLO has no known_trip_count: the count is inferred from `i < K`.
    lowered = jax.jit(jax.shard_map(nested, mesh=mesh_1d(), in_specs=P("x"), out_specs=P("x"))).lower(x)
    (rec,) = report.collective_stats(lowered).records
    assert rec.multiplicity == 15 and rec.trip_count_inferred and not rec.trip_count_unknown


def test_group_size_over_one_axis_of_a_2d_mesh():
    mesh = mesh_2d()
    x = jnp.ones((8 * 128,), jnp.float32)
    for axis, n in (("b", 4), ("a", 2)):
        out = P("a") if axis == "b" else P("b")
        compiled = compile_shard_map(lambda v: jax.lax.psum(v, axis), mesh, P(("a", "b")), out, x)
        (rec,) = report.collective_stats(compiled).records
        assert rec.group_size == n
        assert rec.bytes_per_step == 2 * ring(n) * 128 * F32

    # GSPMD (jit with shardings) prints jax 0.10's mesh-axes form: replica_groups=mesh[...] {...}.
    arg = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("b", "a")))
    summed = jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(mesh, P("a")))
    stats = report.collective_stats(summed.lower(arg).compile())
    (rec,) = stats.of_kind("all-reduce")
    assert rec.group_size == 4 and rec.buffer_bytes == 128 * F32


def test_ppermute_sends_its_whole_buffer():
    x = jnp.ones((8 * 128,), jnp.float32)
    perm = [(i, (i + 1) % 8) for i in range(8)]
    compiled = compile_shard_map(lambda a: jax.lax.ppermute(a, "x", perm), mesh_1d(), P("x"), P("x"), x)
    (rec,) = report.collective_stats(compiled).records
    assert rec.kind == "collective-permute" and rec.group_size == 8
    assert rec.bytes_per_step == 128 * F32


def test_all_to_all_tuple_form_sums_its_elements():
    x = jnp.ones((8 * 128,), jnp.float32)
    body = lambda a: jax.lax.all_to_all(a.reshape(8, 16), "x", 0, 0, tiled=True)
    compiled = compile_shard_map(body, mesh_1d(), P("x"), P("x"), x)
    (rec,) = report.collective_stats(compiled).records  # XLA:CPU splits it into 8 f32[1,16]
    assert rec.kind == "all-to-all" and rec.buffer_bytes == 128 * F32
    assert rec.bytes_per_step == ring(8) * 128 * F32


def test_pre_optimisation_hlo_keeps_bf16():
    x = jnp.ones((8 * 64,), jnp.bfloat16)
    fn = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh_1d(), in_specs=P("x"), out_specs=P()))
    lowered = fn.lower(x)
    (rec,) = report.collective_stats(lowered.compiler_ir("hlo").as_hlo_text()).records
    assert rec.dtype == "bf16" and rec.buffer_bytes == 64 * 2


def test_memory_stats_arguments_are_the_local_shard():
    mesh = mesh_1d()
    arg = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    compiled = jax.jit(lambda a: a * 2.0).lower(arg).compile()
    mem = report.memory_stats(compiled)
    assert mem.argument_bytes == 64 * 128 * F32 // 8
    assert mem.output_bytes == 64 * 128 * F32 // 8
    assert mem.peak_bytes >= mem.argument_bytes + mem.output_bytes and "arguments" in mem.table()


def test_memory_stats_peak_holds_its_own_temporaries():
    # tanh(a @ a.T) @ a: the 64x64 product (a temporary) is alive beside the argument and the
    # output; XLA:CPU's peak leaves it out, so the buffer assignment's sum is reported, flagged.
    compiled = jax.jit(lambda a: jnp.tanh(a @ a.T) @ a).lower(jax.ShapeDtypeStruct((64, 128), jnp.float32)).compile()
    mem = report.memory_stats(compiled)
    assert mem.temp_bytes >= 64 * 64 * F32 // 8
    assert mem.peak_bytes == mem.argument_bytes + mem.output_bytes + mem.temp_bytes - mem.alias_bytes
    assert mem.peak_is_estimate and "peak (estimate)" in mem.table()


def test_flops_per_step_reads_cost_analysis():
    a = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    b = jax.ShapeDtypeStruct((64, 16), jnp.float32)
    flops = report.flops_per_step(jax.jit(jnp.matmul).lower(a, b).compile())
    assert flops == pytest.approx(2 * 32 * 64 * 16, rel=0.01)


# ---------------------------------------------------------------- hand-written HLO


def _module(instructions: str, header: str = "HloModule m, num_partitions=8") -> str:
    return f"""{header}

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}}

ENTRY %main (p: f32[1024]) -> f32[1024] {{
  %p = f32[1024]{{0}} parameter(0)
{instructions}
}}
"""


@pytest.mark.parametrize(
    "groups, n",
    [
        ("{{0,1,2,3},{4,5,6,7}}", 4),
        ("{{0,4},{1,5},{2,6},{3,7}}", 2),
        ("[4,2]<=[8]", 2),
        ("[2,4]<=[4,2]T(1,0)", 4),
        ("[1,8]<=[8]", 8),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", 4),
        ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", 4),
        ("mesh['a'=2,'b'=4] {'a','b'}", 8),
        ("mesh['a'=8] {'a':(2)2}", 2),
        ("{}", 8),
        ("{{0},{1},{2},{3},{4},{5},{6},{7}}", 1),
    ],
)
def test_replica_group_forms(groups, n):
    hlo = _module(f"  ROOT %ar = f32[1024]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
                  "use_global_device_ids=true, to_apply=%add")
    (rec,) = report.collective_stats(hlo).records
    assert rec.group_size == n
    assert rec.bytes_per_step == 2 * ring(n) * 4096  # group size 1 moves nothing


def test_tuple_outputs_and_comments_sum_elements():
    hlo = _module(
        "  %ar = (f32[16]{0}, bf16[8]{0}, /*index=2*/f32[2,2]{1,0}) all-reduce(%p, %p, %p), "
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add\n"
        "  ROOT %ag = (f32[64]{0}, f32[32]{0}) all-gather(%p, %p), replica_groups=[2,4]<=[8], dimensions={0}"
    )
    ar, ag = report.collective_stats(hlo).records
    assert ar.buffer_bytes == 16 * 4 + 8 * 2 + 4 * 4 and ar.dtype == "bf16,f32"
    assert ar.bytes_per_step == 2 * ring(2) * ar.buffer_bytes
    assert ag.buffer_bytes == 96 * 4 and ag.bytes_per_step == ring(4) * 96 * 4


def test_async_starts_count_once_and_dones_are_skipped():
    hlo = _module(
        "  %ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(%p), replica_groups=[1,8]<=[8], dimensions={0}\n"
        "  %agd = f32[1024]{0} all-gather-done(%ags)\n"
        "  %ars = f32[1024]{0} all-reduce-start(%p), replica_groups=[1,8]<=[8], to_apply=%add\n"
        "  %ard = f32[1024]{0} all-reduce-done(%ars)\n"
        "  %cps = (f32[1024]{0}, f32[1024]{0}, u32[], u32[]) collective-permute-start(%p), "
        "source_target_pairs={{0,1},{1,0}}\n"
        "  %cpd = f32[1024]{0} collective-permute-done(%cps)\n"
        "  %rss = ((f32[1024]{0}), f32[128]{0}, s32[]) reduce-scatter-start(%p), "
        "replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add\n"
        "  ROOT %rsd = f32[128]{0} reduce-scatter-done(%rss)"
    )
    stats = report.collective_stats(hlo)
    assert [r.kind for r in stats.records] == ["all-gather", "all-reduce", "collective-permute", "reduce-scatter"]
    assert all(r.is_async for r in stats.records)
    ag, ar, cp, rs = stats.records
    assert ag.buffer_bytes == ar.buffer_bytes == cp.buffer_bytes == rs.buffer_bytes == 4096
    assert cp.group_size == 2 and cp.bytes_per_step == 4096


def test_wrapped_async_collective_is_counted_in_its_computation():
    hlo = """HloModule m, num_partitions=4

%wrapped (a: f32[256]) -> f32[1024] {
  %a = f32[256]{0} parameter(0)
  ROOT %ag = f32[1024]{0} all-gather(%a), replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (p: f32[256]) -> f32[1024] {
  %p = f32[256]{0} parameter(0)
  %s = ((f32[256]{0}), f32[1024]{0}, u32[]) all-gather-start(%p), calls=%wrapped
  ROOT %d = f32[1024]{0} all-gather-done(%s)
}
"""
    (rec,) = report.collective_stats(hlo).records
    assert rec.name == "ag" and rec.multiplicity == 1 and rec.bytes_per_step == ring(4) * 4096


def _loop_module(backend_config: str, direction: str = "LT") -> str:
    return f"""HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}}

%inner_body (t: (s32[], f32[64])) -> (s32[], f32[64]) {{
  %t = (s32[], f32[64]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[64]{{0}} get-tuple-element(%t), index=1
  %ar = f32[64]{{0}} all-reduce(%v), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=%add
  ROOT %r = (s32[], f32[64]{{0}}) tuple(%i, %ar)
}}

%inner_cond (t: (s32[], f32[64])) -> pred[] {{
  %t = (s32[], f32[64]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %k = s32[] constant(3)
  ROOT %c = pred[] compare(%i, %k), direction={direction}
}}

%outer_body (t: (s32[], f32[64])) -> (s32[], f32[64]) {{
  %t = (s32[], f32[64]{{0}}) parameter(0)
  ROOT %w = (s32[], f32[64]{{0}}) while(%t), condition=%inner_cond, body=%inner_body{backend_config}
}}

%outer_cond (t: (s32[], f32[64])) -> pred[] {{
  %t = (s32[], f32[64]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %k = s32[] constant(5)
  ROOT %c = pred[] compare(%i, %k), direction=LT
}}

ENTRY %main (p: (s32[], f32[64])) -> (s32[], f32[64]) {{
  %p = (s32[], f32[64]{{0}}) parameter(0)
  ROOT %w = (s32[], f32[64]{{0}}) while(%p), condition=%outer_cond, body=%outer_body, backend_config={{"known_trip_count":{{"n":"5"}}}}
}}
"""


def test_loop_trip_counts_known_inferred_and_unknown():
    known = _loop_module(', backend_config={"known_trip_count":{"n":"4"}}')
    (rec,) = report.collective_stats(known).records
    assert rec.multiplicity == 20 and not rec.trip_count_inferred

    (rec,) = report.collective_stats(_loop_module("")).records  # from `i < 3`
    assert rec.multiplicity == 15 and rec.trip_count_inferred

    (rec,) = report.collective_stats(_loop_module("", direction="LE")).records  # `i <= 3`
    assert rec.multiplicity == 20

    stats = report.collective_stats(_loop_module("", direction="NE"))  # not recognised
    (rec,) = stats.records
    assert rec.multiplicity == 5 and rec.trip_count_unknown and stats.trip_count_unknown
    assert "?" in stats.table()


def test_table_lists_every_collective_and_totals():
    hlo = _module("  ROOT %ar = f32[1024]{0} all-reduce(%p), replica_groups=[1,8]<=[8], to_apply=%add")
    table = report.collective_stats(hlo).table()
    assert "ar" in table and "all-reduce" in table and "7.00 KiB" in table


# ---------------------------------------------------------------- small helpers


def test_format_bytes_uses_binary_units():
    assert report.format_bytes(0) == "0 B"
    assert report.format_bytes(1023) == "1023 B"
    assert report.format_bytes(1536) == "1.50 KiB"
    assert report.format_bytes(1.5 * 2**20) == "1.50 MiB"
    assert report.format_bytes(3 * 2**30) == "3.00 GiB"


def test_format_table_aligns_columns():
    rows = [{"name": "w", "bytes": 10}, {"name": "longer", "bytes": 2000}]
    lines = report.format_table(rows, ["name", ("bytes", "size")]).splitlines()
    assert lines[0].split() == ["name", "size"]
    assert lines[2] == "w         10" and lines[3] == "longer  2000"
    assert report.format_table([], ["a"]).splitlines()[0] == "a"


def test_peak_flops_and_mfu():
    assert report.peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert report.peak_flops_for("NVIDIA H200") == 989e12
    assert report.peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert report.peak_flops_for("TPU v4") == 275e12
    assert report.peak_flops_for("TPU v5 lite") == 197e12
    assert report.peak_flops_for("TPU v5") == 459e12
    assert report.peak_flops_for("TPU v5p") == 459e12
    assert report.peak_flops_for(jax.devices()[0]) is None  # CPU
    assert report.mfu(989e12 * 8 * 0.5, 1.0, 8, 989e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="step_time_s"):
        report.mfu(1.0, 0.0, 8, 1.0)


def test_peak_flops_of_every_device_kind_come_from_its_hardware_profile():
    # Dense (no sparsity) bf16 figures from the vendors' data sheets, written out here.
    data_sheets = {"NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12, "TPU v6 lite": 918e12,
                   "NVIDIA H100 80GB HBM3": 989e12, "TPU v5 lite": 197e12}
    for kind, peak in data_sheets.items():
        assert report.peak_flops_for(kind) == peak
        assert hardware.profile_for_device(kind).peak_flops["bf16"] == peak
    assert report.peak_flops_for("Some Future Accelerator") is None


@pytest.mark.parametrize(
    "attrs, devices",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['a'=2,'b'=4] {'b'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups={}, channel_id=1", [list(range(8))]),
        ("replica_groups=mesh['a'=8] {'a':(2)2}", None),  # a sub-axis: its size only
    ],
)
def test_collective_records_carry_the_devices_their_groups_join(attrs, devices):
    (rec,) = report.collective_stats(_module(f"  ROOT %ar = f32[1024]{{0}} all-reduce(%p), {attrs}, "
                                             "to_apply=%add")).records
    assert (None if rec.replica_groups is None else [list(g) for g in rec.replica_groups]) == devices
    assert hardware.replica_groups(attrs, 8) == devices  # the link placement reads the same parser
    if devices is not None:
        assert rec.group_size == len(devices[0])


def test_unreadable_shapes_only_matter_on_collectives():
    odd = "  %odd = weird<shape> custom-call(%p), custom_call_target=\"x\"\n"
    hlo = _module(odd + "  ROOT %ar = f32[1024]{0} all-reduce(%p), replica_groups=[1,8]<=[8], to_apply=%add")
    assert report.collective_stats(hlo).total_bytes == 7168
    with pytest.raises(ValueError, match="'ar'"):
        report.collective_stats(_module("  ROOT %ar = weird<shape> all-reduce(%p), replica_groups={}, to_apply=%add"))
