"""Give the heap that requests freed back to the OS each time the engine goes idle.

What: wraps ``EngineCoreProc._process_input_queue`` (the engine core's wait for work, in
whichever process or thread runs the busy loop). When the engine has stepped since the
last trim and now has no work and nothing queued, it calls glibc's ``malloc_trim(0)``
(no ``gc.collect()``: reference counting already freed the requests' objects) before it
waits, once per busy-to-idle transition, and keeps the last result for the log. ``LLM()``
with its engine in the calling process has no such loop: there ``LLM._run_engine`` trims
once it has returned every output (the engine is idle until the next call).
Why: a request's transient allocations (an encoder's activations and attention scores,
the audio features, the output buffers) are freed into glibc's arenas, which keep them
resident: ``heap_trim`` only trims after loading and warm-up, so the first requests
grow the steady-state memory and nothing returns it. The trim runs while nothing is
scheduled, so a step never waits on it; a request that arrives during it waits for it.
Flag: ``VLLM_OMNI_EDGE_IDLE_TRIM=0`` skips it (the lever's A/B arm).
Verified by: tests/test_idle_trim.py (trims once per busy-to-idle transition, never with
work pending or queued, never before the first step; wrapped once); the manual probe in
docs/edge/speech.md.
Remove when: vLLM returns freed heap to the OS on CPU when idle (not as of 0.30.0).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.engine.core"
LLM_MODULE = "vllm.entrypoints.llm"

RECORD = PatchRecord(
    name="idle_trim",
    kind=Kind.LEVER,
    target="vllm.v1.engine.core.EngineCoreProc._process_input_queue; vllm.entrypoints.llm.LLM._run_engine",
    process=Process.WORKER,
    why="Heap freed by requests' temporaries (Whisper's encoder activations) stays resident "
    "in glibc's arenas after serving; malloc_trim when the engine goes idle returns it.",
    verified_by="tests/test_idle_trim.py (once per busy-to-idle transition; not with work "
    "pending or queued; not before the first step). `vllm-omni-edge serve whisper-base` "
    "after the speech fixtures twice (Zen 4 EPYC box, manual probes, shared box): steady "
    "PSS 1,342 -> 1,233 MiB (PSS_Anon 1,259 -> 1,155); a malloc_trim called afterwards "
    "through gdb returned nothing more.",
    remove_when="vLLM trims the heap when its CPU engine goes idle.",
    upstream="none found",
)

# The last idle trim in this process (trim_heap's dict); for logs and probes.
last_idle_trim: dict | None = None
_STEPPED = "_edge_stepped_since_trim"


def should_trim(engine) -> bool:
    """True when ``engine`` has stepped since its last trim and is now idle with nothing queued."""
    if not getattr(engine, _STEPPED, False):
        return False
    if engine.has_work():
        return False
    queue = getattr(engine, "input_queue", None)
    return queue is None or queue.empty()


def make_wrapper(original, trim=None):
    def _process_input_queue(self, *args, **kwargs):
        global last_idle_trim
        if should_trim(self):
            setattr(self, _STEPPED, False)
            if trim is None:
                from vllm_omni_edge.levers.heap import trim_heap

                last_idle_trim = trim_heap(collect=False)
            else:
                last_idle_trim = trim()
            from vllm_omni_edge.log import get_logger

            get_logger("idle_trim").debug("engine idle: %s", last_idle_trim)
        result = original(self, *args, **kwargs)
        # It returns when there is work (a step follows), or without any when it does not
        # block: only the first counts.
        if self.has_work():
            setattr(self, _STEPPED, True)
        return result

    return _process_input_queue


def _wrap(module) -> None:
    wrap_method_once(module.EngineCoreProc, "_process_input_queue", make_wrapper,
                     marker="__edge_idle_trim__")


def make_run_engine_wrapper(original, trim=None):
    def _run_engine(self, *args, **kwargs):
        global last_idle_trim
        outputs = original(self, *args, **kwargs)
        if trim is None:
            from vllm_omni_edge.levers.heap import trim_heap

            last_idle_trim = trim_heap(collect=False)
        else:
            last_idle_trim = trim()
        return outputs

    return _run_engine


def _wrap_llm(module) -> None:
    wrap_method_once(module.LLM, "_run_engine", make_run_engine_wrapper, marker="__edge_idle_trim__")


def apply() -> str:
    from vllm_omni_edge.levers import idle_trim_enabled

    if not idle_trim_enabled():
        return "VLLM_OMNI_EDGE_IDLE_TRIM=0: heap freed by requests left to glibc"
    now = when_imported(TARGET_MODULE, _wrap)
    when_imported(LLM_MODULE, _wrap_llm)
    return ("EngineCoreProc, and LLM() after each call, trim the heap when the engine goes idle"
            + ("" if now else " (on import)"))
