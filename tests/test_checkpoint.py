"""shardlib.runtime.checkpoint / shardlib.tools.export: restore onto any layout, resume, crash safety, export.

Equality here is bit for bit (``np.array_equal``): a checkpoint moves bytes, it computes nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardlib.models import get_config, trainable
from shardlib.models.configs import GPTConfig
from shardlib import build, make_layout, make_mesh
from shardlib import cli
from shardlib.runtime.checkpoint import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    Checkpointer,
    NonFiniteStateError,
    PreemptionGuard,
)
from shardlib.runtime.checkpoint_contents import is_finite_state
from shardlib.runtime.data import ByteBatches, load_text
from shardlib.tools.export import export_params, load_exported, read_export_metadata
from shardlib.sharding.mesh import MESH_AXES
from tests.helpers import assert_bitwise, host_copy
from tests import compile_flags

REPO = Path(__file__).resolve().parents[1]
BATCH, SEQ = 8, 32
CONFIG = {"model": "tiny", "strategy": "zero3", "mesh": {"fsdp": 8}}


def _program(model, strategy: str, sizes: dict, n_devices: int = 8, tx=None):
    mesh = make_mesh(sizes, devices=jax.devices()[:n_devices])
    return build(model, tx or optax.adamw(1e-2), make_layout(model, strategy, mesh))




def _random_host_state(program, seed: int):
    """NumPy values for the program's state: every element a distinct random number.

    Random values (not zeros, as Adam's moments are after init) make any shard that lands in
    the wrong place, or any leaf swapped with another of the same shape, visible.
    """
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda leaf: rng.standard_normal(leaf.shape).astype(leaf.dtype)
        if jnp.issubdtype(leaf.dtype, jnp.floating) else np.full(leaf.shape, 7, leaf.dtype),
        program.abstract_state(),
    )


def _distinct_state(program, seed: int):
    """`_random_host_state` placed in the program's layout."""
    return jax.tree.map(lambda h, leaf: jax.device_put(h, leaf.sharding), _random_host_state(program, seed), program.abstract_state())


def _data_state(step: int) -> dict:
    return {"step": step, "seed": 0}


@pytest.fixture(scope="module")
def tiny():
    return trainable(get_config("tiny"))


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return load_text(None)


@pytest.fixture(scope="module")
def zero3(tiny):
    return _program(tiny, "zero3", {"fsdp": -1})


@pytest.fixture(scope="module")
def trained(zero3, corpus):
    """A zero3 state after 2 real steps (non-zero Adam moments). Never pass it to program.step (donation)."""
    state = zero3.init(jax.random.key(0))
    batches = ByteBatches(corpus, BATCH, SEQ, seed=1)
    for _ in range(2):
        state, _ = zero3.step(state, next(batches))
    return state


# ---------------------------------------------------------------- restore onto any layout


@pytest.mark.parametrize(
    "source, target",
    [
        (("zero3", {"fsdp": -1}, 8), ("dp", {"data": -1}, 4)),
        (("fsdp_tp", {"fsdp": 4, "tensor": 2}, 8), ("zero1", {"data": -1}, 8)),
        (("dp", {"data": -1}, 1), ("zero3", {"fsdp": -1}, 8)),
    ],
    ids=["zero3x8-to-dpx4", "fsdp_tp-to-zero1", "1dev-to-zero3x8"],
)
def test_restore_onto_another_layout_is_bitwise(tiny, tmp_path, source, target) -> None:
    src = _program(tiny, source[0], source[1], source[2])
    dst = _program(tiny, target[0], target[1], target[2])
    state = _distinct_state(src, seed=3)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(5, state, data_state=_data_state(5), config=CONFIG, force=True)
        ckpt.wait()
        restored, data_state, config = ckpt.restore(dst.abstract_state())
    assert_bitwise(state, restored)  # params and optimizer state (Adam mu, nu, count), and step
    assert data_state == _data_state(5) and config == CONFIG
    expected = jax.tree.leaves(dst.state_sharding)
    for leaf, sharding in zip(jax.tree.leaves(restored), expected):
        assert leaf.sharding == sharding  # laid out as the new program wants, on its devices
    assert {d.id for d in jax.tree.leaves(restored.params)[0].devices()} == {d.id for d in jax.devices()[: target[2]]}


# ---------------------------------------------------------------- resume


def test_resume_equals_straight_run_bitwise(zero3, corpus, tmp_path) -> None:
    straight = zero3.init(jax.random.key(1))
    batches = ByteBatches(corpus, BATCH, SEQ, seed=5)
    straight_losses = []
    for _ in range(6):
        straight, m = zero3.step(straight, next(batches))
        straight_losses.append(float(m["loss"]))

    state = zero3.init(jax.random.key(1))
    batches = ByteBatches(corpus, BATCH, SEQ, seed=5)
    for _ in range(3):
        state, _ = zero3.step(state, next(batches))
    with Checkpointer(tmp_path / "ckpt", every=3) as ckpt:
        assert ckpt.should_save(3)
        assert ckpt.save(3, state, data_state=batches.state(), config=CONFIG)
    del state, batches

    with Checkpointer(tmp_path / "ckpt", every=3) as ckpt:  # a new process would start here
        assert ckpt.latest_step() == 3
        state, data_state, config = ckpt.restore(zero3.abstract_state())
    batches = ByteBatches(corpus, BATCH, SEQ, seed=0)  # the wrong seed: restore must fix it
    batches.restore(data_state)
    resumed_losses = []
    for _ in range(3):
        state, m = zero3.step(state, next(batches))
        resumed_losses.append(float(m["loss"]))
    assert config == CONFIG and data_state == {"step": 3, "seed": 5}
    assert resumed_losses == straight_losses[3:]
    assert_bitwise(straight, state)


# ---------------------------------------------------------------- async save, retention


def test_async_save_survives_donation_and_commits_on_wait(zero3, corpus, tmp_path) -> None:
    state = zero3.init(jax.random.key(2))
    expected = host_copy(state)
    with Checkpointer(tmp_path / "ckpt", async_save=True) as ckpt:
        assert ckpt.save(1, state, data_state=_data_state(1), config=CONFIG, force=True)
        # Training goes on while the save is written, and the step donates the saved state. (On
        # CPU Orbax's host copy of a shard may alias its buffer, and XLA then copies instead of
        # donating; on GPU/TPU the buffers are reused. The checkpoint must hold the old values.)
        for step in range(2):
            state, _ = zero3.step(state, ByteBatches(corpus, BATCH, SEQ).batch(step))
        ckpt.wait()
        assert ckpt.latest_step() == 1
        files = [p for p in (tmp_path / "ckpt" / "1" / "state").rglob("*") if p.is_file()]
        assert files and not list((tmp_path / "ckpt").glob("*tmp*"))
        restored, _, _ = ckpt.restore(zero3.abstract_state())
    assert_bitwise(expected, restored)


def test_every_and_keep_retain_the_newest(trained, tmp_path) -> None:
    with Checkpointer(tmp_path / "ckpt", every=2, keep=2) as ckpt:
        saved = [s for s in range(1, 8) if ckpt.save(s, trained, data_state=_data_state(s), config=CONFIG)]
        ckpt.wait()
        assert saved == [2, 4, 6]
        assert ckpt.all_steps() == [4, 6]
        assert not ckpt.should_save(6) and not ckpt.should_save(4)
        assert not ckpt.save(6, trained, data_state=_data_state(99), config=CONFIG, force=True)  # never overwrite
        ckpt.wait()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["4", "6"]
    with Checkpointer(tmp_path / "ckpt", create=False) as ckpt:
        assert ckpt.saved_meta(6)["mesh"] == {a: 8 if a == "fsdp" else 1 for a in MESH_AXES}
        _, data_state, _ = ckpt.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), trained))
    assert data_state == _data_state(6)


# ---------------------------------------------------------------- transient fields


def _dropout_bn_model():
    """A model with both a dropout key (TrainState.rng) and BatchNorm statistics (model_state)."""
    from shardlib import from_nnx
    from tests import zoo

    return from_nnx(lambda rngs: zoo.NnxCNN(rngs=rngs, dropout_rate=0.5), zoo.cnn_loss)


def _built(model, sizes: dict, n_devices: int, **options):
    mesh = make_mesh(sizes, devices=jax.devices()[:n_devices])
    return build(model, optax.adamw(1e-2), make_layout(model, "dp", mesh), **options)


def _assert_learned_fields_bitwise(saved, restored) -> None:
    for name in ("step", "params", "opt_state", "rng", "model_state", "steps_taken"):
        assert_bitwise(getattr(saved, name), getattr(restored, name))


@pytest.mark.parametrize(
    "source, target, field, expected",
    [
        (({"data": 8}, 8, {"grad_compression": "int8"}), ({"data": 4}, 4, {"grad_compression": "int8"}),
         "grad_residual", "re-initialised"),
        (({"data": 8}, 8, {"grad_compression": "int8"}), ({"data": 8}, 8, {}), "grad_residual", "dropped"),
        (({"data": 8}, 8, {"precision": "fp16"}), ({"data": 8}, 8, {"precision": "f32"}), "loss_scale", "dropped"),
        (({"data": 4}, 4, {"precision": "f32"}), ({"data": 8}, 8, {"precision": "fp16"}), "loss_scale", "re-initialised"),
    ],
    ids=["int8x8-to-int8x4", "int8-to-none", "fp16-to-f32", "f32x4-to-fp16x8"],
)
def test_transient_fields_start_afresh_where_the_layout_differs(tmp_path, caplog, source, target, field, expected):
    model = _dropout_bn_model()
    src, dst = _built(model, *source[:2], **source[2]), _built(model, *target[:2], **target[2])
    state = _distinct_state(src, seed=4)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(5, state, data_state=_data_state(5), config=CONFIG, force=True)
        ckpt.wait()
        with caplog.at_level(logging.WARNING, logger="shardlib.runtime.checkpoint"):
            restored, data_state, config = ckpt.restore(dst.abstract_state(), fresh=dst.fresh_transient)
        again, _, _ = ckpt.restore(src.abstract_state())  # the checkpoint itself is unchanged
    _assert_learned_fields_bitwise(state, restored)
    assert_bitwise(state, again)
    assert data_state == _data_state(5) and config == CONFIG
    fresh = host_copy(dst.fresh_transient()[field])
    assert_bitwise(fresh, getattr(restored, field))  # zeros / the initial scale, or None
    if expected == "re-initialised":
        assert jax.tree.leaves(getattr(restored, field))
    for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(dst.state_sharding)):
        assert leaf.sharding == sharding
    assert f"{expected} (" in caplog.text and field.split("_")[-1] in caplog.text


def test_transient_fields_need_the_fresh_values_to_start_afresh(tmp_path):
    model = _dropout_bn_model()
    src, dst = _built(model, {"data": 8}, 8, grad_compression="int8"), _built(model, {"data": 4}, 4, grad_compression="int8")
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, _distinct_state(src, seed=5), data_state=_data_state(1), config=CONFIG, force=True)
        ckpt.wait()
        with pytest.raises(CheckpointMismatchError, match="grad_residual: their shapes differ.*fresh=program.fresh_transient"):
            ckpt.restore(dst.abstract_state())


# ---------------------------------------------------------------- crash safety

_KILLED_SAVER = textwrap.dedent(
    """
    import asyncio, sys
    import jax, jax.numpy as jnp
    import orbax.checkpoint as ocp
    from shardlib.runtime.checkpoint import Checkpointer
    from shardlib.step import TrainState

    def state(value):
        return TrainState(step=jnp.int32(value), params={"w": jnp.full((256, 1024), float(value))},
                          opt_state={"m": jnp.full((1024,), -float(value))})

    ckpt = Checkpointer(sys.argv[1], keep=1)  # keep=1: committing step 2 would delete step 1
    ckpt.save(1, state(1), data_state={"step": 1, "seed": 0}, config={"model": "none"}, force=True)
    ckpt.wait()

    async def never_commit(self, *args, **kwargs):  # the arrays are written; the rename is next
        # While step 2 is in flight, only step 1 counts as a checkpoint.
        print("WRITTEN-NOT-COMMITTED", ckpt.latest_step(), ckpt.all_steps(), flush=True)
        await asyncio.sleep(3600)

    ocp.path.atomicity.AtomicRenameTemporaryPath.finalize = never_commit
    ckpt.save(2, state(2), data_state={"step": 2, "seed": 0}, config={"model": "none"}, force=True)
    ckpt.wait()
    """
)


def _subprocess_env() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=1 --xla_cpu_collective_call_terminate_timeout_seconds=900 "
                        + compile_flags.FAST)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVER, str(ckpt_dir)],
        env=_subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()  # blocks until the save of step 2 reached its commit point
        assert line.startswith("WRITTEN-NOT-COMMITTED"), proc.stderr.read() if proc.poll() is not None else line
        assert line.split(maxsplit=1)[1].strip() == "1 [1]"  # latest_step / all_steps: complete ones only
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    leftovers = [p.name for p in ckpt_dir.iterdir()]
    assert "1" in leftovers and "2" not in leftovers
    assert any(name.startswith("2.orbax-checkpoint-tmp") for name in leftovers)  # killed mid-save

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    from shardlib.step import TrainState

    target = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=dev),
        params={"w": jax.ShapeDtypeStruct((256, 1024), jnp.float32, sharding=dev)},
        opt_state={"m": jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=dev)},
    )
    with Checkpointer(ckpt_dir, keep=1) as ckpt:
        assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
        state, data_state, _ = ckpt.restore(target)
        assert int(state.step) == 1 and np.all(np.asarray(state.params["w"]) == 1.0)
        assert np.all(np.asarray(state.opt_state["m"]) == -1.0) and data_state["step"] == 1
        # The interrupted step can be saved again, and only then does retention drop step 1.
        assert ckpt.save(2, state, data_state={"step": 2, "seed": 0}, config={}, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [2]
    assert not list(ckpt_dir.glob("*orbax-checkpoint-tmp*"))


# ---------------------------------------------------------------- preemption


def test_sigterm_sets_the_guard_and_handler_is_restored() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert not guard.synced  # single process: shardlib's own handler
        assert not guard.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)  # the process survives: the handler only sets a flag
        for _ in range(1000):  # the handler runs on the main thread at the next bytecode boundary
            if guard.requested:
                break
        assert guard.requested and guard.should_stop(2)
    assert signal.getsignal(signal.SIGTERM) == before


# ---------------------------------------------------------------- non-finite states


def test_non_finite_state_is_never_saved(trained, tmp_path) -> None:
    with Checkpointer(tmp_path / "ckpt", every=1) as ckpt:
        assert ckpt.save(1, trained, data_state=_data_state(1), config=CONFIG)
        ckpt.wait()
        assert is_finite_state(trained)
        poisoned = jax.tree_util.tree_map_with_path(
            lambda p, x: x.at[(0,) * x.ndim].set(jnp.nan) if "wq" in jax.tree_util.keystr(p) and p[0].name == "params" else x,
            trained,
        )
        assert not is_finite_state(poisoned)
        with pytest.raises(NonFiniteStateError, match=r"params/blocks/attn/wq") as err:
            ckpt.save(2, poisoned, data_state=_data_state(2), config=CONFIG)
        assert "last good checkpoint (step 1)" in str(err.value)
        assert not ckpt.save(3, trained, data_state=_data_state(3), config=CONFIG, metrics={"loss": jnp.float32(jnp.nan)})
        assert not ckpt.save(4, trained, data_state=_data_state(4), config=CONFIG,
                             metrics={"loss": jnp.float32(2.0), "skipped": jnp.int32(1)})
        assert ckpt.save(5, trained, data_state=_data_state(5), config=CONFIG, metrics={"loss": jnp.float32(2.0), "skipped": jnp.int32(0)})
        ckpt.wait()
        assert ckpt.all_steps() == [1, 5]


# ---------------------------------------------------------------- bad input


def test_mismatched_model_or_optimizer_lists_paths(trained, tmp_path) -> None:
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, trained, data_state=_data_state(1), config=CONFIG, force=True)
        ckpt.wait()
        wider = trainable(GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=128, max_seq_len=64))
        with pytest.raises(CheckpointMismatchError) as err:
            ckpt.restore(_program(wider, "zero3", {"fsdp": -1}).abstract_state())
        message = str(err.value)
        assert "params/embedding: checkpoint (256, 64) float32 vs target (256, 32) float32" in message
        assert "(36 difference(s))" in message and "... and 24 more" in message  # 12 params x (value, mu, nu)
        assert "'model': 'tiny'" in message  # says which model the checkpoint holds
        tiny = trainable(get_config("tiny"))
        with pytest.raises(CheckpointMismatchError, match=r"opt_state/0/mu/\S+: in the checkpoint .* not in the target"):
            ckpt.restore(_program(tiny, "zero3", {"fsdp": -1}, tx=optax.sgd(0.1)).abstract_state())


def test_missing_or_empty_directory_is_named(zero3, tmp_path, capsys) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as err:
        Checkpointer(missing, create=False)
    assert str(missing) in str(err.value)
    assert not missing.exists()  # opening for reading never creates it
    empty = tmp_path / "empty"
    with Checkpointer(empty) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(CheckpointNotFoundError, match="holds no complete checkpoint") as err:
            ckpt.restore(zero3.abstract_state())
        assert str(empty) in str(err.value)
    assert cli.main(["export", "--ckpt", str(missing), "--out", str(tmp_path / "w.npz")]) == 2
    assert f"{missing} does not exist" in capsys.readouterr().err


def test_restore_of_missing_step_lists_complete_ones(trained, tmp_path) -> None:
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(4, trained, data_state=_data_state(4), config=CONFIG, force=True)
        ckpt.wait()
        with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint for step 3; complete steps: 4"):
            ckpt.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), trained), step=3)


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_export_round_trip_matches_model_outputs(tiny, trained, tmp_path, suffix, capsys) -> None:
    ckpt_dir = tmp_path / "ckpt"
    with Checkpointer(ckpt_dir) as ckpt:
        ckpt.save(2, trained, data_state=_data_state(2), config=CONFIG, force=True)
    out = tmp_path / f"weights{suffix}"
    assert cli.main(["export", "--ckpt", str(ckpt_dir), "--out", str(out)]) == 0
    assert "of step 2 (model tiny)" in capsys.readouterr().out
    loaded = load_exported(out)
    original = host_copy(trained.params)
    assert_bitwise(original, loaded)
    record = read_export_metadata(out)
    assert record["step"] == 2 and record["config"] == CONFIG
    tokens = ByteBatches(load_text(None), 2, SEQ).batch(0)["inputs"]
    apply = jax.jit(tiny.apply)  # one compile, not the model's ops one by one
    np.testing.assert_array_equal(np.asarray(apply(loaded, tokens)), np.asarray(apply(original, tokens)))


def test_export_library_call_picks_step_and_checks_model(trained, tmp_path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    with Checkpointer(ckpt_dir) as ckpt:
        ckpt.save(1, trained, data_state=_data_state(1), config=CONFIG, force=True)
        ckpt.save(2, trained, data_state=_data_state(2), config={**CONFIG, "model": "small"}, force=True)
    summary = export_params(ckpt_dir, tmp_path / "w1.npz", step=1)
    assert summary.step == 1 and summary.tensors == len(jax.tree.leaves(trained.params))
    assert summary.largest_tensor_bytes < summary.bytes  # gathered and written one tensor at a time
    with pytest.raises(CheckpointMismatchError, match=r"model 'small'.*embedding: checkpoint \(256, 64\) float32 vs target \(256, 256\)"):
        export_params(ckpt_dir, tmp_path / "w2.npz")  # latest step claims a model it does not hold
    with pytest.raises(ValueError, match=r"must end in \.npz or \.safetensors"):
        export_params(ckpt_dir, tmp_path / "w.pt")
    with Checkpointer(ckpt_dir) as ckpt:  # a config naming no reference model: the saved tree is used
        ckpt.save(3, trained, data_state=_data_state(3), config={"model": "my-own"}, force=True)
    assert export_params(ckpt_dir, tmp_path / "w3.npz").model == "my-own"
    assert_bitwise(host_copy(trained.params), load_exported(tmp_path / "w3.npz"))


def test_export_takes_a_run_folder_without_orbax_read_only_warning(trained, tmp_path, capsys, caplog) -> None:
    run_dir = tmp_path / "run"  # what `shardlib train --out run --ckpt-every K` writes: run/checkpoints/
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        ckpt.save(2, trained, data_state=_data_state(2), config=CONFIG, force=True)
    with caplog.at_level(logging.WARNING):
        assert cli.main(["export", "--ckpt", str(run_dir), "--out", str(tmp_path / "w.npz")]) == 0
    assert "of step 2 (model tiny)" in capsys.readouterr().out
    assert not [r for r in caplog.records if "read only" in r.getMessage()]
    assert_bitwise(host_copy(trained.params), load_exported(tmp_path / "w.npz"))


def test_safetensors_file_reads_with_the_reference_library(trained, tmp_path) -> None:
    import safetensors.numpy as st  # a runtime dependency (the loader reads with it): this test always runs

    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, trained, data_state=_data_state(2), config=CONFIG, force=True)
    export_params(tmp_path / "ckpt", tmp_path / "w.safetensors")
    flat = st.load_file(str(tmp_path / "w.safetensors"))
    for path, leaf in jax.tree_util.tree_flatten_with_path(host_copy(trained.params))[0]:
        name = "/".join(str(k.key) for k in path)
        assert np.array_equal(flat[name], leaf), name


# ---------------------------------------------------------------- multi-process

_WORKER = """
import os, sys
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 --xla_cpu_collective_call_terminate_timeout_seconds=900 "
                           "FAST_FLAGS")
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
port, pid, ckpt_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
import signal, time
import numpy as np
import optax
from jax.sharding import AxisType, Mesh
from shardlib.models import get_config, trainable
from shardlib import build, make_layout
from shardlib.runtime.checkpoint import Checkpointer, PreemptionGuard
from shardlib.tools.export import export_params
from shardlib.sharding.mesh import MESH_AXES

def mesh(shape):  # devices in process order, as make_mesh lays them out on one process
    shape = shape + (1,) * (len(MESH_AXES) - len(shape))  # the axes after the four given: size 1
    return Mesh(np.array(jax.devices()).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))

def random_host_state(program, seed):  # the same values as the test's _random_host_state
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda l: rng.standard_normal(l.shape).astype(l.dtype) if np.issubdtype(l.dtype, np.floating)
                        else np.full(l.shape, 7, l.dtype), program.abstract_state())

model = trainable(get_config("tiny"))
zero3 = build(model, optax.adamw(1e-2), make_layout(model, "zero3", mesh((1, 1, 8, 1))))
dp = build(model, optax.adamw(1e-2), make_layout(model, "dp", mesh((8, 1, 1, 1))))
host = random_host_state(zero3, 11)
state = jax.tree.map(lambda h, l: jax.make_array_from_callback(h.shape, l.sharding, lambda i: h[i]), host, zero3.abstract_state())
with Checkpointer(ckpt_dir) as ckpt:
    ckpt.save(3, state, data_state={"step": 3, "seed": 0, "rank": pid}, config={"model": "tiny"}, force=True)
    ckpt.save(4, state, data_state={"step": 4, "seed": 0}, config={"model": "tiny"}, force=True)
    ckpt.wait()
    for step, want in ((3, {"step": 3, "seed": 0, "rank": pid}), (4, {"step": 4, "seed": 0})):
        restored, data_state, _ = ckpt.restore(dp.abstract_state(), step)
        assert data_state == want, (data_state, want)
        for r, h in zip(jax.tree.leaves(restored), jax.tree.leaves(host)):
            for shard in r.addressable_shards:
                assert np.array_equal(np.asarray(shard.data), h[shard.index])
export_params(ckpt_dir, os.path.join(ckpt_dir, "..", "weights.npz"), step=4)
print("RESTORED", pid, flush=True)
with PreemptionGuard() as guard:
    assert guard.synced  # JAX's preemption service owns SIGTERM in a distributed run
    if pid == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # only one host gets the notice
    for step in range(1, 2001):
        if guard.should_stop(step):
            print("STOP", pid, step, flush=True)
            break
        time.sleep(0.05)
""".replace("FAST_FLAGS", compile_flags.FAST)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_save_restore_export_and_agree_on_preemption(zero3, tmp_path) -> None:
    """Real jax.distributed run (2 processes x 4 CPU devices): per-process data states survive
    Orbax's process-0 JSON, each process restores its shards onto another strategy, export
    gathers across processes, and SIGTERM on one host stops both at the same step."""
    ckpt_dir = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    env["XLA_FLAGS"] = compile_flags.FAST  # the CLI sets up its own devices
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(port), str(pid), str(ckpt_dir)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for pid in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    stops = []
    for pid, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and f"RESTORED {pid}" in out, f"process {pid} failed:\n{out[-3000:]}"
        stops += [line.split()[2] for line in out.splitlines() if line.startswith(f"STOP {pid} ")]
    assert len(stops) == 2 and stops[0] == stops[1], outputs

    host = _random_host_state(zero3, 11)
    with Checkpointer(ckpt_dir, create=False) as ckpt:
        restored, data_state, _ = ckpt.restore(zero3.abstract_state(), step=4)  # one process, 8 devices
        assert data_state == {"step": 4, "seed": 0}
        assert_bitwise(host, restored)
        with pytest.raises(ValueError, match="the 2 processes that saved it had different data iterator states"):
            ckpt.restore(zero3.abstract_state(), step=3)
    assert_bitwise(host.params, load_exported(tmp_path / "weights.npz"))


# ---------------------------------------------------------------- optimizer chain, staleness, export of model state


@pytest.fixture(scope="module")
def mlp():
    from shardlib import from_functions
    from tests import zoo

    return from_functions(zoo.mlp_init, zoo.mlp_loss)


def _mlp_program(model, tx, n_devices: int = 8, **options):
    mesh = make_mesh({"data": n_devices}, devices=jax.devices()[:n_devices])
    return build(model, tx, make_layout(model, "dp", mesh), **options)


def test_another_optimizer_chain_with_the_same_arrays_is_refused_by_name(mlp, tmp_path) -> None:
    """optax.adamw's state is adam's plus one empty node: the same arrays, another tree for Orbax."""
    adam = _mlp_program(mlp, optax.adam(1e-2))
    state = _distinct_state(adam, seed=6)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(1, state, data_state=_data_state(1), config=CONFIG, force=True)
        ckpt.wait()
        with pytest.raises(CheckpointMismatchError, match=r"opt_state/2: an empty node .* in the target, not in the "
                                                          r"checkpoint.*optimizer chain .* differs"):
            ckpt.restore(_mlp_program(mlp, optax.adamw(1e-2)).abstract_state())
        restored, _, _ = ckpt.restore(_mlp_program(mlp, optax.adam(1e-2), n_devices=4).abstract_state())
    assert_bitwise(state, restored)  # the same chain on another mesh still restores


def test_another_staleness_is_refused_naming_the_option(mlp, tmp_path) -> None:
    programs = {tau: _mlp_program(mlp, optax.adam(1e-2), staleness=tau) for tau in (0, 1)}
    for saved, target in ((1, 0), (0, 1)):
        with Checkpointer(tmp_path / f"ckpt{saved}") as ckpt:
            assert ckpt.save(1, _distinct_state(programs[saved], seed=7), data_state=_data_state(1), config=CONFIG,
                             force=True)
            ckpt.wait()
            with pytest.raises(CheckpointMismatchError, match=rf"saved by a program built with staleness={saved}, "
                               rf"and the restore target is built with staleness={target}.*build\(\.\.\., "
                               rf"staleness={saved}\)") as err:
                ckpt.restore(programs[target].abstract_state())
        assert "model and optimizer that saved it" not in str(err.value)


def test_save_without_force_saves_whenever_every_is_zero(mlp, tmp_path) -> None:
    state = _distinct_state(_mlp_program(mlp, optax.adam(1e-2)), seed=8)
    with Checkpointer(tmp_path / "ckpt") as ckpt:  # every=0, the default: no schedule
        assert ckpt.save(3, state, data_state=_data_state(3), config=CONFIG)
        assert not ckpt.should_save(4)
        ckpt.wait()
        assert ckpt.all_steps() == [3]
    with Checkpointer(tmp_path / "ckpt", every=2) as ckpt:  # a schedule: off it, only force saves
        assert not ckpt.save(5, state, data_state=_data_state(5), config=CONFIG)
        assert ckpt.save(5, state, data_state=_data_state(5), config=CONFIG, force=True)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_export_writes_the_model_state_and_load_exported_returns_it(tmp_path, suffix, capsys) -> None:
    program = _built(_dropout_bn_model(), {"data": 8}, 8)
    state = _distinct_state(program, seed=9)  # BatchNorm statistics unlike their init values
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(4, state, data_state=_data_state(4), config={"model": "my-cnn"}, force=True)
    out = tmp_path / f"cnn{suffix}"
    assert cli.main(["export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    assert "4 of them are the model state" in capsys.readouterr().out  # mean and var of 2 BatchNorms
    params, model_state = load_exported(out, model_state=True)
    assert_bitwise(state.params, params)
    assert_bitwise(state.model_state, model_state)
    assert_bitwise(state.params, load_exported(out))  # without the flag: the parameter tree, as before
    names = {t["name"] for t in read_export_metadata(out)["tensors"]}
    assert {"model_state/bn1/mean", "model_state/bn2/var", "bn1/scale"} <= names
