"""vLLM's ``CPUWorker`` with vLLM-Omni's stage runner in place of ``CPUModelRunner``."""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_omni.worker.mixins import OmniWorkerMixin

logger = init_logger(__name__)


class OmniCPUWorkerBase(OmniWorkerMixin, CPUWorker):
    """Thread binding, gloo, KV sizing: vLLM's CPU worker. The runner: ``model_runner_cls``."""

    model_runner_cls: type

    def init_device(self):
        # CPUWorker.init_device binds threads, initialises gloo and builds a CPUModelRunner;
        # the Omni runner replaces that last part (as vLLM-Omni's XPU workers do).
        super().init_device()
        if self.use_v2_model_runner:
            logger.warning("%s uses the v1 model runner: v2 lacks vLLM-Omni's hooks.", type(self).__name__)
            self.use_v2_model_runner = False
        self.model_runner = None  # free the CPUModelRunner's buffers before building ours
        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)
