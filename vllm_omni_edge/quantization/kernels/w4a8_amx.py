"""W4A8 on AMX through vLLM's ``int4_scaled_mm_cpu`` (adapted from SGLang).

Call forms follow vLLM 0.30's own use in
``model_executor/kernels/linear/mixed_precision/cpu.py`` and
``_custom_ops.py``; semantics from ``csrc/cpu/sgl-kernels/gemm_int4.cpp``:

- ``convert_weight_packed_scale_zp(qweight, qzeros, scales, CPUQuantAlgo.AWQ)``
  takes AutoAWQ tensors: qweight int32 [K, N/8] and qzeros int32 [G, N/8], each
  int32 holding 8 values along N in AWQ's interleaved nibble order (value j at
  bit 4 * (0, 4, 1, 5, 2, 6, 3, 7)[j]); scales [G, N]. It returns VNNI-blocked
  weights with per-block compensation [N/32, K/bk, ...] (bk = min(g, 128)),
  int8 zeros and fp32 scales [N/32, G, 32].
- ``int4_scaled_mm_cpu(x, w, w_zeros, w_scales, bias)`` quantizes each
  activation row to uint8 on the fly (dynamic, asymmetric), so results carry
  activation-quantization error on top of the weight error. It dequantizes
  weights as ``(q - z) * scale`` with integer z, our convention. It accepts
  bf16/fp16 activations and reads the bias as fp32.
- vLLM runs it only with bf16 activations on AMX CPUs (or RISC-V), with K and N
  multiples of 32; we keep the same envelope.

It cannot run on CPUs without AMX, and vLLM's ``_C`` built for AVX2 does not
contain the op; its tests skip there with the reason.
"""

from __future__ import annotations

import torch

from vllm_omni_edge.quantization.int4 import unpack_nibbles
from vllm_omni_edge.quantization.kernels.base import Int4Kernel, as_2d, set_weight

# Nibble p (bits 4p..4p+3) of each AutoAWQ int32 holds value AWQ_PACK_ORDER[p] of its 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq_int32(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [R, N] -> int32 [R, N/8] in AutoAWQ's interleaved order."""
    r, n = values.shape
    v = values.to(torch.int64).reshape(r, n // 8, 8)[:, :, AWQ_PACK_ORDER]
    words = (v << torch.arange(0, 32, 4)).sum(dim=-1)  # disjoint nibbles: sum == OR
    # Reinterpret the unsigned 32-bit words as int32 (top nibble >= 8 -> negative).
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def to_awq_tensors(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """Our stored triple ([N, ...] rows) -> AutoAWQ's (qweight [K, N/8], qzeros [G, N/8], scales [G, N])."""
    values = unpack_nibbles(qweight)  # [N, K]
    return (
        pack_awq_int32(values.t().contiguous()),
        pack_awq_int32(zeros.t().contiguous()),
        scales.t().contiguous(),
    )


class AmxW4A8Kernel(Int4Kernel):
    name = "amx_w4a8"

    @classmethod
    def can_implement(cls, features, group_size, K, N, act_dtype, *, float_zero=False):
        if float_zero:
            return False, "needs integer zero points (build with --zero-point int)"
        if not features.amx:
            return False, "CPU has no AMX tiles"
        if not features.vllm_w4a8_op:
            return False, "vLLM's _C has no int4_scaled_mm_cpu on this build/CPU"
        if act_dtype != torch.bfloat16:
            return False, f"needs bf16 activations, model runs {act_dtype}"
        if K % 32 or N % 32:
            return False, f"K={K} and N={N} must be multiples of 32"
        if K % group_size:
            return False, f"group size {group_size} does not divide K={K}"
        return True, "AMX W4A8 (dynamic int8 activations)"

    def process_weights(self, layer):
        from vllm import _custom_ops as ops

        awq_qweight, awq_qzeros, awq_scales = to_awq_tensors(
            layer.qweight.data, layer.scales.data, layer.zeros.data
        )
        blocked_w, blocked_zp, blocked_s = ops.convert_weight_packed_scale_zp(
            awq_qweight, awq_qzeros, awq_scales, ops.CPUQuantAlgo.AWQ
        )
        set_weight(layer, "qweight", blocked_w)
        set_weight(layer, "zeros", blocked_zp)
        set_weight(layer, "scales", blocked_s)

    def apply(self, layer, x, bias):
        from vllm import _custom_ops as ops

        K = layer.int4_in_features
        x2 = as_2d(x, K)
        out = ops.int4_scaled_mm_cpu(
            x=x2,
            w=layer.qweight,
            w_zeros=layer.zeros,
            w_scales=layer.scales,
            bias=bias.float() if bias is not None else None,
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])
