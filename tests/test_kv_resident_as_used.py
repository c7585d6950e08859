"""KV buffer resident as used: zeros that read as zeros, become resident only where written."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_omni_edge.levers import LeverFlagError, kv_resident_as_used
from vllm_omni_edge.patches.worker import kv_resident_as_used as patch

MIB = 1 << 20


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_the_buffer_reads_as_zeros_and_is_writable():
    buf = patch.zero_pages(3 * MIB + 5)
    assert buf.dtype == torch.int8 and buf.numel() == 3 * MIB + 5
    assert int(buf.abs().sum()) == 0
    buf[7] = 3
    assert int(buf[7]) == 3 and int(buf.sum()) == 3


def test_only_written_pages_are_resident_and_torch_zeros_are_all():
    before = rss_anon()
    lazy = patch.zero_pages(256 * MIB)
    untouched = rss_anon() - before
    lazy[: 4 * MIB] = 1  # the first blocks of one stream
    written = rss_anon() - before
    assert untouched < 16 * MIB, f"{untouched / MIB:.0f} MiB resident before any write"
    assert 4 * MIB <= written < 24 * MIB, f"{written / MIB:.0f} MiB resident after writing 4 MiB"
    eager = torch.zeros(256 * MIB, dtype=torch.int8)
    assert rss_anon() - before - written > 200 * MIB  # vLLM's zeros: all of it at once
    del lazy, eager


def test_the_module_gets_lazy_kv_zeros_and_torchs_own_otherwise():
    module = types.SimpleNamespace(torch=torch)
    patch._wrap(module)
    before = patch.mapped_bytes
    buf = module.torch.zeros(MIB, dtype=torch.int8, device=torch.device("cpu"))
    assert patch.mapped_bytes - before == MIB and int(buf.sum()) == 0
    other = module.torch.zeros(2, 3, dtype=torch.float32)
    assert other.shape == (2, 3) and patch.mapped_bytes - before == MIB
    assert module.torch.int8 is torch.int8 and module.torch.empty is torch.empty
    proxy = module.torch
    patch._wrap(module)
    assert module.torch is proxy  # applied twice: wrapped once


def test_the_flag(monkeypatch):
    monkeypatch.delenv("VLLM_OMNI_EDGE_KV_RESIDENT", raising=False)
    assert kv_resident_as_used()
    monkeypatch.setenv("VLLM_OMNI_EDGE_KV_RESIDENT", "all")
    assert not kv_resident_as_used()
    monkeypatch.setenv("VLLM_OMNI_EDGE_KV_RESIDENT", "some")
    with pytest.raises(LeverFlagError, match="KV_RESIDENT"):
        kv_resident_as_used()
