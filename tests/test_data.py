"""shardlib.runtime.data: corpus loading, deterministic process-sharded batches, resume, global arrays."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.runtime import data as D
from tests import compile_flags

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return D.load_text(None)


def _concat(batches: list[D.Batch]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in batches]) for k in ("inputs", "targets")}


# ---------------------------------------------------------------- loading


def test_default_corpus_is_builtin_and_large(corpus: bytes) -> None:
    assert len(corpus) > 400_000
    assert corpus == D.load_text(None)  # deterministic join
    corpus.decode("utf-8")  # valid UTF-8


def test_load_file_folder_and_glob(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("bravo")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("alpha")
    (tmp_path / "skip.md").write_text("not text corpus")
    assert D.load_text(str(tmp_path / "b.txt")) == b"bravo"
    assert D.load_text(tmp_path / "b.txt") == b"bravo"  # PathLike
    # folder: recursive, sorted by relative path ("b.txt" < "sub/a.txt"), .txt only
    assert D.load_text(str(tmp_path)) == b"bravo\nalpha"
    assert D.load_text(str(tmp_path / "**" / "*.txt")) == b"bravo\nalpha"
    assert D.load_text(str(tmp_path / "*.md")) == b"not text corpus"


def test_load_errors_name_the_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="does not exist") as e:
        D.load_text(missing)
    assert missing in str(e.value)
    with pytest.raises(ValueError, match="matches no files"):
        D.load_text(str(tmp_path / "*.txt"))
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "x.md").write_text("hi")
    with pytest.raises(ValueError, match=r"empty_dir.*contains no \.txt files"):
        D.load_text(str(tmp_path / "empty_dir"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text("")
    with pytest.raises(ValueError, match=r"has no text \(read 2 empty file"):
        D.load_text(str(tmp_path / "blank"))


def test_encode_decode_roundtrip() -> None:
    text = "héllo, wörld ✓"
    tokens = D.encode(text)
    assert tokens.dtype == np.int32 and tokens.max() < D.VOCAB_SIZE
    assert D.decode(tokens) == text
    assert D.decode(jax.numpy.asarray(tokens)) == text
    assert D.decode(tokens[:2]) == "h\ufffd"  # a split multi-byte char becomes U+FFFD, not an error
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        D.decode([300])


# ---------------------------------------------------------------- split


def test_split_holds_out_tail() -> None:
    train, val = D.split_train_val(b"0123456789" * 10, val_fraction=0.1)
    assert train.dtype == np.uint8 and (len(train), len(val)) == (90, 10)
    assert bytes(val) == b"0123456789" and bytes(train) + bytes(val) == b"0123456789" * 10
    assert len(D.split_train_val(b"abc", 0.0)[1]) == 0
    with pytest.raises(ValueError, match="val_fraction"):
        D.split_train_val(b"abc", 1.0)


def test_val_batches_only_read_the_tail() -> None:
    data = b"a" * 9000 + b"b" * 1000
    train, val = D.split_train_val(data, val_fraction=0.1)
    loader = D.ByteBatches(train, 8, 32, seed=1, process_index=0, process_count=1)
    for step in range(20):  # train windows never reach the held-out tail
        assert set(np.unique(loader.batch(step)["inputs"])) == {ord("a")}
    vals = D.val_batches(val, 8, 32, process_index=0, process_count=1)
    assert len(vals) == (999 // 32) // 8  # as many as fit without overlap
    for b in vals:
        assert set(np.unique(b["inputs"])) == {ord("b")} and set(np.unique(b["targets"])) == {ord("b")}


def test_val_batches_fixed_and_process_split(corpus: bytes) -> None:
    _, val = D.split_train_val(corpus)
    whole = D.val_batches(val, 8, 64, num_batches=3, process_index=0, process_count=1)
    assert len(whole) == 3 and whole[0]["inputs"].shape == (8, 64)
    again = D.val_batches(val, 8, 64, num_batches=3, process_index=0, process_count=1)
    for a, b in zip(whole, again):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(whole[0]["inputs"], whole[1]["inputs"])
    np.testing.assert_array_equal(whole[0]["inputs"][:, 1:], whole[0]["targets"][:, :-1])
    for n_proc in (2, 4):
        parts = [D.val_batches(val, 8, 64, num_batches=3, process_index=p, process_count=n_proc) for p in range(n_proc)]
        for i in range(3):
            joined = _concat([part[i] for part in parts])
            np.testing.assert_array_equal(joined["inputs"], whole[i]["inputs"])
            np.testing.assert_array_equal(joined["targets"], whole[i]["targets"])


# ---------------------------------------------------------------- training batches


def test_batches_deterministic_and_shifted(corpus: bytes) -> None:
    train, _ = D.split_train_val(corpus)
    make = lambda seed: D.ByteBatches(train, 16, 128, seed=seed, process_index=0, process_count=1)  # noqa: E731
    b0 = make(0).batch(7)
    assert b0["inputs"].shape == b0["targets"].shape == (16, 128)
    assert b0["inputs"].dtype == b0["targets"].dtype == np.int32
    np.testing.assert_array_equal(b0["inputs"], make(0).batch(7)["inputs"])  # same seed + step
    assert not np.array_equal(b0["inputs"], make(0).batch(8)["inputs"])  # other step
    assert not np.array_equal(b0["inputs"], make(1).batch(7)["inputs"])  # other seed
    np.testing.assert_array_equal(b0["inputs"][:, 1:], b0["targets"][:, :-1])
    # each row is a real window of the corpus and its target is the next byte
    starts = D.train_window_starts(0, 7, 16, len(train) - 128)
    for row, s in enumerate(starts):
        np.testing.assert_array_equal(b0["inputs"][row], train[s : s + 128])
        assert b0["targets"][row, -1] == train[s + 128]


def test_window_can_reach_last_byte() -> None:
    # seq_len + 1 == corpus length: the single valid window is the whole corpus
    loader = D.ByteBatches(b"abcde", 2, 4, process_index=0, process_count=1)
    b = loader.batch(0)
    assert D.decode(b["inputs"][0]) == "abcd" and D.decode(b["targets"][0]) == "bcde"


@pytest.mark.parametrize("n_proc", [1, 2, 4])
def test_process_split_concatenates_to_global_batch(corpus: bytes, n_proc: int) -> None:
    train, _ = D.split_train_val(corpus)
    reference = D.ByteBatches(train, 16, 64, seed=5, process_index=0, process_count=1)
    loaders = [D.ByteBatches(train, 16, 64, seed=5, process_index=p, process_count=n_proc) for p in range(n_proc)]
    assert all(loader.local_batch_size == 16 // n_proc for loader in loaders)
    for step in (0, 1, 123):
        joined = _concat([loader.batch(step) for loader in loaders])
        expected = reference.batch(step)
        np.testing.assert_array_equal(joined["inputs"], expected["inputs"])
        np.testing.assert_array_equal(joined["targets"], expected["targets"])


def test_resume_from_saved_state(corpus: bytes) -> None:
    train, _ = D.split_train_val(corpus)
    run = D.ByteBatches(train, 8, 32, seed=11, process_index=1, process_count=2)
    for _ in range(5):
        next(run)
    saved = run.state()
    assert saved == {"step": 5, "seed": 11}
    expected = [next(run) for _ in range(3)]

    resumed = D.ByteBatches(train, 8, 32, seed=0, process_index=1, process_count=2)
    resumed.restore(saved)
    for want in expected:
        got = next(resumed)
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
    assert resumed.state() == {"step": 8, "seed": 11}
    started = D.ByteBatches(train, 8, 32, seed=11, start_step=5, process_index=1, process_count=2)
    np.testing.assert_array_equal(next(started)["targets"], expected[0]["targets"])


def test_batch_size_and_window_errors(corpus: bytes) -> None:
    train, _ = D.split_train_val(corpus)
    msg = (
        "batch size 30 is not divisible by the 8 data-parallel devices (mesh axes data×fsdp); "
        "use a multiple of 8: 24 or 32"
    )
    with pytest.raises(ValueError) as e:
        D.ByteBatches(train, 30, 16, process_index=0, process_count=1, data_parallel_size=8)
    assert str(e.value) == msg
    with pytest.raises(ValueError, match="not divisible by the 4 processes.*multiple of 4: 8 or 12"):
        D.ByteBatches(train, 10, 16, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="not divisible by the 4 processes"):
        D.val_batches(train, 10, 16, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="seq_len 10 needs 11 bytes.*only 10 bytes"):
        D.ByteBatches(b"0123456789", 2, 10, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="validation data has only"):
        D.val_batches(b"0123", 2, 10, process_index=0, process_count=1)
    with pytest.raises(ValueError, match=r"process_index 2 is outside \[0, 2\)"):
        D.ByteBatches(train, 8, 16, process_index=2, process_count=2)


def test_defaults_follow_jax_runtime(corpus: bytes) -> None:
    loader = D.ByteBatches(corpus, 8, 16)
    assert (loader.process_index, loader.process_count) == (jax.process_index(), jax.process_count()) == (0, 1)


# ---------------------------------------------------------------- global arrays


def test_to_global_has_requested_sharding(corpus: bytes) -> None:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P(("data",), None))
    local = D.ByteBatches(corpus, 16, 32, seed=2).batch(3)
    arrays = D.to_global(local, sharding)
    for key in ("inputs", "targets"):
        assert arrays[key].sharding == sharding
        assert arrays[key].shape == (16, 32) and arrays[key].dtype == np.int32
        assert len(arrays[key].addressable_shards) == 8
        assert all(s.data.shape == (2, 32) for s in arrays[key].addressable_shards)
        np.testing.assert_array_equal(np.asarray(arrays[key]), local[key])


def test_to_global_rejects_rows_on_wrong_process(corpus: bytes) -> None:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    local = D.ByteBatches(corpus, 8, 16).batch(0)
    wrong = r"rows \[0, 8\).*live on process 0's devices.*rows \[8, 16\)"
    with pytest.raises(ValueError, match=wrong):
        D.to_global(local, NamedSharding(mesh, P("data")), rows=slice(8, 16))
    # replicated batch: every process loads the full batch and says so
    arrays = D.to_global(local, NamedSharding(mesh, P()), rows=slice(0, 8))
    np.testing.assert_array_equal(np.asarray(arrays["inputs"]), local["inputs"])


_WORKER = """
import os, sys
os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=4 --xla_cpu_collective_call_terminate_timeout_seconds=900"
    " FAST_FLAGS"
)
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
port, pid, reverse = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "reverse"
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from shardlib.runtime import data as D

corpus = D.load_text(None)
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
if reverse:  # process 1's devices first: its rows would silently land in block 0
    mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]), ("data",), axis_types=(AxisType.Auto,))
loader = D.ByteBatches(corpus, 16, 32, seed=9, data_parallel_size=8)
assert loader.local_batch_size == 8 and loader.process_index == pid
loader.restore({"step": 4, "seed": 9})
try:
    arrays = D.to_global(next(loader), NamedSharding(mesh, P("data", None)), rows=loader.rows)
except ValueError as e:
    print("REJECTED", pid, e)
    sys.exit(0)
expected = D.ByteBatches(corpus, 16, 32, seed=9, process_index=0, process_count=1).batch(4)
for key, arr in arrays.items():
    assert arr.shape == (16, 32), arr.shape
    gathered = np.asarray(multihost_utils.process_allgather(arr, tiled=True))
    np.testing.assert_array_equal(gathered, expected[key])
print("OK", pid)
""".replace("FAST_FLAGS", compile_flags.FAST)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mesh_order", ["natural", "reverse"])
def test_two_processes_see_the_single_process_batch(tmp_path: Path, mesh_order: str) -> None:
    """Real jax.distributed run: 2 processes x 4 CPU devices assemble exactly the 1-process batch,
    and a mesh that puts process 1's devices on row block 0 is rejected instead of permuting data."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(_WORKER))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["XLA_FLAGS"] = compile_flags.FAST
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(port), str(pid), mesh_order],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for pid, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {pid} failed:\n{out[-3000:]}"
        if mesh_order == "natural":
            assert f"OK {pid}" in out
        else:
            assert f"REJECTED {pid}" in out and "order the mesh devices by process" in out
