"""The KV cache's pages become resident as blocks are first written, not all at start.

What: gives ``vllm.v1.worker.utils`` (whose one ``torch.zeros`` call is
``allocate_kv_cache``'s backing buffer) a ``torch`` whose 1-D int8 CPU ``zeros`` come from a
fresh anonymous ``mmap``; every other attribute is torch's own. The function itself is not
wrapped: the model runner imported it by name. The kernel hands out zero-filled pages on first touch, so the
buffer reads as zeros exactly as ``torch.zeros`` would, but only the pages of blocks the
engine has written are resident. The mapping
lives as long as the tensor (``torch.frombuffer`` keeps it). Bytes mapped this way are kept
for the worker evidence (``kv_cache_mapped_bytes``).
Why: vLLM writes zeros over the whole KV buffer at start, so every byte of the budget is
resident from the first second, whether one short stream or ``max_num_seqs`` long ones
use it. On an edge box one stream of a few thousand tokens uses a small part of a budget
sized for concurrency; the rest is memory nothing reads.
Flag: ``VLLM_OMNI_EDGE_KV_RESIDENT=all`` keeps vLLM's zeroed buffer (the A/B arm).
Verified by: tests/test_kv_resident_as_used.py (the buffer is zeros, writable, from a
mapping, resident only where written; other zeros are torch's; the flag; idempotence);
the memory grids' PSS and the evidence ``kv_cache_mapped_bytes``.
Remove when: vLLM allocates the CPU KV cache without touching it.
"""

from __future__ import annotations

import mmap

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.worker.utils"

RECORD = PatchRecord(
    name="kv_resident_as_used",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.torch (allocate_kv_cache's zeros)",
    process=Process.WORKER,
    why="vLLM zero-fills the whole CPU KV buffer at start, making every byte of the budget resident; "
    "zero pages from a fresh mapping read the same and become resident as blocks are written.",
    verified_by="tests/test_kv_resident_as_used.py; kv_cache_mapped_bytes in the worker evidence.",
    remove_when="vLLM allocates the CPU KV cache without touching it.",
    upstream="none found",
)

# Bytes of KV buffer this process mapped lazily (0: none); read by vllm_omni_edge.evidence.
mapped_bytes = 0


def apply() -> str:
    from vllm_omni_edge.levers import kv_resident_as_used

    if not kv_resident_as_used():
        return "VLLM_OMNI_EDGE_KV_RESIDENT=all: vLLM's zero-filled KV buffer"
    now = when_imported(TARGET_MODULE, _wrap)
    return "KV buffer resident as used" + ("" if now else " (on import)")


def zero_pages(size: int):
    """An int8 CPU tensor of ``size`` zero bytes whose pages are resident only once written."""
    import torch

    if size <= 0:
        return torch.zeros(size, dtype=torch.int8)
    # Private: anonymous memory of this process (shared would count as shmem), zero-filled on first touch.
    return torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.int8)


class _TorchWithLazyZeros:
    """``torch`` as ``vllm.v1.worker.utils`` sees it: 1-D int8 CPU ``zeros`` (the KV backing
    buffer) are zero pages; every other attribute and call is torch's."""

    __edge_wrapped__ = True

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        value = getattr(self._torch, name)
        setattr(self, name, value)  # looked up once: later uses are a plain attribute read
        return value

    def zeros(self, *size, dtype=None, device=None, **kwargs):
        torch = self._torch
        lazy = (len(size) == 1 and isinstance(size[0], int) and dtype is torch.int8 and not kwargs
                and (device is None or torch.device(device).type == "cpu"))
        if not lazy:
            return torch.zeros(*size, dtype=dtype, device=device, **kwargs)
        global mapped_bytes
        mapped_bytes += size[0]
        return zero_pages(size[0])


def _wrap(module) -> None:
    if not getattr(module.torch, "__edge_wrapped__", False):
        module.torch = _TorchWithLazyZeros(module.torch)
