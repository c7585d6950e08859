"""Worker for vLLM-Omni's autoregressive stages (thinker, talker) on CPU."""

from __future__ import annotations

from vllm_omni_edge.platforms.cpu.worker.cpu_ar_model_runner import CPUARModelRunner
from vllm_omni_edge.platforms.cpu.worker.worker_base import OmniCPUWorkerBase


class CPUARWorker(OmniCPUWorkerBase):
    model_runner_cls = CPUARModelRunner
