"""The compile-cache key patch: our kernel choice and flags join vLLM's key."""

from __future__ import annotations

import json
import types

import pytest

from vllm_omni_edge.patches.worker import compile_cache_key
from vllm_omni_edge.quantization import evidence


def fake_caching_module():
    return types.SimpleNamespace(aot_compile_hash_factors=lambda vllm_config: ["env-hash", "config-hash"])


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("VLLM_OMNI_EDGE_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(compile_cache_key, "last_factor", None)


def keyed(monkeypatch, counts):
    monkeypatch.setattr(evidence, "kernel_counts", lambda: counts)
    module = fake_caching_module()
    compile_cache_key._wrap(module)
    return module.aot_compile_hash_factors(object())


def test_vllms_factors_come_first_and_ours_is_appended(monkeypatch):
    factors = keyed(monkeypatch, {"linear:int4pack": 120, "fallback": 0})
    assert factors[:2] == ["env-hash", "config-hash"] and len(factors) == 3
    ours = json.loads(factors[2])
    assert ours == {"rope_cap": True, "embed_prepack": False, "int4_dense_prefill_copy": False,
                    "fused_mlp": True, "attention_one_call": True,
                    "cpu_int4_kernels": {"fallback": 0, "linear:int4pack": 120}}
    assert compile_cache_key.last_factor == factors[2]


def test_another_kernel_or_graph_lever_is_another_key(monkeypatch):
    tinygemm = keyed(monkeypatch, {"linear:int4pack": 120})
    assert keyed(monkeypatch, {"linear:avx512_w4a8_rows16": 120}) != tinygemm
    # The attention flags decide whether the graph holds vLLM's separate KV update op.
    for flag, value in [("VLLM_OMNI_EDGE_INT4_LAYOUTS", "two"), ("VLLM_OMNI_EDGE_ROPE_CAP", "0"),
                        ("VLLM_OMNI_EDGE_EMBED_PREPACK", "1"), ("VLLM_OMNI_EDGE_FUSED_MLP", "0"),
                        ("VLLM_OMNI_EDGE_ATTENTION_ONE_CALL", "0"), ("VLLM_OMNI_EDGE_ATTENTION_CALLS", "0")]:
        monkeypatch.setenv(flag, value)
        assert keyed(monkeypatch, {"linear:int4pack": 120}) != tinygemm, flag
        monkeypatch.delenv(flag)


def test_defaults_spelled_out_and_flags_outside_the_graph_keep_the_key(monkeypatch):
    tinygemm = keyed(monkeypatch, {"linear:int4pack": 120})
    # The harness sets a fresh evidence directory per pass: that must not force a compile.
    for flag, value in [("VLLM_OMNI_EDGE_EVIDENCE_DIR", "/tmp/pass-3"), ("VLLM_OMNI_EDGE_ROPE_CAP", "1"),
                        ("VLLM_OMNI_EDGE_HEAP_TRIM", "0"), ("VLLM_OMNI_EDGE_SINGLE_PROCESS", "1")]:
        monkeypatch.setenv(flag, value)
    assert keyed(monkeypatch, {"linear:int4pack": 120}) == tinygemm


def test_wrapping_twice_appends_once(monkeypatch):
    monkeypatch.setattr(evidence, "kernel_counts", lambda: {})
    module = fake_caching_module()
    compile_cache_key._wrap(module)
    compile_cache_key._wrap(module)
    assert len(module.aot_compile_hash_factors(None)) == 3


def test_vllm_builds_its_key_through_the_function_we_wrap():
    # decorators.py imports it from caching at call time, so the module attribute is what runs.
    import inspect

    pytest.importorskip("vllm")
    from vllm.compilation import decorators

    source = inspect.getsource(decorators)
    assert "from .caching import aot_compile_hash_factors" in source
    assert "aot_compile_hash_factors(self.vllm_config)" in source
