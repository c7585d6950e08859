"""Run RMSNorm on CPU through vLLM's own fused C++ kernels instead of the torch-op chain.

What: registers a vLLM IR implementation ``edge_cpu_c`` of ``rms_norm`` and
``fused_add_rms_norm`` that calls ``torch.ops._C.rms_norm`` /
``torch.ops._C.fused_add_rms_norm`` (both present in the CPU build of ``_C``), and
wraps ``CpuPlatform.get_default_ir_op_priority`` so that, when the model runs eagerly
(compilation mode NONE, e.g. ``enforce_eager``), both ops prefer ``edge_cpu_c`` and
fall back to ``native``. Under torch.compile the priority stays ``["native"]``: the IR
lowering pass then inlines the native impl and inductor fuses it (the same choice
vLLM's CUDA platform makes).
Why: vLLM 0.30 registers its ``vllm_c`` impls with ``supported=GPGPU_DEVICE`` only, so
the CPU platform runs the "native" impl: several torch ops and dtype copies per norm,
61 norms per SmolLM2 token, mostly Python dispatch in decode.
The CPU kernel reads its input as dense rows: a strided input gives wrong numbers
(not an error), so ``supports_args`` sends non-contiguous inputs to ``native``.
Flag: ``VLLM_OMNI_EDGE_FUSED_RMS_NORM=1`` turns it on; default ``0`` = vLLM's stock
selection. Off by default because the CPU ``fused_add_rms_norm`` kernel rounds the bf16
residual sum toward zero (measured: |kernel| <= |exact| for every element, mean abs
error twice round-to-nearest), where native rounds to nearest; over 30 layers that bias
changed SmolLM2's greedy answer ("The capital of France is Paris." became
"L'Etoile, la Marsebeau, ..."). Needs a fidelity (KLD) arm before it can be on.
Verified by: tests/test_cpu_fused_rms_norm.py (numerics vs native for bf16/fp32, the
in-place residual semantics, strided inputs refused, flag off = stock priority; e2e:
worker evidence ``rms_norm_impl`` and equal greedy text).
Remove when: vLLM registers its ``_C`` RMSNorm impls as supported on CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_omni_edge.patches.base import PatchRecord, Process

PROVIDER = "edge_cpu_c"

RECORD = PatchRecord(
    name="cpu_fused_rms_norm",
    target="vllm.ir.ops.rms_norm / fused_add_rms_norm impls; vllm.platforms.cpu.CpuPlatform.get_default_ir_op_priority",
    process=Process.WORKER,
    why="vLLM's _C RMSNorm impls are registered for GPU only; CPU runs the unfused native torch-op chain.",
    verified_by="tests/test_cpu_fused_rms_norm.py (numerics vs native, in-place residual, strided refused, "
    "flag off = stock); rms_norm_impl in worker evidence.",
    remove_when="vLLM registers its _C rms_norm / fused_add_rms_norm impls as supported on CPU.",
)

# Calls of our impls in this process (read by vllm_omni_edge.evidence).
calls = {"rms_norm": 0, "fused_add_rms_norm": 0}


def _rms_norm_supported(x, weight, epsilon, variance_size=None) -> bool:
    return (
        variance_size is None
        and x.device.type == "cpu"
        and x.is_contiguous()
        and (weight is None or weight.dtype == x.dtype)
    )


def _fused_add_rms_norm_supported(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return (
        variance_size is None
        and x.device.type == "cpu"
        and x.is_contiguous()
        and x_residual.is_contiguous()
        and x_residual.dtype == x.dtype
        and (weight is None or weight.dtype == x.dtype)
    )


def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    calls["rms_norm"] += 1
    output = torch.empty_like(x)
    torch.ops._C.rms_norm(output, x, weight, epsilon)
    return output


def fused_add_rms_norm(
    x: Tensor,
    x_residual: Tensor,
    weight: Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    # In place, like vLLM's own vllm_c impl: x becomes the normed output and
    # x_residual the sum x + residual (the IR layer clones for functional callers).
    calls["fused_add_rms_norm"] += 1
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def register_impls() -> bool:
    """Add ``edge_cpu_c`` to both IR ops; False if it was already there."""
    from vllm import ir

    if PROVIDER in ir.ops.rms_norm.impls:
        return False
    ir.ops.rms_norm.register_impl(PROVIDER, supports_args=_rms_norm_supported)(rms_norm)
    ir.ops.fused_add_rms_norm.register_impl(
        PROVIDER, supports_args=_fused_add_rms_norm_supported, inplace=True
    )(fused_add_rms_norm)
    return True


def prefer_edge_impls(priority, vllm_config):
    """``priority`` with ``edge_cpu_c`` first for both norms, when the model runs eagerly."""
    from vllm.config.compilation import CompilationMode

    if vllm_config.compilation_config.mode != CompilationMode.NONE:
        return priority  # inductor fuses the native impl; an opaque _C call would block that
    for op_name in ("rms_norm", "fused_add_rms_norm"):
        current = [p for p in getattr(priority, op_name) if p != PROVIDER]
        setattr(priority, op_name, [PROVIDER] + (current or ["native"]))
    return priority


def apply() -> str:
    from vllm_omni_edge.levers import fused_rms_norm_enabled

    if not fused_rms_norm_enabled():
        return "VLLM_OMNI_EDGE_FUSED_RMS_NORM is 0 (default): stock IR priority (native on CPU)"
    from vllm.platforms.cpu import CpuPlatform

    register_impls()
    original = CpuPlatform.get_default_ir_op_priority
    if not getattr(original, "__edge_wrapped__", False):
        original_fn = original.__func__

        def get_default_ir_op_priority(cls, vllm_config):
            return prefer_edge_impls(original_fn(cls, vllm_config), vllm_config)

        get_default_ir_op_priority.__edge_wrapped__ = True
        CpuPlatform.get_default_ir_op_priority = classmethod(get_default_ir_op_priority)
    return f"rms_norm / fused_add_rms_norm: {PROVIDER} (torch.ops._C) preferred when eager"
