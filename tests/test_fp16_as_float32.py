"""patches/frontend/fp16_as_float32.py: dtype auto runs float16 checkpoints in float32 on CPUs
without float16 arithmetic; explicit dtypes and other resolutions are untouched."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_edge.patches.frontend import fp16_as_float32 as patch


def test_which_cpus_have_float16_arithmetic():
    assert patch.cpu_has_fp16_arithmetic(frozenset({"avx512f", "avx512_fp16"}))
    assert patch.cpu_has_fp16_arithmetic(frozenset({"amx_tile", "amx_fp16"}))
    assert not patch.cpu_has_fp16_arithmetic(frozenset({"avx512f", "avx512_bf16", "avx2"}))


@pytest.fixture
def model_module(monkeypatch):
    from vllm.config import model

    original = getattr(model._resolve_auto_dtype, "__wrapped__", model._resolve_auto_dtype)
    monkeypatch.setattr(model, "_resolve_auto_dtype", original)
    patch._wrap(model)
    patch._wrap(model)  # idempotent
    assert model._resolve_auto_dtype.__wrapped__ is original
    return model


def test_auto_float16_becomes_float32_and_others_stay(model_module):
    resolve = model_module._resolve_auto_dtype
    assert resolve("llama", torch.float16, is_pooling_model=False) == torch.float32
    assert resolve("llama", torch.bfloat16, is_pooling_model=False) == torch.bfloat16
    # vLLM downcasts a float32 checkpoint to its preferred dtype (bfloat16 on CPU): unchanged.
    assert resolve("llama", torch.float32, is_pooling_model=False) == torch.bfloat16


def test_an_explicit_dtype_is_never_changed(model_module):
    from vllm.config.model import _get_and_verify_dtype
    from transformers import LlamaConfig

    config = LlamaConfig(torch_dtype="float16")
    assert _get_and_verify_dtype("llama", config, "float16", is_pooling_model=False) == torch.float16
    assert _get_and_verify_dtype("llama", config, "auto", is_pooling_model=False) == torch.float32


def test_the_flag_keeps_vllms_choice(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_FP16_ON_CPU", "float16")
    assert "float16" in patch.apply()
    monkeypatch.setenv("VLLM_OMNI_EDGE_FP16_ON_CPU", "half")
    with pytest.raises(ValueError, match="VLLM_OMNI_EDGE_FP16_ON_CPU"):
        patch.apply()
