"""W4A8 on AVX2: our C++ ops ``edge_cpu_int4::w4a8_mm`` and ``w4a8_avx2_rows8_mm``
(``csrc/w4a8_avx2.cpp``).

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

``avx2_w4a8`` reads the stored layout as it is; ``avx2_w4a8_rows8`` rearranges it once at
load, in place, into tiles of 8 interleaved rows (same bytes; N a multiple of 8), so that each
int32 lane of a 256-bit vector is one weight row: the same integer dot products with a whole
vector of weights per ``maddubs`` and no reduction across lanes.
"""

from __future__ import annotations

import torch

from vllm_omni_edge.quantization.kernels import native
from vllm_omni_edge.quantization.kernels.base import (
    Int4Kernel,
    as_2d,
    dense_prefill,
    interleave_layer_inplace,
    interleaved_copy,
    keep_dense_copy_if_asked,
    set_weight,
)

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Weight rows per tile of the interleaved layout: one int32 lane of a 256-bit vector each.
TILE_ROWS = 8


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
        params = layer._parameters
        if x.dim() == 2 and "dense_weight" not in params and not torch.compiler.is_compiling():
            # The common eager call (a [tokens, K] input, no dense copy) with the parameters read from
            # the module's dict: a decode step calls the head this way, outside the compiled graph,
            # and each nn.Module attribute lookup is Python time on the step. A graph being traced
            # takes the general path below, as before.
            out = self.op()(x, params["qweight"], params["scales"], params["zeros"], layer.int4_group_size)
            return out if bias is None else out + bias
        x2 = as_2d(x, layer.int4_in_features)
        out = dense_prefill(layer, x2)
        if out is None:
            out = self.op()(x2, layer.qweight, layer.scales, layer.zeros, layer.int4_group_size)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def interleave_rows8(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor):
    """The stored triple in ``w4a8_avx2_rows8_mm``'s layout, same shapes and bytes (new tensors).

    Per tile of 8 rows and block of 32 k: 4 chunks of 32 bytes; byte 4j + i of chunk c holds
    row j's k = 8c + i (low nibble) and k = 8c + 4 + i (high nibble) (the C++ op
    ``interleave_rows8_inplace``). Scales and offsets become [tile][group][8 rows].
    """
    return interleaved_copy(torch.ops.edge_cpu_int4.interleave_rows8_inplace, qweight, scales, offsets)


class Avx2W4A8Rows8Kernel(Avx2W4A8Kernel):
    """W4A8 on AVX2 on an 8-row interleaved layout (``edge_cpu_int4::w4a8_avx2_rows8_mm``).

    The stored triple is rearranged once at load, in its own memory, so that each int32 lane
    of a 256-bit vector is one weight row: a tile of 8 rows ends with no horizontal sum, and a
    block's float conversion and scale multiply serve 8 rows. Same integer dot products as
    ``avx2_w4a8``; prefill runs on the same tiles, kRowTile activation rows per pass."""

    name = "avx2_w4a8_rows8"

    @classmethod
    def can_implement(cls, features, group_size, K, N, act_dtype, *, float_zero=False):
        ok, why = super().can_implement(features, group_size, K, N, act_dtype, float_zero=float_zero)
        if not ok:
            return ok, why
        if N % TILE_ROWS:
            return False, f"the 8-row layout needs N a multiple of {TILE_ROWS}, got N={N}"
        return True, "W4A8 AVX2, 8 rows interleaved (int8 activations per 32, maddubs)"

    def process_weights(self, layer):
        keep_dense_copy_if_asked(layer)
        # In place: the stored-layout tensors are not read again (a tied embedding is pointed at
        # these bytes, embedding.share_with_embedding; the dense copy was made above).
        interleave_layer_inplace(torch.ops.edge_cpu_int4.interleave_rows8_inplace, layer,
                                 layer.qweight.data.contiguous())

    @staticmethod
    def op():
        return torch.ops.edge_cpu_int4.w4a8_avx2_rows8_mm
