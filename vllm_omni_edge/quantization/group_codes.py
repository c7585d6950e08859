"""8-bit group codes: a 4-bit linear's per-group scales and offsets as one byte each.

The stored format (``int4.py``) keeps a bf16 scale and a bf16 offset per group of 32 weights:
1 bit a weight on top of the 4-bit codes. A kernel may keep them in this smaller form instead
(``avx512_w4a8_rows16``, ``VLLM_OMNI_EDGE_INT4_GROUP_CODES=8bit``): per weight row, the groups
are taken ``superblock_groups(G)`` at a time (8 where they divide, as llama.cpp's Q4_K takes 8
sub-blocks of 32 under one pair of factors), and each superblock keeps one bf16 factor for its
scales and one for its offsets; each group keeps a one-byte code for each::

    scale  = scale_code  * D          (D > 0, codes 0..255)
    offset = offset_code * M          (M < 0: codes 0..255; M > 0: codes -127..127 as int8 bits)

4.625 bits a weight at group 32 and 8 groups a superblock (5.0 with bf16 pairs). The codes
change the weights a little (``decode`` says exactly how): each superblock's factor is the
better (smaller summed absolute error) of its largest value over 63 and over 255, so a GGUF
Q4_K grid, whose 6-bit codes are exactly that first fit, comes back on its own grid up to the
bf16 rounding the stored format already made.

``encode`` (given the stored qweight) is the reference the C++ op (``rows16_group_codes_inplace``)
matches bit for bit;
the kernels compute ``q * scale + offset`` from ``decode``'s values (exact products in fp32).
"""

from __future__ import annotations

import torch

from vllm_omni_edge.quantization.int4 import Int4FormatError, unpack_nibbles

# Groups a superblock takes at most (the largest divisor of a row's group count up to this).
SUPERBLOCK_MAX_GROUPS = 8
# Each superblock's factor is tried as its largest value over each of these.
FIT_DIVISORS = (63, 255)
UNSIGNED_TOP = 255
SIGNED_TOP = 127


def superblock_groups(groups: int) -> int:
    """Groups per superblock for a row of ``groups`` groups: its largest divisor up to 8."""
    if groups < 1:
        raise Int4FormatError(f"a row needs at least one group, got {groups}")
    return max(d for d in range(1, SUPERBLOCK_MAX_GROUPS + 1) if groups % d == 0)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest bf16 value (ties to even), as fp32."""
    return x.to(torch.bfloat16).float()


def _abs_error(values: torch.Tensor, codes: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Summed |code * factor - value| over a superblock, added in group order (as the C++ op adds)."""
    err = torch.zeros_like(values[..., 0])
    for i in range(values.shape[-1]):
        err = err + (codes[..., i] * factor[..., 0] - values[..., i]).abs()
    return err


def _fit_unsigned(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values >= 0 [..., sb] -> (codes 0..255 as float, factor [..., 1] > 0)."""
    top = values.amax(dim=-1, keepdim=True)
    best_codes = best_factor = best_err = None
    for divisor in FIT_DIVISORS:
        factor = _bf16(top / divisor)
        factor = torch.where(factor > 0, factor, torch.ones_like(factor))
        codes = torch.round(values / factor).clamp(0, UNSIGNED_TOP)
        err = _abs_error(values, codes, factor)
        if best_err is None:
            best_codes, best_factor, best_err = codes, factor, err
        else:
            better = (err < best_err).unsqueeze(-1)
            best_codes = torch.where(better, codes, best_codes)
            best_factor = torch.where(better, factor, best_factor)
            best_err = torch.minimum(err, best_err)
    return best_codes, best_factor


def encode(scales: torch.Tensor, offsets: torch.Tensor,
           qweight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 scales and offsets [N, G] -> (scale codes uint8 [N, G], offset codes uint8 [N, G],
    factors bf16 [N, G / sb, 2]: D then M per superblock).

    With the stored ``qweight``, a group whose 4-bit codes are all 0 (a constant group: its
    weights are its offset) takes scale 0, which it never reads, so the stored format's
    placeholder scale of 1 for such a group does not widen its superblock's factor.
    """
    if scales.shape != offsets.shape or scales.dim() != 2:
        raise Int4FormatError(f"scales {tuple(scales.shape)} and offsets {tuple(offsets.shape)} must be one [N, G]")
    n, groups = scales.shape
    sb = superblock_groups(groups)
    s = scales.to(torch.bfloat16).float()
    if qweight is not None:
        unused = (qweight.reshape(n, groups, -1) == 0).all(dim=-1)
        s = torch.where(unused, torch.zeros_like(s), s)
    s = s.reshape(n, groups // sb, sb)
    o = offsets.to(torch.bfloat16).float().reshape(n, groups // sb, sb)
    if not (torch.isfinite(s).all() and torch.isfinite(o).all()) or (s < 0).any():
        raise Int4FormatError("group codes need finite scales >= 0 and finite offsets")
    scale_codes, d = _fit_unsigned(s)
    # Offsets: a superblock with none above 0 keeps magnitudes (M < 0), any other int8 codes (M > 0).
    nonpositive = (o <= 0).all(dim=-1, keepdim=True)
    magnitude_codes, magnitude_factor = _fit_unsigned((-o).clamp(min=0))
    signed_factor = _bf16(o.abs().amax(dim=-1, keepdim=True) / SIGNED_TOP)
    signed_factor = torch.where(signed_factor > 0, signed_factor, torch.ones_like(signed_factor))
    signed_codes = torch.round(o / signed_factor).clamp(-SIGNED_TOP, SIGNED_TOP)
    offset_codes = torch.where(nonpositive, magnitude_codes, signed_codes)
    m = torch.where(nonpositive, -magnitude_factor, signed_factor)
    factors = torch.cat((d, m), dim=-1).to(torch.bfloat16)
    return (scale_codes.reshape(n, groups).to(torch.uint8),
            offset_codes.reshape(n, groups).to(torch.int8).view(torch.uint8),
            factors)


def decode(scale_codes: torch.Tensor, offset_codes: torch.Tensor,
           factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales and offsets [N, G] (fp32, exact) the codes stand for."""
    n, groups = scale_codes.shape
    sb = groups // factors.shape[1]
    f = factors.float()
    d, m = f[..., 0:1], f[..., 1:2]
    s = scale_codes.float().reshape(n, -1, sb) * d
    unsigned = offset_codes.float().reshape(n, -1, sb)
    signed = offset_codes.view(torch.int8).float().reshape(n, -1, sb)
    o = torch.where(m < 0, unsigned, signed) * m
    return s.reshape(n, groups), o.reshape(n, groups)


def dequantize(qweight: torch.Tensor, scale_codes: torch.Tensor, offset_codes: torch.Tensor,
               factors: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The weights a stored-layout qweight means under these codes, rounded once to ``dtype``."""
    s, o = decode(scale_codes, offset_codes, factors)
    n, groups = s.shape
    q = unpack_nibbles(qweight).float().reshape(n, groups, -1)
    return (q * s.unsqueeze(-1) + o.unsqueeze(-1)).reshape(n, -1).to(dtype)
