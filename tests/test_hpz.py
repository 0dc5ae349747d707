"""hpZ (strategy ``zero3_hpz``, ZeRO++'s hierarchical partitioning) on data=2 x fsdp=4, where
``data`` stands for two hosts of four devices each (devices 0-3 and 4-7: make_mesh puts the
processes on ``data`` in a multi-process job, `tests/test_multihost.py` runs that for real).

What is checked, against the compiled program and a one-device reference:
* every collective inside the layer scans (the forward gathers, the backward's remat re-gathers
  and the per-layer reduce-scatters) joins the devices of one host only;
* the only collectives that cross hosts are the once-per-step secondary all-gather over ``data``,
  the matching gradient reduce-scatter, and the scalar loss / metric all-reduces; the bytes are
  the README row's formulas;
* training matches a plain ``jax.jit`` + optax step on one device;
* per-device memory: the same persistent bytes as zero3, temporaries higher by the secondary
  partition and its gradient;
* ``plan`` reports the drop in inter-domain bytes.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardlib
from shardlib import build, make_layout, make_mesh
from shardlib.sharding.rules import RuleError, is_layout
from shardlib.sharding.strategies import STRATEGIES
from shardlib.step.hierarchical import HpzError
from shardlib.step.options import OptionError
from shardlib.tools import hardware as hw
from shardlib.tools.hlo import collective_stats
from shardlib.tools.plan import Planner
from tests import helpers

D, F = 2, 4  # hosts (data), devices per host (fsdp)
N = D * F
MESH = {"data": D, "fsdp": F}
HOSTS = ((0, 1, 2, 3), (4, 5, 6, 7))
ACROSS = ((0, 4), (1, 5), (2, 6), (3, 7))  # the data axis: one device of each host
SCALAR_BYTES = 256  # the loss / aux / grad-norm all-reduces of a step (a few floats)


def _ring(bytes_full: float, n: int) -> float:
    return bytes_full * (n - 1) / n


def _compile(program):
    rows = helpers.batches(1)[0]
    batch = program.abstract_batch({k: (v.shape, v.dtype) for k, v in rows.items()})
    return program.compile_step(program.abstract_state(), batch)


def _psi(layout) -> tuple[int, int]:
    """(all parameters, those of the scanned layer stack): every one is sharded here."""
    leaves = jax.tree.leaves(layout.params, is_leaf=is_layout)
    assert all(any(leaf.spec) for leaf in leaves)
    count = lambda keep: sum(int(np.prod(leaf.shape)) for leaf in leaves if keep(leaf))
    return count(lambda leaf: True), count(lambda leaf: leaf.logical[0] == "layers")


@pytest.fixture(scope="module")
def hpz():
    """5 steps of zero3_hpz run by its compiled step (one compile, shared by every assertion below)."""
    model = helpers.tiny_model()
    program = build(model, helpers.optimizer(), make_layout(model, "zero3_hpz", make_mesh(MESH)))
    compiled = _compile(program)
    state, losses = program.init(jax.random.key(0)), []
    for rows in helpers.batches():
        state, metrics = compiled(state, jax.device_put(rows, program.layout.batch_sharding(rows)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params), program, compiled


@pytest.fixture(scope="module")
def records(hpz):
    return collective_stats(hpz[3].as_text(), num_devices=N).records


def test_layer_gathers_and_regathers_stay_within_one_host(records):
    in_loop = [r for r in records if r.multiplicity > 1]  # the layer scans (trip count: n_layers)
    gathers = [r for r in in_loop if r.kind == "all-gather"]
    assert gathers and {r.kind for r in in_loop} == {"all-gather", "reduce-scatter"}
    assert all(r.replica_groups == HOSTS for r in in_loop), [(r.name, r.replica_groups) for r in in_loop]
    # the forward scan gathers, and the backward scan gathers again (remat), in its own loop body
    assert len({r.computation for r in gathers}) == 2


def test_only_the_secondary_gather_and_its_reduce_scatter_cross_hosts(hpz, records):
    psi, _ = _psi(hpz[2].layout)
    crossing = [r for r in records if hw.crosses_domains(r.replica_groups, r.group_size, F)]
    weights = [r for r in crossing if r.kind != "all-reduce"]
    assert all(r.multiplicity == 1 and r.replica_groups == ACROSS for r in weights)
    by_kind = {k: sum(r.bytes_per_step for r in weights if r.kind == k) for k in ("all-gather", "reduce-scatter")}
    secondary = _ring(4 * psi / F, D)  # every weight's 1/F block, gathered once over the hosts
    assert by_kind == {"all-gather": pytest.approx(secondary, rel=1e-6), "reduce-scatter": pytest.approx(secondary, rel=1e-6)}
    assert {r.kind for r in crossing} - {"all-gather", "reduce-scatter"} == {"all-reduce"}
    assert sum(r.bytes_per_step for r in crossing if r.kind == "all-reduce") < SCALAR_BYTES


def test_within_a_host_the_traffic_is_zero3s_over_fsdp(hpz, records):
    """zero3's exact accounting (tests/test_contract.py), over groups of F: the stack gathered
    forward and backward, the embedding and head once, every gradient reduce-scattered once."""
    psi, stack = _psi(hpz[2].layout)
    inside = [r for r in records if r.replica_groups == HOSTS]
    total = lambda kind: sum(r.bytes_per_step for r in inside if r.kind == kind)
    assert total("all-gather") == pytest.approx(_ring(4 * (psi + stack), F), rel=0.01)
    assert total("reduce-scatter") == pytest.approx(_ring(4 * psi, F), rel=0.01)


def test_trains_like_one_device(hpz):
    losses, params, _, _ = hpz
    ref_losses, ref_params = helpers.reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Adam amplifies reduction-order noise in parameters (docs/design.md); helpers.optimizer's eps bounds it
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, ref_params)


@pytest.fixture(scope="module")
def zero3():
    """zero3's compiled step on the same mesh, the baseline hpZ is measured against."""
    model = helpers.tiny_model()
    return _compile(build(model, helpers.optimizer(), make_layout(model, "zero3", make_mesh(MESH))))


def test_memory_is_zero3s_plus_the_secondary_partition(hpz, zero3):
    """Persistent bytes unchanged (12 Psi / N); temporaries rise by the secondary partition (each
    device holds 1/F of every weight instead of 1/N, from the gather to the end of the backward)
    and by its gradient, which waits for the once-per-step inter-host reduce-scatter: 2 x 4 Psi (1/F - 1/N)."""
    mine, theirs = hpz[3].memory_analysis(), zero3.memory_analysis()
    psi, _ = _psi(hpz[2].layout)
    assert mine.argument_size_in_bytes == theirs.argument_size_in_bytes
    secondary = 4 * psi * (1 / F - 1 / N)
    rise = mine.temp_size_in_bytes - theirs.temp_size_in_bytes
    assert 2 * secondary <= rise <= 1.1 * 2 * secondary, (rise, secondary)


def test_plan_reports_the_inter_domain_drop(zero3):
    """On a profile whose link domain is 4 devices (one "host"), plan lists hpZ with the default mesh
    data=2,fsdp=4; its inter-domain bytes are the secondary gather and reduce-scatter only, where
    every byte of zero3 on that mesh crosses domains (its groups are all 8 devices)."""
    profile = dataclasses.replace(hw.get_hardware("h100"), domain_size=F)
    planner = Planner("tiny", N, batch_size=helpers.BATCH, seq_len=helpers.SEQ, hardware=profile)
    assert "zero3_hpz" in planner.default_strategies()
    row = planner.candidate("zero3_hpz")
    assert row.mesh == MESH and not row.error
    psi, stack = planner.params, _psi(make_layout(helpers.tiny_model(), "zero3_hpz", make_mesh(MESH)))[1]
    assert row.inter_domain_bytes == pytest.approx(2 * _ring(4 * psi / F, D), abs=SCALAR_BYTES)
    assert row.intra_domain_bytes == pytest.approx(_ring(4 * (2 * psi + stack), F), rel=0.01)
    baseline = hw.link_bytes(collective_stats(zero3.as_text(), num_devices=N).records, N, F)
    assert baseline.intra == 0 and row.inter_domain_bytes < baseline.inter / 9


def test_secondary_gather_needs_the_host_axis_minor():
    """Blocks of a dim stored over (fsdp, data): a gather over data alone is a contiguous block of
    the fsdp split, so gathering over fsdp afterwards restores the tensor; over (data, fsdp) not."""
    mesh = make_mesh(MESH)
    x = jnp.arange(N * 2, dtype=jnp.float32)

    def two_stage(storage):
        gather = lambda s: jax.lax.all_gather(jax.lax.all_gather(s, "data", tiled=True), "fsdp", tiled=True)
        return jax.shard_map(gather, mesh=mesh, in_specs=P(storage), out_specs=P(), check_vma=False)(x)

    np.testing.assert_array_equal(two_stage(("fsdp", "data")), x)
    assert not np.array_equal(two_stage(("data", "fsdp")), x)
    model = helpers.tiny_model()
    wrong = STRATEGIES["zero3"].with_rules(name="zero3_data_major", secondary_axis="data")
    with pytest.raises(HpzError, match=r"blocks/attn/wk is stored over \('data', 'fsdp'\).*'data' last"):
        build(model, helpers.optimizer(), make_layout(model, wrong, mesh))


def test_refuses_a_mesh_without_a_host_split():
    model = helpers.tiny_model()
    with pytest.raises(RuleError, match=r"'zero3_hpz' shards over mesh axis data, .*--mesh data=2,fsdp=4"):
        make_layout(model, "zero3_hpz", make_mesh({"fsdp": N}))


def test_warns_for_a_model_that_gathers_everything_up_front():
    model = shardlib.from_functions(lambda key: {"w": jax.random.normal(key, (64, 64))},
                                    lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), logical_axes={"w": ("embed", "mlp")})
    with pytest.warns(UserWarning, match="gathers_params=False.*only adds the secondary partition's memory"):
        build(model, optax.sgd(0.1), make_layout(model, "zero3_hpz", make_mesh(MESH)))


def test_qwz_composes_and_int8_qgz_is_refused_by_name():
    """qwZ's int8 gather applies to the per-layer (intra-host) gathers; qgZ's int8 error feedback
    is not carried through the secondary gather, and build says so, before anything is traced."""
    model = helpers.tiny_model()
    layout = make_layout(model, "zero3_hpz", make_mesh(MESH))
    rows = helpers.batches(1)[0]
    batch = lambda program: program.abstract_batch({k: (v.shape, v.dtype) for k, v in rows.items()})
    program = build(model, helpers.optimizer(), layout, weight_gather="int8")
    text = program.step.lower(program.abstract_state(), batch(program)).as_text()
    assert re.search(r"stablehlo.all_gather.*xi8>", text)  # int8 codes are gathered
    with pytest.raises(OptionError, match="grad_compression='int8' .*zero3_hpz.*grad_compression='bf16'"):
        build(model, helpers.optimizer(), layout, grad_compression="int8")
