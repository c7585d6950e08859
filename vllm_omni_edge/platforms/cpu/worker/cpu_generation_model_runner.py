"""Model runner for vLLM-Omni's non-autoregressive generation stages (e.g. code2wav) on CPU."""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni_edge.platforms.cpu.worker.runner_base import CpuRunnerMixin


class CPUGenerationModelRunner(CpuRunnerMixin, GPUGenerationModelRunner, CPUModelRunner):
    pass
