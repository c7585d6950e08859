"""Build a bare layer holding a stored cpu_int4 triple, as the linear method leaves it."""

from __future__ import annotations

import torch

from vllm_omni_edge.quantization import int4


def int4_layer(N: int, K: int, group_size: int, act_dtype: torch.dtype, seed: int = 0,
               zero_point: str = int4.DEFAULT_ZERO_POINT, weight: torch.Tensor | None = None):
    """(layer, exact fp32 weights the layer stands for); ``weight`` [N, K] instead of random ones."""
    if weight is None:
        weight = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    qweight, scales, zeros = int4.quantize(weight, group_size, zero_point=zero_point)
    layer = torch.nn.Module()
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    layer.int4_in_features = K
    layer.int4_group_size = group_size
    layer.int4_act_dtype = act_dtype
    return layer, int4.dequantize(qweight, scales, zeros)


def w4a8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the W4A8 ops quantize it: int8 per block of 32 (absmax / 127), in fp32."""
    M, K = x.shape
    xf = x.float().reshape(M, K // 32, 32)
    block_scale = xf.abs().amax(-1, keepdim=True) / 127
    qa = torch.where(block_scale > 0, torch.round(xf / block_scale), torch.zeros_like(xf))
    return (qa * block_scale).reshape(M, K)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())



def resident_groups(layer: torch.nn.Module, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-group scales and offsets (fp32) a processed layer computes with, from the stored
    triple it was loaded with: the 8-bit group codes' values where its kernel keeps them (rows16
    with ``group_factors``), else the stored values."""
    from vllm_omni_edge.quantization import group_codes

    if "group_factors" in layer._parameters:
        return group_codes.decode(*group_codes.encode(scales, zeros, qweight))
    return scales.float(), zeros.float()


def resident_dequantize(layer: torch.nn.Module, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights a processed layer computes with, from the stored triple it was loaded with."""
    from vllm_omni_edge.quantization import group_codes

    if "group_factors" in layer._parameters:
        return group_codes.dequantize(qweight, *group_codes.encode(scales, zeros, qweight), dtype=dtype)
    return int4.dequantize(qweight, scales, zeros, dtype=dtype)
