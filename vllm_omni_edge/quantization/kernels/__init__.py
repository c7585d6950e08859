"""The cpu_int4 kernels and the one place that picks between them.

Preference, when more than one can run a layer:
1. ``amx_w4a8``: on AMX Xeons with bf16 activations. In the one-off kernel
   microbenchmark in the project's field notes (AMX Xeon, group 128; not a
   harness result) it beat tinygemm at decode shapes and stayed near bf16 at
   prefill shapes, where tinygemm was ~11x slower than bf16.
2. ``int4pack``: tinygemm W4A16, any x86 CPU PyTorch supports (AVX2 here).
3. ``dequant``: pure PyTorch, any shape, slow.

``VLLM_OMNI_EDGE_INT4_KERNEL=int4pack|amx_w4a8|dequant`` forces one kernel; a
layer the forced kernel cannot run is an error, not a silent fallback.
"""

from __future__ import annotations

import os

import torch

from vllm_omni_edge.quantization.kernels.amx_w4a8 import AmxW4A8Kernel
from vllm_omni_edge.quantization.kernels.base import CpuFeatures, Int4Kernel
from vllm_omni_edge.quantization.kernels.dequant import DequantFallbackKernel
from vllm_omni_edge.quantization.kernels.int4pack import Int4PackCpuKernel

KERNEL_ENV = "VLLM_OMNI_EDGE_INT4_KERNEL"
PREFERENCE: tuple[type[Int4Kernel], ...] = (AmxW4A8Kernel, Int4PackCpuKernel, DequantFallbackKernel)
KERNELS: dict[str, type[Int4Kernel]] = {k.name: k for k in PREFERENCE}

__all__ = [
    "AmxW4A8Kernel",
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
) -> tuple[type[Int4Kernel], str]:
    """The kernel for one layer and why it was chosen (including why others were not)."""
    forced = os.environ.get(KERNEL_ENV, "").strip()
    if forced:
        if forced not in KERNELS:
            raise KernelUnavailableError(
                f"{KERNEL_ENV}={forced!r} is not a kernel (choose from {', '.join(KERNELS)})"
            )
        ok, reason = KERNELS[forced].can_implement(features, group_size, K, N, act_dtype)
        if not ok:
            raise KernelUnavailableError(f"{KERNEL_ENV}={forced} cannot run {what}: {reason}")
        return KERNELS[forced], f"forced by {KERNEL_ENV}"
    passed_over = []
    for kernel in PREFERENCE:
        ok, reason = kernel.can_implement(features, group_size, K, N, act_dtype)
        if ok:
            if passed_over:
                reason += f" [not {'; '.join(passed_over)}]"
            return kernel, reason
        passed_over.append(f"{kernel.name}: {reason}")
    raise KernelUnavailableError(f"no cpu_int4 kernel can run {what}: {'; '.join(passed_over)}")
