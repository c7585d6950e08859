"""The trimmed CPU attention calls write the same KV cache and produce the same output as vLLM's."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_omni_edge.patches.worker import cpu_attention_calls as patch

HEADS, KV_HEADS, HEAD, BLOCK, BLOCKS = 4, 2, 64, 32, 8


@pytest.fixture(scope="module")
def backend():
    return pytest.importorskip("vllm.v1.attention.backends.cpu_attn")


@pytest.fixture(scope="module")
def stock_impl_class(backend):
    """vLLM's own methods, even if this process already loaded the plugin."""
    import inspect

    base = backend.CPUAttentionBackendImpl

    class Stock(base):
        forward = inspect.unwrap(base.forward)
        do_kv_cache_update = inspect.unwrap(base.do_kv_cache_update)

    assert Stock.forward.__module__ == backend.__name__
    return Stock


@pytest.fixture(scope="module")
def trimmed_impl_class(backend):
    class Trimmed(backend.CPUAttentionBackendImpl):
        pass

    module = types.SimpleNamespace(AttentionType=backend.AttentionType, CPUAttentionBackendImpl=Trimmed)
    patch._wrap(module)
    patch._wrap(module)  # idempotent
    return Trimmed


def _impl(cls, **kw):
    return cls(num_heads=HEADS, head_size=HEAD, scale=HEAD ** -0.5, num_kv_heads=KV_HEADS,
               alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto", **kw)


def _layer():
    return types.SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)


def _batch(seed, padded_rows=0):
    """Two requests on a paged cache: one decoding 1 token at position 4, one 3 tokens at 6-8."""
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16)
    tokens = 4
    rows = tokens + padded_rows
    query = torch.randn(rows, HEADS, HEAD, generator=g).to(torch.bfloat16)
    key = torch.randn(rows, KV_HEADS, HEAD, generator=g).to(torch.bfloat16)
    value = torch.randn(rows, KV_HEADS, HEAD, generator=g).to(torch.bfloat16)
    seq_lens = torch.tensor([5, 9], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1, 4], dtype=torch.int32)
    slot_mapping = torch.tensor([4, 2 * BLOCK + 6, 2 * BLOCK + 7, 2 * BLOCK + 8] + [-1] * padded_rows)
    metadata = types.SimpleNamespace(
        num_actual_tokens=tokens, query_start_loc=query_start_loc, seq_lens=seq_lens, causal=True,
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), dynamic_causal=None,
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=2, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD, seq_lens=seq_lens,
            dtype=torch.bfloat16, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1,
            isa="vec", enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto"),
    )
    return kv_cache, query, key, value, slot_mapping, metadata


def _step(impl, layer, kv_cache, query, key, value, slot_mapping, metadata):
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping[: metadata.num_actual_tokens])
    output = torch.zeros(query.shape[0], HEADS * HEAD, dtype=torch.bfloat16).view(-1, HEADS, HEAD)
    returned = impl.forward(layer, query, key, value, kv_cache, metadata, output=output)
    assert returned is output
    return kv_cache, output


@pytest.mark.parametrize("padded_rows", [0, 3])
def test_same_cache_writes_and_output_as_vllms_code(stock_impl_class, trimmed_impl_class, padded_rows):
    stock_cache, stock_out = _step(_impl(stock_impl_class), _layer(), *_batch(7, padded_rows))
    trimmed_cache, trimmed_out = _step(_impl(trimmed_impl_class), _layer(), *_batch(7, padded_rows))
    assert torch.equal(trimmed_cache, stock_cache)
    assert torch.equal(trimmed_out, stock_out)
    assert stock_out[:4].abs().sum() > 0  # the attention ran
    assert not trimmed_out[4:].any()  # padded rows untouched, as in vLLM


def test_cache_views_are_made_once_per_kv_tensor(trimmed_impl_class):
    impl, layer = _impl(trimmed_impl_class), _layer()
    batch = _batch(1)
    _step(impl, layer, *batch)
    first = getattr(layer, patch._VIEWS_ATTR)
    _step(impl, layer, *batch)
    assert getattr(layer, patch._VIEWS_ATTR) is first
    replaced = _batch(2)  # a new KV tensor (vLLM re-allocated the cache): new views
    _step(impl, layer, *replaced)
    assert getattr(layer, patch._VIEWS_ATTR)[0] is replaced[0]


def test_warm_up_and_encoder_attention_take_vllms_path(backend, trimmed_impl_class):
    impl, layer = _impl(trimmed_impl_class), _layer()
    kv_cache, query, key, value, _, _ = _batch(3)
    output = torch.zeros(query.shape[0], HEADS, HEAD, dtype=torch.bfloat16)
    assert impl.forward(layer, query, key, value, kv_cache, None, output=output) is output
    assert not output.any() and not hasattr(layer, patch._VIEWS_ATTR)
    encoder = _impl(trimmed_impl_class, attn_type=backend.AttentionType.ENCODER_ONLY)
    before = kv_cache.clone()
    encoder.do_kv_cache_update(layer, key, value, kv_cache, torch.arange(4))
    assert torch.equal(kv_cache, before)  # vLLM's code: encoders keep no KV cache


def test_in_force_reads_the_backend_class(backend, monkeypatch):
    wrapped = lambda *a, **k: None  # noqa: E731
    wrapped.__edge_wrapped__ = True
    monkeypatch.setattr(backend.CPUAttentionBackendImpl, "forward", wrapped)
    assert patch.in_force()
    monkeypatch.setattr(backend.CPUAttentionBackendImpl, "forward", lambda *a, **k: None)
    assert not patch.in_force()


def test_the_flag_keeps_vllms_calls(monkeypatch):
    from vllm_omni_edge.levers import LeverFlagError

    monkeypatch.setenv("VLLM_OMNI_EDGE_ATTENTION_CALLS", "0")
    assert "kept" in patch.apply()
    monkeypatch.setenv("VLLM_OMNI_EDGE_ATTENTION_CALLS", "fast")
    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_ATTENTION_CALLS"):
        patch.apply()


@pytest.fixture(scope="module")
def one_call(backend):
    """(impl class, backend class) wrapped in one-call mode, on subclasses of vLLM's stock code."""
    import inspect

    class OneCall(backend.CPUAttentionBackendImpl):
        forward = inspect.unwrap(backend.CPUAttentionBackendImpl.forward)
        do_kv_cache_update = inspect.unwrap(backend.CPUAttentionBackendImpl.do_kv_cache_update)

    class Backend(backend.CPUAttentionBackend):
        forward_includes_kv_cache_update = False  # vLLM 0.30's value

    module = types.SimpleNamespace(AttentionType=backend.AttentionType, CPUAttentionBackendImpl=OneCall,
                                   CPUAttentionBackend=Backend)
    patch._wrap(module, writes_kv=True)
    patch._wrap(module, writes_kv=True)  # idempotent
    return OneCall, Backend


def test_one_call_declares_the_write_to_vllm(one_call):
    _, backend_class = one_call
    assert backend_class.forward_includes_kv_cache_update is True


@pytest.mark.parametrize("padded_rows", [0, 3])
def test_one_call_writes_and_attends_as_vllms_two_calls(stock_impl_class, one_call, padded_rows):
    stock_cache, stock_out = _step(_impl(stock_impl_class), _layer(), *_batch(11, padded_rows))
    kv_cache, query, key, value, slot_mapping, metadata = _batch(11, padded_rows)
    # The runner builds an unpadded slot mapping when no backend updates the cache separately.
    metadata.slot_mapping = slot_mapping[: metadata.num_actual_tokens]
    before = kv_cache.clone()
    output = torch.zeros(query.shape[0], HEADS, HEAD, dtype=torch.bfloat16)
    impl = _impl(one_call[0])
    assert impl.forward(_layer(), query, key, value, kv_cache, metadata, output=output) is output
    assert not torch.equal(kv_cache, before)  # it wrote
    assert torch.equal(kv_cache, stock_cache)
    assert torch.equal(output, stock_out)


def test_one_call_writes_nothing_for_a_shared_cache_or_no_keys(one_call):
    kv_cache, query, key, value, slot_mapping, metadata = _batch(5)
    metadata.slot_mapping = slot_mapping
    before = kv_cache.clone()
    output = torch.zeros(query.shape[0], HEADS, HEAD, dtype=torch.bfloat16)
    sharing = _impl(one_call[0], kv_sharing_target_layer_name="model.layers.0.self_attn.attn")
    sharing.forward(_layer(), query, key, value, kv_cache, metadata, output=output)
    assert torch.equal(kv_cache, before)
    _impl(one_call[0]).forward(_layer(), query, None, None, kv_cache, metadata, output=output)
    assert torch.equal(kv_cache, before)


def test_one_call_flag(monkeypatch):
    from vllm_omni_edge.levers import attention_one_call_enabled

    assert attention_one_call_enabled()
    monkeypatch.setenv("VLLM_OMNI_EDGE_ATTENTION_ONE_CALL", "0")
    assert not attention_one_call_enabled()
    monkeypatch.setenv("VLLM_OMNI_EDGE_ATTENTION_ONE_CALL", "1")
    monkeypatch.setenv("VLLM_OMNI_EDGE_ATTENTION_CALLS", "0")  # one call needs the trimmed calls
    assert not attention_one_call_enabled()
