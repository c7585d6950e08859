"""atomic: a file or directory is seen whole or not at all."""

from __future__ import annotations

import os

import pytest

from vllm_omni_edge.atomic import atomic_file, atomic_write_bytes


def test_a_written_file_replaces_the_old_one_whole(tmp_path):
    target = tmp_path / "sub" / "data.bin"
    atomic_write_bytes(target, b"old")
    with atomic_file(target) as tmp:
        assert tmp.parent == target.parent and tmp != target
        tmp.write_bytes(b"new")
        assert target.read_bytes() == b"old"  # not before the block ends
    assert target.read_bytes() == b"new"
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    assert os.listdir(target.parent) == ["data.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "data.bin"
    atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError, match="half way"):
        with atomic_file(target) as tmp:
            tmp.write_bytes(b"ne")
            raise RuntimeError("half way")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["data.bin"]
