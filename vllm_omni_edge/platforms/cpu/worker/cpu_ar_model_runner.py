"""Model runner for vLLM-Omni's autoregressive stages (thinker, talker) on CPU."""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni_edge.platforms.cpu.worker.runner_base import CpuRunnerMixin


class CPUARModelRunner(CpuRunnerMixin, GPUARModelRunner, CPUModelRunner):
    pass
