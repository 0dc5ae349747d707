"""`shardlib.runtime.files.AtomicDir`: a directory that appears whole, written never through a link."""

from __future__ import annotations

import os

import pytest

from shardlib.runtime.files import AtomicDir, LinkedOutputError


def test_the_directory_appears_only_on_commit_and_an_earlier_one_is_set_aside(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "old.txt").write_text("old")
    staging = AtomicDir(out)
    staging.write("config.json", "{}\n")
    staging.write("weights.bin", b"\x00\x01")
    (tmp_path / "source.json").write_text("tokenizer")
    staging.copy(tmp_path / "source.json", "tokenizer.json")
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]  # nothing of the new one yet
    old = staging.commit()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json", "weights.bin"]
    assert (out / "weights.bin").read_bytes() == b"\x00\x01" and (out / "tokenizer.json").read_text() == "tokenizer"
    assert old is not None and (old / "old.txt").read_text() == "old"  # the caller empties what it owns
    assert not staging.tmp.exists()


def test_a_file_is_never_written_twice_nor_through_a_link(tmp_path):
    staging = AtomicDir(tmp_path / "export")
    staging.write("a.txt", "a")
    with pytest.raises(FileExistsError):
        staging.write("a.txt", "again")
    (tmp_path / "elsewhere").write_text("keep")
    os.symlink(tmp_path / "elsewhere", staging.tmp / "b.txt")
    with pytest.raises(OSError):
        staging.write("b.txt", "through")
    assert (tmp_path / "elsewhere").read_text() == "keep"
    staging.discard()
    assert not staging.tmp.exists() and not (tmp_path / "export").exists()


def test_a_link_at_the_path_is_refused_before_and_at_commit(tmp_path):
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "linked")
    with pytest.raises(LinkedOutputError):
        AtomicDir(tmp_path / "linked")
    staging = AtomicDir(tmp_path / "export")
    staging.write("a.txt", "a")
    os.symlink(tmp_path / "target", tmp_path / "export")  # planted while writing
    with pytest.raises(LinkedOutputError):
        staging.commit()
    assert list((tmp_path / "target").iterdir()) == []
