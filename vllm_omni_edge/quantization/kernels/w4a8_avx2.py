"""W4A8 on AVX2: our C++ op ``edge_cpu_int4::w4a8_mm`` (``csrc/w4a8_avx2.cpp``).

llama.cpp's Q4_1 x Q8_1 dot product on our stored format: weights stay as they
are on disk (uint8 [N, K/2] plus bf16 scale and offset per group: no repack, no
second copy); each call quantizes the activation rows to int8 per block of 32
(absmax / 127) and multiplies with ``maddubs``. Results therefore carry the
activation rounding on top of the weight error; the fidelity grids measure it.

Envelope: float offsets (format 2; integer zero points take ``int4pack``), group
sizes that are multiples of 32 (32/64/128/256), K a multiple of the group, any
N, fp32/bf16/fp16 activations, an x86-64 CPU with AVX2 and FMA, and the library
built on this machine (``vllm-omni-edge build-kernels``). The second layout
(``VLLM_OMNI_EDGE_INT4_LAYOUTS=two``) works as it does for ``int4pack``.
"""

from __future__ import annotations

import torch

from vllm_omni_edge.quantization.kernels import native
from vllm_omni_edge.quantization.kernels.base import (
    Int4Kernel,
    as_2d,
    dense_prefill,
    keep_dense_copy_if_asked,
    set_weight,
)

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Avx2W4A8Kernel(Int4Kernel):
    name = "avx2_w4a8"

    @classmethod
    def can_implement(cls, features, group_size, K, N, act_dtype, *, float_zero=False):
        if not float_zero:
            return False, "needs float offsets (format 2); integer zero points run on int4pack"
        if not features.capability.startswith(("AVX2", "AVX512", "AMX")):
            return False, f"needs AVX2 (PyTorch dispatch level here: {features.capability})"
        if group_size % 32 or K % group_size:
            return False, f"group size {group_size} must be a multiple of 32 dividing K={K}"
        if act_dtype not in ACT_DTYPES:
            return False, f"activation dtype {act_dtype} not supported"
        loaded, why = native.load_library()
        if not loaded:
            return False, f"C++ op {why}"
        return True, "W4A8 AVX2 (int8 activations per 32, maddubs)"

    def process_weights(self, layer):
        keep_dense_copy_if_asked(layer)
        # The stored triple is the kernel's layout; only make the dtypes exact.
        set_weight(layer, "scales", layer.scales.data.to(torch.bfloat16).contiguous())
        set_weight(layer, "zeros", layer.zeros.data.to(torch.bfloat16).contiguous())

    @staticmethod
    def op():
        return torch.ops.edge_cpu_int4.w4a8_mm

    def apply(self, layer, x, bias):
        x2 = as_2d(x, layer.int4_in_features)
        out = dense_prefill(layer, x2)
        if out is None:
            out = self.op()(x2, layer.qweight, layer.scales, layer.zeros, layer.int4_group_size)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])
