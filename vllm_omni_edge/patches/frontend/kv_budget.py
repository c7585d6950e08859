"""Honour the KV budget on CPU, and size a default from need, not from RAM.

What: wraps ``CpuPlatform.check_and_update_config`` (front end, while the config
is built): refuses a ``VLLM_CPU_KVCACHE_SPACE`` that disagrees with an explicit
``kv_cache_memory_bytes`` or is not whole GiB; sets a need-sized default when no
budget is given; refuses a budget below one ``max_model_len`` request, naming the
minimum. Rules and numbers: ``vllm_omni_edge/levers/kv_budget.py``.
Why: vLLM-CPU 0.30 silently lets the env var overwrite the argument (measured:
192 MiB asked, 1,073,479,680 B allocated), and without a budget it reserves 0.92
of the node's RAM and refuses to start when that much is not free.
Verified by: tests/test_levers.py (the rules) and tests/e2e/test_memory_levers.py
(the worker's allocated KV bytes, read from worker evidence, per setting).
Remove when: vLLM-CPU drops the env overwrite and sizes its default from need.
"""

from __future__ import annotations

import functools

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

RECORD = PatchRecord(
    name="kv_budget",
    kind=Kind.FIX,
    target="vllm.platforms.cpu.CpuPlatform.check_and_update_config",
    process=Process.FRONTEND,
    why="VLLM_CPU_KVCACHE_SPACE silently overrides kv_cache_memory_bytes; the default takes 0.92 of RAM.",
    verified_by="tests/test_levers.py; tests/e2e/test_memory_levers.py reads the worker's KV bytes.",
    remove_when="vLLM-CPU honours kv_cache_memory_bytes over the env var and sizes KV from need.",
    upstream="https://github.com/vllm-project/vllm/issues/29233",
)


def apply() -> str:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, "__edge_wrapped__", False):
        return "already wrapped"

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        import psutil

        from vllm_omni_edge.levers import kv_default_mode
        from vllm_omni_edge.levers import kv_budget as kv
        from vllm_omni_edge.log import get_logger
        from vllm_omni_edge.patches.worker.kv_default_exact import NEED_SIZED_ATTR

        cache = vllm_config.cache_config
        # A budget this wrapper sized on an earlier call is ours, not the user's.
        sized_before = getattr(cache, NEED_SIZED_ATTR, False)
        explicit = None if sized_before else cache.kv_cache_memory_bytes
        kv.reconcile_explicit_and_env(explicit, kv.env_kvcache_space_bytes())
        original(cls, vllm_config)  # may copy the (equal) env value into the config
        given = None if sized_before else cache.kv_cache_memory_bytes
        if vllm_config.model_config is None:
            return
        try:
            shape = kv.kv_shape(vllm_config)
        except Exception as exc:  # an architecture our estimate does not cover
            get_logger("kv_budget").warning(
                "KV cache budget: cannot size this model's KV per token (%s); "
                "vLLM's own sizing applies", exc)
            return
        decision = kv.decide(
            given,
            shape,
            vllm_config.model_config.max_model_len,
            vllm_config.scheduler_config.max_num_seqs,
            psutil.virtual_memory().total,
            kv_default_mode(),
        )
        if decision.budget_bytes is not None:
            cache.kv_cache_memory_bytes = decision.budget_bytes
        # The engine core sizes a need-sized default again from the layers' KV specs.
        setattr(cache, NEED_SIZED_ATTR, given is None and decision.budget_bytes is not None)
        get_logger("kv_budget").info("KV cache budget: %s", decision.reason)

    check_and_update_config.__edge_wrapped__ = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return "CpuPlatform.check_and_update_config honours and sizes the KV budget"
