"""Worker for vLLM-Omni's generation stages (code2wav and other non-AR decoders) on CPU."""

from __future__ import annotations

from vllm_omni_edge.platforms.cpu.worker.cpu_generation_model_runner import CPUGenerationModelRunner
from vllm_omni_edge.platforms.cpu.worker.worker_base import OmniCPUWorkerBase


class CPUGenerationWorker(OmniCPUWorkerBase):
    model_runner_cls = CPUGenerationModelRunner
