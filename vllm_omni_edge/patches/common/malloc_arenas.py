"""Every thread of a vLLM process allocates from one glibc arena, so freed heap is reused across threads.

What: calls glibc's ``mallopt(M_ARENA_MAX, n)`` (``n`` = ``VLLM_OMNI_EDGE_MALLOC_ARENAS``, 1 by
default) in a process that imports vLLM: at interpreter start, just before ``vllm``'s body runs
(``patches/early.py``), and again when the plugin's patches are applied (a process started
without the interpreter hook; the call is made once). Threads that have not yet allocated
take an arena from at most ``n``; a thread that already has one keeps it.
Why: glibc gives each thread that meets a busy arena its own (up to eight per core), and each
arena keeps what its thread freed. A server runs requests on several threads (the event loop,
the renderer's workers, the engine core's busy loop, the audio decoding), each freeing its
own activations, features and buffers into its own arena: the same transient bytes are
resident once per thread that touched them. With one arena they are resident once. The
threads of a vLLM process take turns on the GIL, so they rarely allocate at the same time.
Flag: ``VLLM_OMNI_EDGE_MALLOC_ARENAS=0`` leaves glibc's default (the lever's A/B arm); any
other integer is the arena limit.
Verified by: tests/test_malloc_arenas.py (a fresh interpreter that imports vLLM runs its
threads in the main arena; ``0`` leaves glibc's; off glibc a reason, no call; once per
process); evidence ``malloc_arenas`` in the process record; the speech grid's A/B arm.
Remove when: vLLM sets an arena limit for its CPU processes (not as of 0.30.0).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

TARGET_MODULE = "vllm"
M_ARENA_MAX = -8  # glibc's malloc.h

RECORD = PatchRecord(
    name="malloc_arenas",
    kind=Kind.LEVER,
    target="glibc mallopt(M_ARENA_MAX) in every process that imports vllm (before its body runs)",
    process=Process.WORKER,  # every vLLM process: the front end and each spawned engine/worker
    why="glibc gives each allocating thread its own arena and each keeps what its thread freed, so "
    "a server's request-time transients are resident once per thread; one arena holds them once.",
    verified_by="tests/test_malloc_arenas.py (threads share the main arena after `import vllm`; 0 "
    "leaves glibc's; off glibc a reason); evidence malloc_arenas; the speech grid's A/B arm.",
    remove_when="vLLM limits glibc's arenas in its CPU processes.",
    upstream="none found",
)

_lock = threading.Lock()
_state: dict = {}  # the one call's outcome: {"limit": n, "set": bool} or {"reason": ...}


def record() -> dict:
    return dict(_state)


def limit_arenas() -> dict:
    """Set the arena limit from the flag, once per process; returns what was done."""
    from vllm_omni_edge.levers import malloc_arena_limit

    with _lock:
        if _state:
            return dict(_state)
        limit = malloc_arena_limit()
        if limit == 0:
            _state.update(limit=None, set=False, reason="VLLM_OMNI_EDGE_MALLOC_ARENAS=0: glibc's default")
        elif platform.libc_ver()[0] != "glibc":
            _state.update(limit=None, set=False, reason=f"not glibc ({platform.libc_ver()[0] or 'unknown'} libc)")
        else:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            ok = libc.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(limit)) == 1
            _state.update(limit=limit, set=ok, reason=None if ok else "mallopt refused M_ARENA_MAX")
        return dict(_state)


def install() -> None:
    """Interpreter start: limit the arenas just before ``vllm``'s body runs (threads start later)."""
    from vllm_omni_edge.patches.import_hook import before_imported

    if not before_imported(TARGET_MODULE, lambda _module: limit_arenas()):
        limit_arenas()  # vllm already imported: as early as we can


def apply() -> str:
    state = limit_arenas()
    if state["set"]:
        return f"glibc arenas limited to {state['limit']}"
    return f"glibc arenas left as they are: {state['reason']}"
