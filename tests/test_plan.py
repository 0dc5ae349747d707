"""`shardlib plan` / `shardlib inspect` / scripts/benchmark.py.

Every figure here comes from programs compiled for the 8 simulated devices (never run, except in
the benchmark smoke test), so the assertions are properties of the compiled step, not of the
machine: byte counts against the ZeRO memory model, the fit decision at an exact HBM boundary,
the JSON schema, and one-line errors for bad flags.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardlib.models import get_config, param_count
from shardlib import cli
from shardlib.tools import hardware
from shardlib.tools.plan import Planner, mark_best, plan
from shardlib.tools.plan_candidates import PlanError, PlanRow

ROW_KEYS = set(PlanRow.__dataclass_fields__) | {"mesh_text"}
DOC_KEYS = {"schema_version", "model", "config", "params", "devices", "batch_size", "seq_len", "precision",
            "hbm_bytes", "hardware", "candidates", "best", "suggestions", "model_notes",
            "topology", "slices", "compiler", "links"}  # the last four since plan --topology (additive)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- the JSON document


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> str:
    """A plan cache for the JSON test and the plot test, which both plan tiny's zero3 on 8 devices
    at batch 8: the second reads the first's compile back instead of compiling it again (every
    figure of a read-back row is the compiled one's: `test_a_rerun_plan_reads_its_compiles_back`)."""
    return str(tmp_path_factory.mktemp("plan-cache"))


def test_plan_json_is_one_document_with_stable_keys(capsys, shared_cache):
    code, out, err = run_cli(capsys, "plan", "--model", "tiny", "--devices", "8", "--strategy", "zero3",
                             "--batch-size", "8", "--json", "--cache-dir", shared_cache)
    assert code == 0, err
    doc = json.loads(out)  # exactly one JSON document on stdout
    assert set(doc) == DOC_KEYS
    assert doc["schema_version"] == 1 and doc["devices"] == 8 and doc["params"] == param_count(get_config("tiny"))
    (row,) = doc["candidates"]
    assert set(row) == ROW_KEYS
    assert row["strategy"] == "zero3" and row["mesh"] == {"fsdp": 8} and row["mesh_text"] == "fsdp=8"
    assert row["error"] is None and row["fits"] is True and row["best"] is True
    assert set(row["collective_bytes"]) == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                            "collective-permute"}
    assert row["collective_total_bytes"] == sum(row["collective_bytes"].values())
    assert row["step_s"] == max(row["compute_s"], row["comm_s"]) > 0
    assert row["persistent_bytes"] == row["params_bytes"] + row["opt_state_bytes"] + 4  # + the step counter
    assert row["peak_bytes"] == row["persistent_bytes"] + row["transient_bytes"]
    command = doc["best"].pop("command")  # the `shardlib train` line that runs the pick
    assert doc["best"] == {"strategy": "zero3", "mesh": {"fsdp": 8}} and doc["suggestions"] == []
    assert command.startswith("shardlib train --model tiny --strategy zero3 --mesh fsdp=8 --batch-size")
    assert doc["hardware"]["name"] == "h100" and doc["hbm_bytes"] == doc["hardware"]["hbm_bytes"]
    assert doc["topology"] is None and doc["compiler"]["platform"] == "cpu"
    assert row["attention"] == "einsum"  # the GPU policy in float32 (cuDNN takes bf16), below FLASH_MIN_SEQ


def test_plan_for_tpu_on_cpu_devices_compiles_flash_for_the_pallas_kernel(capsys):
    """On simulated devices with a TPU's --hardware, bf16: the Pallas kernel a TPU run uses cannot
    compile on XLA:CPU, so the row compiles (and names) shardlib's flash attention, and says why."""
    code, out, err = run_cli(capsys, "plan", "--model", "tiny", "--devices", "8", "--hardware", "tpu-v5e",
                             "--strategy", "zero3", "--batch-size", "8", "--precision", "bf16", "--json")
    assert code == 0, err
    (row,) = json.loads(out)["candidates"]
    assert row["attention"] == "flash" and any("Pallas splash kernel" in note for note in row["notes"])


def test_plan_for_gpu_on_cpu_devices_stands_in_for_cudnn_with_memory_linear_flash():
    """On simulated devices with a GPU's --hardware, bf16: cuDNN's fused kernel cannot compile on
    XLA:CPU, so the row compiles shardlib's flash in its place and says so; its temporaries then
    grow linearly with the tokens, as cuDNN's do (XLA's dot_product_attention, the stand-in before,
    grew x3.5 for 2x tokens: its T x T scores)."""
    rows = [Planner("tiny", 8, batch_size=8, seq_len=seq_len, precision="bf16", hardware="h100", remat=False)
            .candidate("zero3", {"fsdp": 8}) for seq_len in (512, 1024)]
    for row in rows:
        assert row.error is None and row.attention == "flash (stand-in for cuDNN)"
        assert any("stand-in for cuDNN" in note for note in row.notes)
    short, long = rows
    assert long.temp_bytes <= 2.3 * short.temp_bytes, (short.temp_bytes, long.temp_bytes)


# ---------------------------------------------------------------- fit / no fit


def test_fit_decision_at_the_hbm_boundary_and_advice_when_nothing_fits():
    planner = Planner("tiny", 8, batch_size=16, seq_len=64)
    rows = planner.run(["dp", "zero2"])
    dp, zero2 = rows
    assert zero2.peak_bytes < dp.peak_bytes

    planner.decide(rows, hbm=dp.peak_bytes)  # exactly dp's peak: both fit; equal times -> less memory wins
    assert dp.fits and zero2.fits and zero2.best and not dp.best

    planner.decide(rows, hbm=zero2.peak_bytes)  # zero2 fits exactly, dp does not
    assert zero2.fits and zero2.best and not dp.fits

    planner.decide(rows, hbm=zero2.peak_bytes - 1)
    assert not any(r.fits or r.best for r in rows)

    # An HBM where zero3 needs ~12 devices at this many sequences per device: 12 Psi / 12 + transient.
    state_total = planner._state_total()
    transient = min(r.transient_bytes for r in rows)
    planner.decide(rows, hbm=transient + state_total // 12)
    advice = {a["kind"]: a for a in planner.advise(rows)}
    assert set(advice) == {"devices", "grad_accumulation", "strategy"}  # remat is already on
    more = advice["devices"]
    assert more["strategy"] == "zero3" and more["min_devices"] in (12, 13) and more["devices"] == 16
    assert more["persistent_bytes"] + more["transient_bytes"] <= planner.hbm_bytes
    assert advice["strategy"]["strategy"] == "zero3" and advice["strategy"]["fits"] is False  # not on 8
    accumulation = advice["grad_accumulation"]  # 2 sequences per device: 2 microbatches of 1, if anything
    assert accumulation["strategy"] == "zero2"
    if accumulation["microbatches"] is not None:
        assert accumulation["microbatches"] == 2 and accumulation["estimated_peak_bytes"] <= planner.hbm_bytes
    assert mark_best(rows) is None


# ---------------------------------------------------------------- memory contract, >= 100M params


def test_zero3_memory_and_traffic_contract_on_gpt2_small():
    config = get_config("gpt2-small")
    psi, n = param_count(config), 8
    assert psi > 100e6
    (row,) = plan("gpt2-small", n, ["zero3"], batch_size=8, seq_len=128)
    assert row.error is None
    assert row.persistent_bytes == pytest.approx(12 * psi / n, rel=0.02)  # fp32 params + Adam, sharded
    assert row.argument_bytes == pytest.approx(12 * psi / n, rel=0.02)
    # One layer at a time: every scanned layer is gathered in the forward and again in the backward
    # (remat), the embedding and the head once (the lookup's backward needs no weights; the head's
    # gathered weights are reused by its backward, as in tests/test_contract.py), and every gradient
    # is reduce-scattered once: 3 Psi minus (embedding + head + final norm), f32, ring (N-1)/N.
    # A whole-model gather (2 Psi: forward, reused) or a per-use re-gather would miss by >= 6%.
    ring = 4 * (n - 1) / n
    stack = param_count(config) - param_count(dataclasses.replace(config, n_layers=0))  # the scanned layers
    assert row.collective_bytes["reduce-scatter"] == pytest.approx(ring * psi, rel=0.001)
    assert row.collective_bytes["all-gather"] == pytest.approx(ring * (psi + stack), rel=0.001)
    assert row.collective_total_bytes == pytest.approx(ring * (2 * psi + stack), rel=0.001)


# ---------------------------------------------------------------- bf16 collective counting


def test_bf16_tensor_parallel_collectives_are_counted_at_two_bytes():
    f32, bf16 = (plan("tiny", 8, ["tp"], batch_size=8, seq_len=64, precision=p)[0] for p in ("f32", "bf16"))
    assert f32.error is None and bf16.error is None
    assert any("bf16 collective" in note for note in bf16.notes)
    # Parameter traffic is f32 either way; the activation all-reduces halve.
    assert bf16.collective_bytes["all-reduce"] < f32.collective_bytes["all-reduce"]
    assert bf16.collective_bytes["all-reduce"] >= f32.collective_bytes["all-reduce"] / 2


# ---------------------------------------------------------------- which link a collective uses


def test_replica_group_forms_and_domain_crossing():
    groups = hardware.replica_groups
    assert groups("replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("replica_groups={}, to_apply=%add", 4) == [[0, 1, 2, 3]]
    assert groups("replica_groups=[2,4]<=[8], dimensions={0}", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups("replica_groups=mesh['a'=2,'b'=4] {'a'}, use_global_device_ids=true", 8) == \
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups("replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}, channel_id=1", 8) == \
        [[0, 1, 2, 3], [4, 5, 6, 7]]  # devices listed column-major: a varies fastest in device order
    assert groups("source_target_pairs={{0,1},{1,0}}", 2) == [[0, 1], [1, 0]]
    assert groups("to_apply=%add", 4) == [[0, 1, 2, 3]]  # no replica_groups: every device
    assert groups("replica_groups=[2,2,2]<=[8]", 8) is None  # a form not understood: placed by size
    assert hardware.crosses_domains([[0, 4]], 2, 4) and not hardware.crosses_domains([[0, 1, 2, 3]], 4, 4)
    assert hardware.crosses_domains(None, 8, 4) and not hardware.crosses_domains(None, 4, 4)


def test_hsdp_data_axis_traffic_crosses_nodes_of_four():
    four_per_node = hardware.HardwareProfile(
        name="test-node4", description="4 devices per node", hbm_bytes=10**12, peak_flops={"f32": 1e12},
        domain_size=4, intra_bandwidth=1e11, inter_bandwidth=1e10, sources=())
    (row,) = plan("tiny", 8, ["hsdp"], mesh="data=2,fsdp=4", batch_size=8, seq_len=64, hardware=four_per_node)
    assert row.error is None and row.inter_domain_bytes > 0 and row.intra_domain_bytes > 0
    # Only the gradient all-reduce over `data` (plus scalars) crosses: gathers stay in the fsdp node.
    assert row.inter_domain_bytes == pytest.approx(row.collective_bytes["all-reduce"], rel=0.01)
    assert row.comm_s == pytest.approx(row.intra_domain_bytes / 1e11 + row.inter_domain_bytes / 1e10)


# ---------------------------------------------------------------- clear errors


@pytest.mark.parametrize("argv, words", [
    (["--model", "gpt5", "--devices", "8"], ["unknown model config 'gpt5'", "--model", "tiny"]),
    (["--model", "tiny", "--devices", "8", "--hardware", "tpu-v9"], ["unknown hardware 'tpu-v9'", "--hardware", "h100"]),
    (["--model", "tiny", "--devices", "8", "--mesh", "data=2,fsdp=2"], ["needs 4 devices", "8 are available"]),
    (["--model", "tiny", "--devices", "8", "--strategy", "zero4"], ["unknown strategy 'zero4'", "--strategy"]),
    (["--model", "tiny", "--devices", "8", "--hbm", "lots"], ["cannot read 'lots'", "--hbm"]),
    (["--model", "tiny", "--devices", "8", "--hbm", "80"], ["'80' has no unit", "--hbm 80GB"]),  # not 80 bytes
    (["--model", "tiny"], ["--devices N", "--topology NAME"]),
])
def test_plan_errors_are_one_line_naming_the_flag(capsys, argv, words):
    code, out, err = run_cli(capsys, "plan", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("shardlib plan: error:")
    for word in words:
        assert word in err


def test_more_devices_than_the_process_has_says_how_to_get_them():
    with pytest.raises(PlanError, match=r"planning for 16 devices .* has 8.*jax_num_cpu_devices"):
        plan("tiny", 16, ["dp"])


def test_plot_draws_memory_and_step_time_against_chips(tmp_path, shared_cache):
    """`plan --plot`: a line per strategy over the plans' chip counts (zero3 planned on 4 and 8 devices)."""
    from shardlib.tools.plan_report import plan_document
    from shardlib.tools.plan_plot import plot_plans

    documents = []
    for devices in (4, 8):
        planner = Planner("tiny", devices, batch_size=8, cache_dir=shared_cache)
        rows = planner.run(["zero3"])
        documents.append(plan_document(planner, rows, []))
    path = plot_plans(documents, str(tmp_path / "chips.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_rerun_plan_reads_its_compiles_back(tmp_path, monkeypatch):
    """The plan's compile cache: a candidate planned again is not compiled again (compiling fails
    on the second planner), and every figure of its row is the first's (its compile time aside).
    The candidate offloads its optimizer state, so the read-back program must also know which of
    its arguments live in host memory: XLA:CPU counts them as device bytes, and the plan takes them out."""
    import dataclasses

    import jax

    def plan():
        return Planner("tiny", 8, batch_size=8, offload="opt_state", cache_dir=str(tmp_path)).candidate("zero3")

    first = plan()
    assert first.error is None and first.host_bytes and len(list(tmp_path.iterdir())) == 1

    def refuse(self, *args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    again = plan()
    assert again.error is None
    for field, value in dataclasses.asdict(first).items():
        if field != "compile_s":
            assert getattr(again, field) == value, field


# One process planning the same bf16 candidate twice, with JAX's persistent compilation cache on.
PLAN_TWICE_WITH_JAXS_CACHE = """
from shardlib.tools.plan import Planner
for _ in range(2):
    row = Planner("tiny", 8, precision="bf16", hardware="h100").candidate("zero3", {"fsdp": 8})
    print(row.collective_bytes["all-gather"], " | ".join(row.notes))
"""


def test_a_plan_read_from_jaxs_compilation_cache_says_why_its_bf16_count_is_an_upper_bound(tmp_path):
    """A bf16 plan on CPU devices counts bf16 collectives at 2 bytes from XLA's dump of the module
    after SPMD partitioning (XLA:CPU widens them to f32). JAX's compilation cache key leaves the dump
    options out, so the second compile of the program is a cache hit that dumps nothing: that row
    counts them at f32 (more than the first, bf16 all-gathers at 4 bytes an element) and its note
    names the cache and the setting that counts them exactly."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", PLAN_TWICE_WITH_JAXS_CACHE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (compiled, compiled_notes), (hit, hit_notes) = [line.split(" ", 1) for line in proc.stdout.splitlines()[-2:]]
    assert "was not found" not in compiled_notes and "counted at 2 bytes/element" in compiled_notes
    assert int(hit) > 1.8 * int(compiled)  # the bf16 all-gathers at XLA:CPU's 4 bytes (2.2x here)
    assert ("XLA's partitioned HLO was not found (JAX's persistent compilation cache returned the program without "
            "compiling it; JAX_ENABLE_COMPILATION_CACHE=false counts them exactly)") in hit_notes


# ---------------------------------------------------------------- inspect


def test_inspect_lists_every_parameter_and_the_replicated_ones(capsys):
    code, out, err = run_cli(capsys, "inspect", "--model", "tiny", "--strategy", "zero3", "--devices", "8", "--json")
    assert code == 0, err
    doc = json.loads(out)
    by_path = {r["path"]: r for r in doc["params"]}
    assert len(by_path) == 12 and doc["replicated"] == []
    wq = by_path["blocks/attn/wq"]
    assert wq["logical"] == ["layers", "embed", "heads", "head_dim"] and "fsdp" in json.dumps(wq["spec"])
    assert wq["bytes_per_device"] * 8 == wq["bytes"]

    # 3 devices divide none of tiny's dimensions: every tensor stays replicated, each with its reason.
    code, out, err = run_cli(capsys, "inspect", "--model", "tiny", "--strategy", "zero3", "--devices", "3")
    assert code == 0, err
    assert "12 tensor(s) stay replicated" in out and "not divisible by fsdp=3" in out
    assert "blocks/mlp/w_up" in out and "per device" in out


# ---------------------------------------------------------------- benchmark smoke test


def test_benchmark_script_runs_and_prints_ratios(capsys):
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "benchmark.py")
    spec = importlib.util.spec_from_file_location("shardlib_benchmark", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    assert benchmark.main(["--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--repeats", "1",
                           "--warmup", "0", "--strategies", "zero3", "--markdown"]) == 0
    out = capsys.readouterr().out
    (line,) = [l for l in out.splitlines() if l.startswith("| zero3 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "fsdp=8" and float(cells[4]) > 0  # median ratio shardlib / jit
