"""What every cpu_int4 kernel provides, and the CPU facts they choose by.

A kernel takes a layer holding the stored triple (``qweight`` uint8 [N, K/2],
``scales`` [N, G], ``zeros`` [N, G]: bf16 offsets or uint8 zero points; see
``int4.py``), repacks it once
into the one layout it runs on (``process_weights``; it may do so in the stored
tensors' own memory, so nothing may read them in the stored layout afterwards),
then multiplies activations by it (``apply``). The repacked tensors stay registered on the layer
as parameters, so memory accounting sees them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vllm_omni_edge.cpu_features import CpuFeatures  # noqa: F401  (the kernels choose by it)
from vllm_omni_edge.levers import int4_dense_prefill_copy
from vllm_omni_edge.quantization.int4 import dequantize

# Rows per call from which the dense copy (if kept) is used: prefill, not decode.
DENSE_MIN_ROWS = 16


class Int4Kernel:
    name: ClassVar[str]
    # Runs a 6-bit layer's codes (its ``qweight_high`` plane); other kernels get such a layer
    # re-quantized to 4 bits at load (linear.py).
    six_bit: ClassVar[bool] = False

    @classmethod
    def can_implement(
        cls, features: CpuFeatures, group_size: int, K: int, N: int, act_dtype: torch.dtype,
        *, float_zero: bool = False,
    ) -> tuple[bool, str]:
        raise NotImplementedError

    def process_weights(self, layer: torch.nn.Module) -> None:
        raise NotImplementedError

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError


def set_weight(layer: torch.nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Replace (or, with None, remove) one of the layer's parameters."""
    if name in layer._parameters:
        del layer._parameters[name]
    if tensor is not None:
        layer.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))


def high_bits(layer: torch.nn.Module) -> torch.Tensor | None:
    """A 6-bit layer's top-bits plane (``qweight_high``), or None for a 4-bit layer."""
    return layer._parameters.get("qweight_high")


def as_2d(x: torch.Tensor, K: int) -> torch.Tensor:
    return x.reshape(-1, K).contiguous()


def keep_dense_copy_if_asked(layer: torch.nn.Module) -> None:
    """The second layout (``VLLM_OMNI_EDGE_INT4_LAYOUTS=two``): a dense copy for prefill.

    Made from the stored triple before the kernel repacks it; any kernel may keep it.
    """
    if int4_dense_prefill_copy():
        set_weight(layer, "dense_weight", dequantize(
            layer.qweight.data, layer.scales.data, layer.zeros.data, dtype=layer.int4_act_dtype,
            qweight_high=high_bits(layer)))


def dense_prefill(layer: torch.nn.Module, x2: torch.Tensor) -> torch.Tensor | None:
    """``F.linear`` on the dense copy for calls of ``DENSE_MIN_ROWS`` rows or more, if kept."""
    dense = getattr(layer, "dense_weight", None)
    if dense is None or x2.shape[0] < DENSE_MIN_ROWS:
        return None
    return F.linear(x2, dense)


def interleaved_copy(interleave_inplace, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor):
    """New contiguous copies of the stored triple (bf16 scales and offsets), rearranged by
    ``interleave_inplace`` (one of the C++ ``interleave_rows*_inplace`` ops); the inputs are left as
    they were."""
    packed = qweight.clone(memory_format=torch.contiguous_format)
    scales = scales.to(torch.bfloat16, copy=True, memory_format=torch.contiguous_format)
    offsets = offsets.to(torch.bfloat16, copy=True, memory_format=torch.contiguous_format)
    interleave_inplace(packed, scales, offsets)
    return packed, scales, offsets


def interleave_layer_inplace(interleave_inplace, layer: torch.nn.Module, qweight: torch.Tensor) -> None:
    """The layer's triple rearranged by ``interleave_inplace`` in its own memory (``qweight``: the
    layer's contiguous codes; scales and offsets made contiguous bf16), then set as its weights.
    Nothing may read the stored layout afterwards."""
    scales = layer.scales.data.to(torch.bfloat16).contiguous()
    offsets = layer.zeros.data.to(torch.bfloat16).contiguous()
    interleave_inplace(qweight, scales, offsets)
    set_weight(layer, "qweight", qweight)
    set_weight(layer, "scales", scales)
    set_weight(layer, "zeros", offsets)
