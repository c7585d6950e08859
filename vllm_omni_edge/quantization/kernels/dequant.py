"""Pure-PyTorch fallback: dequantize on every call, then ``F.linear``. Any CPU.

The packed uint8 weights stay resident (0.5 byte per weight, plus scales and
zero points kept in the activation dtype). The cost is paid per call: two
[N, K/2] weight halves are materialized in the activation dtype (2 bytes per
weight for bf16, transient) with O(N*K) elementwise work, whatever the batch
size M. That makes decode (small M) several times slower than a bf16 linear;
it exists so that a layer no fast kernel accepts still runs, not for speed.

Why two halves: the low nibbles hold the even k and the high nibbles the odd
k, so ``x[:, 0::2] @ W_even.T + x[:, 1::2] @ W_odd.T`` needs no interleaving
of the unpacked weights (interleaving uint8 on CPU costs more than the
dequantization itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_omni_edge.quantization.int4 import has_float_zero
from vllm_omni_edge.quantization.kernels.base import Int4Kernel, set_weight


class DequantFallbackKernel(Int4Kernel):
    name = "dequant"

    @classmethod
    def can_implement(cls, features, group_size, K, N, act_dtype, *, float_zero=False):
        if K % group_size or group_size % 2:
            return False, f"group size {group_size} must be even and divide K={K}"
        if not act_dtype.is_floating_point:
            return False, f"activation dtype {act_dtype} is not floating point"
        return True, "pure-PyTorch dequantize + F.linear (slow: dequantizes every call)"

    def process_weights(self, layer):
        act_dtype = layer.int4_act_dtype
        layer.int4_float_zero = has_float_zero(layer.zeros.data)
        # Zero points 0..15 are exact in any float dtype.
        set_weight(layer, "scales", layer.scales.data.to(act_dtype))
        set_weight(layer, "zeros", layer.zeros.data.to(act_dtype))

    def apply(self, layer, x, bias):
        qweight, scales, zeros = layer.qweight, layer.scales, layer.zeros
        n, groups = scales.shape
        s, z = scales.unsqueeze(-1), zeros.unsqueeze(-1)

        def half(nibbles: torch.Tensor) -> torch.Tensor:
            q = nibbles.reshape(n, groups, -1).to(x.dtype)
            return (q * s + z if layer.int4_float_zero else (q - z) * s).reshape(n, -1)

        out = F.linear(x[..., 0::2], half(qweight & 0x0F))
        out += F.linear(x[..., 1::2], half(qweight >> 4))
        if bias is not None:
            out += bias
        return out
