"""How a cpu_int4 layer is built, loaded and run inside vLLM.

Two ways in, one resident result:

- pre-quantized checkpoint (``quantization_config.quant_method == "cpu_int4"``):
  ``qweight`` / ``scales`` / ``zeros`` are created in the stored format
  (``int4.py``) with the output dim as dim 0, so vLLM's v2 loaders place
  q/k/v and gate/up shards by output offset exactly as for a bf16 weight;
- a bf16/fp16/fp32 checkpoint with ``quantization="cpu_int4"``: a plain
  ``weight`` is loaded and quantized. By default it is created on the meta
  device and each layer is materialized, loaded and quantized as soon as its
  last shard arrives (vLLM's layer-wise online processing, the mechanism its
  online FP8 uses), so only one layer is ever held in bf16 and the load-time
  peak stays near the int4 steady state. ``VLLM_OMNI_EDGE_INT4_LOAD=whole``
  loads the whole bf16 model first (the A/B arm; peak bf16 + int4).

Either way the chosen kernel then repacks the triple once into its own layout.

The LM head (``ParallelLMHead``) is built by the same method. With tied word
embeddings and a cpu_int4 input embedding (format 3, or online), the head shares
the embedding's matrix: the stored triple (pre-quantized) or the bf16 weight
(online, quantized once here); after its kernel repacks it, the embedding is
pointed at the repacked bytes (``embedding.py``), so one copy is resident.
With a bf16 embedding (formats 1-2), the head keeps its own 4-bit ``lm_head.*``
(pre-quantized) or quantizes from the shared bf16 weight and drops its reference.

A layer the checkpoint stores 6-bit (``quantization_config["six_bit"]``) also loads
``qweight_high``; a kernel that runs only 4-bit codes gets it re-quantized to 4 bits at load.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, LinearMethodBase
from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
from vllm.model_executor.parameter import (
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
)
from vllm.model_executor.utils import set_weight_attrs

from vllm_omni_edge.levers import int4_layerwise_load
from vllm_omni_edge.log import get_logger
from vllm_omni_edge.quantization import evidence
from vllm_omni_edge.quantization.embedding import (
    is_int4_embedding,
    share_with_embedding,
    tie_head_to_embedding,
)
from vllm_omni_edge.quantization.int4 import (
    DEFAULT_ZERO_POINT,
    SCALE_DTYPE,
    Int4FormatError,
    dequantize,
    group_size_for,
    has_float_zero,
    quantize,
)
from vllm_omni_edge.quantization.kernels import CpuFeatures, choose_kernel, native
from vllm_omni_edge.quantization.kernels.base import set_weight

logger = get_logger("cpu_int4")


class CpuInt4LinearMethod(LinearMethodBase):
    def __init__(self, group_size: int, prequantized: bool, kind: str, prefix: str,
                 zero_point: str = DEFAULT_ZERO_POINT, six_bit: bool = False):
        if six_bit and (not prequantized or zero_point != "float"):
            raise Int4FormatError(f"{prefix}: 6-bit layers are stored pre-quantized with float offsets")
        self.requested_group_size = group_size
        self.six_bit = six_bit  # the checkpoint stores a top-bits plane (qweight_high)
        self.zero_point = zero_point
        self.prequantized = prequantized
        self.kind = kind  # "linear" | "lm_head"
        self.prefix = prefix
        self.tied_embedding: torch.nn.Module | None = None  # set by tie_weights (int4 embedding)
        # vLLM's loader reads this to run layer-wise online processing.
        self.uses_meta_device = not prequantized and int4_layerwise_load()

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        weight_loader = extra_weight_attrs.pop("weight_loader")
        K, N = input_size_per_partition, sum(output_partition_sizes)
        g = group_size_for(K, self.requested_group_size, what=self.prefix or "layer")
        layer.int4_in_features = K
        layer.int4_group_size = g
        layer.int4_act_dtype = params_dtype
        if self.prequantized:
            def packed(per_byte: int) -> PackedvLLMParameter:  # uint8 [N, K / per_byte], along K
                return PackedvLLMParameter(data=torch.empty(N, K // per_byte, dtype=torch.uint8), input_dim=1,
                                           output_dim=0, packed_dim=1, packed_factor=per_byte,
                                           weight_loader=weight_loader)

            params = {
                "qweight": packed(2),
                "scales": GroupQuantScaleParameter(
                    data=torch.empty(N, K // g, dtype=SCALE_DTYPE),
                    input_dim=1,
                    output_dim=0,
                    weight_loader=weight_loader,
                ),
                "zeros": GroupQuantScaleParameter(
                    data=torch.empty(N, K // g,
                                     dtype=torch.uint8 if self.zero_point == "int" else SCALE_DTYPE),
                    input_dim=1,
                    output_dim=0,
                    weight_loader=weight_loader,
                ),
            }
            if self.six_bit:
                params["qweight_high"] = packed(4)
        else:
            params = {
                "weight": ModelWeightParameter(
                    data=torch.empty(N, K, dtype=params_dtype,
                                     device="meta" if self.uses_meta_device else None),
                    input_dim=1,
                    output_dim=0,
                    weight_loader=weight_loader,
                )
            }
        for name, param in params.items():
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)
        if self.uses_meta_device:
            initialize_online_processing(layer)

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module):
        if self.six_bit:
            raise Int4FormatError(f"{self.prefix}: a 6-bit head cannot be tied to the input embedding")
        if is_int4_embedding(embed_tokens):
            # One matrix for both: loaded once, as the embedding; repacked here, handed back.
            tie_head_to_embedding(layer, embed_tokens, self.prequantized)
            self.tied_embedding = embed_tokens
        elif not self.prequantized:
            # Share the bf16 weight so it is loaded once; quantized from it later.
            layer.weight = embed_tokens.weight
        # Pre-quantized with a bf16 embedding: the head keeps its own lm_head.* 4-bit tensors.
        return layer

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Layer-wise loading already processed this layer; vLLM calls again at the end.
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        g = layer.int4_group_size
        if not self.prequantized:
            qweight, scales, zeros = quantize(layer.weight.data, g, what=self.prefix,
                                              zero_point=self.zero_point)
            set_weight(layer, "weight", None)  # a tied embedding keeps its own reference
            set_weight(layer, "qweight", qweight)
            set_weight(layer, "scales", scales)
            set_weight(layer, "zeros", zeros)
        K, N = layer.int4_in_features, layer.qweight.shape[0]
        kernel_cls, reason = choose_kernel(
            CpuFeatures.detect(), g, K, N, layer.int4_act_dtype, what=self.prefix,
            float_zero=has_float_zero(layer.zeros.data),
        )
        logger.debug("cpu_int4: %s (K=%d N=%d g=%d) -> %s: %s",
                     self.prefix, K, N, g, kernel_cls.name, reason)
        if self.six_bit and not kernel_cls.six_bit:
            fold_to_4bit(layer, self.prefix, kernel_cls.name)
        kernel = kernel_cls()
        stored = (layer.qweight.data, layer.scales.data, layer.zeros.data)
        kernel.process_weights(layer)
        layer.int4_kernel = kernel
        if self.tied_embedding is not None:
            share_with_embedding(layer, self.tied_embedding, kernel.name, stored)
        del stored
        evidence.record(
            evidence.LayerChoice(self.prefix, self.kind, kernel.name, reason, K, N, g,
                                 dense_prefill_copy=hasattr(layer, "dense_weight"),
                                 group_codes="group_factors" in layer._parameters,
                                 six_bit="qweight_high" in layer._parameters)
        )
        layer._already_called_process_weights_after_loading = True

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return layer.int4_kernel.apply(layer, x, bias)


# Rows re-quantized at a time when a 6-bit layer is folded to 4 bits: its fp32 weights are made a
# block at a time, so a large head does not hold a float copy of itself at load.
FOLD_ROWS = 4096
# Kernels this process has folded 6-bit layers for (announced once each).
_FOLDED_FOR: set[str] = set()


def fold_6bit_reference(qweight: torch.Tensor, high: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                        group_size: int, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-bit triple of a 6-bit layer: its weights dequantized and quantized again (float offsets)."""
    parts = [quantize(dequantize(qweight[r:r + FOLD_ROWS], scales[r:r + FOLD_ROWS], offsets[r:r + FOLD_ROWS],
                                 qweight_high=high[r:r + FOLD_ROWS]), group_size, what=what)
             for r in range(0, qweight.shape[0], FOLD_ROWS)]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


def fold_6bit(qweight: torch.Tensor, high: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
              group_size: int, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fold_6bit_reference``'s values; by the library's op (one pass, each group in registers) when
    it is built, as the reference's float copies of a large layer cost seconds at every load."""
    op = native.edge_cpu_op("fold_6bit_to_4bit")
    if op is None or scales.dtype != SCALE_DTYPE or offsets.dtype != SCALE_DTYPE:
        return fold_6bit_reference(qweight, high, scales, offsets, group_size, what)
    packed, scales4, offsets4, finite = op(qweight, high, scales, offsets)
    if not finite:
        raise Int4FormatError(f"{what}: contains NaN or infinite values")
    return packed, scales4, offsets4


def fold_to_4bit(layer: torch.nn.Module, prefix: str, kernel: str) -> None:
    """A 6-bit layer's weights re-quantized to the 4-bit triple, for a kernel without 6-bit codes."""
    folded = fold_6bit(layer.qweight.data, layer.qweight_high.data, layer.scales.data, layer.zeros.data,
                       layer.int4_group_size, prefix)
    for name, tensor in zip(("qweight_high", "qweight", "scales", "zeros"), (None, *folded)):
        set_weight(layer, name, tensor)
    if kernel not in _FOLDED_FOR:  # once per kernel and process; each layer at debug level
        _FOLDED_FOR.add(kernel)
        logger.info("cpu_int4: %s runs 4-bit codes: the layers the checkpoint stores 6-bit are re-quantized "
                    "to 4 bits at load", kernel)
    logger.debug("cpu_int4: %s is stored 6-bit; re-quantized to 4 bits for %s", prefix, kernel)


# Linear layers hand v2-parameter methods to weight_loader_v2 only when listed here.
if CpuInt4LinearMethod.__name__ not in WEIGHT_LOADER_V2_SUPPORTED:
    WEIGHT_LOADER_V2_SUPPORTED.append(CpuInt4LinearMethod.__name__)
