"""Turn automatic garbage collection back on once the server is ready.

What: the CLI pauses automatic collection at its first line (``levers.startup_gc.pause``,
``vllm-omni-edge serve`` and ``vllm serve``). This patch wraps the API server's
``freeze_gc_heap`` (called in its lifespan, when the engine is up and the app is built)
so that, after vLLM has collected and frozen the start-up heap, automatic collection
resumes (``levers.startup_gc.resume``); from then on the process collects as stock vLLM
does. When the model runs in this process (one-process layout), it also wraps
``CPUWorker.init_device`` to collect once and freeze before the model is loaded, so the
three explicit full collections that follow in the start scan only what loading made.
Why: with collection on, CPython rescans the growing start-up heap in ~2,200
collections: 5.2 s of a 24 s compiled single-process start on this box (4.6 s in full
collections); paused, the three explicit ones (heap trim, vLLM's profile run, vLLM's
freeze) still took 0.8 s each, as each scanned every imported module's objects.
Flag: ``VLLM_OMNI_EDGE_STARTUP_GC=0`` leaves collection on throughout (the A/B arm).
Verified by: tests/test_startup_gc.py (pause/resume, flag, the wrapper resumes only
after vLLM's freeze, a skipped patch resumes at once, only `serve` pauses); the
start-up grids (evidence ``startup_gc``; tree PSS peaks compared with the flag off).
Remove when: vLLM pauses collection during its own start-up (not as of 0.30.0).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.entrypoints.launchers.utils.server_utils"
WORKER_MODULE = "vllm.v1.worker.cpu_worker"

RECORD = PatchRecord(
    name="startup_gc",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.freeze_gc_heap; {WORKER_MODULE}.CPUWorker.init_device",
    process=Process.FRONTEND,
    why="Automatic collection rescans the growing start-up heap ~2,200 times (5.2 s of a "
    "24 s start); collection stays paused until vLLM's own collect-and-freeze at server ready.",
    verified_by="tests/test_startup_gc.py; evidence startup_gc and the PSS peaks in the start-up grids.",
    remove_when="vLLM pauses automatic collection during its own start-up.",
    upstream="none found",
)


def wrap_freeze_gc_heap(original):
    def freeze_gc_heap():
        from vllm_omni_edge.levers import startup_gc

        try:
            return original()
        finally:
            if startup_gc.resume(startup_gc.RESUMED_SERVER_READY) is not None:
                from vllm_omni_edge.evidence import write_process_record

                write_process_record()

    return freeze_gc_heap


def wrap_init_device(original):
    def init_device(self, *args, **kwargs):
        from vllm_omni_edge.levers import startup_gc

        result = original(self, *args, **kwargs)
        startup_gc.collect_and_freeze()
        return result

    return init_device


def _wrap(module) -> None:
    wrap_method_once(module, "freeze_gc_heap", wrap_freeze_gc_heap)


def wrap_worker_init(module) -> None:
    """Collect once and freeze before the model load (also used by engine_start_gc)."""
    wrap_method_once(module.CPUWorker, "init_device", wrap_init_device)


def resume_unless_in_force() -> None:
    """Resume collection now if this patch did not apply (another vLLM version, a failure)."""
    from vllm_omni_edge.levers import startup_gc
    from vllm_omni_edge.patches.base import outcomes

    outcome = outcomes().get(RECORD.name)
    if outcome is None or outcome.status != "applied":
        startup_gc.resume(startup_gc.RESUMED_PATCH_NOT_APPLIED)


def apply() -> str:
    from vllm_omni_edge.levers import startup_gc

    if not startup_gc.is_paused():
        return "automatic collection is not paused in this process: nothing to resume"
    now = when_imported(TARGET_MODULE, _wrap)
    when_imported(WORKER_MODULE, wrap_worker_init)
    return "automatic collection resumes after the server's freeze_gc_heap" + ("" if now else " (on import)")
