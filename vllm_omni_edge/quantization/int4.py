"""The cpu_int4 number format, in one place: quantize, pack, unpack, dequantize.

Asymmetric per-group uint4, with one of two zero-point conventions:

- ``zero_point="float"`` (the default since format_version 2): a float offset,
  the group minimum, as llama.cpp's Q4_1 / Q4_K do::

      w[n, k] ~= q[n, k] * scale[n, k // g] + offset[n, k // g],   q in 0..15

  Each group's 16 levels span exactly [min, max]. A GGUF's Q4_0 / Q4_1 / Q4_K
  blocks of 32 are float-offset grids too, but not always min-max ones: the builder
  stores those weights on their own grid (``quantize_on_grid``), not re-fitted.
- ``zero_point="int"`` (format_version 1): an integer zero point, the AWQ/GPTQ
  convention that vLLM's W4A8 AMX kernel needs::

      w[n, k] ~= (q[n, k] - zero[n, k // g]) * scale[n, k // g],   q, zero in 0..15

  Every group's range is widened to include 0 (as GPTQ does), so the zero
  point lands in 0..15; a one-sided group wastes levels.

Either way the scale is rounded *up* to its storage dtype (bf16) before q is
computed, so the group's range fits in 15 steps and every weight is within half
a stored scale (plus, for float offsets, the offset's bf16 rounding) of its
dequantized value (the bounds the tests check).

Tensors (what the builder writes and the linear method loads):

- ``qweight`` uint8 [N, K/2]: two values per byte along K; the low nibble is the
  even k, the high nibble the odd k. The output dim is dim 0, so vLLM's merged
  QKV / gate_up loaders concatenate shards on dim 0 unchanged.
- ``scales`` bf16 [N, K/g].
- ``zeros`` [N, K/g]: bf16 offsets (``zero_point="float"``) or uint8 zero points
  0..15 (``"int"``). Its dtype says which; nothing else has to.

6-bit layers (``quantize_6bit``; the builder stores so the tensors a GGUF keeps at more bits
than its main type): float offsets, codes 0..63, ``w ~= q * scale + offset``; ``qweight``
holds each code's low four bits as above and ``qweight_high`` uint8 [N, K/4] its top two,
four per byte in k order (k % 4 at bits 2 * (k % 4)).
"""

from __future__ import annotations

import torch

# 1: integer zero points only; 2: float offsets, input embedding bf16; 3: the input
# embedding stored 4-bit too (``"embedding": "int4"``; a tied head reads the same bytes,
# see embedding.py).
FORMAT_VERSION = 3
READABLE_FORMAT_VERSIONS = (1, 2, 3)
# How the input embedding is kept: "int4" (this format's triple, rows dequantized on
# lookup), "int8" (int8 rows with one bf16 scale per row, ``quantize_rows_int8``; a tied
# head then keeps its own 4-bit copy) or "bf16" (as read, the only choice of versions 1-2).
EMBEDDING_FORMATS = ("int4", "int8", "bf16")
DEFAULT_EMBEDDING = "int4"
# A builder's default when the head is tied to the embedding: a 4-bit table would also be the
# head's, and read as the input embedding it costs measurable quality on the default model
# (docs/edge/cpu-4bit.md); int8 rows keep it, with the head its own 4-bit copy.
TIED_HEAD_EMBEDDING = "int8"
# Encoder-decoder models the builder takes; their tied vocabulary matrix stays one 4-bit copy
# (transcripts unchanged, docs/edge/speech.md).
ENCODER_DECODER_MODEL_TYPES = ("whisper",)
ZERO_POINT_MODES = ("float", "int")
DEFAULT_ZERO_POINT = "float"
# Group 32 with float offsets: KLD 0.065 vs 0.298 nats for group 128 on the default model
# (harness grid 2026-11-30-quality-default) and the block size of the GGUF files our models
# come from, for 0.75 bit per weight more (5.0 vs 4.25 bits). See docs/edge/cpu-4bit.md.
DEFAULT_GROUP_SIZE = 32
BITS = 4
SUPPORTED_GROUP_SIZES = (32, 64, 128, 256)
SCALE_DTYPE = torch.bfloat16
SUPPORTED_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_QMAX = (1 << BITS) - 1
HIGH_BITS = 6
_QMAX_HIGH = (1 << HIGH_BITS) - 1


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


def check_zero_point(zero_point: str) -> None:
    if zero_point not in ZERO_POINT_MODES:
        raise Int4FormatError(
            f"zero_point {zero_point!r} is not supported (supported: {', '.join(ZERO_POINT_MODES)})"
        )


def check_embedding_format(embedding: str) -> None:
    if embedding not in EMBEDDING_FORMATS:
        raise Int4FormatError(
            f"embedding {embedding!r} is not supported (supported: {', '.join(EMBEDDING_FORMATS)})"
        )


def format_version_for(embedding: str) -> int:
    """The checkpoint format a build with this embedding format writes (bf16 = the old format 2)."""
    check_embedding_format(embedding)
    return 2 if embedding == "bf16" else FORMAT_VERSION


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], bf16 scales [N, 1]): symmetric, absmax / 127 per row.

    The scale is rounded up to bf16 (as in ``quantize``), so every q fits in -127..127.
    """
    if weight.dim() != 2:
        raise Int4FormatError(f"expected a 2-D [N, K] weight, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    exact = w.abs().amax(dim=1, keepdim=True) / 127
    scales = exact.to(SCALE_DTYPE)
    scales = torch.where(scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, float("inf"))),
                         scales)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(w / scales.float()).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_rows_int8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scales.float()).to(dtype)


def has_float_zero(zeros: torch.Tensor) -> bool:
    return zeros.dtype != torch.uint8


def quantize(weight: torch.Tensor, group_size: int, what: str = "weight",
             zero_point: str = DEFAULT_ZERO_POINT):
    """[N, K] float weight -> (qweight uint8 [N, K/2], scales bf16 [N, G], zeros [N, G]).

    ``zeros`` is bf16 offsets for ``zero_point="float"``, uint8 zero points for "int".
    """
    check_zero_point(zero_point)
    w = _groups(weight, group_size, what)
    n, k = weight.shape
    wmin, wmax = w.amin(dim=-1), w.amax(dim=-1)
    if zero_point == "int":
        wmin, wmax = wmin.clamp(max=0), wmax.clamp(min=0)
    scales = _scales(wmin, wmax, _QMAX)
    s = scales.float()
    if zero_point == "float":
        offsets = wmin.to(SCALE_DTYPE)
        q = torch.round((w - offsets.float().unsqueeze(-1)) / s.unsqueeze(-1)).clamp(0, _QMAX)
        return pack_nibbles(q.reshape(n, k).to(torch.uint8)), scales, offsets
    zeros = torch.round(-wmin / s).clamp(0, _QMAX)
    q = (torch.round(w / s.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, _QMAX)
    qweight = pack_nibbles(q.reshape(n, k).to(torch.uint8))
    return qweight, scales, zeros.to(torch.uint8)


def _groups(weight: torch.Tensor, group_size: int, what: str) -> torch.Tensor:
    """A 2-D float weight as fp32 [N, G, group_size], its dtype, shape and values checked."""
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
    return w


def _scales(wmin: torch.Tensor, wmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """Each group's scale for ``qmax`` steps over [wmin, wmax], rounded up to bf16."""
    exact = (wmax - wmin) / qmax
    scales = exact.to(SCALE_DTYPE)
    scales = torch.where(
        scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales
    )
    # A constant group: any non-zero scale stores it exactly (q == zero, or q == 0).
    return torch.where(scales == 0, torch.ones_like(scales), scales)


def quantize_6bit(weight: torch.Tensor, group_size: int, what: str = "weight"):
    """[N, K] float weight -> (qweight uint8 [N, K/2], qweight_high uint8 [N, K/4], scales bf16 [N, G],
    offsets bf16 [N, G]): codes 0..63 over each group's min..max, float offsets (the module docstring)."""
    w = _groups(weight, group_size, what)
    n, k = weight.shape
    if k % 4:
        raise Int4FormatError(f"{what}: 6-bit codes need K a multiple of 4, got K={k}")
    wmin = w.amin(dim=-1)
    scales = _scales(wmin, w.amax(dim=-1), _QMAX_HIGH)
    offsets = wmin.to(SCALE_DTYPE)
    q = torch.round((w - offsets.float().unsqueeze(-1)) / scales.float().unsqueeze(-1)).clamp(0, _QMAX_HIGH)
    q = q.reshape(n, k).to(torch.uint8)
    return pack_nibbles(q & 0x0F), pack_high_bits(q >> 4), scales, offsets


def pack_high_bits(top: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..3 [N, K] -> uint8 [N, K/4], k % 4 at bits 2 * (k % 4)."""
    if top.shape[-1] % 4:
        raise Int4FormatError(f"cannot pack {top.shape[-1]} columns of top bits (a multiple of 4 is needed)")
    return top[..., 0::4] | (top[..., 1::4] << 2) | (top[..., 2::4] << 4) | (top[..., 3::4] << 6)


def unpack_high_bits(qweight_high: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/4] -> uint8 values 0..3 [N, K]."""
    n, quarter = qweight_high.shape
    return torch.stack([(qweight_high >> (2 * i)) & 3 for i in range(4)], dim=-1).reshape(n, quarter * 4)


def quantize_on_grid(weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, what: str = "weight"):
    """[N, K] weight onto a given float-offset grid -> the ``zero_point="float"`` triple.

    ``scale`` and ``offset`` [N, G] (float32, scales >= 0) are a grid the weights already lie on,
    such as a GGUF 4-bit tensor's own (``models.gguf_to_hf.grid_of``): each weight takes the
    nearest of its group's 16 points after scale and offset are rounded to bf16, so the codes
    are the file's and only that rounding changes the weights (a zero scale stores its group
    as the offset, as ``quantize`` stores a constant group).
    """
    if weight.dim() != 2:
        raise Int4FormatError(f"{what}: expected a 2-D [N, K] weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if scale.shape != offset.shape or scale.dim() != 2 or scale.shape[0] != n or not scale.shape[1] \
            or k % scale.shape[1]:
        raise Int4FormatError(f"{what}: grid {tuple(scale.shape)} / {tuple(offset.shape)} does not fit the "
                              f"weight {tuple(weight.shape)}")
    group_size = k // scale.shape[1]
    check_group_size(group_size)
    if not (torch.isfinite(scale).all() and torch.isfinite(offset).all()) or (scale < 0).any():
        raise Int4FormatError(f"{what}: the grid has negative, NaN or infinite scales or offsets")
    scales = scale.to(SCALE_DTYPE)
    offsets = offset.to(SCALE_DTYPE)
    s = scales.float().unsqueeze(-1)
    w = weight.detach().float().reshape(n, -1, group_size)
    q = torch.round((w - offsets.float().unsqueeze(-1)) / torch.where(s == 0, 1.0, s)).clamp(0, _QMAX)
    q = torch.where(s == 0, 0.0, q)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    return pack_nibbles(q.reshape(n, k).to(torch.uint8)), scales, offsets


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
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype=torch.float32,
    qweight_high: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: exactly the weights the stored triple means (with ``qweight_high``, a 6-bit
    layer's), rounded once to ``dtype``."""
    n, groups = scales.shape
    q = unpack_nibbles(qweight)
    if qweight_high is not None:
        if qweight_high.shape != (n, qweight.shape[1] // 2) or not has_float_zero(zeros):
            raise Int4FormatError(f"qweight_high {tuple(qweight_high.shape)} does not fit qweight "
                                  f"{tuple(qweight.shape)} with float offsets")
        q = q | (unpack_high_bits(qweight_high) << 4)
    q = q.float().reshape(n, groups, -1)
    s, z = scales.float().unsqueeze(-1), zeros.float().unsqueeze(-1)
    w = q * s + z if has_float_zero(zeros) else (q - z) * s
    return w.reshape(n, -1).to(dtype)


def check_triple(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, what: str) -> int:
    """Validate stored tensors against each other; return the group size."""
    if qweight.dtype != torch.uint8:
        raise Int4FormatError(f"{what}: qweight must be uint8")
    if zeros.dtype != torch.uint8 and zeros.dtype != scales.dtype:
        raise Int4FormatError(
            f"{what}: zeros must be uint8 zero points or offsets in the scales' dtype ({scales.dtype}), "
            f"got {zeros.dtype}"
        )
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
