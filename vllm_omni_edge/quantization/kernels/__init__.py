"""The cpu_int4 kernels and the one place that picks between them.

Order of preference, when more than one can run a layer: the router's
(``vllm_omni_edge/routing``, which owns the CPU classes), i.e. the decode ranking measured for this CPU class
and shipped as a generated table; kernels the table does not rank follow in the
static order below, the last resort being the slowest:
1. ``amx_w4a8``: AMX Xeons, bf16 activations, integer zero points.
2. ``int4pack``: tinygemm W4A16, any x86 CPU PyTorch supports (AVX2 here).
3. ``avx2_w4a8``: our C++ op (int8 activations, float offsets), x86 with AVX2,
   once built on the machine; ranked only where a table measured it.
   ``avx2_w4a8_rows8``: the same on an 8-row interleaved layout (made at load, replacing
   the stored layout; N a multiple of 8).
   ``avx512_w4a8_rows16``: VNNI on a 16-row interleaved copy of the weights (made at load,
   replacing the stored layout); the router's first float-offset kernel on x86-amx. On AMX
   CPUs its calls of 96 rows or more (prefill) run a bf16 GEMM on blocks dequantized from
   that layout, inside the same op (``VLLM_OMNI_EDGE_INT4_PREFILL``).
4. ``dequant``: pure PyTorch, any shape, slow.

``VLLM_OMNI_EDGE_INT4_KERNEL=int4pack|amx_w4a8|avx2_w4a8|avx2_w4a8_rows8|avx512_w4a8_rows16|dequant`` forces one kernel; a
layer the forced kernel cannot run is an error, not a silent fallback.
"""

from __future__ import annotations

import torch

from vllm_omni_edge import envs
from vllm_omni_edge.quantization.kernels.w4a8_amx import AmxW4A8Kernel
from vllm_omni_edge.quantization.kernels.w4a8_avx2 import Avx2W4A8Kernel, Avx2W4A8Rows8Kernel
from vllm_omni_edge.quantization.kernels.w4a8_avx512 import Avx512VnniRows16W4A8Kernel
from vllm_omni_edge.quantization.kernels.base import CpuFeatures, Int4Kernel
from vllm_omni_edge.routing.weight_path import route_summary, routed_order
from vllm_omni_edge.quantization.kernels.dequant import DequantFallbackKernel
from vllm_omni_edge.quantization.kernels.int4pack import Int4PackCpuKernel

KERNEL_ENV = "VLLM_OMNI_EDGE_INT4_KERNEL"
PREFERENCE: tuple[type[Int4Kernel], ...] = (
    AmxW4A8Kernel, Int4PackCpuKernel, Avx2W4A8Kernel, Avx2W4A8Rows8Kernel, Avx512VnniRows16W4A8Kernel,
    DequantFallbackKernel,
)
KERNELS: dict[str, type[Int4Kernel]] = {k.name: k for k in PREFERENCE}

__all__ = [
    "AmxW4A8Kernel",
    "Avx2W4A8Kernel",
    "Avx2W4A8Rows8Kernel",
    "Avx512VnniRows16W4A8Kernel",
    "CpuFeatures",
    "DequantFallbackKernel",
    "Int4Kernel",
    "Int4PackCpuKernel",
    "KERNELS",
    "KERNEL_ENV",
    "KernelUnavailableError",
    "choose_kernel",
]


class KernelUnavailableError(RuntimeError):
    """The kernel forced by the environment cannot run this layer on this CPU."""


def choose_kernel(
    features: CpuFeatures,
    group_size: int,
    K: int,
    N: int,
    act_dtype: torch.dtype,
    what: str = "layer",
    *,
    float_zero: bool = False,
) -> tuple[type[Int4Kernel], str]:
    """The kernel for one layer and why it was chosen (including why others were not)."""
    forced = envs.get(KERNEL_ENV)
    if forced:
        ok, reason = KERNELS[forced].can_implement(features, group_size, K, N, act_dtype,
                                                   float_zero=float_zero)
        if not ok:
            raise KernelUnavailableError(f"{KERNEL_ENV}={forced} cannot run {what}: {reason}")
        return KERNELS[forced], f"forced by {KERNEL_ENV}"
    passed_over = []
    route = routed_order(features)
    for kernel in sorted(PREFERENCE, key=lambda k: route.index(k.name) if k.name in route else len(route)):
        ok, reason = kernel.can_implement(features, group_size, K, N, act_dtype, float_zero=float_zero)
        if ok:
            reason += f" [router: {route_summary(features)}]"
            if passed_over:
                reason += f" [not {'; '.join(passed_over)}]"
            return kernel, reason
        passed_over.append(f"{kernel.name}: {reason}")
    raise KernelUnavailableError(f"no cpu_int4 kernel can run {what}: {'; '.join(passed_over)}")

