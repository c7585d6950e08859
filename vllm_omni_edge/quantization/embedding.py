"""The input embedding in cpu_int4: rows stored 4-bit, dequantized on lookup.

Format 3 checkpoints (and online quantization) keep ``embed_tokens`` as the same
triple as a linear layer (``int4.py``: ``qweight`` uint8 [V, H/2], ``scales`` and
``zeros`` [V, H/g]); a lookup gathers the rows of the token ids and dequantizes
them to the activation dtype, exactly ``int4.dequantize(triple)[ids]``.

- **Tied** word embeddings (one matrix for the input embedding and the output
  head): the checkpoint holds the matrix once (``model.embed_tokens.*``). The head
  shares the embedding's parameters while loading; its kernel then repacks them
  once, and the embedding is pointed at the head's repacked tensors, so one copy is
  resident. The lookup therefore reads the head kernel's layout: the stored one
  (``avx2_w4a8``), ``avx2_w4a8_rows8``'s 8-row or ``avx512_w4a8_rows16``'s 16-row interleave.
  A head kernel whose layout the lookup cannot read (tinygemm's, AMX's) leaves the
  embedding its own copy of the stored triple: two 4-bit copies, still a quarter
  of one bf16 matrix.
- **Untied**: the embedding has its own tensors, kept in the stored layout.
- **int8** (``"embedding": "int8"``): ``qweight`` int8 [V, H] and one bf16 scale per
  row (``int4.quantize_rows_int8``); never shared, a tied head keeps its own 4-bit copy.

The lookup is plain torch ops (index + nibble unpack + scale/offset), which vLLM's
compiled graph fuses; no custom op is needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter
from vllm.model_executor.utils import set_weight_attrs

from vllm_omni_edge.log import get_logger
from vllm_omni_edge.quantization import evidence, group_codes
from vllm_omni_edge.quantization.int4 import (
    DEFAULT_ZERO_POINT,
    SCALE_DTYPE,
    group_size_for,
    has_float_zero,
    quantize,
    quantize_rows_int8,
)
from vllm_omni_edge.quantization.kernels.base import set_weight

logger = get_logger("cpu_int4")

LAYOUT_STORED = "stored"
LAYOUT_ROWS8 = "rows8"
LAYOUT_ROWS16 = "rows16"
# Head kernels whose weight layout the lookup reads, and which layout that is.
KERNEL_LAYOUTS = {
    "avx2_w4a8": LAYOUT_STORED,
    "avx2_w4a8_rows8": LAYOUT_ROWS8,
    "avx512_w4a8_rows16": LAYOUT_ROWS16,
}
# Rows per tile of the interleaved layouts (kernels/w4a8_avx2.py, kernels/w4a8_avx512.py).
TILE_ROWS = {LAYOUT_ROWS8: 8, LAYOUT_ROWS16: 16}
TRIPLE = ("qweight", "scales", "zeros")


def _gather_stored(ids, qweight, scales, zeros):
    """Rows ``ids`` of the stored triple -> (values uint8 [T, K], scales [T, G], zeros [T, G])."""
    q = qweight.index_select(0, ids)  # [T, K/2]: k = 2i low nibble, 2i + 1 high
    values = torch.stack((q & 0x0F, q >> 4), dim=-1)
    return values.reshape(ids.shape[0], -1), scales.index_select(0, ids), zeros.index_select(0, ids)


def _gather_tiles(ids, qweight, scales, zeros, rows, factors=None):
    """The same from an interleaved layout of tiles of ``rows`` rows (``interleave_rows8``,
    ``interleave_rows16``).

    A tile is rows * K/2 contiguous bytes: K/8 chunks of rows x 4 bytes, byte i of row j
    in chunk m holding k = 8m + i (low nibble) and 8m + 4 + i (high). Scales and offsets
    are [tile][group][rows]: bf16 values, or (rows16 with ``factors``,
    [tile][superblock][D, M][16 rows]) 8-bit group codes, decoded here to fp32
    (``group_codes.decode``).
    """
    n, half = qweight.shape
    groups = scales.shape[1]
    tile, row = ids // rows, ids % rows
    q = qweight.view(n // rows, half // 4, rows, 4)[tile, :, row]  # [T, K/8, 4]
    values = torch.stack((q & 0x0F, q >> 4), dim=-2)  # [T, K/8, 2, 4]: k = 8m + 4 * nibble + i
    s = scales.view(n // rows, groups, rows)[tile, :, row]
    z = zeros.view(n // rows, groups, rows)[tile, :, row]
    if factors is not None:
        supers = factors.shape[1] // 2
        f = factors.view(n // rows, supers, 2, rows)[tile, :, :, row]  # [T, S, 2]
        s, z = group_codes.decode(s, z, f)
    return values.reshape(ids.shape[0], -1), s, z


def lookup(ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           layout: str = LAYOUT_STORED, dtype: torch.dtype = torch.bfloat16,
           factors: torch.Tensor | None = None) -> torch.Tensor:
    """Embedding rows for token ``ids`` (any shape) -> [*ids.shape, K] in ``dtype``.

    Computed as ``int4.dequantize`` does (fp32, one rounding to ``dtype``), so the
    result equals ``dequantize(stored)[ids]`` bit for bit (with 8-bit group codes, the
    rows16 layout's ``factors``: ``group_codes.dequantize``'s rows).
    """
    flat = ids.reshape(-1)
    if layout in TILE_ROWS:
        values, s, z = _gather_tiles(flat, qweight, scales, zeros, TILE_ROWS[layout], factors)
    else:
        values, s, z = _gather_stored(flat, qweight, scales, zeros)
    float_zero = factors is not None or has_float_zero(z)
    t, k = values.shape
    groups = s.shape[1]
    q = values.reshape(t, groups, k // groups).float()
    s, zf = s.float().unsqueeze(-1), z.float().unsqueeze(-1)
    w = q * s + zf if float_zero else (q - zf) * s
    return w.reshape(*ids.shape, k).to(dtype)


def lookup_int8(ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """int8 rows: exactly ``int4.dequantize_rows_int8(q, s)[ids]``."""
    flat = ids.reshape(-1)
    w = qweight.index_select(0, flat).float() * scales.index_select(0, flat).float()
    return w.reshape(*ids.shape, qweight.shape[1]).to(dtype)


class CpuInt4EmbeddingMethod(QuantizeMethodBase):
    """``VocabParallelEmbedding`` (the input embedding, not a head) in cpu_int4."""

    def __init__(self, group_size: int, prequantized: bool, prefix: str,
                 zero_point: str = DEFAULT_ZERO_POINT, fmt: str = "int4"):
        self.requested_group_size = group_size
        self.prequantized = prequantized
        self.prefix = prefix
        self.zero_point = zero_point
        self.fmt = fmt  # "int4" | "int8"
        # Online: the bf16 table is loaded whole (not on the meta device) and quantized at
        # the end; a tied head quantizes it from the same tensor, once.
        self.uses_meta_device = False

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        weight_loader = extra_weight_attrs.pop("weight_loader")
        K, N = input_size_per_partition, sum(output_partition_sizes)
        g = group_size_for(K, self.requested_group_size, what=self.prefix) if self.fmt == "int4" else K
        layer.int4_in_features = K
        layer.int4_group_size = g
        layer.int4_act_dtype = params_dtype
        layer.int4_embed_layout = LAYOUT_STORED if self.fmt == "int4" else "int8"
        if self.prequantized and self.fmt == "int8":
            params = {
                "qweight": GroupQuantScaleParameter(data=torch.empty(N, K, dtype=torch.int8), input_dim=1,
                                                    output_dim=0, weight_loader=weight_loader),
                "scales": GroupQuantScaleParameter(data=torch.empty(N, 1, dtype=SCALE_DTYPE), input_dim=1,
                                                   output_dim=0, weight_loader=weight_loader),
            }
            for name, param in params.items():
                layer.register_parameter(name, param)
                set_weight_attrs(param, extra_weight_attrs)
        elif self.prequantized:
            zeros_dtype = torch.uint8 if self.zero_point == "int" else SCALE_DTYPE
            params = {
                "qweight": PackedvLLMParameter(data=torch.empty(N, K // 2, dtype=torch.uint8), input_dim=1,
                                               output_dim=0, packed_dim=1, packed_factor=2,
                                               weight_loader=weight_loader),
                "scales": GroupQuantScaleParameter(data=torch.empty(N, K // g, dtype=SCALE_DTYPE), input_dim=1,
                                                   output_dim=0, weight_loader=weight_loader),
                "zeros": GroupQuantScaleParameter(data=torch.empty(N, K // g, dtype=zeros_dtype), input_dim=1,
                                                  output_dim=0, weight_loader=weight_loader),
            }
            for name, param in params.items():
                layer.register_parameter(name, param)
                set_weight_attrs(param, extra_weight_attrs)
        else:
            weight = Parameter(torch.empty(N, K, dtype=params_dtype), requires_grad=False)
            set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": weight_loader})
            set_weight_attrs(weight, extra_weight_attrs)
            layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        if getattr(layer, "int4_tied_head", False):
            return  # the head quantizes / repacks the shared matrix and hands it back (share_with_embedding)
        if self.fmt == "int8":
            if not self.prequantized:
                q, scales = quantize_rows_int8(layer.weight.data)
                set_weight(layer, "weight", None)  # a tied head keeps its own reference until it quantizes
                set_weight(layer, "qweight", q)
                set_weight(layer, "scales", scales)
            layer.int4_embed_layout = "int8"
            _record(self.prefix, layer, "int8 rows, one scale per row (its own copy)")
            layer._already_called_process_weights_after_loading = True
            return
        if not self.prequantized:
            triple = quantize(layer.weight.data, layer.int4_group_size, what=self.prefix,
                              zero_point=self.zero_point)
            set_weight(layer, "weight", None)
            for name, t in zip(TRIPLE, triple):
                set_weight(layer, name, t)
        layer.int4_embed_layout = LAYOUT_STORED
        _record(self.prefix, layer, "untied: its own 4-bit rows, stored layout")
        layer._already_called_process_weights_after_loading = True

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        if "weight" in layer._parameters:
            # Online, before processing: a model that embeds special tokens while loading
            # (vLLM-Omni's Qwen2.5-Omni talker) reads the bf16 table it has at that point.
            return F.embedding(input_, layer.weight)
        if self.fmt == "int8":
            return lookup_int8(input_, layer.qweight, layer.scales, layer.int4_act_dtype)
        return lookup(input_, layer.qweight, layer.scales, layer.zeros, layer.int4_embed_layout,
                      layer.int4_act_dtype, layer._parameters.get("group_factors"))

    def apply(self, layer, x, bias=None):
        raise RuntimeError("a cpu_int4 input embedding only does lookups")


def is_int4_embedding(module: torch.nn.Module) -> bool:
    """An input embedding in cpu_int4's 4-bit triple, which a tied head can share."""
    method = getattr(module, "quant_method", None)
    return isinstance(method, CpuInt4EmbeddingMethod) and method.fmt == "int4"


def tie_head_to_embedding(head: torch.nn.Module, embed: torch.nn.Module, prequantized: bool) -> None:
    """At model construction: the head will read the embedding's matrix (loaded once, as ``embed_tokens``)."""
    embed.int4_tied_head = True
    if prequantized:
        for name in TRIPLE:  # the same Parameter objects: vLLM loads them once, by the embedding's name
            del head._parameters[name]
            head.register_parameter(name, getattr(embed, name))
    else:
        head.weight = embed.weight


def share_with_embedding(head: torch.nn.Module, embed: torch.nn.Module, kernel_name: str,
                         stored: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """After the head's kernel repacked the shared matrix: point the embedding at the same bytes.

    ``stored`` is the triple before the repack, kept by the embedding only when the
    lookup cannot read the kernel's layout.
    """
    if "weight" in embed._parameters:
        set_weight(embed, "weight", None)  # online: the bf16 table the head was quantized from
    layout = KERNEL_LAYOUTS.get(kernel_name)
    if layout is not None:
        for name in TRIPLE + ("group_factors",):
            embed._parameters.pop(name, None)
            if name in head._parameters:
                embed.register_parameter(name, head._parameters[name])
        reason = f"tied: reads lm_head's {kernel_name} bytes ({layout} layout), one copy"
    else:
        for name, t in zip(TRIPLE, stored):
            set_weight(embed, name, t)
        layout = LAYOUT_STORED
        reason = f"tied: own stored copy (the lookup cannot read {kernel_name}'s layout)"
        logger.info("cpu_int4: the input embedding keeps its own 4-bit copy: %s", reason)
    embed.int4_embed_layout = layout
    embed.int4_group_size = head.int4_group_size
    embed._already_called_process_weights_after_loading = True
    method = embed.quant_method
    _record(method.prefix, embed, reason)


def _record(prefix: str, layer: torch.nn.Module, reason: str) -> None:
    evidence.record(evidence.LayerChoice(
        prefix, "embedding", f"gather_{layer.int4_embed_layout}", reason, layer.int4_in_features,
        int(layer.qweight.shape[0]), layer.int4_group_size))
