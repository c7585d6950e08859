"""The attention-ISA patch: bf16 attention never runs vLLM's AMX kernels unless asked."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_omni_edge.levers import LeverFlagError, amx_attention_enabled
from vllm_omni_edge.patches.worker import cpu_attention_isa


def fake_module(isa: str):
    calls = []

    def _get_attn_isa(dtype, block_size, head_size=None, kv_cache_dtype=None):
        calls.append((dtype, block_size, head_size, kv_cache_dtype))
        return isa

    return types.SimpleNamespace(_get_attn_isa=_get_attn_isa), calls


def test_amx_becomes_vec_and_every_other_choice_passes_through():
    for upstream, expected in (("amx", "vec"), ("vec", "vec"), ("vec16", "vec16"), ("amx_fp8", "amx_fp8")):
        module, calls = fake_module(upstream)
        cpu_attention_isa._wrap(module)
        assert module._get_attn_isa(torch.bfloat16, 128, 64, "auto") == expected
        assert calls == [(torch.bfloat16, 128, 64, "auto")]  # arguments reach vLLM unchanged


def test_wrapping_twice_wraps_once():
    module, calls = fake_module("amx")
    cpu_attention_isa._wrap(module)
    first = module._get_attn_isa
    cpu_attention_isa._wrap(module)
    assert module._get_attn_isa is first
    module._get_attn_isa(torch.bfloat16, 32)
    assert len(calls) == 1


def test_on_vllm_itself_an_amx_cpu_gets_vec(monkeypatch):
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", getattr(cpu_attn._get_attn_isa, "__wrapped__",
                                                           cpu_attn._get_attn_isa))
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "amx"  # vLLM 0.30's own choice
    cpu_attention_isa._wrap(cpu_attn)
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "vec"
    assert cpu_attn._get_attn_isa(torch.float32, 128, 64) == "vec"
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 80) == "vec16"  # head size 80: untouched


def test_the_flag_leaves_vllm_alone(monkeypatch):
    wrapped = []
    monkeypatch.setattr(cpu_attention_isa, "when_imported", lambda target, fn: wrapped.append(target) or True)
    monkeypatch.setenv("VLLM_OMNI_EDGE_AMX_ATTENTION", "1")
    assert "vLLM picks" in cpu_attention_isa.apply() and wrapped == []
    monkeypatch.delenv("VLLM_OMNI_EDGE_AMX_ATTENTION")
    assert "runs vec, not amx" in cpu_attention_isa.apply() and wrapped == [cpu_attention_isa.TARGET_MODULE]


def test_a_flag_that_is_not_0_or_1_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_AMX_ATTENTION", "yes")
    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_AMX_ATTENTION"):
        amx_attention_enabled()
