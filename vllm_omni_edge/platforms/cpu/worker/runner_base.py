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


class PlainModelKwargsMixin:
    """Lets an AR stage run a plain vLLM model (Llama, Qwen2, ...), not only vLLM-Omni's own.

    vLLM-Omni's AR runner calls the model with its extra keyword arguments
    (``sampling_metadata``, ``logits_index``, ``sampler``, ``runtime_additional_information``,
    ...). Its own models take ``**kwargs``; vLLM's text models do not, so a stage serving
    SmolLM2 died on its first step with "LlamaForCausalLM.forward() got an unexpected
    keyword argument 'sampling_metadata'". Placed after the Omni runners and before vLLM's
    in the MRO, this passes a model whose ``forward`` has no ``**kwargs`` only the
    arguments it names; a model that takes ``**kwargs`` gets everything, as before.
    """

    _plain_forward_params: frozenset[str] | None | bool = False  # False: not inspected yet

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        params = self._plain_forward_params
        if params is False:
            params = self._plain_forward_params = forward_params(self.model)
        if params is not None:
            model_kwargs = {k: v for k, v in model_kwargs.items() if k in params}
        return super()._model_forward(input_ids=input_ids, positions=positions,
                                      intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds,
                                      **model_kwargs)


def forward_params(model) -> frozenset[str] | None:
    """Names ``model.forward`` takes, or None when it takes ``**kwargs`` (or cannot be read)."""
    import inspect

    forward = getattr(model, "forward", None)
    unwrap = getattr(model, "unwrap", None)  # vLLM's graph wrappers
    if callable(unwrap):
        forward = getattr(unwrap(), "forward", forward)
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return frozenset(signature.parameters)
