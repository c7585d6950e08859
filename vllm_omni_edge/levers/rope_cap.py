"""Size rotary cos/sin tables to the servable context, not the model's maximum.

vLLM builds each ``cos_sin_cache`` for ``max_position_embeddings`` (8,192 rows for
SmolLM2, 32,768 for Qwen2.5) although no position reaches ``max_model_len``.
Rows are independent of the table length (row p is cos/sin of p * inv_freq), so
keeping the first ``max_model_len`` rows leaves every reachable value bit for bit
unchanged. Layers share one table (``get_rope`` caches modules), so each is cut once.
"""

from __future__ import annotations

import torch

# Buffers whose row index is the token position. Others (Phi-3 long/short caches
# offset by the original context, dual-chunk caches) are left alone.
POSITION_INDEXED_BUFFERS = ("cos_sin_cache", "cos_sin_cache_bf16")


def cap_rotary_tables(model: torch.nn.Module, max_model_len: int) -> list[dict]:
    """Cut every position-indexed rotary table in ``model`` to ``max_model_len`` rows.

    Returns one record per table that was cut (class, rows before/after, bytes freed).
    """
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    cut = []
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, RotaryEmbeddingBase) or id(module) in seen:
            continue
        seen.add(id(module))
        for name in POSITION_INDEXED_BUFFERS:
            table = getattr(module, name, None)
            if not isinstance(table, torch.Tensor) or table.shape[0] <= max_model_len:
                continue
            before = table.shape[0]
            # clone() so the full-length storage is freed, not kept alive by a view.
            setattr(module, name, table[:max_model_len].clone())
            cut.append({
                "class": type(module).__name__,
                "buffer": name,
                "rows_before": before,
                "rows_after": max_model_len,
                "bytes_freed": (before - max_model_len) * table[0].numel() * table.element_size(),
            })
    return cut
