"""Each kernel against the exact dequantized reference, and the chooser's decisions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.quantization.helpers import int4_layer, relative_error
from vllm_omni_edge.envs import FlagError
from vllm_omni_edge.quantization import int4
from vllm_omni_edge.quantization.kernels import (
    KERNEL_ENV,
    KERNELS,
    AmxW4A8Kernel,
    CpuFeatures,
    DequantFallbackKernel,
    Int4PackCpuKernel,
    KernelUnavailableError,
    choose_kernel,
)
from vllm_omni_edge.quantization.kernels import int4pack as int4pack_module
from vllm_omni_edge.quantization.kernels.w4a8_amx import to_awq_tensors

# Worst relative error seen over these cases was ~4e-7 (fp32), ~3e-4 (fp16),
# ~3e-3 (bf16); the bounds leave room without hiding a wrong zero-point sign
# (that gives errors of order 1).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (N, K, group): smallest N tinygemm takes, N not a multiple of 32, a single
# group per row, SmolLM2's K, and N past one conversion chunk (4096 rows).
SHAPES = [(16, 32, 32), (48, 512, 64), (96, 576, 64), (64, 256, 256), (4160, 256, 128)]
W4A16_KERNELS = [Int4PackCpuKernel, DequantFallbackKernel]


def run_kernel(kernel_cls, N, K, g, act_dtype, M, bias=True, seed=0, zero_point="float"):
    layer, weight = int4_layer(N, K, g, act_dtype, seed, zero_point)
    kernel = kernel_cls()
    kernel.process_weights(layer)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(M, K, generator=gen).to(act_dtype)
    b = torch.randn(N, generator=gen).to(act_dtype) if bias else None
    out = kernel.apply(layer, x, b)
    ref = F.linear(x.float(), weight, b.float() if bias else None)
    return out, ref, layer


@pytest.mark.parametrize("kernel_cls", W4A16_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("N,K,g", SHAPES)
@pytest.mark.parametrize("M", [1, 37])
@pytest.mark.parametrize("zero_point", int4.ZERO_POINT_MODES)
def test_w4a16_kernels_match_reference(kernel_cls, act_dtype, N, K, g, M, zero_point):
    ok, why = kernel_cls.can_implement(CpuFeatures.detect(), g, K, N, act_dtype,
                                       float_zero=zero_point == "float")
    assert ok, why
    out, ref, _ = run_kernel(kernel_cls, N, K, g, act_dtype, M, zero_point=zero_point)
    assert out.shape == (M, N) and out.dtype == act_dtype
    assert relative_error(out, ref) < TOLERANCE[act_dtype]


@pytest.mark.parametrize("group_size", int4.SUPPORTED_GROUP_SIZES)
def test_every_group_size_on_int4pack(group_size):
    out, ref, _ = run_kernel(Int4PackCpuKernel, 32, 512, group_size, torch.bfloat16, 5)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("kernel_cls", W4A16_KERNELS, ids=lambda k: k.name)
def test_3d_input_and_no_bias(kernel_cls):
    layer, weight = int4_layer(32, 128, 32, torch.float32)
    kernel = kernel_cls()
    kernel.process_weights(layer)
    x = torch.randn(2, 3, 128)
    out = kernel.apply(layer, x, None)
    assert out.shape == (2, 3, 32)
    assert relative_error(out, F.linear(x, weight)) < 1e-5


def test_tinygemm_zero_point_convention():
    """The op computes (q - 8) * scale + zero with a float zero, per group along K."""
    gen = torch.Generator().manual_seed(3)
    N, K, g = 32, 128, 32
    q = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen)
    scale = torch.rand(K // g, N, generator=gen) + 0.1
    zero = torch.randn(K // g, N, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.randn(3, K, generator=gen)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, torch.stack([scale, zero], -1))
    w = (q.float() - 8) * scale.repeat_interleave(g, 0).t() + zero.repeat_interleave(g, 0).t()
    assert relative_error(out, x @ w.t()) < 1e-6


@pytest.mark.parametrize(
    "N,K,g,message",
    [(8, 64, 32, "dividable by 16"), (32, 64, 16, "qGroupSize"), (32, 512, 512, "qGroupSize")],
)
def test_tinygemm_limits_are_what_can_implement_says(N, K, g, message):
    ok, _ = Int4PackCpuKernel.can_implement(CpuFeatures.detect(), g, K, N, torch.bfloat16)
    assert not ok
    q = torch.zeros(N, K, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.zeros(max(K // g, 1), N, 2, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, K, dtype=torch.bfloat16), packed, g, sz)


def test_int4pack_chunked_conversion_equals_whole(monkeypatch):
    layer, _ = int4_layer(208, 128, 32, torch.bfloat16)
    values = int4.unpack_nibbles(layer.qweight.data).to(torch.int32)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    monkeypatch.setattr(int4pack_module, "_CONVERT_ROWS", 64)
    Int4PackCpuKernel().process_weights(layer)
    assert torch.equal(layer.qweight.data, whole)


def test_int4pack_keeps_one_layout():
    _, _, layer = run_kernel(Int4PackCpuKernel, 64, 256, 64, torch.bfloat16, 1)
    assert set(dict(layer.named_parameters())) == {"qweight", "scales_and_zeros"}
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (64, 128)


def test_dequant_keeps_packed_weights_resident():
    _, _, layer = run_kernel(DequantFallbackKernel, 64, 256, 64, torch.bfloat16, 1)
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (64, 128)
    assert layer.scales.dtype == layer.zeros.dtype == torch.bfloat16


def test_awq_repack_matches_vllm_unpacking():
    """Our (N-major, K-packed) triple -> AutoAWQ int32 words, read back the way
    vLLM's C++ ``int4pack`` (AWQ branch of convert_weight_packed_scale_zp) reads them."""
    layer, _ = int4_layer(64, 256, 64, torch.bfloat16, zero_point="int")
    qweight, scales, zeros = layer.qweight.data, layer.scales.data, layer.zeros.data
    awq_q, awq_z, awq_s = to_awq_tensors(qweight, scales, zeros)
    assert awq_q.shape == (256, 8) and awq_q.dtype == torch.int32
    assert awq_z.shape == (4, 8) and awq_s.shape == (4, 64)

    bitshifts = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], dtype=torch.int32) * 4

    def cpp_awq_unpack(words):
        return ((words.unsqueeze(-1) >> bitshifts) & 0xF).flatten(-2)

    assert torch.equal(cpp_awq_unpack(awq_q).t().to(torch.uint8), int4.unpack_nibbles(qweight))
    assert torch.equal(cpp_awq_unpack(awq_z).t().to(torch.uint8), zeros)
    assert torch.equal(awq_s.t(), scales)


AMX = CpuFeatures.detect()


@pytest.mark.amx
@pytest.mark.skipif(
    not AmxW4A8Kernel.can_implement(AMX, 128, 256, 64, torch.bfloat16)[0],
    reason=f"amx_w4a8 cannot run here: {AmxW4A8Kernel.can_implement(AMX, 128, 256, 64, torch.bfloat16)[1]}",
)
@pytest.mark.parametrize("N,K,g", [(64, 256, 128), (96, 576, 64), (32, 512, 256), (4160, 256, 32)])
@pytest.mark.parametrize("M", [1, 37])
def test_amx_w4a8_matches_reference(N, K, g, M):
    out, ref, layer = run_kernel(AmxW4A8Kernel, N, K, g, torch.bfloat16, M, zero_point="int")
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    # Activations are quantized to 8 bits per row on the fly: ~1% extra error.
    assert relative_error(out, ref) < 3e-2
    assert layer.qweight.dtype == torch.uint8 and layer.scales.dtype == torch.float32


def test_amx_refuses_without_amx_or_bf16():
    no_amx = CpuFeatures(capability="AVX2", amx=False, vllm_w4a8_op=False)
    refusal = AmxW4A8Kernel.can_implement(no_amx, 128, 256, 64, torch.bfloat16)
    assert refusal == (False, "CPU has no AMX tiles")
    amx = CpuFeatures(capability="AVX512", amx=True, vllm_w4a8_op=True)
    assert not AmxW4A8Kernel.can_implement(amx, 128, 256, 64, torch.float16)[0]
    assert not AmxW4A8Kernel.can_implement(amx, 128, 256, 48, torch.bfloat16)[0]
    assert AmxW4A8Kernel.can_implement(amx, 128, 256, 64, torch.bfloat16)[0]


def test_chooser_follows_the_measured_route(monkeypatch):
    from vllm_omni_edge.quantization import kernels as kernels_module

    monkeypatch.delenv(KERNEL_ENV, raising=False)
    amx = CpuFeatures(capability="AVX512", amx=True, vllm_w4a8_op=True)
    avx2 = CpuFeatures(capability="AVX2", amx=False, vllm_w4a8_op=False)
    # The x86-amx table decides; whatever it ranks first (and can run) is chosen.
    first = next(name for name in kernels_module.routed_order(amx)
                 if name in KERNELS and KERNELS[name].can_implement(amx, 128, 4096, 4096, torch.bfloat16)[0])
    kernel, reason = choose_kernel(amx, 128, 4096, 4096, torch.bfloat16)
    assert kernel is KERNELS[first] and "router: x86-amx" in reason
    # A table that ranks W4A8 first gets W4A8; one that ranks tinygemm first gets tinygemm.
    for order, expected in [(("amx_w4a8", "int4pack", "dequant"), AmxW4A8Kernel),
                            (("int4pack", "amx_w4a8", "dequant"), Int4PackCpuKernel)]:
        monkeypatch.setattr(kernels_module, "routed_order", lambda features, order=order: order)
        assert choose_kernel(amx, 128, 4096, 4096, torch.bfloat16)[0] is expected
        # fp32 activations: W4A8 needs bf16, tinygemm takes it.
        kernel, reason = choose_kernel(amx, 128, 4096, 4096, torch.float32)
        assert kernel is Int4PackCpuKernel
        assert ("amx_w4a8: needs bf16" in reason) == (order[0] == "amx_w4a8")
    monkeypatch.undo()
    kernel, reason = choose_kernel(avx2, 64, 576, 960, torch.bfloat16)
    # The measured x86-avx2 route ranks int4pack first; W4A8 is not even tried there.
    assert kernel is Int4PackCpuKernel and "router: x86-avx2" in reason
    kernel, reason = choose_kernel(avx2, 64, 576, 40, torch.bfloat16)  # N not a multiple of 16
    assert kernel is DequantFallbackKernel and "N=40 is not a multiple of 16" in reason


def test_env_forces_a_kernel_or_fails_loudly(monkeypatch):
    avx2 = CpuFeatures(capability="AVX2", amx=False, vllm_w4a8_op=False)
    monkeypatch.setenv(KERNEL_ENV, "dequant")
    forced = choose_kernel(avx2, 64, 576, 960, torch.bfloat16)
    assert forced == (DequantFallbackKernel, f"forced by {KERNEL_ENV}")
    monkeypatch.setenv(KERNEL_ENV, "amx_w4a8")
    with pytest.raises(KernelUnavailableError, match="cannot run lm_head: CPU has no AMX tiles"):
        choose_kernel(avx2, 64, 576, 960, torch.bfloat16, what="lm_head")
    monkeypatch.setenv(KERNEL_ENV, "fastest")
    with pytest.raises(FlagError, match=f"{KERNEL_ENV}='fastest': expected one of int4pack, "):
        choose_kernel(avx2, 64, 576, 960, torch.bfloat16)
