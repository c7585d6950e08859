"""Our decode attention op writes and attends as vLLM's CPU attention ops do, and the trimmed
attention calls send exactly the one-token batches to it."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_omni_edge.patches.worker import cpu_attention_calls as patch
from vllm_omni_edge.quantization.kernels import native

LOADED, WHY = native.load_library()
pytestmark = pytest.mark.skipif(not LOADED, reason=f"decode attention op unavailable: {WHY}")


def _ops():
    return pytest.importorskip("vllm._custom_ops")


def _decode_batch(seed, dtype, heads, kv_heads, head, block, lens, blocks=40, padded_rows=0):
    """One new token per request, the query/key/value strided views of one fused projection."""
    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(blocks, kv_heads, block, 2 * head, generator=g).to(dtype)
    per_request = max((n + block - 1) // block for n in lens)
    table = torch.randperm(blocks, generator=g)[: len(lens) * per_request].to(torch.int32).view(len(lens), per_request)
    rows = len(lens) + padded_rows
    fused = torch.randn(rows, heads + 2 * kv_heads, head, generator=g).to(dtype)
    query, key, value = fused[:, :heads], fused[:, heads:heads + kv_heads], fused[:, heads + kv_heads:]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    slots = torch.tensor([int(table[r, (n - 1) // block]) * block + (n - 1) % block for r, n in enumerate(lens)])
    return kv_cache, table, query, key, value, seq_lens, slots


def _vllm(kv_cache, table, query, key, value, seq_lens, slots, isa, window=-1):
    ops = _ops()
    kv_cache = kv_cache.clone()
    blocks, kv_heads, block, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(blocks, kv_heads, 2 * block, -1).chunk(2, dim=2)
    requests = seq_lens.shape[0]
    ops.cpu_attn_reshape_and_cache(key[:requests], value[:requests], key_cache, value_cache, slots, isa)
    heads, head = query.shape[1], query.shape[2]
    out = torch.zeros(requests, heads, head, dtype=query.dtype)
    starts = torch.arange(requests + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=requests, num_heads=heads, num_kv_heads=kv_heads, head_dim=head, seq_lens=seq_lens,
        dtype=query.dtype, query_start_loc=starts, causal=True, sliding_window_size=window, isa=isa,
        enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(
        query=query[:requests].contiguous(), key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=starts, seq_lens=seq_lens, scale=head ** -0.5, causal=True, alibi_slopes=None,
        sliding_window=window, block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)
    return kv_cache, out


def _ours(kv_cache, table, query, key, value, seq_lens, slots, window=-1, write=True, isa="vec"):
    kv_cache = kv_cache.clone()
    out = torch.zeros(query.shape[0], query.shape[1], query.shape[2], dtype=query.dtype)
    torch.ops.edge_cpu.decode_attention(query, key, value, kv_cache, out, slots, table, seq_lens,
                                        query.shape[2] ** -0.5, window, write, isa == "amx")
    return kv_cache, out


# vLLM's "amx" attention runs only on a CPU with AMX tiles, once the process may use them (what the
# plugin's amx_tile_permission patch asks for in every vLLM process); its KV write is plain stores.
AMX = torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx()
# vLLM's amx KV write itself is built into its AVX-512 kernels only: on an AVX2 CPU it refuses the ISA.
AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}
SHAPES = [  # heads, kv heads, head size, block size, sequence lengths, window
    (9, 3, 64, 128, [200], -1),  # SmolLM2's group of 3
    (12, 2, 128, 128, [5, 300, 129], -1),  # Qwen2.5-1.5B's group of 6: two passes of 3
    (8, 8, 64, 32, [1, 33, 64], -1),  # no grouping, one position, block edges
    (10, 2, 80, 32, [70, 2], -1),  # a group of 5 (passes of 2 and 3), head size 80
    (32, 4, 64, 32, [1000], -1),  # a group of 8 (two passes of 4), parallel work items
    (9, 3, 64, 128, [300, 77], 50),  # a sliding window starting inside a block
    # Fewer (request, kv head) items than two a thread: each attends over parts of its positions.
    (9, 3, 64, 128, [900], -1),  # SmolLM2's group over a long context: two parts of several blocks
    (9, 3, 64, 128, [700], 300),  # the same inside a sliding window
    (4, 1, 128, 32, [600, 3], -1),  # a request too short for its second part (an empty part)
    (8, 1, 64, 32, [1000], 9),  # one kv head, four parts of a 9-position window: two parts empty
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}-block{s[3]}-len{s[4]}-w{s[5]}")
@pytest.mark.parametrize("isa", ["vec", "vec16", pytest.param("amx", marks=pytest.mark.skipif(
    not AMX, reason="vLLM's amx attention needs AMX tiles (the layout itself: test_the_amx_layout_...)"))])
def test_writes_and_attends_as_vllms_ops(dtype, shape, isa):
    heads, kv_heads, head, block, lens, window = shape
    if isa in ("vec", "amx") and block % 32:
        pytest.skip(f"vLLM's {isa} ISA takes block sizes in multiples of 32")
    if isa == "amx" and (dtype != torch.bfloat16 or head % 32):
        pytest.skip("vLLM's amx ISA holds bfloat16 caches of heads in multiples of 32 only")
    batch = _decode_batch(3, dtype, heads, kv_heads, head, block, lens)
    stock_cache, stock_out = _vllm(*batch, isa=isa, window=window)
    cache, out = _ours(*batch, window=window, isa=isa)
    assert not torch.equal(cache, batch[0])  # it wrote
    assert torch.equal(cache, stock_cache)
    assert stock_out.abs().sum() > 0
    torch.testing.assert_close(out.float(), stock_out.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}-block{s[3]}-len{s[4]}-w{s[5]}")
def test_the_amx_layout_holds_what_vllms_amx_write_holds_and_attends_as_the_vec_layout(shape):
    # On any CPU: vLLM's amx KV write is plain stores; the attention over it is compared with ours
    # over the vec layout of the same tokens (same products, sums in another order).
    heads, kv_heads, head, block, lens, window = shape
    if not AVX512:
        pytest.skip("vLLM's amx KV write needs a CPU with AVX-512")
    if block % 32 or head % 32:
        pytest.skip("vLLM's amx ISA takes heads and block sizes in multiples of 32")
    kv_cache, table, query, key, value, seq_lens, slots = _decode_batch(3, torch.bfloat16, heads, kv_heads, head,
                                                                        block, lens)
    # The history written by vLLM in each layout: every position before each request's new token.
    history = [(r, p) for r, n in enumerate(lens) for p in range(n - 1)]
    g = torch.Generator().manual_seed(11)
    past_k = torch.randn(len(history), kv_heads, head, generator=g).bfloat16()
    past_v = torch.randn(len(history), kv_heads, head, generator=g).bfloat16()
    past_slots = torch.tensor([int(table[r, p // block]) * block + p % block for r, p in history], dtype=torch.long)
    caches = {}
    for isa in ("vec", "amx"):
        cache = kv_cache.clone()
        blocks = cache.shape[0]
        key_cache, value_cache = cache.view(blocks, kv_heads, 2 * block, -1).chunk(2, dim=2)
        if history:
            _ops().cpu_attn_reshape_and_cache(past_k, past_v, key_cache, value_cache, past_slots, isa)
        caches[isa] = cache
    vec_cache, vec_out = _ours(caches["vec"], table, query, key, value, seq_lens, slots, window=window)
    amx_cache, amx_out = _ours(caches["amx"], table, query, key, value, seq_lens, slots, window=window, isa="amx")
    stock_amx, _ = _vllm(caches["amx"], table, query, key, value, seq_lens, slots, isa="amx") if AMX else (None, None)
    if stock_amx is None:
        # Without AMX: vLLM's write of the new tokens alone, into the amx cache with the history.
        stock_amx = caches["amx"].clone()
        key_cache, value_cache = stock_amx.view(stock_amx.shape[0], kv_heads, 2 * block, -1).chunk(2, dim=2)
        _ops().cpu_attn_reshape_and_cache(key[:len(lens)], value[:len(lens)], key_cache, value_cache, slots, "amx")
    assert torch.equal(amx_cache, stock_amx)
    assert not torch.equal(amx_cache.view(-1), vec_cache.view(-1))  # another layout
    torch.testing.assert_close(amx_out.float(), vec_out.float(), **TOLERANCE[torch.bfloat16])


def test_the_amx_layout_takes_what_vllm_puts_in_it_only():
    for dtype, head in ((torch.float32, 64), (torch.bfloat16, 80)):
        batch = _decode_batch(3, dtype, 10, 2, head, 128, [10])
        with pytest.raises(RuntimeError, match="amx layout holds bfloat16 heads of a multiple of 32 dims"):
            _ours(*batch, isa="amx")


def test_padded_rows_and_slots_are_left_alone():
    kv_cache, table, query, key, value, seq_lens, slots = _decode_batch(
        5, torch.bfloat16, 9, 3, 64, 128, [40, 90], padded_rows=2)
    slots = torch.cat([slots, torch.tensor([-1, -1])])
    stock_cache, stock_out = _vllm(kv_cache, table, query, key, value, seq_lens, slots[:2], isa="vec")
    cache, out = _ours(kv_cache, table, query, key, value, seq_lens, slots)
    assert torch.equal(cache, stock_cache)
    torch.testing.assert_close(out[:2].float(), stock_out.float(), **TOLERANCE[torch.bfloat16])
    assert not out[2:].any()


def test_without_the_write_it_attends_over_the_cache_as_it_is():
    batch = _decode_batch(9, torch.float32, 9, 3, 64, 128, [64])
    written, _ = _vllm(*batch, isa="vec")
    _, expected = _vllm(written, *batch[1:], isa="vec")
    cache, out = _ours(written, *batch[1:], write=False)
    assert torch.equal(cache, written)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("change, message", [
    (lambda b: {**b, "kv_cache": b["kv_cache"].to(torch.float16)}, "share a dtype"),
    (lambda b: {**b, "seq_lens": b["seq_lens"].long()}, "int32"),
    (lambda b: {**b, "seq_lens": torch.tensor([129], dtype=torch.int32)}, "sequence length 129; its block table holds 1 to 128"),
    (lambda b: {**b, "seq_lens": torch.tensor([0], dtype=torch.int32)}, "sequence length 0"),
    (lambda b: {**b, "slots": torch.tensor([40 * 128])}, "slot 5120 is past the cache's 5120 slots"),
    (lambda b: {**b, "kv_cache": b["kv_cache"][..., :72].contiguous(),
                "query": b["query"][..., :36], "key": b["key"][..., :36], "value": b["value"][..., :36]},
     "multiple of 16"),
])
def test_bad_input_names_the_problem(change, message):
    names = ("kv_cache", "table", "query", "key", "value", "seq_lens", "slots")
    batch = change(dict(zip(names, _decode_batch(1, torch.bfloat16, 9, 3, 64, 128, [10]))))
    out = torch.zeros(1, 9, batch["query"].shape[2], dtype=batch["query"].dtype)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.edge_cpu.decode_attention(batch["query"], batch["key"], batch["value"], batch["kv_cache"], out,
                                            batch["slots"], batch["table"], batch["seq_lens"], 0.125, -1, True)


# The trimmed calls: which batches go to the op.

@pytest.fixture(scope="module")
def backend():
    return pytest.importorskip("vllm.v1.attention.backends.cpu_attn")


@pytest.fixture(scope="module")
def routed(backend):
    """(impl class, calls list): the one-call wrapper on vLLM's stock code, decode through a spy."""
    import inspect

    calls = []
    op = patch.decode_op()
    assert op is not None

    def spy(*args):
        calls.append(args)
        return op(*args)

    class Routed(backend.CPUAttentionBackendImpl):
        forward = inspect.unwrap(backend.CPUAttentionBackendImpl.forward)
        do_kv_cache_update = inspect.unwrap(backend.CPUAttentionBackendImpl.do_kv_cache_update)

    class Backend(backend.CPUAttentionBackend):
        forward_includes_kv_cache_update = False

    module = types.SimpleNamespace(AttentionType=backend.AttentionType, CPUAttentionBackendImpl=Routed,
                                   CPUAttentionBackend=Backend)
    patch._wrap(module, writes_kv=True, decode=spy)
    return Routed, calls


def _impl(cls, heads, kv_heads, head, **kw):
    return cls(num_heads=heads, head_size=head, scale=head ** -0.5, num_kv_heads=kv_heads, alibi_slopes=None,
               sliding_window=None, kv_cache_dtype="auto", **kw)


def _metadata(table, seq_lens, slots, query_lens):
    ops = _ops()
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return types.SimpleNamespace(
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), query_start_loc=starts,
        seq_lens=seq_lens, causal=True, dynamic_causal=None, block_table=table, slot_mapping=slots,
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(query_lens), num_heads=9, num_kv_heads=3, head_dim=64, seq_lens=seq_lens,
            dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec",
            enable_kv_split=False))


def test_a_decode_batch_takes_the_op_with_vllms_result(routed):
    cls, calls = routed
    kv_cache, table, query, key, value, seq_lens, slots = _decode_batch(2, torch.bfloat16, 9, 3, 64, 128, [30, 140])
    stock_cache, stock_out = _vllm(kv_cache, table, query, key, value, seq_lens, slots, isa="vec")
    layer = types.SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    output = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    before = len(calls)
    cls_impl = _impl(cls, 9, 3, 64)
    cls_impl.forward(layer, query, key, value, kv_cache, _metadata(table, seq_lens, slots, [1, 1]), output=output)
    assert len(calls) == before + 1
    assert torch.equal(kv_cache, stock_cache)
    torch.testing.assert_close(output.float(), stock_out.float(), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("case", ["prefill in the batch", "ALiBi", "soft cap", "neon layout", "fp8 cache"])
def test_other_batches_and_layers_keep_vllms_op(routed, case):
    cls, calls = routed
    kv_cache, table, query, key, value, seq_lens, slots = _decode_batch(4, torch.bfloat16, 9, 3, 64, 128, [30, 140])
    query_lens = [1, 1]
    kw = {}
    isa = "vec"
    if case == "prefill in the batch":
        query_lens = [1, 3]
        query, key, value = (torch.cat([t, t[1:], t[1:]]) for t in (query, key, value))
        slots = torch.cat([slots[:1], slots[1:] - 2, slots[1:] - 1, slots[1:]])
    elif case == "ALiBi":
        kw["alibi_slopes"] = [0.5] * 9
    elif case == "soft cap":
        kw["logits_soft_cap"] = 30.0
    elif case == "neon layout":
        isa = "neon"
    impl = cls(num_heads=9, head_size=64, scale=0.125, num_kv_heads=3, sliding_window=None,
               kv_cache_dtype="fp8" if case == "fp8 cache" else "auto", **{"alibi_slopes": None, **kw})
    layer = types.SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    assert not patch._serves(impl, layer, query) or case == "prefill in the batch"
    if case == "prefill in the batch":
        before = len(calls)
        output = torch.zeros(query.shape[0], 9, 64, dtype=torch.bfloat16)
        impl.forward(layer, query, key, value, kv_cache, _metadata(table, seq_lens, slots, query_lens), output=output)
        assert len(calls) == before
        assert output.abs().sum() > 0  # vLLM's op attended


def test_the_flag_keeps_vllms_decode(monkeypatch):
    from vllm_omni_edge.levers import decode_attention_enabled

    assert decode_attention_enabled()
    monkeypatch.setenv("VLLM_OMNI_EDGE_DECODE_ATTENTION", "0")
    assert not decode_attention_enabled()
    monkeypatch.setattr(patch, "when_imported", lambda name, then: True)  # this process's vLLM stays as it is
    assert "decode" not in patch.apply()
    monkeypatch.setenv("VLLM_OMNI_EDGE_DECODE_ATTENTION", "1")
    assert "decode through edge_cpu::decode_attention" in patch.apply()
    monkeypatch.setenv("VLLM_OMNI_EDGE_ATTENTION_CALLS", "0")  # the decode op needs the trimmed calls
    assert not decode_attention_enabled()


def test_the_forward_without_decode_keeps_the_rest_of_the_trimmed_call(backend, routed):
    cls, calls = routed
    module = types.SimpleNamespace(AttentionType=backend.AttentionType, CPUAttentionBackendImpl=cls,
                                   CPUAttentionBackend=types.SimpleNamespace(forward_includes_kv_cache_update=True))
    without = patch.forward_without_decode(module)
    assert without.__wrapped__ is cls.forward.__wrapped__  # vLLM's forward underneath
    kv_cache, table, query, key, value, seq_lens, slots = _decode_batch(6, torch.bfloat16, 9, 3, 64, 128, [30, 140])
    stock_cache, stock_out = _vllm(kv_cache, table, query, key, value, seq_lens, slots, isa="vec")
    layer = types.SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    output = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    before = len(calls)
    without(_impl(cls, 9, 3, 64), layer, query, key, value, kv_cache, _metadata(table, seq_lens, slots, [1, 1]),
            output=output)
    assert len(calls) == before  # vLLM's op attended
    assert torch.equal(kv_cache, stock_cache)  # and the KV write stayed in the call
    assert torch.equal(output, stock_out)
