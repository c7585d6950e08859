"""The W4A8 C++ ops (AVX2, and AVX-512 VNNI on the 16-row layout) against two references, their
envelope, and the build cache.

Two references, because the op has two error sources: against a PyTorch model of
exactly what it computes (activations quantized per 32 the same way) it must
agree to float rounding, which proves the integer math, the nibble order and
the offset term; against the exact float product it must stay within the
activation-rounding error, which bounds what a user loses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.quantization.helpers import int4_layer, relative_error, resident_groups, w4a8_activations
from vllm_omni_edge.cache_paths import CACHE_ENV
from vllm_omni_edge.levers import INT4_GROUP_CODES_ENV
from vllm_omni_edge.quantization import group_codes, int4
from vllm_omni_edge.quantization.kernels import (
    KERNEL_ENV,
    Avx2W4A8Kernel,
    Avx2W4A8Rows8Kernel,
    Avx512VnniRows16W4A8Kernel,
    CpuFeatures,
    KernelUnavailableError,
    choose_kernel,
    native,
)

LOADED, WHY = native.load_library()
needs_op = pytest.mark.skipif(not LOADED, reason=f"avx2_w4a8 op unavailable: {WHY}")
VNNI_OK, VNNI_WHY = Avx512VnniRows16W4A8Kernel.can_implement(
    CpuFeatures.detect(), 32, 64, 16, torch.float32, float_zero=True)
needs_vnni = pytest.mark.skipif(not VNNI_OK, reason=f"avx512_w4a8_rows16 cannot run here: {VNNI_WHY}")


class Rows16StoredGroups(Avx512VnniRows16W4A8Kernel):
    """The rows16 kernel keeping the stored bf16 scales and offsets (its lever's other value)."""

    def process_weights(self, layer):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(INT4_GROUP_CODES_ENV, "bf16")
            super().process_weights(layer)


# Every variant of the op, each where this CPU runs it.
W4A8_KERNELS = [
    pytest.param(Avx2W4A8Kernel, id="avx2"),
    pytest.param(Avx2W4A8Rows8Kernel, id="avx2-rows8"),
    pytest.param(Avx512VnniRows16W4A8Kernel, id="vnni-rows16", marks=needs_vnni),
    pytest.param(Rows16StoredGroups, id="vnni-rows16-bf16-groups", marks=needs_vnni),
]

# Rows per tile of each interleaved layout (N must be a multiple).
TILE_ROWS = {Avx2W4A8Rows8Kernel: 8, Avx512VnniRows16W4A8Kernel: 16, Rows16StoredGroups: 16}

# Against the model of the op: fp32 accumulation order differs, nothing else
# (worst seen 3e-7 in fp32 over these shapes).
MODEL_TOLERANCE = 1e-5
# Against the exact product: int8 activations per 32 (absmax/127) on Gaussian inputs
# gave 0.4-0.6 % relative error here; 2 % still catches a wrong nibble order (~100 %)
# or a dropped offset term (> 50 %).
EXACT_TOLERANCE = 0.02
OUTPUT_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# (N, K, group): one block; N below any tile; N past a weight chunk with a remainder;
# every group size; Qwen's down_proj K (8960 = 280 blocks); SmolLM2's K (576 = 18 blocks),
# an odd block count past 16 (1120 = 35 blocks), and 36 blocks of groups of 2.
SHAPES = [(1, 32, 32), (7, 64, 32), (37, 512, 64), (48, 512, 128), (40, 1024, 256), (24, 8960, 32),
          (40, 576, 32), (20, 1120, 32), (16, 1152, 64)]


def model_of_op(x: torch.Tensor, qweight, scales, offsets) -> torch.Tensor:
    """What w4a8_mm computes, in PyTorch: int8 activations per block of 32, float offsets."""
    M, K = x.shape
    xq = w4a8_activations(x)
    n, groups = scales.shape
    q = int4.unpack_nibbles(qweight).float().reshape(n, groups, -1)
    # d * sum(q * xq) + m * sum(x): the scale term on quantized x, the offset term on exact x.
    scale_part = xq @ (q * scales.float().unsqueeze(-1)).reshape(n, K).t()
    offset_part = x.float().reshape(M, groups, -1).sum(-1) @ offsets.float().t()
    return scale_part + offset_part


def run(N, K, g, M, act_dtype=torch.float32, seed=0, kernel_cls=Avx2W4A8Kernel):
    """(output, x, layer, exact weights, the stored triple as loaded)."""
    layer, weight = int4_layer(N, K, g, act_dtype, seed)
    stored = (layer.qweight.data.clone(), layer.scales.data.clone(), layer.zeros.data.clone())
    layer.loaded_at = [t.data_ptr() for t in (layer.qweight, layer.scales, layer.zeros)]
    kernel = kernel_cls()  # may rearrange the layer's tensors in place
    kernel.process_weights(layer)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1)).to(act_dtype)
    return kernel.apply(layer, x, None), x, layer, weight, stored


@needs_op
@pytest.mark.parametrize("kernel_cls", W4A8_KERNELS)
@pytest.mark.parametrize("N,K,g", SHAPES)
@pytest.mark.parametrize("M", [1, 3, 4, 9])
def test_matches_model_of_op_and_exact_product(N, K, g, M, kernel_cls):
    tile = TILE_ROWS.get(kernel_cls, 1)
    if N % tile:
        ok, why = kernel_cls.can_implement(CpuFeatures.detect(), g, K, N, torch.float32, float_zero=True)
        assert not ok and f"multiple of {tile}, got N={N}" in why
        return
    out, x, layer, weight, (qweight, scales, zeros) = run(N, K, g, M, kernel_cls=kernel_cls)
    assert out.shape == (M, N) and out.dtype == torch.float32
    # The model of the op on the scales and offsets the layer keeps (8-bit group codes on rows16).
    assert relative_error(out, model_of_op(x, qweight, *resident_groups(layer, qweight, scales, zeros))) < MODEL_TOLERANCE
    assert relative_error(out, F.linear(x, weight)) < EXACT_TOLERANCE


@needs_op
@pytest.mark.parametrize("kernel_cls", W4A8_KERNELS)
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_activations(act_dtype, kernel_cls):
    out, x, _, weight, _ = run(96, 576, 32, 5, act_dtype, kernel_cls=kernel_cls)
    assert out.dtype == act_dtype
    assert relative_error(out, F.linear(x.float(), weight)) < EXACT_TOLERANCE + OUTPUT_ROUNDING[act_dtype]


@needs_op
@pytest.mark.parametrize("kernel_cls", W4A8_KERNELS)
def test_zero_rows_and_bias_and_3d(kernel_cls):
    layer, weight = int4_layer(32, 128, 32, torch.float32)
    kernel = kernel_cls()
    kernel.process_weights(layer)
    x = torch.randn(2, 3, 128)
    x[0, 1] = 0  # an all-zero block must give exactly the bias, not NaN
    bias = torch.randn(32)
    out = kernel.apply(layer, x, bias)
    assert out.shape == (2, 3, 32)
    assert torch.equal(out[0, 1], bias)
    assert relative_error(out, F.linear(x, weight, bias)) < EXACT_TOLERANCE


@needs_op
@pytest.mark.parametrize("kernel_cls", W4A8_KERNELS)
def test_a_2d_eager_call_gives_the_general_paths_result(kernel_cls):
    layer, _ = int4_layer(64, 128, 32, torch.bfloat16, seed=4)
    kernel = kernel_cls()
    kernel.process_weights(layer)
    x = torch.randn(3, 128).to(torch.bfloat16)
    bias = torch.randn(64).to(torch.bfloat16)
    for b in (None, bias):
        # A 3-D input takes the general path (reshape, dense-copy check, reshape back).
        assert torch.equal(kernel.apply(layer, x, b), kernel.apply(layer, x.unsqueeze(0), b).squeeze(0))
    strided = torch.randn(128, 3).to(torch.bfloat16).t()  # [3, 128], not contiguous
    assert not strided.is_contiguous()
    assert torch.equal(kernel.apply(layer, strided, None), kernel.apply(layer, strided.contiguous(), None))
    with pytest.raises(RuntimeError, match="K=64"):
        kernel.apply(layer, torch.randn(1, 64).to(torch.bfloat16), None)


@needs_op
def test_avx2_runs_on_the_stored_weights_without_a_copy():
    _, _, layer, _, stored = run(64, 256, 32, 1, kernel_cls=Avx2W4A8Kernel)
    assert layer.qweight.data_ptr() == layer.loaded_at[0] and torch.equal(layer.qweight, stored[0])
    assert sorted(n for n, _ in layer.named_parameters()) == ["qweight", "scales", "zeros"]


@needs_op
@needs_vnni
def test_rows16_keeps_8bit_group_codes_by_default_and_rearranges_the_weights_in_their_memory():
    _, _, layer, _, (qweight, scales, zeros) = run(48, 576, 32, 1, kernel_cls=Avx512VnniRows16W4A8Kernel)
    assert sorted(n for n, _ in layer.named_parameters()) == ["group_factors", "qweight", "scales", "zeros"]
    assert layer.qweight.data_ptr() == layer.loaded_at[0]  # in place: no second weight-sized buffer
    assert layer.scales.dtype == layer.zeros.dtype == torch.uint8 and layer.scales.shape == scales.shape
    G = scales.shape[1]
    sb = group_codes.superblock_groups(G)
    assert sb == 6 and layer.group_factors.shape == (48, 2 * (G // sb))
    # The op's codes are group_codes.encode's, in the tile layout: [tile][group][16 rows] and
    # [tile][superblock][D, M][16 rows].
    scale_codes, offset_codes, factors = group_codes.encode(scales, zeros, qweight)
    tile = lambda t: t.reshape(3, 16, -1).transpose(1, 2).reshape(48, -1)  # noqa: E731
    assert torch.equal(layer.scales, tile(scale_codes)) and torch.equal(layer.zeros, tile(offset_codes))
    f = factors.reshape(3, 16, G // sb, 2).permute(0, 2, 3, 1).reshape(48, -1)
    assert torch.equal(layer.group_factors.view(torch.int16), f.view(torch.int16))
    # The weights are the same 4-bit codes, rearranged as in the bf16 arm below.
    byte = layer.qweight.reshape(-1)[1 * 16 * 288 + 2 * 256 + 3 * 64 + 4 * 5 + 2]
    q = int4.unpack_nibbles(qweight)
    assert byte & 0x0F == q[21, 90] and byte >> 4 == q[21, 94]


@needs_op
@pytest.mark.parametrize("kernel_cls,rows", [pytest.param(Rows16StoredGroups, 16, id="rows16-bf16-groups",
                                                          marks=needs_vnni),
                                             pytest.param(Avx2W4A8Rows8Kernel, 8, id="rows8")])
def test_a_tile_layout_replaces_the_stored_one_with_the_same_bytes_in_their_memory(kernel_cls, rows):
    _, _, layer, _, (qweight, scales, zeros) = run(32, 128, 64, 1, kernel_cls=kernel_cls)
    assert sorted(n for n, _ in layer.named_parameters()) == ["qweight", "scales", "zeros"]
    for now, was, at in zip((layer.qweight, layer.scales, layer.zeros), (qweight, scales, zeros.bfloat16()),
                            layer.loaded_at):
        assert now.shape == was.shape and now.dtype == was.dtype
        assert now.data_ptr() == at  # rearranged in place: no second weight-sized buffer
        assert not torch.equal(now, was)
    q = int4.unpack_nibbles(qweight)
    packed = layer.qweight.reshape(-1)
    # Row 21 is row 21 % rows of tile 21 // rows; block 2 (k 64-95) of a tile starts 2 * rows * 16 bytes
    # in; chunk 3 of it 3 * 4 * rows bytes further, row j's 4 bytes at 4 j; byte 2 of them:
    # low nibble is k = 64 + 8*3 + 2, high nibble k + 4.
    tile, j = divmod(21, rows)
    byte = packed[tile * rows * 64 + 2 * rows * 16 + 3 * 4 * rows + 4 * j + 2]
    assert byte & 0x0F == q[21, 90] and byte >> 4 == q[21, 94]
    # Scales: [tile][group][rows].
    assert layer.scales.reshape(-1)[tile * rows * 2 + 1 * rows + j] == scales[21, 1]


def interleave_by_permute(qweight: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """The 16-row (or 8-row) layout as the tensor permutation it is (the C++ ops' reference)."""
    N, half_k = qweight.shape
    q = int4.unpack_nibbles(qweight)
    # k = 32 b + 8 c + 4 h + i  ->  [tile, j, b, c, h, i]  ->  [tile, b, c, j, i, h]
    q = q.reshape(N // rows, rows, half_k // 16, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    return (q[..., 0] | (q[..., 1] << 4)).contiguous().reshape(N, half_k)


@needs_op
@pytest.mark.parametrize("rows", [16, 8])
@pytest.mark.parametrize("N,K", [(16, 32), (32, 64), (48, 576), (64, 1536)])
def test_interleave_is_the_permutation_of_the_tile_layout(N, K, rows):
    from vllm_omni_edge.quantization.kernels.w4a8_avx2 import interleave_rows8
    from vllm_omni_edge.quantization.kernels.w4a8_avx512 import interleave_rows16

    interleave = {16: interleave_rows16, 8: interleave_rows8}[rows]
    qweight = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(N + K))
    scales = torch.zeros(N, K // 32, dtype=torch.bfloat16)
    kept = qweight.clone()
    assert torch.equal(interleave(qweight, scales, scales)[0], interleave_by_permute(qweight, rows))
    assert torch.equal(qweight, kept)  # new tensors: the inputs are left as they were
    # A non-contiguous input is read as its values.
    wide = torch.cat([qweight, qweight], dim=1)[:, : K // 2]
    assert torch.equal(interleave(wide, scales, scales)[0], interleave_by_permute(qweight, rows))


INTERLEAVE_OPS = [pytest.param("interleave_rows16_inplace", 16, id="rows16"),
                  pytest.param("interleave_rows8_inplace", 8, id="rows8")]


@needs_op
@pytest.mark.parametrize("op_name,rows", INTERLEAVE_OPS)
@pytest.mark.parametrize("N,K,g", [(16, 32, 32), (48, 576, 64), (64, 1536, 32)])
def test_interleave_in_place_is_the_same_layout_in_the_same_memory(N, K, g, op_name, rows):
    gen = torch.Generator().manual_seed(N + K)
    qweight = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    scales, offsets = (torch.randn(N, K // g, generator=gen).bfloat16() for _ in range(2))
    expected_scales = scales.reshape(N // rows, rows, -1).transpose(1, 2).reshape(N, -1)
    expected_offsets = offsets.reshape(N // rows, rows, -1).transpose(1, 2).reshape(N, -1)
    expected = interleave_by_permute(qweight, rows)
    at = [t.data_ptr() for t in (qweight, scales, offsets)]
    getattr(torch.ops.edge_cpu_int4, op_name)(qweight, scales, offsets)
    assert [t.data_ptr() for t in (qweight, scales, offsets)] == at
    assert torch.equal(qweight, expected)
    assert torch.equal(scales, expected_scales) and torch.equal(offsets, expected_offsets)


@needs_op
@pytest.mark.parametrize("op_name,rows", INTERLEAVE_OPS)
def test_interleave_in_place_refuses_what_it_cannot_rearrange_by_name(op_name, rows):
    op = getattr(torch.ops.edge_cpu_int4, op_name)
    q, s = torch.zeros(32, 16, dtype=torch.uint8), torch.zeros(32, 1, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="qweight must be contiguous"):
        op(torch.zeros(32, 32, dtype=torch.uint8)[:, :16], s, s.clone())
    with pytest.raises(RuntimeError, match="must be contiguous bf16"):
        op(q, s.float(), s.clone())
    with pytest.raises(RuntimeError, match="must be contiguous bf16"):
        op(q, s, torch.zeros(16, 1, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="distinct tensors"):
        op(q, s, s)


@needs_op
@pytest.mark.parametrize("op_name,rows", INTERLEAVE_OPS)
def test_interleave_op_refuses_bad_shapes_by_name(op_name, rows):
    op = getattr(torch.ops.edge_cpu_int4, op_name)
    s = torch.zeros(rows + 4, 1, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"N must be a multiple of {rows}, got N={rows + 4}"):
        op(torch.zeros(rows + 4, 16, dtype=torch.uint8), s, s.clone())
    with pytest.raises(RuntimeError, match="K must be a multiple of 32, got K=48"):
        op(torch.zeros(16, 24, dtype=torch.uint8), s[:16], s[:16].clone())
    with pytest.raises(RuntimeError, match="must be uint8"):
        op(torch.zeros(16, 16, dtype=torch.int32), s[:16], s[:16].clone())


@needs_op
@pytest.mark.parametrize("kernel_cls", W4A8_KERNELS)
def test_op_rejects_bad_shapes_by_name(kernel_cls):
    layer, _ = int4_layer(16, 64, 32, torch.float32)
    op = kernel_cls.op()
    with pytest.raises(RuntimeError, match="group size 48 is not a multiple of 32"):
        op(torch.randn(1, 64), layer.qweight, layer.scales, layer.zeros, 48)
    with pytest.raises(RuntimeError, match="does not match K=128"):
        op(torch.randn(1, 128), layer.qweight, layer.scales, layer.zeros, 32)
    with pytest.raises(RuntimeError, match="must be bf16"):
        op(torch.randn(1, 64), layer.qweight, layer.scales.float(), layer.zeros, 32)
    if kernel_cls in (Avx2W4A8Kernel, Avx2W4A8Rows8Kernel):
        with pytest.raises(RuntimeError, match="x must be floating point, got Long"):
            op(torch.ones(1, 64, dtype=torch.int64), layer.qweight, layer.scales, layer.zeros, 32)


def test_envelope_is_what_can_implement_says():
    features = CpuFeatures.detect()
    ok, why = Avx2W4A8Kernel.can_implement(features, 32, 64, 16, torch.bfloat16, float_zero=False)
    assert not ok and "float offsets" in why
    ok, why = Avx2W4A8Kernel.can_implement(features, 48, 96, 16, torch.bfloat16, float_zero=True)
    assert not ok and "multiple of 32" in why
    no_avx2 = CpuFeatures(capability="DEFAULT", amx=False, vllm_w4a8_op=False)
    ok, why = Avx2W4A8Kernel.can_implement(no_avx2, 32, 64, 16, torch.bfloat16, float_zero=True)
    assert not ok and "needs AVX2" in why


@needs_op
@pytest.mark.parametrize("kernel,n,message", [
    pytest.param(Avx2W4A8Rows8Kernel, 20, "8-row layout needs N a multiple of 8, got N=20", id="rows8"),
    pytest.param(Avx512VnniRows16W4A8Kernel, 24, "needs N a multiple of 16, got N=24", id="rows16",
                 marks=needs_vnni),
])
def test_tile_op_refuses_n_off_the_tile(kernel, n, message):
    layer, _ = int4_layer(n, 64, 32, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        kernel.op()(torch.randn(1, 64), layer.qweight, layer.scales.bfloat16(), layer.zeros.bfloat16(), 32)


def test_vnni_variant_names_the_flags_a_cpu_lacks(monkeypatch):
    import vllm_omni_edge.quantization.kernels.w4a8_avx512 as module

    monkeypatch.setattr(module, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    ok, why = Avx512VnniRows16W4A8Kernel.can_implement(CpuFeatures.detect(), 32, 64, 16, torch.bfloat16,
                                                       float_zero=True)
    assert not ok and "lacks avx512bw, avx512vl, avx512dq, avx512_vnni" in why
    # Everything else in its envelope is the AVX2 variant's.
    monkeypatch.setattr(module, "cpu_flags", lambda: frozenset(module.VNNI_FLAGS))
    ok, why = Avx512VnniRows16W4A8Kernel.can_implement(CpuFeatures.detect(), 32, 64, 16, torch.bfloat16)
    assert not ok and "float offsets" in why


def test_unbuilt_library_is_a_reason_not_a_compile(tmp_path):
    # A fresh interpreter: this one may have loaded the op already.
    code = ("import json; from vllm_omni_edge.quantization.kernels import native; "
            "print(json.dumps(native.load_library()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, CACHE_ENV: str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded, why = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not loaded and "vllm-omni-edge build-kernels" in why
    assert list(tmp_path.iterdir()) == []  # nothing compiled, nothing written


def test_library_name_follows_every_source_the_header_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    files = native.SOURCES + native.HEADERS
    shipped = native.library_path()
    assert shipped.parent == tmp_path / "kernels"
    for i, path in enumerate(files):
        edited = tmp_path / path.name
        edited.write_bytes(path.read_bytes() + b"\n// edited\n")
        assert native.library_path(files[:i] + (edited,) + files[i + 1:]) != shipped, path.name
    assert native.library_path(flags=native.compile_flags() + ("-g",)) != shipped


@needs_op
def test_forced_by_env_or_refused_for_integer_zero_points(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "avx2_w4a8")
    features = CpuFeatures.detect()
    kernel, reason = choose_kernel(features, 32, 576, 576, torch.bfloat16, float_zero=True)
    assert kernel is Avx2W4A8Kernel and KERNEL_ENV in reason
    with pytest.raises(KernelUnavailableError, match="float offsets"):
        choose_kernel(features, 32, 576, 576, torch.bfloat16, float_zero=False)


@needs_op
def test_second_layout_serves_prefill_and_the_op_serves_decode(monkeypatch):
    from vllm_omni_edge.quantization.kernels.base import DENSE_MIN_ROWS

    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_LAYOUTS", "two")
    layer, weight = int4_layer(32, 256, 32, torch.float32)
    kernel = Avx2W4A8Kernel()
    kernel.process_weights(layer)
    assert torch.equal(layer.dense_weight, weight)
    prefill, decode = torch.randn(DENSE_MIN_ROWS, 256), torch.randn(1, 256)
    assert torch.equal(kernel.apply(layer, prefill, None), F.linear(prefill, layer.dense_weight))
    # Decode goes through the op: int8-activation error, not the dense product's exactness.
    out = kernel.apply(layer, decode, None)
    assert torch.equal(out, torch.ops.edge_cpu_int4.w4a8_mm(decode, layer.qweight, layer.scales, layer.zeros, 32))


def test_a_failed_build_is_a_named_error_and_leaves_nothing(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    def broken_compiler(**_kwargs):
        raise RuntimeError("g++: command not found")

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", broken_compiler)
    if not native.x86_64():
        pytest.skip("the C++ kernel is x86-64 only")
    sources = ", ".join(path.name for path in native.SOURCES)
    with pytest.raises(native.KernelBuildError, match=re.escape(f"building {sources} failed: g++: command not found")):
        native.build_library()
    assert list(native.cache_dir().iterdir()) == []  # no library, no temporary build directory


def test_the_wheel_ships_every_file_the_build_compiles():
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(native.__file__).resolve().parents[3]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vllm_omni_edge"]
    for path in native.SOURCES + native.HEADERS:
        relative = path.resolve().relative_to(root / "vllm_omni_edge").as_posix()
        assert any(fnmatch.fnmatch(relative, g) for g in globs), f"{relative} is not in the package data"
