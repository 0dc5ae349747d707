"""A damaged checkpoint is detected, named and set aside; the newest intact one is restored.

Each test copies one set of checkpoints (steps 2, 4 and 6 of the tiny GPT under ZeRO-3 on 8
devices), damages step 6 as a fault-injection pass would (a flipped bit, truncation, a deleted
file, random bytes, an empty step directory, garbage metadata, a data state of another step)
and restores with ``step=None``: step 4 must come back bit for bit, step 6 must be renamed
``6.damaged-<reason>`` (never deleted), and the log must name it. A failed background save must
be reported at once and stop the next step. One end-to-end rerun of ``shardlib train`` after a
bit flip checks the same through the CLI.
"""

from __future__ import annotations

import json
import logging
import re
import os
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.cli import main
from shardlib.run.checkpointing import SaveCheckpoint
from shardlib.runtime import checkpoint_digests
from shardlib.runtime.checkpoint import CheckpointDamagedError, Checkpointer, CheckpointReadError, CheckpointSaveError
from shardlib.runtime.checkpoint_damage import LEGACY_FORMATS, incomplete_reason
from shardlib.runtime.checkpoint_digests import digest_arrays, digest_hex
from tests.helpers import assert_bitwise, batches, host_copy, optimizer, tiny_model

STEPS = (2, 4, 6)


def _program(strategy: str = "zero3", sizes=None, n: int = 8):
    model = tiny_model()
    mesh = make_mesh(sizes or {"fsdp": n}, devices=jax.devices()[:n])
    return build(model, optimizer(), make_layout(model, strategy, mesh))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(template checkpoint dir, {step: host copy of the saved state}, the program)."""
    program = _program()
    directory = tmp_path_factory.mktemp("integrity") / "ckpt"
    state, copies = program.init(jax.random.key(0)), {}
    with Checkpointer(directory, keep=None) as ckpt:
        for step, rows in enumerate(batches(max(STEPS)), start=1):
            state, _ = program.step(state, rows)
            if step in STEPS:
                copies[step] = host_copy(state)
                assert ckpt.save(step, state, data_state={"step": step, "seed": 0}, config={"model": "tiny"})
    return directory, copies, program


@pytest.fixture
def work(saved, tmp_path):
    template, copies, program = saved
    directory = tmp_path / "ckpt"
    shutil.copytree(template, directory)
    return directory, copies, program


def _largest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "ocdbt.process_" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def _flip_bit(path: Path, offset: int | None = None, bit: int = 4) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def _restores_step_4(directory: Path, copies, program, caplog, reason: str) -> None:
    """Restoring the latest gives step 4 bit for bit; step 6 is set aside and named in the log."""
    with caplog.at_level(logging.WARNING, logger="shardlib.runtime.checkpoint"):
        ckpt = Checkpointer(directory)
        state, data, _ = ckpt.restore(program.abstract_state())
    assert int(state.step) == 4 and data == {"step": 4, "seed": 0}
    assert_bitwise(state, copies[4])
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["2", "4", f"6.damaged-{reason}"], names
    assert "step 6 is damaged" in caplog.text and f"6.damaged-{reason}" in caplog.text, caplog.text
    assert (directory / f"6.damaged-{reason}" / "DAMAGED.txt").read_text().startswith(f"checkpoint {directory} step 6")
    assert ckpt.latest_step() == 4
    ckpt.close()


def test_digest_is_the_same_on_any_mesh_and_catches_one_bit(saved):
    _, copies, program = saved
    ckpt = Checkpointer(saved[0], create=False)
    other = _program("dp", {"data": 4}, n=4)  # another strategy and device count
    state, _, _ = ckpt.restore(other.abstract_state(), step=6)  # verified against digests saved under zero3 on 8
    assert_bitwise(state, copies[6])
    assert digest_hex(*digest_arrays(state)) == json.loads((saved[0] / "6" / "digests" / "metadata").read_text())["arrays"]
    # one bit of one element of one tensor: verify names exactly that tensor
    params = jax.tree.map(lambda x: x, state.params)  # new containers, the same arrays
    wq = np.array(copies[6].params["blocks"]["attn"]["wq"])
    wq.view(np.uint32).reshape(-1)[17] ^= 1
    params["blocks"]["attn"]["wq"] = jax.device_put(wq, state.params["blocks"]["attn"]["wq"].sharding)
    with pytest.raises(CheckpointDamagedError, match=r"params/blocks/attn/wq differ") as err:
        ckpt.verify(6, {"params": params})
    assert err.value.reason == "digest" and "params/blocks/attn/wv" not in str(err.value)
    ckpt.verify(6, {"params": state.params})  # the untouched values pass


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _documented_digest(x: np.ndarray) -> str:
    """checkpoint_digests' formula, in NumPy (uint64 arithmetic masked to 32 bits): the sum over
    elements of fmix32((row-major index * golden + seed) ^ the element's bits), for both seeds."""
    if x.dtype == np.bool_:
        x = x.astype(np.int32)  # as the digest reads sub-byte and bool values
    bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).reshape(-1).astype(np.uint64)
    position = (np.arange(bits.size, dtype=np.uint64) * 0x9E3779B9) & 0xFFFFFFFF
    lanes = [int(_fmix32(((position + seed) & 0xFFFFFFFF) ^ bits).sum() & 0xFFFFFFFF) for seed in (0x3C6EF372, 0xA54FF53A)]
    return f"{lanes[0]:08x}{lanes[1]:08x}"


def test_digests_are_the_documented_position_hash_on_any_sharding():
    """The values every saved checkpoint's digests were written with (a change of the formula would
    fail every checkpoint saved before it): each array's digest, sharded over 8 devices or on one,
    is NumPy's computation of the formula in checkpoint_digests' docstring."""
    rng = np.random.default_rng(0)
    mesh = make_mesh({"fsdp": 8})
    values = {"f32": rng.standard_normal((8, 6)).astype(np.float32),
              "bf16": rng.standard_normal((5, 7)).astype(jax.numpy.bfloat16),
              "i8": rng.integers(-128, 128, (3, 4, 2), dtype=np.int8), "bool": rng.random(9) > 0.5}
    tree = {name: jax.numpy.asarray(value) for name, value in values.items()}
    tree["f32"] = jax.device_put(values["f32"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    assert digest_hex(*digest_arrays(tree)) == {name: _documented_digest(value) for name, value in values.items()}


def test_bit_flip_in_a_data_file_falls_back_to_the_previous_checkpoint(work, caplog):
    directory, copies, program = work
    _flip_bit(_largest_data_file(directory / "6"))
    _restores_step_4(directory, copies, program, caplog, "digest")


def test_truncated_data_file(work, caplog):
    directory, copies, program = work
    path = _largest_data_file(directory / "6")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _restores_step_4(directory, copies, program, caplog, "unreadable")
    assert "step 6 is damaged (unreadable): reading state: ValueError:" in caplog.text


def test_deleted_data_file(work, caplog):
    directory, copies, program = work
    deleted = _largest_data_file(directory / "6")
    deleted.unlink()
    _restores_step_4(directory, copies, program, caplog, "missing-file")
    assert f"its data file(s) {deleted.relative_to(directory / '6' / 'state')} are missing" in caplog.text


def test_random_bytes_in_a_data_file(work, caplog):
    directory, copies, program = work
    path = _largest_data_file(directory / "6")
    data = bytearray(path.read_bytes())
    data[64:4160] = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    _restores_step_4(directory, copies, program, caplog, "unreadable")


def test_empty_step_directory_is_not_a_checkpoint(work, caplog):
    directory, copies, program = work
    shutil.rmtree(directory / "6")
    (directory / "6").mkdir()
    assert incomplete_reason(directory / "6") == "no Orbax commit marker (commit_success.txt)"
    assert Checkpointer(directory, create=False).all_steps() == [2, 4]  # read-only: seen as incomplete, left alone
    assert (directory / "6").is_dir()
    _restores_step_4(directory, copies, program, caplog, "incomplete")  # the writer sets it aside on opening


def test_missing_digests_make_a_checkpoint_incomplete(work, caplog):
    directory, copies, program = work
    shutil.rmtree(directory / "6" / "digests")
    _restores_step_4(directory, copies, program, caplog, "incomplete")


@pytest.mark.parametrize("item", ["config", "data", "meta", "digests"])
def test_garbage_metadata_is_refused_naming_the_file(work, caplog, item):
    directory, copies, program = work
    (directory / "6" / item / "metadata").write_text('{"step": 6, garbage')
    _restores_step_4(directory, copies, program, caplog, "metadata")
    assert f"{item}/metadata is not valid JSON" in caplog.text


def test_data_state_of_another_step_is_refused(work, caplog):
    directory, copies, program = work
    (directory / "6" / "data" / "metadata").write_text(json.dumps({"process_count": 1, "states": [{"seed": 0, "step": 5}]}))
    _restores_step_4(directory, copies, program, caplog, "data-step")
    assert "data/metadata says the data iterator stood at step 5, but the checkpoint is step 6" in caplog.text


def test_edited_metadata_that_still_parses_is_refused(work, caplog):
    directory, copies, program = work
    (directory / "6" / "config" / "metadata").write_text(json.dumps({"model": "small"}))
    _restores_step_4(directory, copies, program, caplog, "metadata")
    assert "config/metadata differs from the SHA-256 saved with it" in caplog.text


def _link_step_elsewhere(directory: Path, step: int) -> Path:
    """Move ``DIR/<step>`` to a sibling folder and leave a symbolic link to it in its place; the folder."""
    elsewhere = directory.parent / "elsewhere"
    elsewhere.mkdir()
    shutil.move(directory / str(step), elsewhere / str(step))
    (directory / str(step)).symlink_to(elsewhere / str(step))
    return elsewhere


def test_a_linked_step_directory_is_set_aside_without_writing_into_its_target(work, caplog):
    directory, copies, program = work
    elsewhere = _link_step_elsewhere(directory, 6)
    (elsewhere / "6" / "config" / "metadata").write_text('{"step": 6, garbage')
    with Checkpointer(directory) as ckpt:
        state, _, _ = ckpt.restore(program.abstract_state())
    assert int(state.step) == 4
    assert (directory / "6.damaged-metadata").is_symlink()  # the link was renamed, its target left as it was
    assert sorted(p.name for p in (elsewhere / "6").iterdir()) == sorted(p.name for p in (directory / "4").iterdir())


def test_a_requested_step_that_is_damaged_raises_and_is_left_in_place(work):
    directory, _, program = work
    _flip_bit(_largest_data_file(directory / "6"))
    with pytest.raises(CheckpointDamagedError, match=r"step 6 is damaged \(digest\): the restored values of"):
        Checkpointer(directory).restore(program.abstract_state(), step=6)
    assert (directory / "6").is_dir()


def test_no_intact_checkpoint_left_says_so(work):
    directory, _, program = work
    for step in STEPS:
        (directory / str(step) / "config" / "metadata").write_text("garbage")
    with pytest.raises(CheckpointDamagedError, match="no older checkpoint is intact"):
        Checkpointer(directory).restore(program.abstract_state())
    assert sorted(p.name for p in directory.iterdir()) == [f"{s}.damaged-metadata" for s in STEPS]


@pytest.mark.parametrize("fault", [
    ValueError("UNAVAILABLE: Error reading from GCS: connection reset (a storage outage)"),
    PermissionError(13, "Permission denied"),
    ValueError("Requested shape (2, 64) does not match the restore target (an error about the target)"),
], ids=["unavailable", "permission", "target"])
def test_a_transient_read_error_sets_nothing_aside_and_the_rerun_restores_the_newest(work, monkeypatch, fault):
    directory, copies, program = work
    real, calls = ocp.CheckpointManager.restore, []

    def fails_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise Exception("Encountered error while reading array index") from fault  # as Orbax wraps it
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", fails_once)
    with Checkpointer(directory) as ckpt, pytest.raises(CheckpointReadError, match="step 6 could not be read .*nothing was set aside"):
        ckpt.restore(program.abstract_state())
    assert sorted(p.name for p in directory.iterdir()) == ["2", "4", "6"]
    with Checkpointer(directory) as ckpt:  # the rerun: the fault has passed
        state, _, _ = ckpt.restore(program.abstract_state())
    assert int(state.step) == 6
    assert_bitwise(state, copies[6])


def test_checkpoint_saved_before_digests_restores_unverified(work, caplog):
    directory, copies, program = work
    shutil.rmtree(directory / "6" / "digests")
    meta = json.loads((directory / "6" / "meta" / "metadata").read_text())
    (directory / "6" / "meta" / "metadata").write_text(json.dumps({**meta, "format": LEGACY_FORMATS[0]}))
    with caplog.at_level(logging.WARNING, logger="shardlib.runtime.checkpoint"):
        state, _, _ = Checkpointer(directory).restore(program.abstract_state())
    assert int(state.step) == 6 and "saved before digests" in caplog.text
    assert_bitwise(state, copies[6])


def test_failed_background_save_is_reported_at_once_and_stops_the_next_step(saved, tmp_path, monkeypatch, caplog):
    _, copies, program = saved
    state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), copies[2], program.abstract_state())
    real = checkpoint_digests.DigestHandler._save_fn

    async def disk_full(self, x, directory):
        if "/4.orbax-checkpoint-tmp" in str(directory):
            raise OSError(28, "No space left on device")
        return await real(self, x, directory)

    monkeypatch.setattr(checkpoint_digests.DigestHandler, "_save_fn", disk_full)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=None)
    saver = SaveCheckpoint(ckpt, lambda step: step % 2 == 0, seed=0, config={"model": "tiny"})
    with caplog.at_level(logging.ERROR, logger="shardlib.runtime.checkpoint"):
        saver(2, state, {})
        ckpt.wait()
        saver(4, state, {})  # returns: the write runs in the background
        deadline = time.monotonic() + 30
        while "failed to save" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)  # nothing else is called: the report comes from the background
    assert "step 4 failed to save in the background (OSError: [Errno 28] No space left on device)" in caplog.text
    assert "the last good checkpoint is step 2" in caplog.text
    with pytest.raises(CheckpointSaveError, match="step 4 failed to save .* the last good checkpoint is step 2"):
        saver(5, state, {})  # the next step stops
    with pytest.raises(CheckpointSaveError):
        ckpt.save(6, state, data_state={"step": 6, "seed": 0}, force=True)
    ckpt.close()  # already reported: closing adds no second error
    assert ckpt.all_steps() == [2]


def test_retention_skips_a_linked_step_directory_and_the_save_succeeds(work, caplog):
    directory, copies, program = work
    elsewhere = _link_step_elsewhere(directory, 2)
    state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), copies[6], program.abstract_state())
    with caplog.at_level(logging.WARNING, logger="shardlib.runtime.checkpoint"), Checkpointer(directory, keep=2) as ckpt:
        assert ckpt.save(8, state, data_state={"step": 8, "seed": 0}, force=True)
        ckpt.wait()  # raised CheckpointSaveError ("Cannot call rmtree on a symbolic link") before
    assert sorted(p.name for p in directory.iterdir()) == ["2", "6", "8"]
    assert (elsewhere / "2" / "state").is_dir()
    assert "checkpoint step 2 is a symbolic link: retention (keep=2) skipped it" in caplog.text


def test_train_rerun_after_a_bit_flip_resumes_from_the_newest_intact_checkpoint(tmp_path, capfd, caplog):
    out = tmp_path / "run"
    flags = ["train", "--model", "tiny", "--batch-size", "16", "--seq-len", "32", "--no-progress", "--no-tensorboard",
             "--eval-every", "0", "--sample-tokens", "0", "--steps", "6", "--ckpt-every", "2", "--out", str(out)]
    assert main(flags) == 0
    reference = Checkpointer(out / "checkpoints", create=False)
    final = host_copy(reference.restore_subtree({"params": _abstract_params(out)})["params"])
    reference.close()
    _flip_bit(_largest_data_file(out / "checkpoints" / "6"))
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="shardlib.runtime.checkpoint"):
        assert main(flags) == 0
    printed, _ = capfd.readouterr()
    assert "resumed    step 4 from" in printed, printed
    # Where the flipped bit lands in OCDBT's file (the writer's threads order it) decides who sees it
    # first: the digest of the value it decoded to, or zstd, when the bit hits a frame's header.
    reason = re.search(r"step 6 is damaged \((digest|unreadable)\)", caplog.text)
    assert reason and f"6.damaged-{reason.group(1)}" in caplog.text, caplog.text
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert f"6.damaged-{reason.group(1)}" in names and "6" in names and "4" in names, names
    again = Checkpointer(out / "checkpoints", create=False)
    assert_bitwise(again.restore_subtree({"params": _abstract_params(out)})["params"], final)  # steps 5, 6 redone exactly
    again.close()


def _abstract_params(out: Path):
    return _program().abstract_state().params


@pytest.fixture(autouse=True)
def _no_leftover_env():
    yield
    os.environ.pop("SHARDLIB_ELASTIC_RESTART", None)
