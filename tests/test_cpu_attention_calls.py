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


# The attention op's kernel: the one-call forward's work with each layer's constants kept.

class _Recorder:
    """Stands for vLLM's kernel of the op: records that the fallback ran."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _context(name, layer, metadata):
    context = types.SimpleNamespace(no_compile_layers={name: layer}, attn_metadata={name: metadata})
    return types.SimpleNamespace(_forward_context=context)


@pytest.fixture
def op_layer(backend, one_call, monkeypatch):
    """A decoder layer on the one-call backend, as the op kernel finds it in the forward context."""
    monkeypatch.setattr(backend.CPUAttentionBackend, "forward_includes_kv_cache_update", True)

    def make(kv_cache, **impl_kw):
        layer = _layer()
        layer.impl, layer.kv_cache = _impl(one_call[0], **impl_kw), kv_cache
        return layer

    return make


@pytest.mark.parametrize("padded_rows", [0, 3])
def test_the_op_kernel_writes_and_attends_as_the_one_call_forward(op_layer, padded_rows):
    name = "model.layers.0.self_attn.attn"
    kv_cache, query, key, value, slot_mapping, metadata = _batch(13, padded_rows)
    metadata.slot_mapping = slot_mapping[: metadata.num_actual_tokens]
    expected_cache = kv_cache.clone()
    expected = torch.zeros(query.shape[0], HEADS, HEAD, dtype=torch.bfloat16)
    reference = op_layer(expected_cache)
    reference.impl.forward(reference, query, key, value, expected_cache, metadata, output=expected)
    layer, vllm_kernel = op_layer(kv_cache), _Recorder()
    kernel = patch.make_op_kernel(vllm_kernel, _context(name, layer, metadata), lambda: False)
    for _ in range(2):  # the second call reads the constants kept on the layer
        kv_cache.copy_(_batch(13, padded_rows)[0])
        output = torch.zeros_like(expected)
        kernel(query, key, value, output, types.SimpleNamespace(value=name))
        assert torch.equal(kv_cache, expected_cache) and torch.equal(output, expected)
    assert vllm_kernel.calls == []
    kept = layer.__dict__[patch._CALL_ATTR]
    assert kept[0] is kv_cache and kept[1] is not None
    layer.kv_cache = _batch(14)[0]  # vLLM re-allocated the cache: the constants are made again
    kernel(query, key, value, torch.zeros_like(expected), name)
    assert layer.__dict__[patch._CALL_ATTR][0] is layer.kv_cache


def test_the_op_kernel_leaves_every_other_case_to_vllms_kernel(backend, op_layer):
    name = "model.layers.0.self_attn.attn"
    kv_cache, query, key, value, slot_mapping, metadata = _batch(15)
    metadata.slot_mapping = slot_mapping
    before = kv_cache.clone()
    output = torch.zeros(query.shape[0], HEADS, HEAD, dtype=torch.bfloat16)
    cases = {
        "no metadata (warm-up)": (_context(name, op_layer(kv_cache), None), False, {}),
        "output quantization": (_context(name, op_layer(kv_cache), metadata), False,
                                {"output_scale": torch.ones(1)}),
        "a KV transfer connector": (_context(name, op_layer(kv_cache), metadata), True, {}),
        "encoder attention": (_context(name, op_layer(kv_cache, attn_type=backend.AttentionType.ENCODER_ONLY),
                                       metadata), False, {}),
        "an fp8 KV cache": (_context(name, op_layer(kv_cache), metadata), False, {}),
        "no forward context": (types.SimpleNamespace(_forward_context=None), False, {}),
        "speculative decoding's list of metadata": (types.SimpleNamespace(_forward_context=types.SimpleNamespace(
            no_compile_layers={name: op_layer(kv_cache)}, attn_metadata=[{name: metadata}])), False, {}),
    }
    cases["an fp8 KV cache"][0]._forward_context.no_compile_layers[name].impl.kv_cache_dtype = "fp8"
    for case, (context, transfer, kwargs) in cases.items():
        vllm_kernel = _Recorder()
        kernel = patch.make_op_kernel(vllm_kernel, context, lambda transfer=transfer: transfer)
        kernel(query, key, value, output, name, **kwargs)
        assert len(vllm_kernel.calls) == 1, case
        assert vllm_kernel.calls[0][4] == name and vllm_kernel.calls[0][3] is output, case
    assert torch.equal(kv_cache, before) and not output.any()


def test_the_op_kernel_is_registered_once_over_vllms_and_removable(backend):
    attention_module = pytest.importorskip(patch.OP_MODULE)
    was_in_force = patch.op_kernel_in_force()
    patch.remove_op_kernel()
    recorder = _Recorder()
    fake_module = types.SimpleNamespace(**{patch.OP_NAME: recorder})
    q = torch.zeros(1, HEADS, HEAD, dtype=torch.bfloat16)
    try:
        assert patch.install_op_kernel(fake_module) is True
        assert patch.install_op_kernel(fake_module) is False  # once
        assert patch.op_kernel_in_force()
        # No forward context: the op kernel hands the call to "vLLM's kernel" (the recorder here).
        torch.ops.vllm.unified_attention_with_output(q, q, q, q.clone(), "layer")
        assert len(recorder.calls) == 1
        patch.remove_op_kernel()
        assert not patch.op_kernel_in_force()
        with pytest.raises(AssertionError, match="Forward context is not set"):  # vLLM's own kernel again
            torch.ops.vllm.unified_attention_with_output(q, q, q, q.clone(), "layer")
        assert len(recorder.calls) == 1
    finally:
        patch.remove_op_kernel()
        if was_in_force:
            patch.install_op_kernel(attention_module)


def test_the_op_kernel_flag(monkeypatch):
    from vllm_omni_edge.levers import attention_op_kernel_enabled

    assert attention_op_kernel_enabled()
    monkeypatch.setenv("VLLM_OMNI_EDGE_ATTENTION_OP_KERNEL", "0")
    assert not attention_op_kernel_enabled()
    monkeypatch.setenv("VLLM_OMNI_EDGE_ATTENTION_OP_KERNEL", "1")
    monkeypatch.setenv("VLLM_OMNI_EDGE_ATTENTION_ONE_CALL", "0")  # the kernel writes KV: one call only
    assert not attention_op_kernel_enabled()
