"""Model runner for vLLM-Omni's autoregressive stages (thinker, talker) on CPU."""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni_edge.platforms.cpu.worker.runner_base import CpuRunnerMixin, PlainModelKwargsMixin


# PlainModelKwargsMixin sits after the Omni runners and before vLLM's in the MRO, so it sees
# the Omni keyword arguments and filters them for plain vLLM models (see runner_base).
class CPUARModelRunner(CpuRunnerMixin, GPUARModelRunner, PlainModelKwargsMixin, CPUModelRunner):
    pass
