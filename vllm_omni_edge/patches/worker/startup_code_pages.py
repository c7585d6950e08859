"""Unmap the library code that only start-up ran, once the model is warmed up.

What: wraps ``CPUWorker.compile_or_warm_up_model`` (the last step of a start, in the process
that runs the model: the caller of ``LLM()`` or the one-process server) to call
``levers.code_pages.drop_clean_code_pages`` afterwards: ``madvise(MADV_DONTNEED)`` on the
clean, file-backed segments of every mapped ELF object. The code that runs again (the
kernels, the interpreter, the server's request path) faults back in from the page cache
within the first requests and stays; the rest is no longer resident. What it released is in
the worker evidence (``startup_code_pages``).
Why: importing torch, vLLM and their extensions executes module and op-registration code
once; those pages of ``libtorch_cpu.so`` and the other libraries stay mapped and count in
the process's RSS and PSS for as long as it runs, though nothing executes them again.
Flag: ``VLLM_OMNI_EDGE_CODE_PAGES=0`` leaves them mapped (the lever's A/B arm).
Verified by: tests/test_code_pages.py (which mappings it picks from a smaps text: never one
with a private or dirty page; in a fresh interpreter after ``import torch`` it releases file
pages and torch still computes; wrapped once); worker evidence in the memory grids.
Remove when: never upstream (a process-level memory choice of ours); re-check the hook point
when moving off vLLM 0.30.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.worker.cpu_worker"

RECORD = PatchRecord(
    name="startup_code_pages",
    kind=Kind.LEVER,
    target="vllm.v1.worker.cpu_worker.CPUWorker.compile_or_warm_up_model",
    process=Process.WORKER,
    why="Library code that only start-up executed (op registrations, static initialisers) "
    "stays mapped and counts in RSS and PSS; unmapping its clean pages after warm-up leaves "
    "resident only the code that runs again.",
    verified_by="tests/test_code_pages.py (mapping choice from smaps; a real torch process "
    "releases file pages and still computes; wrapped once); worker evidence startup_code_pages. "
    "Zen 4 box, quiet: SmolLM2 LLM() 644.5 vs 707.0 MiB tree PSS kept, server 655.9 vs 708.9 "
    "(results/2026-12-04-memory-code-pages-quiet-epyc); Qwen LLM() 1,800 vs 1,862 MiB "
    "(results/2026-12-04-memory-levers-qwen-epyc); decode within the spread.",
    remove_when="Never upstream: our memory choice; re-check the hook on each vLLM upgrade.",
    upstream="none found",
)

# What the drop in this process did; read by vllm_omni_edge.evidence.
last_drop: dict | None = None


def apply() -> str:
    from vllm_omni_edge.levers import code_pages_drop_enabled

    if not code_pages_drop_enabled():
        return "VLLM_OMNI_EDGE_CODE_PAGES=0: start-up code left mapped"
    now = when_imported(TARGET_MODULE, _wrap)
    return ("CPUWorker.compile_or_warm_up_model unmaps clean library code pages afterwards"
            + ("" if now else " (on import)"))


def make_wrapper(original, drop=None):
    def compile_or_warm_up_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        global last_drop
        if drop is None:
            from vllm_omni_edge.levers.code_pages import drop_clean_code_pages

            last_drop = drop_clean_code_pages()
        else:
            last_drop = drop()
        from vllm_omni_edge.log import get_logger

        get_logger("startup_code_pages").info("after warm-up: %s", last_drop)
        return result

    return compile_or_warm_up_model


def _wrap(module) -> None:
    # heap_trim and evidence_recorder wrap this method too: our own marker leaves them room.
    wrap_method_once(module.CPUWorker, "compile_or_warm_up_model", make_wrapper,
                     marker="__edge_startup_code_pages__")
