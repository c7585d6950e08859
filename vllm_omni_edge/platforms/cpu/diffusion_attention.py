"""Diffusion attention on CPU: vLLM-Omni's SDPA backend, dispatched for this platform.

vLLM-Omni's ``AttentionImpl.forward`` dispatches on the platform (cuda/hip/npu/xpu/musa)
and raises for any other, so its ``SDPAImpl`` cannot run on an out-of-tree CPU platform
as is. This backend reuses ``SDPAImpl._forward_impl`` (mask reshaping, GQA expansion,
``torch.nn.functional.scaled_dot_product_attention``) and only supplies the dispatch.
"""

from __future__ import annotations

import torch

from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        # [B, 1, 1, K] boolean masks broadcast in CPU SDPA as in the CUDA path.
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class CpuSDPABackend(SDPABackend):
    @staticmethod
    def get_impl_cls() -> type[CpuSDPAImpl]:
        return CpuSDPAImpl
