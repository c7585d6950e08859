"""W4A16 through PyTorch's CPU "tinygemm": ``aten._weight_int4pack_mm_for_cpu``.

Verified on torch 2.13 (tests/quantization/test_kernels.py):
- group sizes 32, 64, 128, 256 only; N must be a multiple of 16;
- activations fp32, bf16 or fp16; ``scales_and_zeros`` [K/g, N, 2] in the
  activation dtype;
- it dequantizes as ``(q - 8) * scale + zero`` with a *float* zero. A float
  offset o becomes ``zero = o + 8 * scale``, an integer zero point z
  ``zero = (8 - z) * scale``. In bf16 that is rounded (to 1/64 of a step at
  worst), so bf16 results differ slightly from the exact reference; fp32 ones do not.
- ``_convert_weight_to_int4pack_for_cpu`` takes int32 values [N, K] and writes
  uint8 [N, K/2] blocked by 64 rows under AVX-512 and 32 under AVX2 (the
  ``innerKTiles`` argument is ignored on CPU). The layout depends on the CPU, so
  it is made at load, never stored on disk.

One layout by default. ``VLLM_OMNI_EDGE_INT4_LAYOUTS=two`` also keeps a dense
copy in the activation dtype and sends calls of ``DENSE_MIN_ROWS`` rows or more
(prefill) to ``F.linear`` on it (``base.keep_dense_copy_if_asked``): the
memory-for-prefill trade, as an A/B.
"""

from __future__ import annotations

import torch

from vllm_omni_edge.quantization.int4 import has_float_zero, unpack_nibbles
from vllm_omni_edge.quantization.kernels.base import (
    CpuFeatures,
    Int4Kernel,
    as_2d,
    dense_prefill,
    keep_dense_copy_if_asked,
    set_weight,
)

TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)
TINYGEMM_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows converted at a time: the int32 staging copy is 8x the packed bytes, so
# converting a 150k-row LM head at once would need ~1 GB of transient memory.
# A multiple of 64 keeps chunk boundaries on the packer's row blocks.
_CONVERT_ROWS = 4096


class Int4PackCpuKernel(Int4Kernel):
    name = "int4pack"

    @classmethod
    def can_implement(cls, features, group_size, K, N, act_dtype, *, float_zero=False):
        if group_size not in TINYGEMM_GROUP_SIZES:
            return False, f"group size {group_size} not in {TINYGEMM_GROUP_SIZES}"
        if K % group_size:
            return False, f"group size {group_size} does not divide K={K}"
        if N % 16:
            return False, f"N={N} is not a multiple of 16"
        if act_dtype not in TINYGEMM_ACT_DTYPES:
            return False, f"activation dtype {act_dtype} not supported"
        return True, f"tinygemm W4A16 ({features.capability} dispatch)"

    def process_weights(self, layer):
        qweight, scales, zeros = layer.qweight.data, layer.scales.data, layer.zeros.data
        act_dtype = layer.int4_act_dtype
        keep_dense_copy_if_asked(layer)
        n = qweight.shape[0]
        packed = torch.empty_like(qweight)
        for start in range(0, n, _CONVERT_ROWS):
            rows = slice(start, min(start + _CONVERT_ROWS, n))
            values = unpack_nibbles(qweight[rows]).to(torch.int32)
            packed[rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        s = scales.float()
        float_zero = zeros.float() + 8.0 * s if has_float_zero(zeros) else (8.0 - zeros.float()) * s
        scales_and_zeros = torch.stack([s.t(), float_zero.t()], dim=-1).to(act_dtype).contiguous()
        set_weight(layer, "qweight", packed)
        set_weight(layer, "scales", None)
        set_weight(layer, "zeros", None)
        set_weight(layer, "scales_and_zeros", scales_and_zeros)

    def apply(self, layer, x, bias):
        K = layer.int4_in_features
        x2 = as_2d(x, K)
        out = dense_prefill(layer, x2)
        if out is None:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, layer.qweight, layer.int4_group_size, layer.scales_and_zeros
            )
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])
