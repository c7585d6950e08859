"""The CPU classes the routing table is keyed on, and which class a CPU belongs to.

Routing owns the classes; kernels ask routing (``weight_path.routed_order``) and never
classify a CPU themselves.
"""

from __future__ import annotations

from vllm_omni_edge.cpu_features import CpuFeatures, cpu_flags

CPU_CLASSES = ("x86-amx", "x86-avx512-vnni", "x86-avx512", "x86-avx2", "other")


def cpu_class() -> str:
    """This machine's class, from its /proc/cpuinfo flags."""
    flags = cpu_flags()
    if "amx_tile" in flags and "amx_int8" in flags:
        return "x86-amx"
    if "avx512_vnni" in flags or "avx512_bf16" in flags:
        return "x86-avx512-vnni"
    if "avx512f" in flags:
        return "x86-avx512"
    if "avx2" in flags:
        return "x86-avx2"
    return "other"


def routing_class(features: CpuFeatures) -> str:
    """The class for these features (the detected CPU's own class if it matches)."""
    if features.amx:
        return "x86-amx"
    if features.capability.startswith("AVX512"):
        here = cpu_class()
        return here if here.startswith("x86-avx512") else "x86-avx512"
    if features.capability == "AVX2":
        return "x86-avx2"
    return "other"
