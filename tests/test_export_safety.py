"""`shardlib export` writes atomically and `load_exported` reads defensively: each test injects one
fault (a disk that fills mid-write, a tensor of another dtype or shape, a zip bomb, a forged
safetensors header) and checks it is refused by name, before anything large is allocated.

The checkpoint restore is replaced by a small in-memory tree (``_fake_restore``): what is under test
is the writing and the reading, not Orbax."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from shardlib.cli import main
from shardlib.runtime.checkpoint import CheckpointError
from shardlib.tools import export
from shardlib.tools.export import METADATA_ENTRY, export_params, load_exported, read_export_metadata

SUFFIXES = [".npz", ".safetensors"]


def _params(scale: float = 1.0) -> dict:
    return {
        "embed": {"embedding": jnp.arange(40, dtype=jnp.float32).reshape(10, 4) * scale},
        "dense": {"w": (jnp.ones((4, 3)) * scale).astype(jnp.bfloat16), "b": jnp.full((3,), scale, jnp.float32)},
    }


def _state() -> dict:
    return {"bn": {"mean": jnp.zeros((3,), jnp.float32), "count": jnp.array(7, jnp.int32)}}


@pytest.fixture
def fake_restore(monkeypatch):
    """export_params on an in-memory tree: ``holder["scale"]`` picks the weights."""
    holder = {"scale": 1.0}

    def restore(ckpt_dir, step):
        return 5, {"model": "my-own"}, {"params": _params(holder["scale"]), "model_state": _state()}

    monkeypatch.setattr(export, "_restore_parts", restore)
    return holder


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_same(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _one_line_naming(err: pytest.ExceptionInfo, path: Path) -> str:
    message = str(err.value)
    assert "\n" not in message and str(path) in message, message
    return message


# ---------------------------------------------------------------- atomic write


class _DiskFull:
    """A file object that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, file, room: int) -> None:
        self._file, self._room = file, room

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self._room:
            self._file.write(data[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= len(data)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_export_interrupted_mid_write_leaves_no_partial_file_and_keeps_the_previous_one(
    fake_restore, tmp_path, monkeypatch, suffix
) -> None:
    out = tmp_path / "out" / f"w{suffix}"
    real_writer = export._writer

    # no previous file: a failure leaves nothing at all
    monkeypatch.setattr(export, "_writer", lambda file, sfx, record: real_writer(_DiskFull(file, 600), sfx, record))
    with pytest.raises(OSError, match="No space left"):
        export_params("unused", out)
    assert list(out.parent.iterdir()) == []

    # a complete export, read back (the safetensors file by the reference library too)
    monkeypatch.setattr(export, "_writer", real_writer)
    export_params("unused", out)
    previous = out.read_bytes()
    params, state = load_exported(out, model_state=True)
    _assert_same(params, _host(_params()))
    _assert_same(state, _host(_state()))
    if suffix == ".safetensors":
        import safetensors.numpy

        assert set(safetensors.numpy.load_file(str(out))) == {t["name"] for t in read_export_metadata(out)["tensors"]}

    # the next export fails two thirds through: the previous file is untouched, no temporary is left
    fake_restore["scale"] = 2.0
    room = 2 * len(previous) // 3
    monkeypatch.setattr(export, "_writer", lambda file, sfx, record: real_writer(_DiskFull(file, room), sfx, record))
    with pytest.raises(OSError, match="No space left"):
        export_params("unused", out)
    assert out.read_bytes() == previous
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    _assert_same(load_exported(out), _host(_params(1.0)))

    # and a successful one replaces it
    monkeypatch.setattr(export, "_writer", real_writer)
    export_params("unused", out)
    _assert_same(load_exported(out), _host(_params(2.0)))
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_export_onto_a_full_disk_is_one_line_and_exit_2(fake_restore, tmp_path, monkeypatch, capsys) -> None:
    out, real_writer = tmp_path / "w.npz", export._writer
    monkeypatch.setattr(export, "_writer", lambda file, sfx, record: real_writer(_DiskFull(file, 600), sfx, record))
    assert main(["export", "--ckpt", "unused", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"shardlib export: error: cannot write {out}: No space left on device;"), err[0]
    assert list(tmp_path.iterdir()) == []


def test_a_killed_exports_partial_file_is_removed_by_the_next_export(fake_restore, tmp_path) -> None:
    out = tmp_path / "w.npz"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".w.npz.{dead.pid}.0badc0de.partial"  # what kill -9 during an export leaves
    running = tmp_path / f".w.npz.{os.getppid()}.0badc0de.partial"  # another export, still going
    stale.write_bytes(b"PK half a zip")
    running.write_bytes(b"PK half a zip")
    export_params("unused", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, running.name])


# ---------------------------------------------------------------- tensors of another dtype or shape


def _rewrite_npz(src: Path, dst: Path, replace: dict[str, bytes], compression=zipfile.ZIP_STORED) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression=compression) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, replace.get(info.filename, zin.read(info.filename)))


def _npy(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, allow_pickle=False)
    return buf.getvalue()


def test_npz_tensor_of_another_dtype_or_shape_is_refused_by_name(fake_restore, tmp_path) -> None:
    good = tmp_path / "good.npz"
    export_params("unused", good)

    bad = tmp_path / "bad.npz"  # the embedding comes back int64 with shape (10,)
    _rewrite_npz(good, bad, {"embed/embedding.npy": _npy(np.arange(10, dtype=np.int64))})
    with pytest.raises(CheckpointError) as err:
        load_exported(bad)
    message = _one_line_naming(err, bad)
    assert "'embed/embedding'" in message and "int64[10]" in message and "float32[10, 4]" in message

    # the record forged to agree with the tensor: only the model can tell, and like= does
    record = read_export_metadata(good)
    for t in record["tensors"]:
        if t["name"] == "embed/embedding":
            t.update(shape=[10], dtype="int64")
    forged = tmp_path / "forged.npz"
    _rewrite_npz(bad, forged, {f"{METADATA_ENTRY}.npy": _npy(np.frombuffer(json.dumps(record).encode(), np.uint8))})
    assert load_exported(forged)["embed"]["embedding"].dtype == np.int64  # consistent with its own record
    like = jax.eval_shape(lambda: _params())
    with pytest.raises(CheckpointError) as err:
        load_exported(forged, like=like)
    message = _one_line_naming(err, forged)
    assert "'embed/embedding': the file holds int64[10], the model expects float32[10, 4]" in message
    _assert_same(load_exported(good, like=like), _host(_params()))  # the genuine file passes
    _assert_same(load_exported(good, like=_params(), model_state=True, like_model_state=_state())[1], _host(_state()))
    with pytest.raises(CheckpointError, match=r"'dense/extra': missing from the file"):
        load_exported(good, like={**like, "dense": {**like["dense"], "extra": jax.ShapeDtypeStruct((2,), jnp.float32)}})


def test_safetensors_header_that_disagrees_with_the_record_is_refused_by_name(fake_restore, tmp_path) -> None:
    good = tmp_path / "good.safetensors"
    export_params("unused", good)
    raw = good.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["embed/embedding"]["dtype"] = "I32"  # same byte count: a valid file, but not what was exported
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    with pytest.raises(CheckpointError) as err:
        load_exported(bad)
    assert "'embed/embedding' is I32[10, 4]" in _one_line_naming(err, bad)


# ---------------------------------------------------------------- zip bomb

BOMB = 200 * 2**20  # bytes the bomb inflates to


def _bomb(path: Path, member: str) -> None:
    """An .npz whose record names one small float32 tensor ``w``, and whose ``member`` inflates to
    200 MiB of zeros (deflated: a few hundred KiB on disk)."""
    record = {"format": export.EXPORT_FORMAT, "step": 0, "config": {},
              "tensors": [{"name": "w", "part": "params", "path": ["w"], "shape": [4, 4], "dtype": "float32"}]}
    entries = {f"{METADATA_ENTRY}.npy": _npy(np.frombuffer(json.dumps(record).encode(), np.uint8)),
               "w.npy": _npy(np.zeros((4, 4), np.float32))}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries.items():
            if name != member:
                zf.writestr(name, data)
                continue
            count = BOMB // 4
            big = np.lib.format.header_data_from_array_1_0(np.zeros(0, np.float32)) | {"shape": (count,)}
            with zf.open(name, "w", force_zip64=True) as entry:
                np.lib.format.write_array_header_1_0(entry, big)
                chunk = bytes(8 * 2**20)
                for _ in range(BOMB // len(chunk)):
                    entry.write(chunk)


def _refused_in_little_memory(bomb: Path) -> str:
    """`load_exported` refuses ``bomb`` in one line naming it, having allocated under 16 MiB."""
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as err:
            load_exported(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"peak {peak} bytes"
    return _one_line_naming(err, bomb)


@pytest.mark.parametrize("member", ["w.npy", f"{METADATA_ENTRY}.npy"])
def test_npz_zip_bomb_is_refused_before_it_is_inflated(tmp_path, member) -> None:
    bomb = tmp_path / "bomb.npz"
    _bomb(bomb, member)
    assert bomb.stat().st_size < 2 * 2**20  # small on disk
    with zipfile.ZipFile(bomb) as zf:
        assert zf.getinfo(member).file_size > BOMB  # declares 200 MiB

    start = time.perf_counter()
    message = _refused_in_little_memory(bomb)
    assert time.perf_counter() - start < 5  # inflating 200 MiB would take longer than reading headers
    assert member in message and "are compressed" in message and "refusing to inflate it" in message, message


def _stored_npz(path: Path, tensors: list[dict], arrays: dict[str, np.ndarray]) -> Path:
    """An .npz laid out as `shardlib export` writes one (stored entries), with a hand-written record."""
    record = {"format": export.EXPORT_FORMAT, "step": 0, "config": {}, "tensors": tensors}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{METADATA_ENTRY}.npy", _npy(np.frombuffer(json.dumps(record).encode(), np.uint8)))
        for name, array in arrays.items():
            zf.writestr(f"{name}.npy", _npy(array))
    return path


def _entry(name: str, path=None, shape=(2,)) -> dict:
    return {"name": name, "part": "params", "path": [name] if path is None else path, "shape": list(shape),
            "dtype": "float32"}


def test_npz_whose_own_record_declares_a_huge_tensor_is_refused_before_it_is_inflated(tmp_path) -> None:
    """Without like= nothing but the file vouches for the sizes: only stored entries (their bytes are in the file)."""
    count = 64 * 2**20 // 4
    bomb = tmp_path / "bomb.npz"
    record = {"format": export.EXPORT_FORMAT, "step": 0, "config": {}, "tensors": [_entry("w", shape=(count,))]}
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{METADATA_ENTRY}.npy", _npy(np.frombuffer(json.dumps(record).encode(), np.uint8)))
        with zf.open("w.npy", "w", force_zip64=True) as entry:
            big = np.lib.format.header_data_from_array_1_0(np.zeros(0, np.float32)) | {"shape": (count,)}
            np.lib.format.write_array_header_1_0(entry, big)
            for _ in range(8):
                entry.write(bytes(8 * 2**20))
    assert bomb.stat().st_size < 2**20
    assert "are compressed" in _refused_in_little_memory(bomb)


LYING_RECORDS = {  # each passes a check on names alone (like= sees a, b), but builds another tree from its paths
    "swapped": [_entry("a", ["b"]), _entry("b", ["a"])],
    "dropped": [_entry("a"), _entry("b", ["a"])],
    "added": [_entry("a"), _entry("b", ["__evil__"])],
    "empty_path": [_entry("a"), _entry("b", [])],
    "dict_path": [_entry("a"), _entry("b", {"b": 1})],
}


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("fault", list(LYING_RECORDS))
def test_a_record_whose_names_are_not_its_paths_is_refused(tmp_path, fault, suffix) -> None:
    tensors = LYING_RECORDS[fault]
    arrays = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([3.0, 4.0], np.float32)}
    if suffix == ".npz":
        path = _stored_npz(tmp_path / "w.npz", tensors, arrays)
    else:
        header = {n: {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]} for i, n in enumerate(arrays)}
        path = _safetensors(tmp_path / "w.safetensors", header, b"".join(a.tobytes() for a in arrays.values()),
                            record_tensors=tensors)
    like = {n: jax.ShapeDtypeStruct((2,), np.float32) for n in arrays}
    with pytest.raises(CheckpointError) as err:
        load_exported(path, like=like)
    assert "is malformed or repeated, or its name is not its path" in _one_line_naming(err, path)


def test_tensor_paths_that_cannot_make_one_tree_are_one_line(tmp_path) -> None:
    inner = [_entry("a"), {**_entry("a/b", ["a", "b"])}]
    path = _stored_npz(tmp_path / "w.npz", inner, {"a": np.zeros(2, np.float32), "a/b": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError) as err:
        load_exported(path)
    assert "sit where other tensors' paths go on below them" in _one_line_naming(err, path)


def test_deeply_nested_records_and_zip_entries_are_one_line(tmp_path) -> None:
    nested = tmp_path / "nested.npz"
    with zipfile.ZipFile(nested, "w") as zf:
        zf.writestr(f"{METADATA_ENTRY}.npy", _npy(np.frombuffer(b"[" * 200_000, np.uint8)))
    with pytest.raises(CheckpointError) as err:
        load_exported(nested)
    assert "the export record is not JSON" in _one_line_naming(err, nested)
    inner = tmp_path / "inner.npz"
    _stored_npz(inner, [_entry("w")], {"w": np.zeros(2, np.float32)})
    disguised = tmp_path / "disguised.npz"  # a zip file where a tensor's .npy should be
    with zipfile.ZipFile(disguised, "w") as zf:
        with zipfile.ZipFile(inner) as src:
            zf.writestr(f"{METADATA_ENTRY}.npy", src.read(f"{METADATA_ENTRY}.npy"))
        zf.writestr("w.npy", inner.read_bytes())
    with pytest.raises(CheckpointError) as err:
        load_exported(disguised)
    assert "is not a valid .npy entry" in _one_line_naming(err, disguised)


# ---------------------------------------------------------------- forged safetensors files


def _safetensors(path: Path, tensors: dict, data: bytes, length: int | None = None,
                 record_tensors: list[dict] | None = None) -> Path:
    record = {"format": export.EXPORT_FORMAT, "step": 0, "config": {},
              "tensors": record_tensors or [{"name": name, "part": "params", "path": [name], "shape": spec["shape"],
                                             "dtype": "float32"} for name, spec in tensors.items()]}
    blob = json.dumps({"__metadata__": {METADATA_ENTRY: json.dumps(record)}, **tensors}).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return path


FORGED = {
    "huge_header_length": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 2**60, "header too large"),
    "overlapping_ranges": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, None, "invalid offset"),
    "shape_against_data_length": ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, None,
                                  "invalid shape, data type, or offset"),
    "dtype_against_data_length": ({"a": {"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}}, None,
                                  "invalid shape, data type, or offset"),
}


@pytest.mark.parametrize("fault", list(FORGED))
def test_forged_safetensors_file_is_refused_in_one_line_naming_it(tmp_path, fault) -> None:
    tensors, length, reason = FORGED[fault]
    path = _safetensors(tmp_path / f"{fault}.safetensors", tensors, bytes(12 if "b" in tensors else 8), length)
    start = time.perf_counter()
    for read in (load_exported, read_export_metadata):
        with pytest.raises(CheckpointError) as err:
            read(path)
        message = _one_line_naming(err, path)
        assert "is not a valid safetensors file" in message and reason in message, message
    assert time.perf_counter() - start < 5


def test_a_well_formed_hand_written_safetensors_file_still_loads(tmp_path) -> None:
    """The forged files above differ from this one by their fault only."""
    path = _safetensors(tmp_path / "ok.safetensors", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                        np.array([1.5, -2.0], "<f4").tobytes())
    np.testing.assert_array_equal(load_exported(path)["a"], np.array([1.5, -2.0], np.float32))


def test_bfloat16_tensor_round_trips_through_both_formats(fake_restore, tmp_path) -> None:
    for suffix in SUFFIXES:
        export_params("unused", tmp_path / f"w{suffix}")
        w = load_exported(tmp_path / f"w{suffix}")["dense"]["w"]
        assert w.dtype == ml_dtypes.bfloat16 and w.shape == (4, 3) and w.flags.writeable
