"""Prefill on a bf16 GEMM straight from the rows16 layout, and the op's branch on the row count.

The rows16 ops (``w4a8_vnni_rows16_mm`` and the fused ``w4a8_vnni_rows16_silu_mlp``) take,
from ``set_bf16_prefill``'s row count up, a path that dequantizes blocks of weight rows to
bf16 and multiplies them with at::mm. Its weights must be exactly ``int4.dequantize``'s, so
its output differs from the dense product only by the GEMM's bf16 rounding (with 8-bit group
codes, ``group_codes.dequantize``'s weights, exactly); the branch must
sit inside the op, so a graph compiled once takes both paths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.quantization.helpers import int4_layer, relative_error, resident_dequantize
from vllm_omni_edge.cpu_features import cpu_flags
from vllm_omni_edge.quantization import evidence, int4
from vllm_omni_edge.quantization.kernels import Avx512VnniRows16W4A8Kernel, CpuFeatures, native
from vllm_omni_edge.quantization.kernels import w4a8_avx512
from vllm_omni_edge.quantization.kernels.w4a8_avx512 import interleave_rows16, silu_mlp

LOADED, WHY = native.load_library()
VNNI_OK, VNNI_WHY = Avx512VnniRows16W4A8Kernel.can_implement(
    CpuFeatures.detect(), 32, 64, 16, torch.float32, float_zero=True) if LOADED else (False, WHY)
pytestmark = pytest.mark.skipif(not VNNI_OK, reason=f"avx512_w4a8_rows16 cannot run here: {VNNI_WHY}")

# The row count the tests set: the larger of the two GEMMs' thresholds (the tail past whole 32-row
# slices and the W4A8 side below it are exercised on both).
ROWS = max(w4a8_avx512.PREFILL_MIN_ROWS.values())
AMX_OK = VNNI_OK and w4a8_avx512.amx_bf16_usable()
GEMMS = [pytest.param(w4a8_avx512.GEMM_ONEDNN, id="onednn"),
         pytest.param(w4a8_avx512.GEMM_AMX, id="amx-tiles",
                      marks=pytest.mark.skipif(not AMX_OK, reason="AMX BF16 tiles are not usable on this CPU"))]
# bf16 output rounding (2^-9 relative per element, about 0.2 % over a vector) is all the bf16
# path adds to the exact product of the dequantized weights; the W4A8 path adds its int8
# activation rounding (0.4-1.5 % here) on top.
BF16_TOLERANCE = 4e-3
W4A8_TOLERANCE = 0.02


@pytest.fixture(params=GEMMS)
def prefill_from(request):
    """Set the op's prefill row count (and block bytes) on one GEMM for one test (each test runs on
    both GEMMs); back to the lever after."""
    ops = torch.ops.edge_cpu_int4

    def set_rows(rows: int, block_bytes: int = w4a8_avx512.PREFILL_BLOCK_BYTES) -> None:
        ops.set_bf16_prefill(rows, block_bytes, request.param)

    yield set_rows
    w4a8_avx512.configure_prefill()


def rows16_layer(N, K, g, seed=0, weight=None):
    """(a layer loaded on rows16, its stored triple before the repack)."""
    layer, _ = int4_layer(N, K, g, torch.bfloat16, seed, weight=weight)
    stored = (layer.qweight.data.clone(), layer.scales.data.clone(), layer.zeros.data.clone())  # process_weights rearranges in place
    kernel = Avx512VnniRows16W4A8Kernel()
    kernel.process_weights(layer)
    layer.int4_kernel, layer.bias = kernel, None
    return layer, stored


def bf16_rows(M, K, seed=1):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def op(layer, x):
    return torch.ops.edge_cpu_int4.w4a8_vnni_rows16_mm(x, layer.qweight, layer.scales, layer.zeros,
                                                        layer.int4_group_size, w4a8_avx512.group_factors(layer))


@pytest.mark.parametrize("portable", [False, True], ids=["native-bf16", "portable"])
@pytest.mark.parametrize("N,K,g", [(16, 32, 32), (48, 1536, 32), (32, 512, 128), (64, 8960, 32), (16, 1024, 256)])
def test_dequantized_blocks_are_exactly_the_stored_weights(N, K, g, portable):
    gen = torch.Generator().manual_seed(N + K)
    qweight, scales, offsets = int4.quantize(torch.randn(N, K, generator=gen) * 0.05, g)
    packed = interleave_rows16(qweight, scales, offsets)
    kn = torch.ops.edge_cpu_int4.rows16_dequantize(*packed, g, portable)
    assert kn.shape == (K, N) and kn.dtype == torch.bfloat16
    assert torch.equal(kn, int4.dequantize(qweight, scales, offsets, dtype=torch.bfloat16).t())


# N = 16 (one tile: an odd tile on the AMX tiles), 48 with blocks of one tile each (several GEMM
# calls), Qwen's down K; 99 rows (three whole 32-row slices and a tail of 3).
@pytest.mark.parametrize("N,K,g,block_bytes", [(16, 64, 32, 1 << 20), (48, 512, 64, 1), (32, 8960, 32, 1 << 20),
                                                (96, 1536, 32, 2 << 20)])
def test_prefill_is_the_bf16_product_of_the_dequantized_weights(prefill_from, N, K, g, block_bytes):
    layer, stored = rows16_layer(N, K, g)
    dense = resident_dequantize(layer, *stored, dtype=torch.bfloat16)  # the 8-bit group codes' weights
    x = bf16_rows(ROWS + 3, K)
    prefill_from(ROWS, block_bytes)
    out = op(layer, x)
    assert out.shape == (ROWS + 3, N) and out.dtype == torch.bfloat16
    exact = x.float() @ dense.float().t()
    assert relative_error(out, exact) < BF16_TOLERANCE
    assert relative_error(out, F.linear(x, dense)) < BF16_TOLERANCE  # what the dense copy gave
    prefill_from(0)
    assert relative_error(op(layer, x), exact) < W4A8_TOLERANCE


def test_the_row_count_picks_the_path(prefill_from):
    layer, _ = rows16_layer(32, 256, 32)
    prefill_from(ROWS)
    before = evidence.rows16_paths()
    op(layer, bf16_rows(ROWS - 1, 256))
    op(layer, bf16_rows(ROWS, 256))
    op(layer, bf16_rows(1, 256))
    op(layer, bf16_rows(ROWS, 256).float())  # fp32 activations stay on W4A8
    after = evidence.rows16_paths()
    assert after["w4a8"] - before["w4a8"] == 3 and after["bf16_gemm"] - before["bf16_gemm"] == 1
    prefill_from(0)
    op(layer, bf16_rows(512, 256))
    assert evidence.rows16_paths()["bf16_gemm"] == after["bf16_gemm"]


def test_the_onednn_library_is_installed_and_linked():
    """The dependency is declared for x86-64: the build must find it (else the packed path is silently gone)."""
    found = native.onednn()
    assert found is not None, f"{native.ONEDNN_DISTRIBUTIONS} not installed"
    assert (found.include_dir / "oneapi" / "dnnl" / "dnnl.hpp").exists()
    assert (found.lib_dir / "libdnnl.so.3").exists()
    assert "-DEDGE_ONEDNN" in native.compile_flags()
    maps = open("/proc/self/maps").read()
    assert "libdnnl.so.3" in maps  # linked by the kernel library, loaded with it


PACKED_OK = VNNI_OK and "avx512_bf16" in cpu_flags() and native.onednn() is not None


def on_onednn(layer, x, block_bytes=w4a8_avx512.PREFILL_BLOCK_BYTES):
    """(the op's output with the bf16 path on oneDNN from ROWS rows, the path counters' increase)."""
    try:
        torch.ops.edge_cpu_int4.set_bf16_prefill(ROWS, block_bytes, w4a8_avx512.GEMM_ONEDNN)
        before = evidence.rows16_paths()
        out = op(layer, x)
        after = evidence.rows16_paths()
    finally:
        w4a8_avx512.configure_prefill()
    return out, {k: after[k] - before[k] for k in after}


@pytest.mark.skipif(not PACKED_OK, reason="needs AVX512_BF16 and the oneDNN library")
@pytest.mark.parametrize("N,K,g,block_bytes", [(128, 1536, 32, 2 << 20), (192, 1024, 64, 64 * 1024 * 2),
                                                (64, 8960, 32, 1 << 20)])
def test_onednn_takes_blocks_dequantized_into_its_own_layout(N, K, g, block_bytes):
    """Weights in whole 64-column blocks go to oneDNN's primitive in its blocked layout: the same
    product as the dense weights (one block, several blocks per thread, the down projection's K)."""
    layer, stored = rows16_layer(N, K, g)
    dense = resident_dequantize(layer, *stored, dtype=torch.bfloat16)
    x = bf16_rows(ROWS + 3, K)
    out, calls = on_onednn(layer, x, block_bytes)
    assert calls["onednn_packed"] == 1
    assert relative_error(out, x.float() @ dense.float().t()) < BF16_TOLERANCE
    # What at::mm on the plain block gives, to bf16 rounding of the same sums.
    assert relative_error(out, F.linear(x, dense)) < 1e-3


def test_the_evidence_names_how_onednn_gets_its_weights(monkeypatch):
    monkeypatch.setattr(w4a8_avx512, "_configured_prefill", None)
    assert w4a8_avx512.onednn_weight_layout() is None
    monkeypatch.setattr(w4a8_avx512, "_configured_prefill", (384, w4a8_avx512.GEMM_AMX))
    assert w4a8_avx512.onednn_weight_layout() == ("packed" if PACKED_OK else "plain")
    monkeypatch.setattr(native, "onednn", lambda: None)
    assert w4a8_avx512.onednn_weight_layout() == "plain"


@pytest.mark.skipif(not PACKED_OK, reason="needs AVX512_BF16 and the oneDNN library")
@pytest.mark.parametrize("N,K", [(48, 1024), (64, 576)], ids=["columns-not-in-64s", "under-1024-features"])
def test_other_weights_stay_on_at_mm(N, K):
    layer, stored = rows16_layer(N, K, 32)
    dense = resident_dequantize(layer, *stored, dtype=torch.bfloat16)
    x = bf16_rows(ROWS, K)
    out, calls = on_onednn(layer, x)
    assert calls["bf16_gemm"] == 1 and calls["onednn_packed"] == 0
    assert relative_error(out, x.float() @ dense.float().t()) < BF16_TOLERANCE


@pytest.mark.skipif(not AMX_OK, reason="AMX BF16 tiles are not usable on this CPU")
def test_amx_tiles_hand_large_calls_to_onednn():
    """With the AMX tiles, calls of onednn_from_rows rows or more run on oneDNN; both give the product."""
    ops = torch.ops.edge_cpu_int4
    layer, stored = rows16_layer(64, 512, 32)
    dense = resident_dequantize(layer, *stored, dtype=torch.bfloat16)
    try:
        ops.set_bf16_prefill(32, w4a8_avx512.PREFILL_BLOCK_BYTES, w4a8_avx512.GEMM_AMX, 64)
        for rows, on_tiles in ((40, 1), (63, 1), (64, 0), (100, 0)):
            before = evidence.rows16_paths()
            x = bf16_rows(rows, 512)
            out = op(layer, x)
            after = evidence.rows16_paths()
            assert after["bf16_gemm"] - before["bf16_gemm"] == 1, rows
            assert after["amx_tiles"] - before["amx_tiles"] == on_tiles, rows
            assert relative_error(out, x.float() @ dense.float().t()) < BF16_TOLERANCE
    finally:
        w4a8_avx512.configure_prefill()
    with pytest.raises(RuntimeError, match="onednn_from_rows must be >= 0"):
        ops.set_bf16_prefill(32, 1 << 20, w4a8_avx512.GEMM_AMX, -1)


def test_fused_mlp_prefill_matches_its_parts(prefill_from):
    H, I = 256, 512
    gate_up, _ = rows16_layer(2 * I, H, 32, seed=2)
    down, _ = rows16_layer(H, I, 32, seed=3)
    x = bf16_rows(ROWS + 5, H)
    prefill_from(ROWS)
    before = evidence.rows16_paths()["bf16_gemm"]
    fused = silu_mlp(gate_up, down, x)
    assert evidence.rows16_paths()["bf16_gemm"] == before + 1
    y = op(gate_up, x).float()
    h = (F.silu(y[:, :I]) * y[:, I:]).to(torch.bfloat16)
    parts = op(down, h)
    # Same bf16 GEMMs and roundings; only exp (polynomial vs libm) can move a bf16 ulp of h.
    assert relative_error(fused, parts) < 2e-3
    prefill_from(0)
    assert relative_error(silu_mlp(gate_up, down, x), parts) < 0.03  # the W4A8 MLP, for scale


def test_fused_mlp_rounds_silu_and_mul_to_nearest_even(prefill_from):
    """h = silu(gate) * up is rounded to bf16 as torch rounds it (nearest, ties to even): with a
    diagonal down projection each output is one h times one weight, exact in fp32 before the
    output's own rounding, so the fused op's output must equal torch's h times the weights,
    up to the exp of a few elements landing on the other side of a rounding boundary."""
    H = I = 256
    gate_up, _ = rows16_layer(2 * I, H, 32, seed=7)
    diagonal = torch.diag(torch.rand(I, generator=torch.Generator().manual_seed(8)) * 0.5 + 0.25)
    down, stored = rows16_layer(H, I, 32, weight=diagonal)
    weights = resident_dequantize(down, *stored, dtype=torch.bfloat16).diagonal().float()
    assert torch.count_nonzero(resident_dequantize(down, *stored)) == I  # diagonal as stored
    x = bf16_rows(ROWS + 7, H, seed=9) * 4  # gates well into both tails of the SiLU
    prefill_from(ROWS)
    fused = silu_mlp(gate_up, down, x)
    y = op(gate_up, x).float()
    h = (F.silu(y[:, :I]) * y[:, I:]).to(torch.bfloat16)
    expected = (h.float() * weights).to(torch.bfloat16)  # bf16 x bf16 is exact in fp32
    same = (fused == expected).float().mean().item()
    assert same > 0.98, f"only {same:.1%} of outputs round as torch's silu-and-multiply"
    ulps = (fused.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1


def test_a_compiled_graph_keeps_both_paths(prefill_from):
    """Traced once (rows dynamic): 512 rows take the bf16 GEMM, 1 row the W4A8 tiles, same graph."""
    import torch._dynamo

    H, I = 128, 256
    qkv, _ = rows16_layer(H, H, 32, seed=4)
    gate_up, _ = rows16_layer(2 * I, H, 32, seed=5)
    down, _ = rows16_layer(H, I, 32, seed=6)

    def block(x):
        y = qkv.int4_kernel.apply(qkv, x, None)
        return silu_mlp(gate_up, down, y.relu())

    prefill_from(ROWS)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    torch._dynamo.utils.counters.clear()
    prompt, token = bf16_rows(512, H), bf16_rows(1, H, seed=7)
    torch._dynamo.decorators.mark_unbacked(prompt, 0)  # no 0/1 specialisation: one graph for every row count
    with torch.inference_mode():
        start = evidence.rows16_paths()
        out_prefill = compiled(prompt)
        mid = evidence.rows16_paths()
        out_decode = compiled(token)
        end = evidence.rows16_paths()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert mid["bf16_gemm"] - start["bf16_gemm"] == 2 and mid["w4a8"] == start["w4a8"]
    assert end["w4a8"] - mid["w4a8"] == 2 and end["bf16_gemm"] == mid["bf16_gemm"]
    eager = block(prompt)
    assert relative_error(out_prefill, eager) < 1e-2 and relative_error(out_decode, block(token)) < 1e-2


def test_lever_and_cpu_decide_the_row_count(monkeypatch):
    amx = CpuFeatures(capability="AVX512", amx=True, vllm_w4a8_op=False)
    no_amx = CpuFeatures(capability="AVX512", amx=False, vllm_w4a8_op=False)
    monkeypatch.delenv("VLLM_OMNI_EDGE_INT4_PREFILL", raising=False)
    monkeypatch.delenv("VLLM_OMNI_EDGE_INT4_PREFILL_GEMM", raising=False)
    here = w4a8_avx512.PREFILL_MIN_ROWS[w4a8_avx512.prefill_gemm()]
    assert w4a8_avx512.prefill_min_rows(amx) == here and w4a8_avx512.prefill_min_rows(no_amx) == 0
    for gemm, rows in w4a8_avx512.PREFILL_MIN_ROWS.items():
        assert w4a8_avx512.prefill_min_rows(amx, gemm) == rows
    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_PREFILL", "bf16")
    assert w4a8_avx512.prefill_min_rows(no_amx) == here
    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_PREFILL", "w4a8")
    assert w4a8_avx512.prefill_min_rows(amx) == 0


def test_the_gemm_lever_and_the_cpu_pick_the_gemm(monkeypatch):
    monkeypatch.delenv("VLLM_OMNI_EDGE_INT4_PREFILL_GEMM", raising=False)
    assert w4a8_avx512.prefill_gemm() == (w4a8_avx512.GEMM_AMX if AMX_OK else w4a8_avx512.GEMM_ONEDNN)
    assert AMX_OK == ("amx_bf16" in cpu_flags())
    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_PREFILL_GEMM", "onednn")
    assert w4a8_avx512.prefill_gemm() == w4a8_avx512.GEMM_ONEDNN
    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_PREFILL_GEMM", "tiles")
    with pytest.raises(Exception, match="VLLM_OMNI_EDGE_INT4_PREFILL_GEMM"):
        w4a8_avx512.prefill_gemm()


def test_an_unknown_gemm_is_refused_by_name_and_changes_nothing(prefill_from):
    layer, _ = rows16_layer(32, 256, 32)
    prefill_from(ROWS)
    with pytest.raises(RuntimeError, match=r"gemm must be 0 \(oneDNN\) or 1 \(AMX tiles\), got 2"):
        torch.ops.edge_cpu_int4.set_bf16_prefill(1, 2 << 20, 2)
    before = evidence.rows16_paths()
    op(layer, bf16_rows(ROWS - 1, 256))  # the row count set before the refused call still holds
    assert evidence.rows16_paths()["w4a8"] == before["w4a8"] + 1


def test_asking_for_amx_tiles_without_them_is_refused():
    if AMX_OK:
        pytest.skip("this CPU has usable AMX BF16 tiles")
    with pytest.raises(RuntimeError, match="gemm=1 needs AMX BF16 tiles"):
        torch.ops.edge_cpu_int4.set_bf16_prefill(32, 2 << 20, 1)


def test_loading_a_layer_configures_the_op_and_says_so(monkeypatch, prefill_from):
    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_PREFILL", "bf16")
    monkeypatch.delenv("VLLM_OMNI_EDGE_INT4_PREFILL_GEMM", raising=False)
    layer, _ = rows16_layer(16, 64, 32)  # process_weights configures the library
    gemm = w4a8_avx512.prefill_gemm()
    rows = w4a8_avx512.PREFILL_MIN_ROWS[gemm]
    assert w4a8_avx512.configured_prefill_rows() == rows  # what the worker evidence records
    assert w4a8_avx512.configured_prefill_gemm() == w4a8_avx512.GEMM_NAMES[gemm]
    before = evidence.rows16_paths()["bf16_gemm"]
    op(layer, bf16_rows(rows, 64))
    assert evidence.rows16_paths()["bf16_gemm"] == before + 1
    ok, why = Avx512VnniRows16W4A8Kernel.can_implement(CpuFeatures.detect(), 32, 64, 16, torch.bfloat16,
                                                        float_zero=True)
    assert ok and f">= {rows} rows" in why and ("AMX tiles" in why) == (gemm == w4a8_avx512.GEMM_AMX)
    assert w4a8_avx512.configured_onednn_from_rows() == (
        w4a8_avx512.AMX_ONEDNN_FROM_ROWS if gemm == w4a8_avx512.GEMM_AMX else None)
    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_PREFILL", "w4a8")
    ok, why = Avx512VnniRows16W4A8Kernel.can_implement(CpuFeatures.detect(), 32, 64, 16, torch.bfloat16,
                                                        float_zero=True)
    assert ok and "prefill on the same W4A8 tiles" in why


def test_no_dense_weight_is_kept(prefill_from):
    layer, _ = rows16_layer(32, 256, 32)
    prefill_from(ROWS)
    op(layer, bf16_rows(ROWS, 256))
    assert sorted(n for n, _ in layer.named_parameters()) == ["group_factors", "qweight", "scales", "zeros"]
    assert layer.qweight.dtype == layer.scales.dtype == layer.zeros.dtype == torch.uint8
