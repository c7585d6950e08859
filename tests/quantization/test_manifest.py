"""The cpu_int4 manifest check: hashed once per file version, never fooled by an edit."""

from __future__ import annotations

import os

import pytest

from vllm_omni_edge.levers import WEIGHTS_CHECK_ENV, LeverFlagError
from vllm_omni_edge.quantization import manifest
from vllm_omni_edge.quantization.manifest import CheckpointIntegrityError, verify_manifest, write_manifest


@pytest.fixture
def checkpoint(tmp_path, isolated_cache, monkeypatch):
    monkeypatch.delenv(WEIGHTS_CHECK_ENV, raising=False)
    monkeypatch.setattr(manifest, "_checks", {"hashed": 0, "remembered": 0})
    monkeypatch.setattr(manifest, "_matched_here", set())  # a new process each call unless a test says
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(os.urandom(1 << 16))
    write_manifest(directory, ["model.safetensors"], {"format": "test"})
    return directory


def new_process():
    manifest._matched_here.clear()


def test_an_unchanged_file_is_hashed_once(checkpoint):
    verify_manifest(checkpoint)
    new_process()
    verify_manifest(checkpoint)
    assert manifest.checks() == {"hashed": 1, "remembered": 1}


def test_a_process_checks_a_file_version_once_even_when_always(checkpoint, monkeypatch):
    monkeypatch.setenv(WEIGHTS_CHECK_ENV, "always")
    verify_manifest(checkpoint)
    verify_manifest(checkpoint)  # vLLM builds the quantization config twice per start
    assert manifest.checks() == {"hashed": 1, "remembered": 0}


def test_a_same_size_edit_with_its_mtime_restored_is_still_caught(checkpoint):
    weights = checkpoint / "model.safetensors"
    verify_manifest(checkpoint)
    new_process()
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # ctime moves anyway
    with pytest.raises(CheckpointIntegrityError, match="does not match its SHA-256"):
        verify_manifest(checkpoint)
    assert manifest.checks()["hashed"] == 2


def test_a_mismatch_is_never_remembered(checkpoint):
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[0] ^= 0xFF
    weights.write_bytes(bytes(data))
    for _ in range(2):
        with pytest.raises(CheckpointIntegrityError, match="does not match"):
            verify_manifest(checkpoint)
    assert manifest.checks() == {"hashed": 2, "remembered": 0}


def test_always_hashes_every_start(checkpoint, monkeypatch):
    monkeypatch.setenv(WEIGHTS_CHECK_ENV, "always")
    verify_manifest(checkpoint)
    new_process()
    verify_manifest(checkpoint)
    assert manifest.checks() == {"hashed": 2, "remembered": 0}


def test_a_bad_flag_value_names_the_variable(checkpoint, monkeypatch):
    monkeypatch.setenv(WEIGHTS_CHECK_ENV, "sometimes")
    with pytest.raises(LeverFlagError, match=WEIGHTS_CHECK_ENV):
        verify_manifest(checkpoint)


def test_an_unwritable_cache_costs_only_the_memo(checkpoint, isolated_cache, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_OMNI_EDGE_CACHE", str(blocker))  # its subdirectories cannot be made
    verify_manifest(checkpoint)
    new_process()
    verify_manifest(checkpoint)
    assert manifest.checks() == {"hashed": 2, "remembered": 0}
