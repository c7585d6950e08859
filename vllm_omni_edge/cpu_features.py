"""What this CPU can do, read once from /proc/cpuinfo and PyTorch."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def usable_cores() -> int:
    """Cores this process may run on (affinity), not the host's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuFeatures:
    capability: str  # PyTorch's kernel dispatch level: "AVX2", "AVX512", "DEFAULT", ...
    amx: bool  # AMX tiles present (AMX-BF16/INT8 Xeons)
    vllm_w4a8_op: bool  # vLLM's _C was built with int4_scaled_mm_cpu

    @classmethod
    @functools.cache
    def detect(cls) -> "CpuFeatures":
        import torch

        return cls(
            capability=torch.backends.cpu.get_cpu_capability(),
            amx=bool(torch.cpu._is_amx_tile_supported()),
            vllm_w4a8_op=_has_vllm_w4a8_op(),
        )


def _has_vllm_w4a8_op() -> bool:
    import torch

    try:
        import vllm._custom_ops  # noqa: F401  (loads vLLM's _C op library)
    except Exception:
        return False
    return hasattr(torch.ops._C, "int4_scaled_mm_cpu") and hasattr(
        torch.ops._C, "convert_weight_packed_scale_zp"
    )
