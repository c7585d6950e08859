"""W4A8 on AVX-512 VNNI: our C++ ops on a 16-row interleaved layout (``csrc/w4a8_avx512.cpp``).

``avx512_w4a8_rows16`` runs a linear (``edge_cpu_int4::w4a8_vnni_rows16_mm``): the same
integer math as ``avx2_w4a8`` (int8 activations per 32, unsigned 4-bit weights, exact float
offset term) with ``vpdpbusd``, on the stored triple rearranged once at load. The same op
prefills on a bf16 GEMM from that layout where the CPU has AMX (``VLLM_OMNI_EDGE_INT4_PREFILL``).
Each group's scale and offset are kept as one-byte codes under bf16 factors per superblock of
groups (``quantization/group_codes.py``; ``VLLM_OMNI_EDGE_INT4_GROUP_CODES=bf16`` keeps the
stored bf16 pair): fewer bytes read a token, the weights ``group_codes.dequantize`` gives.
A 6-bit layer (``int4.quantize_6bit``) keeps its top-bits plane beside the nibbles, in the same
tile order, and its stored bf16 pairs; the ops add the top bits to each code.
``silu_mlp`` runs a gated SiLU MLP whose two linears are on this kernel as one op
(``edge_cpu_int4::w4a8_vnni_rows16_silu_mlp``; ``patches/worker/fused_silu_mlp.py`` uses it).
"""

from __future__ import annotations

import torch

from vllm_omni_edge.cpu_features import CpuFeatures, cpu_flags
from vllm_omni_edge.levers import int4_group_codes, int4_prefill_gemm, int4_prefill_mode
from vllm_omni_edge.quantization.kernels.base import (
    as_2d,
    dense_prefill,
    high_bits,
    interleave_layer_inplace,
    interleaved_copy,
    keep_dense_copy_if_asked,
    set_weight,
)
from vllm_omni_edge.quantization.kernels.w4a8_avx2 import Avx2W4A8Kernel

# What the op's target attribute asks of the CPU (Linux /proc/cpuinfo names).
VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
# Weight rows per tile of the interleaved layout: one int32 lane of a 512-bit vpdpbusd each.
TILE_ROWS = 16


def interleave_rows16(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor):
    """The stored triple in ``w4a8_vnni_rows16_mm``'s layout, same shapes and bytes (new tensors).

    Per tile of 16 rows and block of 32 k: 4 chunks of 64 bytes; byte 4j + i of chunk c
    holds row j's k = 8c + i (low nibble) and k = 8c + 4 + i (high nibble) (the C++ op
    ``interleave_rows16_inplace``). Scales and offsets become [tile][group][16 rows].
    """
    return interleaved_copy(torch.ops.edge_cpu_int4.interleave_rows16_inplace, qweight, scales, offsets)


def rows16_group_codes(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor):
    """The stored triple in the 16-row layout with 8-bit group codes (new tensors): qweight as
    ``interleave_rows16``; scale codes and offset codes uint8 [N, G] ([tile][group][16 rows]) and
    bf16 factors [N, 2 * superblocks] ([tile][superblock][D, M][16 rows]), ``group_codes.encode``'s."""
    packed = qweight.clone(memory_format=torch.contiguous_format)
    codes = torch.ops.edge_cpu_int4.rows16_group_codes_inplace(packed, scales.to(torch.bfloat16),
                                                                 offsets.to(torch.bfloat16))
    return (packed, *codes)


# Prefill on the rows16 ops (csrc ``rows16_bf16_mm``): from a number of activation rows per
# call up, bf16 activations, the weights are dequantized a block of rows at a time into a
# per-thread bf16 scratch of at most PREFILL_BLOCK_BYTES (rounded up to 16 rows) and multiplied
# on one of two GEMMs (set_bf16_prefill's gemm):
# - GEMM_AMX: the op's own AMX tiles (tdpbf16ps), the block dequantized straight into the
#   tiles' k-pair layout; where AMX BF16 is usable (the lever's auto), below AMX_ONEDNN_FROM_ROWS
#   rows (from there on oneDNN: the tiles' order re-reads activations that outgrow the cache);
# - GEMM_ONEDNN: oneDNN's matmul primitive on the block dequantized into its own weight layout
#   (kernel library built with the oneDNN wheel, AVX512_BF16, whole 64-column blocks, from 1,024
#   input features), else at::mm on the block as [K, rows] (which repacks every block).
# Below the threshold, and for decode, the W4A8 tiles. Each GEMM's threshold is the smallest
# row count from which it beats the tiles on an AMX CPU (docs/edge/cpu-4bit.md;
# vllm_omni_edge_bench/harness/int4_prefill_bench.py sweeps both).
GEMM_ONEDNN, GEMM_AMX = 0, 1
GEMM_NAMES = {GEMM_ONEDNN: "onednn", GEMM_AMX: "amx_tiles"}
PREFILL_MIN_ROWS = {GEMM_ONEDNN: 96, GEMM_AMX: 32}
# With GEMM_AMX, the row count from which a call runs on oneDNN instead (end-to-end sweep on the
# AMX box, docs/edge/cpu-4bit.md).
AMX_ONEDNN_FROM_ROWS = 384
# One block's bf16 weights stay in a core's L2 while the GEMM reads them (block size swept by
# int4_prefill_bench).
PREFILL_BLOCK_BYTES = 2 << 20


def prefill_gemm() -> int:
    """The bf16 prefill path's GEMM in this process: the AMX tiles where usable (lever ``auto``)."""
    return GEMM_AMX if int4_prefill_gemm() == "auto" and amx_bf16_usable() else GEMM_ONEDNN


def prefill_min_rows(features: CpuFeatures, gemm: int | None = None) -> int:
    """Rows from which the rows16 ops take the bf16 path on this CPU; 0 = never.

    ``auto`` takes it only where the CPU has AMX: without AMX oneDNN's bf16 matmul
    (avx512_core_bf16 or below) is no faster than the W4A8 tiles, so they keep prefill.
    """
    # The measurement behind "no faster without AMX": docs/edge/cpu-4bit.md (bf16 prefill).
    mode = int4_prefill_mode()
    if mode == "w4a8" or (mode == "auto" and not features.amx):
        return 0
    return PREFILL_MIN_ROWS[prefill_gemm() if gemm is None else gemm]


# What configure_prefill last set in this process: (row count, GEMM); None: no rows16 layer loaded here.
_configured_prefill: tuple[int, int] | None = None


def amx_bf16_usable() -> bool:
    """AMX BF16 tiles usable by this process (the CPU has them, Linux granted the tile state)."""
    try:
        return bool(torch.ops.edge_cpu_int4.amx_bf16_usable())
    except (AttributeError, RuntimeError):  # the op library is not loaded (or predates the op)
        return False


def configure_prefill(features: CpuFeatures | None = None) -> int:
    """Tell the loaded op library from which row count to prefill on the bf16 path, and on which
    GEMM; that count."""
    global _configured_prefill
    gemm = prefill_gemm()
    rows = prefill_min_rows(features or CpuFeatures.detect(), gemm)
    torch.ops.edge_cpu_int4.set_bf16_prefill(rows, PREFILL_BLOCK_BYTES, gemm,
                                             AMX_ONEDNN_FROM_ROWS if gemm == GEMM_AMX else 0)
    _configured_prefill = (rows, gemm)
    return rows


def configured_prefill_rows() -> int | None:
    """From which row count this process's rows16 ops prefill on the bf16 path (0: never); None
    when no rows16 layer was loaded here."""
    return None if _configured_prefill is None else _configured_prefill[0]


def configured_prefill_gemm() -> str | None:
    """The GEMM of this process's rows16 bf16 prefill path (``amx_tiles`` or ``onednn``); None
    when no rows16 layer was loaded here or the path is off."""
    if _configured_prefill is None or not _configured_prefill[0]:
        return None
    return GEMM_NAMES[_configured_prefill[1]]


def onednn_weight_layout() -> str | None:
    """How oneDNN's calls in this process's bf16 path get their weight blocks: ``packed`` (dequantized
    into the primitive's own layout, where the shape allows) or ``plain`` (at::mm, repacked per call);
    None when no rows16 layer was loaded here or the path is off."""
    if configured_prefill_gemm() is None:
        return None
    from vllm_omni_edge.cpu_features import cpu_flags
    from vllm_omni_edge.quantization.kernels.native import onednn

    return "packed" if onednn() is not None and "avx512_bf16" in cpu_flags() else "plain"


def configured_onednn_from_rows() -> int | None:
    """With the AMX tiles, from which row count this process's bf16 path runs on oneDNN; None
    otherwise."""
    if configured_prefill_gemm() != GEMM_NAMES[GEMM_AMX]:
        return None
    return AMX_ONEDNN_FROM_ROWS


def prefill_path_summary(rows: int) -> str:
    if not rows:
        return "prefill on the same W4A8 tiles"
    on = (f"AMX tiles from blocks dequantized into their k-pair layout (oneDNN from {AMX_ONEDNN_FROM_ROWS} rows)"
          if prefill_gemm() == GEMM_AMX else "oneDNN bf16 GEMM from blocks dequantized per call")
    return f"prefill (>= {rows} rows, bf16) on {on} (scratch <= {PREFILL_BLOCK_BYTES >> 20} MiB per thread)"


class Avx512VnniRows16W4A8Kernel(Avx2W4A8Kernel):
    """W4A8 with ``vpdpbusd`` on a 16-row interleaved layout (``edge_cpu_int4::w4a8_vnni_rows16_mm``).

    The stored triple is rearranged once at load (same bytes, one layout) so that each int32
    lane of a 512-bit vector is one weight row: a tile of 16 rows finishes with no horizontal
    sum and no per-block lane shuffles. Same integer dot products as ``avx2_w4a8``.

    Prefill (``PREFILL_MIN_ROWS`` rows or more per call, where ``prefill_min_rows`` enables
    it) runs inside the same op on a bf16 GEMM from the same layout: the op branches on the
    row count, so a graph traced once keeps both paths."""

    name = "avx512_w4a8_rows16"
    six_bit = True

    @classmethod
    def can_implement(cls, features, group_size, K, N, act_dtype, *, float_zero=False):
        missing = [f for f in VNNI_FLAGS if f not in cpu_flags()]
        if missing:
            return False, f"needs AVX-512 VNNI (this CPU lacks {', '.join(missing)})"
        ok, why = super().can_implement(features, group_size, K, N, act_dtype, float_zero=float_zero)
        if not ok:
            return ok, why
        if N % TILE_ROWS:
            return False, f"the 16-row layout needs N a multiple of {TILE_ROWS}, got N={N}"
        rows = prefill_min_rows(features) if act_dtype == torch.bfloat16 else 0
        return True, ("W4A8 AVX-512 VNNI, 16 rows interleaved (int8 activations per 32, vpdpbusd); "
                      + prefill_path_summary(rows))

    def process_weights(self, layer):
        configure_prefill()
        keep_dense_copy_if_asked(layer)
        # In place: the stored-layout tensors are not read again (a tied embedding is pointed at
        # these bytes, embedding.share_with_embedding; the dense copy was made above).
        qweight = layer.qweight.data.contiguous()
        top = high_bits(layer)
        if top is not None:
            # 6-bit: the codes' top bits in tile order, and the stored pairs (the group codes' encoder
            # tells an unused group by its 4-bit codes).
            top = top.data.contiguous()
            torch.ops.edge_cpu_int4.interleave_rows16_high_bits_inplace(top)
            set_weight(layer, "qweight_high", top)
        if int4_group_codes() and top is None:
            scales, offsets, factors = torch.ops.edge_cpu_int4.rows16_group_codes_inplace(
                qweight, layer.scales.data.to(torch.bfloat16), layer.zeros.data.to(torch.bfloat16))
            set_weight(layer, "group_factors", factors)
            set_weight(layer, "qweight", qweight)
            set_weight(layer, "scales", scales)
            set_weight(layer, "zeros", offsets)
        else:
            interleave_layer_inplace(torch.ops.edge_cpu_int4.interleave_rows16_inplace, layer, qweight)

    @staticmethod
    def op():
        return torch.ops.edge_cpu_int4.w4a8_vnni_rows16_mm

    def apply(self, layer, x, bias):
        params = layer._parameters
        if x.dim() == 2 and "dense_weight" not in params and not torch.compiler.is_compiling():
            # The eager [tokens, K] call without a dense copy, parameters read from the module's dict
            # (as Avx2W4A8Kernel.apply: the decode step's head); a traced graph takes the path below.
            out = self.op()(x, params["qweight"], params["scales"], params["zeros"], layer.int4_group_size,
                            params.get("group_factors"), params.get("qweight_high"))
            return out if bias is None else out + bias
        x2 = as_2d(x, layer.int4_in_features)
        out = dense_prefill(layer, x2)
        if out is None:
            out = self.op()(x2, layer.qweight, layer.scales, layer.zeros, layer.int4_group_size,
                            group_factors(layer), high_bits(layer))
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def group_factors(layer: torch.nn.Module) -> torch.Tensor | None:
    """A rows16 layer's per-superblock factors when it keeps 8-bit group codes, else None."""
    return layer._parameters.get("group_factors")


def silu_mlp(gate_up: torch.nn.Module, down: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` in one op (``edge_cpu_int4::w4a8_vnni_rows16_silu_mlp``).

    ``gate_up`` is a merged [gate; up] linear and ``down`` the projection back, both on
    ``avx512_w4a8_rows16`` with no bias: the same products and roundings as their two calls
    and vLLM's SiluAndMul between them, in one dispatch.
    """
    x2 = as_2d(x, gate_up.int4_in_features)
    out = torch.ops.edge_cpu_int4.w4a8_vnni_rows16_silu_mlp(
        x2, gate_up.qweight, gate_up.scales, gate_up.zeros, gate_up.int4_group_size,
        down.qweight, down.scales, down.zeros, down.int4_group_size,
        group_factors(gate_up), group_factors(down), high_bits(gate_up), high_bits(down))
    return out.reshape(*x.shape[:-1], out.shape[-1])
