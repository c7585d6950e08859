"""What makes a vLLM-Omni GPU model runner run on CPU: vLLM's ``CPUModelRunner`` in the MRO.

``CPUARModelRunner(GPUARModelRunner, CPUModelRunner)`` linearises to
Omni runner -> Omni base -> ``CPUModelRunner`` -> ``GPUModelRunner``: every Omni override
(hidden-state payloads, talker MTP, connectors) stays first, and each ``super()`` call that
would reach vLLM's GPU runner reaches its CPU adaptation instead (``load_model`` without
CUDA memory profiling, no-op ``_sync_device``/``_init_device_properties``, the eager
warm-up, CPU-safe ``_to_list``). vLLM's ``CPUModelRunner.__init__`` runs inside the chain
and neutralises ``torch.accelerator`` and CUDA streams/events; the Omni ``__init__`` code
after it creates more staging buffers, so this mixin repeats the device-to-host aliasing
(``CpuGpuBuffer.gpu = .cpu``) once the whole chain has run.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper


class CpuRunnerMixin:
    """First base of the CPU runners: wraps the whole Omni ``__init__`` for CPU."""

    def __init__(self, vllm_config, device: torch.device, *args, **kwargs):
        if device != torch.device("cpu"):
            raise ValueError(f"{type(self).__name__} runs on the CPU device only, got {device}")
        with _torch_cuda_wrapper():
            super().__init__(vllm_config, device, *args, **kwargs)
        # Buffers the Omni __init__ made after CPUModelRunner's own pass.
        CPUModelRunner._postprocess_tensors(self)
