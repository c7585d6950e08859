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

from vllm_omni_edge.cpu_features import cpu_flags
from vllm_omni_edge.quantization.kernels import native
from vllm_omni_edge.quantization.kernels.base import (
    Int4Kernel,
    as_2d,
    dense_prefill,
    keep_dense_copy_if_asked,
    set_weight,
)

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What the VNNI variant's target attribute asks of the CPU (Linux /proc/cpuinfo names).
VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")


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
        loaded, why = native.load_w4a8_avx2()
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


class Avx512VnniW4A8Kernel(Avx2W4A8Kernel):
    """The same W4A8 product with ``vpdpbusd`` (``edge_cpu_int4::w4a8_vnni_mm``): two 32-blocks
    per 512-bit register, scales applied 16 blocks per vector. Same integer dot products as
    ``avx2_w4a8``, so the same numerics up to fp32 summation order."""

    name = "avx512_w4a8"

    @classmethod
    def can_implement(cls, features, group_size, K, N, act_dtype, *, float_zero=False):
        missing = [f for f in VNNI_FLAGS if f not in cpu_flags()]
        if missing:
            return False, f"needs AVX-512 VNNI (this CPU lacks {', '.join(missing)})"
        ok, why = super().can_implement(features, group_size, K, N, act_dtype, float_zero=float_zero)
        if not ok:
            return ok, why
        return True, "W4A8 AVX-512 VNNI (int8 activations per 32, vpdpbusd)"

    @staticmethod
    def op():
        return torch.ops.edge_cpu_int4.w4a8_vnni_mm


# Weight rows per tile of the interleaved layout: one int32 lane of a 512-bit vpdpbusd each.
TILE_ROWS = 16


def interleave_rows16(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor):
    """The stored triple in ``w4a8_vnni_rows16_mm``'s layout, same shapes and bytes.

    Per tile of 16 rows and block of 32 k: 4 chunks of 64 bytes; byte 4j + i of chunk c
    holds row j's k = 8c + i (low nibble) and k = 8c + 4 + i (high nibble) (the C++ op
    ``interleave_rows16``). Scales and offsets become [tile][group][16 rows].
    """
    N = qweight.shape[0]
    packed = torch.ops.edge_cpu_int4.interleave_rows16(qweight)

    def by_tile(t: torch.Tensor) -> torch.Tensor:
        groups = t.shape[1]
        return t.reshape(N // TILE_ROWS, TILE_ROWS, groups).transpose(1, 2).contiguous().reshape(N, groups)

    return packed, by_tile(scales), by_tile(offsets)


class Avx512VnniRows16W4A8Kernel(Avx512VnniW4A8Kernel):
    """W4A8 with ``vpdpbusd`` on a 16-row interleaved layout (``edge_cpu_int4::w4a8_vnni_rows16_mm``).

    The stored triple is rearranged once at load (same bytes, one layout) so that each int32
    lane of a 512-bit vector is one weight row: a tile of 16 rows finishes with no horizontal
    sum and no per-block lane shuffles. Same integer dot products as ``avx2_w4a8``."""

    name = "avx512_w4a8_rows16"

    @classmethod
    def can_implement(cls, features, group_size, K, N, act_dtype, *, float_zero=False):
        ok, why = super().can_implement(features, group_size, K, N, act_dtype, float_zero=float_zero)
        if not ok:
            return ok, why
        if N % TILE_ROWS:
            return False, f"the 16-row layout needs N a multiple of {TILE_ROWS}, got N={N}"
        return True, "W4A8 AVX-512 VNNI, 16 rows interleaved (int8 activations per 32, vpdpbusd)"

    def process_weights(self, layer):
        keep_dense_copy_if_asked(layer)
        packed, scales, offsets = interleave_rows16(
            layer.qweight.data, layer.scales.data.to(torch.bfloat16), layer.zeros.data.to(torch.bfloat16))
        set_weight(layer, "qweight", packed)
        set_weight(layer, "scales", scales)
        set_weight(layer, "zeros", offsets)

    @staticmethod
    def op():
        return torch.ops.edge_cpu_int4.w4a8_vnni_rows16_mm


def silu_mlp(gate_up: torch.nn.Module, down: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` in one op (``edge_cpu_int4::w4a8_vnni_rows16_silu_mlp``).

    ``gate_up`` is a merged [gate; up] linear and ``down`` the projection back, both on
    ``avx512_w4a8_rows16`` with no bias: the same products and roundings as their two calls
    and vLLM's SiluAndMul between them, in one dispatch.
    """
    x2 = as_2d(x, gate_up.int4_in_features)
    out = torch.ops.edge_cpu_int4.w4a8_vnni_rows16_silu_mlp(
        x2, gate_up.qweight, gate_up.scales, gate_up.zeros, gate_up.int4_group_size,
        down.qweight, down.scales, down.zeros, down.int4_group_size)
    return out.reshape(*x.shape[:-1], out.shape[-1])
