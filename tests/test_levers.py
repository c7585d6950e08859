"""The memory levers' rules, without starting an engine."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_omni_edge.levers import LeverFlagError, kv_default_mode, rope_cap_enabled
from vllm_omni_edge.levers import kv_budget as kv
from vllm_omni_edge.levers.rope_cap import cap_rotary_tables

GiB, MiB = kv.GiB, kv.MiB
# SmolLM2-135M: 30 layers x 2 (K,V) x 3 KV heads x 64 x bf16
SMOL = kv.KVShape(bytes_per_token=30 * 2 * 3 * 64 * 2, block_size=128)


@pytest.fixture(autouse=True)
def vllm_config_context():
    """Rotary modules are CustomOps, which read the current vLLM config when built."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    _ROPE_DICT.clear()  # get_rope caches modules process-wide
    with set_current_vllm_config(VllmConfig()):
        yield
    _ROPE_DICT.clear()


# RoPE variants the supported models use (Llama/SmolLM2, Qwen2/2.5, Llama 3.x,
# YaRN/NTK long-context configs, Qwen2-VL/Omni M-RoPE).
ROPE_VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
             "original_max_position_embeddings": 1024},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "mrope": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
}


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_capped_rope_rows_equal_the_uncapped_table_bit_for_bit(variant):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope = get_rope(64, 4096, True, dict(ROPE_VARIANTS[variant]), torch.bfloat16)
    full = rope.cos_sin_cache.clone()
    model = torch.nn.Sequential(rope, rope)  # shared module, as layers share it
    cut = cap_rotary_tables(model, 512)
    assert len(cut) == 1 and cut[0]["rows_after"] == 512
    assert cut[0]["rows_before"] == full.shape[0] > 512
    assert rope.cos_sin_cache.shape[0] == 512
    assert torch.equal(rope.cos_sin_cache, full[:512])
    assert rope.cos_sin_cache.untyped_storage().nbytes() == rope.cos_sin_cache.nbytes


def test_rope_cap_leaves_short_tables_alone():
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope = get_rope(64, 256, True, dict(ROPE_VARIANTS["default"]), torch.float32)
    assert cap_rotary_tables(rope, 512) == [] and rope.cos_sin_cache.shape[0] == 256


def test_lever_flags_parse_and_refuse_garbage(monkeypatch):
    assert rope_cap_enabled() and kv_default_mode() == "need"
    monkeypatch.setenv("VLLM_OMNI_EDGE_ROPE_CAP", "0")
    monkeypatch.setenv("VLLM_OMNI_EDGE_KV_DEFAULT", "vllm")
    assert not rope_cap_enabled() and kv_default_mode() == "vllm"
    monkeypatch.setenv("VLLM_OMNI_EDGE_ROPE_CAP", "maybe")
    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_ROPE_CAP='maybe'"):
        rope_cap_enabled()


def test_int4_load_and_layout_flags(monkeypatch):
    from vllm_omni_edge.levers import int4_dense_prefill_copy, int4_layerwise_load

    assert int4_layerwise_load() and not int4_dense_prefill_copy()
    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_LOAD", "whole")
    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_LAYOUTS", "two")
    assert not int4_layerwise_load() and int4_dense_prefill_copy()
    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_LAYOUTS", "2")
    with pytest.raises(LeverFlagError, match="expected one of one, two"):
        int4_dense_prefill_copy()


def test_explicit_budget_is_honoured_exactly():
    d = kv.decide(192 * MiB, SMOL, 512, 256, 24 * GiB, "need")
    assert d.budget_bytes == 192 * MiB


def test_budget_below_one_request_is_refused_naming_the_minimum():
    minimum = SMOL.pool_bytes(8192, 1)
    assert minimum == SMOL.one_request_bytes(8192) + 128 * SMOL.bytes_per_token  # vLLM's null block
    with pytest.raises(kv.KVBudgetError, match=f"at least .*{minimum} B") as err:
        kv.decide(minimum - 1, SMOL, 8192, 1, 24 * GiB, "need")
    assert "max_model_len=8192" in str(err.value)
    assert kv.decide(minimum, SMOL, 8192, 1, 24 * GiB, "need").budget_bytes == minimum


def test_default_budget_is_sized_from_need_and_capped():
    small = kv.decide(None, SMOL, 512, 4, 24 * GiB, "need")
    assert small.budget_bytes == 4 * SMOL.one_request_bytes(512) + SMOL.block_bytes  # the need, null block too
    big = kv.decide(None, SMOL, 8192, 256, 24 * GiB, "need")
    assert big.budget_bytes == 256 * MiB  # 256 x 8192 tokens would be ~47 GiB
    tiny_box = kv.decide(None, SMOL, 512, 256, 1 * GiB, "need")
    assert tiny_box.budget_bytes == GiB // 8  # RAM/8
    huge_ctx = kv.decide(None, SMOL, 131072, 8, 1 * GiB, "need")
    assert huge_ctx.budget_bytes == SMOL.pool_bytes(131072, 1)  # never below one request
    assert kv.decide(None, SMOL, 512, 4, 24 * GiB, "vllm").budget_bytes is None


def test_env_and_argument_that_disagree_are_refused(monkeypatch):
    monkeypatch.setenv(kv.ENV_KVCACHE_SPACE, "1")
    env = kv.env_kvcache_space_bytes()
    assert env == GiB
    kv.reconcile_explicit_and_env(GiB, env)  # equal: fine
    kv.reconcile_explicit_and_env(None, env)
    with pytest.raises(kv.KVBudgetError, match="disagree"):
        kv.reconcile_explicit_and_env(192 * MiB, env)


@pytest.mark.parametrize("raw,message", [("0.5", "not a whole number of GiB"),
                                         ("lots", "not a whole number"),
                                         ("0", "at least 1 GiB")])
def test_bad_env_budget_is_a_clear_error(monkeypatch, raw, message):
    monkeypatch.setenv(kv.ENV_KVCACHE_SPACE, raw)
    with pytest.raises(kv.KVBudgetError, match=message):
        kv.env_kvcache_space_bytes()


def test_input_embedding_is_not_prepacked_but_the_head_is(monkeypatch):
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    from vllm_omni_edge.patches.worker import embedding_prepack

    monkeypatch.setattr(vpe.UnquantizedEmbeddingMethod, "process_weights_after_loading",
                        vpe.UnquantizedEmbeddingMethod.process_weights_after_loading)
    embedding_prepack._wrap(vpe)
    def bare(cls):  # the layer without its tensor-parallel set-up
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.weight = torch.nn.Parameter(torch.randn(512, 64, dtype=torch.bfloat16),
                                          requires_grad=False)
        return layer

    embed, head = bare(vpe.VocabParallelEmbedding), bare(vpe.ParallelLMHead)
    method = vpe.UnquantizedEmbeddingMethod()
    for layer in (embed, head):
        method.process_weights_after_loading(layer)
    assert not hasattr(embed, "cpu_linear")  # no prepacked copy for lookups
    assert hasattr(head, "cpu_linear")  # the head still gets its matmul kernel
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(head.cpu_linear(x, head.weight, None), x @ head.weight.t())


HEAP_HOLE = """
import json
from vllm_omni_edge.levers.heap import trim_heap
# 64 MiB of 4 KiB blocks from malloc's heap (above pymalloc's 512 B, below the mmap
# threshold); the last block stays alive, so the freed ones sit below the heap top
# and free() alone cannot give them back.
blocks = [bytearray(4096) for _ in range(16384)]
keep = blocks[-1]
del blocks
print(json.dumps(trim_heap()))
"""


def test_heap_trim_returns_freed_heap_to_the_os():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", HEAP_HOLE], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["trimmed"] is True
    assert result["released_bytes"] > 48 << 20, result


def test_heap_trim_says_why_it_skips_off_glibc(monkeypatch):
    from vllm_omni_edge.levers import heap, heap_trim_enabled

    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("musl", "1.2"))
    heap._libc.cache_clear()
    try:
        assert heap.trim_heap() == {"trimmed": False, "reason": "libc is musl, not glibc"}
    finally:
        heap._libc.cache_clear()
    monkeypatch.setenv("VLLM_OMNI_EDGE_HEAP_TRIM", "0")
    assert heap_trim_enabled() is False
    monkeypatch.setenv("VLLM_OMNI_EDGE_HEAP_TRIM", "yes")
    with pytest.raises(LeverFlagError):
        heap_trim_enabled()


def test_heap_trim_wraps_load_and_warm_up_once_and_trims_after_each(monkeypatch):
    from vllm_omni_edge.levers import heap
    from vllm_omni_edge.patches.base import wrap_method_once
    from vllm_omni_edge.patches.worker import heap_trim

    class FakeWorker:
        def load_model(self):
            return "loaded"

        def compile_or_warm_up_model(self):
            return "warm"

    module = types.ModuleType("fake_cpu_worker")
    module.CPUWorker = FakeWorker
    trims = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(len(trims)) or {"n": len(trims)})
    monkeypatch.setattr(heap_trim, "last_trim", None)
    monkeypatch.setattr(heap_trim, "last_warmup_trim", None)
    heap_trim._wrap(module)
    # evidence_recorder wraps the warm-up after this patch; it must still get its turn.
    recorded = []
    assert wrap_method_once(FakeWorker, "compile_or_warm_up_model",
                            lambda original: lambda self: recorded.append(heap_trim.last_warmup_trim) or original(self))
    heap_trim._wrap(module)  # a second apply wraps nothing more
    worker = FakeWorker()
    assert worker.load_model() == "loaded" and heap_trim.last_trim == {"n": 1}
    assert worker.compile_or_warm_up_model() == "warm" and heap_trim.last_warmup_trim == {"n": 2}
    assert trims == [0, 1] and recorded == [None]  # the outer wrapper ran, once
