"""Hold automatic garbage collection back while an engine core starts, outside `serve` too.

What: in a process that is about to build vLLM's ``EngineCore`` (an ``LLM()`` with the
in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or by default from ``llm_in_process``
when it builds the engine; or vLLM's engine-core child), the
plugin's load pauses automatic collection the way ``serve`` does (``levers.startup_gc``,
young mode by default), ``CPUWorker.init_device`` collects once and freezes before the model
load (the ``startup_gc`` patch's wrapper, shared), and the engine core's own
``freeze_gc_heap`` (the end of ``EngineCore.__init__``) turns collection back on.
Why: ``startup_gc`` acted only in the process the CLI starts, so an ``LLM()`` start still ran
three full collections over every imported module's objects (our heap trim's, vLLM's after its
profile run, vLLM's freeze: ~0.5 s each on the Zen 5 box) plus the automatic ones while the
model was built.
Not here: a process that `serve`'s CLI already paused (it resumes at server ready), a worker
child (no engine core: nothing would resume it before the deadline), the flag off.
Flag: ``VLLM_OMNI_EDGE_STARTUP_GC=0`` (the same lever as ``serve``'s).
Verified by: tests/test_engine_start_gc.py (which processes pause, resume after vLLM's freeze
and not before, idempotent); start-up-llm-gc-default.yaml (evidence ``startup_gc``).
Remove when: vLLM pauses automatic collection during its own start-up (not as of 0.30.0).
"""

from __future__ import annotations

import multiprocessing

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

ENGINE_MODULE = "vllm.v1.engine.core"
WORKER_MODULE = "vllm.v1.worker.cpu_worker"
ENGINE_CORE_PROCESS = "EngineCore"  # vLLM's name for its engine-core child

RECORD = PatchRecord(
    name="engine_start_gc",
    kind=Kind.LEVER,
    target=f"{ENGINE_MODULE}.freeze_gc_heap; {WORKER_MODULE}.CPUWorker.init_device",
    process=Process.FRONTEND,
    why="An LLM() start ran three full collections over the whole import heap (~1.5 s) and "
    "the automatic ones; startup_gc held collection back only in the CLI's server process.",
    verified_by="tests/test_engine_start_gc.py; start-up-llm-gc-default.yaml (evidence startup_gc).",
    remove_when="vLLM pauses automatic collection during its own start-up.",
    upstream="none found",
)


def builds_engine_core_here() -> bool:
    """This process will build an EngineCore: vLLM's engine-core child, or a front end whose
    engine runs in-process."""
    from vllm_omni_edge.levers import in_process_engine

    if multiprocessing.parent_process() is not None:
        return multiprocessing.current_process().name.startswith(ENGINE_CORE_PROCESS)
    return in_process_engine()


def wrap_engine_freeze(original):
    def freeze_gc_heap():
        from vllm_omni_edge.levers import startup_gc

        try:
            return original()
        finally:
            if startup_gc.resume(startup_gc.RESUMED_ENGINE_READY, only_if_paused_for="engine") is not None:
                from vllm_omni_edge.evidence import update_worker_evidence, write_process_record

                # The worker's record was written before this (at warm-up): say how the pause ended.
                update_worker_evidence(startup_gc=startup_gc.record())
                write_process_record()

    return freeze_gc_heap


def _wrap_engine(module) -> None:
    wrap_method_once(module, "freeze_gc_heap", wrap_engine_freeze)


def apply() -> str:
    from vllm_omni_edge.levers import startup_gc

    if startup_gc.is_paused():
        held_for = startup_gc.record().get("paused_for")
        return f"collection already held back in this process for the {held_for} start; left as it is"
    if not builds_engine_core_here():
        return "no engine core is built in this process: collection left as it is"
    return hold_collection_for_engine_start()


def hold_collection_for_engine_start() -> str:
    """Pause collection until the engine core's freeze; also called by ``llm_in_process`` when
    it chooses the in-process engine (after the plugin loaded)."""
    from vllm_omni_edge.levers import startup_gc

    if not startup_gc.pause(paused_for="engine"):
        return "collection left on (VLLM_OMNI_EDGE_STARTUP_GC=0, or already off)"
    when_imported(ENGINE_MODULE, _wrap_engine)
    from vllm_omni_edge.patches.frontend.startup_gc import wrap_worker_init

    when_imported(WORKER_MODULE, wrap_worker_init)
    return "collection held back until the engine core's freeze_gc_heap"
