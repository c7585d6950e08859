"""``CpuOmniPlatform``: vLLM-Omni's platform interface on vLLM's ``CpuPlatform``.

vLLM-Omni keeps two platform singletons: vLLM's ``current_platform`` (config
validation, attention, KV sizing) and its own ``current_omni_platform`` (stage worker
classes, diffusion attention, device and memory queries, per-platform YAML sections).
This class is both, so the two agree: every vLLM behaviour comes from ``CpuPlatform``
unchanged (``is_cpu()`` stays true, ``device_name`` is ``"cpu"``, gloo, thread binding),
and the Omni interface is answered for a CPU: stage workers and runners from
``worker/``, a diffusion attention backend on ``scaled_dot_product_attention``, memory
from the NUMA node vLLM's CPU worker uses, and no-ops for stream, event and
caching-allocator calls that a CPU has no notion of.
"""

from __future__ import annotations

from pathlib import Path

import torch
from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

logger = init_logger(__name__)

_WORKERS = "vllm_omni_edge.platforms.cpu.worker"
CPU_SDPA_BACKEND = "vllm_omni_edge.platforms.cpu.diffusion_attention.CpuSDPABackend"
# Diffusion attention backends a user may name that run here: both mean our SDPA one.
_SDPA_NAMES = ("TORCH_SDPA", "SDPA", "CPU_SDPA")
DEPLOY_DIR = Path(__file__).resolve().parent / "deploy"


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """Out-of-tree Omni platform for CPU-only boxes (selected by ``probe.py``)."""

    _omni_enum = OmniPlatformEnum.OOT

    # ---- stage workers -------------------------------------------------------------
    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return f"{_WORKERS}.cpu_ar_worker.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return f"{_WORKERS}.cpu_generation_worker.CPUGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return str(DEPLOY_DIR)

    # ---- diffusion -----------------------------------------------------------------
    @classmethod
    def get_diffusion_attn_backend_cls(
        cls,
        selected_backend: str | None,
        head_size: int,
        allow_trtllm_default: bool = False,
    ) -> str:
        if selected_backend is None or selected_backend.upper() in _SDPA_NAMES:
            return CPU_SDPA_BACKEND
        raise ValueError(
            f"The {selected_backend.upper()} diffusion attention backend does not run on CPU; "
            f"the CPU platform runs TORCH_SDPA (torch.nn.functional.scaled_dot_product_attention). "
            "Select TORCH_SDPA or leave the backend unset."
        )

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def has_flash_attn_package(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # vLLM's CPU backend compiles with inductor (C++/OpenMP codegen).
        return True

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        # Graph capture is a CUDA-graph feature; CPU runs the talker MTP eagerly.
        return False

    @classmethod
    def supports_cpu_offload(cls) -> bool:
        # Weights already live in host memory; offloading to the CPU would be a copy.
        return False

    # ---- device --------------------------------------------------------------------
    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        # One CPU device; the rank selects cores (VLLM_CPU_OMP_THREADS_BIND), not a device.
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        # CPU kernels return when done; there is no device queue to drain.
        return None

    @classmethod
    def record_device_event(cls):
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def reset_peak_memory_stats(cls, device=None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device=None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def memory_reserved(cls, device: torch.device | int | None = None) -> int:
        # No caching allocator of torch's own on CPU (tcmalloc/glibc hold the pages).
        return 0

    # ---- memory --------------------------------------------------------------------
    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        """(available, total) bytes over the memory nodes vLLM's CPU worker may use."""
        from vllm.utils.cpu_resource_utils import get_memory_node_info, get_visible_memory_node

        nodes = [get_memory_node_info(node) for node in get_visible_memory_node()]
        return sum(n.available_memory for n in nodes), sum(n.total_memory for n in nodes)

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return cls.get_device_memory(device)[0]
