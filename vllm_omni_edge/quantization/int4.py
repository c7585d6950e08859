"""The cpu_int4 number format, in one place: quantize, pack, unpack, dequantize.

Asymmetric per-group uint4 with integer zero points, the AWQ/GPTQ convention:

    w[n, k] ~= (q[n, k] - zero[n, k // g]) * scale[n, k // g],   q, zero in 0..15

Every group's range is widened to include 0 (as GPTQ does), so the zero point
always lands in 0..15 and one-sided groups are not clipped. The scale is rounded
*up* to its storage dtype (bf16) before q and the zero point are computed, so the
group's range still fits in 15 steps and every weight is within half a stored
scale of its dequantized value (the bound the tests check).

Tensors (format_version 1, what the builder writes and the linear method loads):

- ``qweight`` uint8 [N, K/2]: two values per byte along K; the low nibble is the
  even k, the high nibble the odd k. The output dim is dim 0, so vLLM's merged
  QKV / gate_up loaders concatenate shards on dim 0 unchanged.
- ``scales`` bf16 [N, K/g].
- ``zeros`` uint8 [N, K/g], one unpacked zero point (0..15) per group.
"""

from __future__ import annotations

import torch

FORMAT_VERSION = 1
BITS = 4
SUPPORTED_GROUP_SIZES = (32, 64, 128, 256)
SCALE_DTYPE = torch.bfloat16
SUPPORTED_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_QMAX = (1 << BITS) - 1


class Int4FormatError(ValueError):
    """A tensor, shape or setting the cpu_int4 format cannot represent."""


def check_group_size(group_size: int) -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise Int4FormatError(
            f"group size {group_size} is not supported "
            f"(supported: {', '.join(map(str, SUPPORTED_GROUP_SIZES))})"
        )


def group_size_for(in_features: int, requested: int, what: str = "layer") -> int:
    """The group size a layer with ``in_features`` (K) inputs is stored with.

    The requested size when it divides K. Otherwise the largest supported size
    below it that does (SmolLM2's K=576 takes 64 when 128 is asked for): smaller
    groups only cost a little more scale storage, and both the builder and the
    loader apply this same rule, so a checkpoint's shapes are predictable from
    (K, requested). If no supported size divides K the layer cannot be stored.
    """
    check_group_size(requested)
    for g in SUPPORTED_GROUP_SIZES[::-1]:
        if g <= requested and in_features % g == 0:
            return g
    raise Int4FormatError(
        f"{what}: in_features K={in_features} is not a multiple of any supported "
        f"group size <= {requested} ({', '.join(map(str, SUPPORTED_GROUP_SIZES))}); "
        "it cannot be stored as cpu_int4"
    )


def quantize(weight: torch.Tensor, group_size: int, what: str = "weight"):
    """[N, K] float weight -> (qweight uint8 [N, K/2], scales bf16 [N, G], zeros uint8 [N, G])."""
    if weight.dtype not in SUPPORTED_WEIGHT_DTYPES:
        raise Int4FormatError(
            f"{what}: dtype {weight.dtype} is not supported "
            f"(supported: {', '.join(str(d) for d in SUPPORTED_WEIGHT_DTYPES)})"
        )
    if weight.dim() != 2:
        raise Int4FormatError(f"{what}: expected a 2-D [N, K] weight, got shape {tuple(weight.shape)}")
    check_group_size(group_size)
    n, k = weight.shape
    if k % group_size:
        raise Int4FormatError(
            f"{what}: group size {group_size} does not divide in_features K={k}"
        )
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    if not torch.isfinite(w).all():
        raise Int4FormatError(f"{what}: contains NaN or infinite values")
    wmin = w.amin(dim=-1).clamp(max=0)
    wmax = w.amax(dim=-1).clamp(min=0)
    exact = (wmax - wmin) / _QMAX
    scales = exact.to(SCALE_DTYPE)
    scales = torch.where(
        scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales
    )
    # An all-zero group: any non-zero scale stores it exactly (q == zero).
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    s = scales.float()
    zeros = torch.round(-wmin / s).clamp(0, _QMAX)
    q = (torch.round(w / s.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, _QMAX)
    qweight = pack_nibbles(q.reshape(n, k).to(torch.uint8))
    return qweight, scales, zeros.to(torch.uint8)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> uint8 [N, K/2], even k in the low nibble."""
    if q.shape[-1] % 2:
        raise Int4FormatError(f"cannot pack an odd number of columns ({q.shape[-1]})")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 values 0..15 [N, K]."""
    n, half = qweight.shape
    out = torch.empty(n, half, 2, dtype=torch.uint8)
    out[..., 0] = qweight & 0x0F
    out[..., 1] = qweight >> 4
    return out.view(n, half * 2)


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype=torch.float32
) -> torch.Tensor:
    """The reference: exactly the weights the stored triple means, rounded once to ``dtype``."""
    n, groups = scales.shape
    q = unpack_nibbles(qweight).float().reshape(n, groups, -1)
    w = (q - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return w.reshape(n, -1).to(dtype)


def check_triple(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, what: str) -> int:
    """Validate stored tensors against each other; return the group size."""
    if qweight.dtype != torch.uint8 or zeros.dtype != torch.uint8:
        raise Int4FormatError(f"{what}: qweight and zeros must be uint8")
    if scales.dtype not in SUPPORTED_WEIGHT_DTYPES:
        raise Int4FormatError(f"{what}: scales dtype {scales.dtype} is not supported")
    if qweight.dim() != 2 or scales.shape != zeros.shape or scales.shape[0] != qweight.shape[0]:
        raise Int4FormatError(
            f"{what}: inconsistent shapes qweight {tuple(qweight.shape)}, "
            f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}"
        )
    k = qweight.shape[1] * 2
    if k % scales.shape[1]:
        raise Int4FormatError(f"{what}: {scales.shape[1]} groups do not divide K={k}")
    group_size = k // scales.shape[1]
    check_group_size(group_size)
    return group_size
