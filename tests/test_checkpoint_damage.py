"""Every row of `TEXT_SIGNALS` (the error texts that are the only signal of what a read error
means) matches the real library's message: a real damaged checkpoint read through Orbax and
TensorStore, JAX's real out-of-memory error, Orbax's real coroutine, asyncio's real error."""

from __future__ import annotations

import asyncio
import importlib
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.runtime.checkpoint import CheckpointDamagedError, Checkpointer
from shardlib.runtime.checkpoint_damage import TEXT_SIGNALS, ReadingStep, damage_shown


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(a checkpoint directory holding step 1 of one sharded array, its restore target)."""
    mesh = jax.make_mesh((8,), ("x",), devices=jax.devices()[:8])
    sharding = NamedSharding(mesh, P("x"))
    state = {"w": jax.device_put(np.arange(256 * 64, dtype=np.float32).reshape(256, 64), sharding)}
    directory = tmp_path_factory.mktemp("damage") / "ckpt"
    with Checkpointer(directory) as ckpt:
        assert ckpt.save(1, state, data_state={})
    return directory, {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=sharding)}


def _data_file(state_dir: Path) -> Path:
    files = [p for p in state_dir.rglob("*") if p.is_file() and "ocdbt.process_" in str(p) and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(state_dir: Path) -> None:
    path = _data_file(state_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _scramble(state_dir: Path) -> None:
    path = _data_file(state_dir)
    data = bytearray(path.read_bytes())
    data[8:] = np.random.default_rng(0).integers(0, 256, len(data) - 8, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


DAMAGE = {  # how to damage a checkpoint -> (the status code TensorStore reports, the row, the reason)
    "manifest deleted": (lambda d: (d / "manifest.ocdbt").unlink(), "NOT_FOUND", "missing-file"),
    "manifest garbage": (lambda d: (d / "manifest.ocdbt").write_bytes(b"garbage" * 8), "DATA_LOSS", "unreadable"),
    "data file truncated": (_truncate, "OUT_OF_RANGE", "unreadable"),
    "data file scrambled": (_scramble, "FAILED_PRECONDITION", "unreadable"),
}


def _chain_text(err: BaseException) -> tuple[list[BaseException], str]:
    chain, seen = [], err
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain, " | ".join(" ".join(str(e).split()) for e in chain)


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoints_real_error_matches_its_row(saved, tmp_path, case):
    template, target = saved
    damage, code, reason = DAMAGE[case]
    directory = tmp_path / "ckpt"
    shutil.copytree(template, directory)
    damage(directory / "1" / "state")
    with pytest.raises(CheckpointDamagedError) as raised:
        Checkpointer(directory, create=False).restore(target, step=1)
    assert raised.value.reason == reason, raised.value
    chain, text = _chain_text(raised.value.__cause__)
    assert f"{code}: " in text, text  # TensorStore's own message, with its status code
    assert TEXT_SIGNALS[reason].search(text) and damage_shown(chain, text) == reason
    assert not TEXT_SIGNALS["memory"].search(text)
    if case.startswith("data file"):  # a chunk read: Orbax's wrapper around TensorStore's error
        assert TEXT_SIGNALS["abandoned-read"].search(str(chain[0])), chain[0]


def test_the_devices_running_out_of_memory_is_not_damage():
    with pytest.raises(jax.errors.JaxRuntimeError) as raised:  # 256 TiB: more than any address space
        jnp.zeros((2**48,), jnp.uint8).block_until_ready()
    assert TEXT_SIGNALS["memory"].search(str(raised.value)), raised.value
    with pytest.raises(jax.errors.JaxRuntimeError), ReadingStep("ckpt", 1, Path("ckpt/1"), "state"):
        raise raised.value  # passed on as it is: nothing set aside, not a read error


def test_the_abandoned_read_coroutine_and_the_closed_loop_match_their_rows():
    serialization = importlib.import_module("orbax.checkpoint._src.serialization.serialization")
    coroutine = serialization._read_array_index_and_device_put(
        [], (), None, global_shape=(), new_shard_shape=(), dtype=None, byte_limiter=None, strict=True, dll=None,
        memory_kind=None)
    try:
        assert TEXT_SIGNALS["abandoned-coroutine"].search(repr(coroutine)), repr(coroutine)
    finally:
        coroutine.close()
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError) as raised:
        loop.call_soon(print)
    assert TEXT_SIGNALS["closed-loop"].search(str(raised.value)), raised.value


def test_every_row_is_checked_here():
    checked = {reason for _, _, reason in DAMAGE.values()} | {"memory", "abandoned-read", "abandoned-coroutine",
                                                              "closed-loop"}
    assert checked == set(TEXT_SIGNALS)
