"""Garbage collection held back while a server starts; one freeze before the model load.

A server start imports ~6,000 modules and builds the model: millions of objects that
live until the process exits. CPython runs a full collection each time the heap of
surviving objects grows by a quarter, so it scans that growing heap again and again:
measured on this box, 2,200 collections and 5.2 s of a 24 s compiled start (4.6 s of it
in full collections; gc.callbacks timing). Nothing collectable is found worth that:
vLLM itself collects once and freezes the heap when the engine and the server are
ready (``freeze_gc_heap``). So the CLI pauses automatic collection at its first line
(:func:`pause`) and the patch ``startup_gc`` resumes it right after the server's own
``freeze_gc_heap`` (:func:`resume`), which has just collected everything the start
left behind.

Two ways to hold it back (``VLLM_OMNI_EDGE_STARTUP_GC``):
- ``young`` (default): automatic collection stays on for the youngest generation only
  (its threshold kept, the older two never reached), so cycles that die young (import
  machinery, ``inspect`` signature closures holding copies of ``sys.modules``) are freed
  as they die, and nothing that survived is scanned again. Before the model load the
  heap is frozen after a young collection, with no full scan: that full collection was
  1.0 s of a 9 s start on the Zen 5 box (py-spy), and the young mode measured 0.85x the
  start to first token of ``pause`` with +0.3 % tree PSS (start-up-young-gc-default; Qwen:
  1.00x, its start dominated by other costs);
- ``pause`` (``1``, the lever's first form): automatic collection off, one full
  collection and a freeze before the load.

No vLLM import here: :func:`pause` runs before vLLM, torch and transformers are.
"""

from __future__ import annotations

import gc
import os
import threading
import time

# Why automatic collection is on again; the evidence names it.
RESUMED_SERVER_READY = "server ready (after vLLM's freeze_gc_heap)"
RESUMED_ENGINE_READY = "engine core ready (after EngineCore's freeze_gc_heap)"
RESUMED_PATCH_NOT_APPLIED = "the startup_gc patch is not in force"
RESUMED_DEADLINE = "deadline: the server was not ready in time"
RESUMED_IMPORTED = "the module's import finished"
RESUMED_TAKEN_OVER = "a server or engine start paused collection for itself"

# ``paused_for`` of a pause that lasts one module's import (patches/common/import_gc.py).
IMPORT = "import"
_imports = {"pauses": 0, "seconds": 0.0}  # import pauses ended in this process, and their time

# A start that never reaches the server's freeze (a headless engine, a supervisor of
# several API servers, a hang) gets collection back after this long anyway.
DEADLINE_S = 900.0

NEVER = 1 << 30  # a generation threshold never reached in a start
_paused_at: float | None = None
_thresholds: tuple[int, int, int] | None = None  # CPython's, while mode "young" holds them
_record: dict = {"paused": False}
_deadline: threading.Timer | None = None
_lock = threading.Lock()  # the deadline timer resumes from its own thread


def pause(deadline_s: float = DEADLINE_S, paused_for: str = "server") -> bool:
    """Turn automatic collection off until :func:`resume` (at the latest after
    ``deadline_s``), if the lever is on. ``paused_for`` names the start held back: "server"
    (the CLI's `serve`, resumed at server ready), "engine" (an engine core built in this
    process, patches/frontend/engine_start_gc.py, resumed when the engine core is ready) or
    "import" (one module's import, patches/common/import_gc.py; a server's or an engine's
    pause ends it and takes over).

    Returns whether this call paused it (False when the lever is off, or collection
    was already off, paused by us or by someone else whose choice we leave alone)."""
    from vllm_omni_edge.levers import startup_gc_enabled

    from vllm_omni_edge.levers import startup_gc_mode

    global _paused_at, _record, _deadline, _thresholds
    with _lock:
        if _paused_at is not None and _record.get("paused_for") == IMPORT and paused_for != IMPORT:
            _end_pause(RESUMED_TAKEN_OVER)  # a start's own pause takes over from an import's
        if _paused_at is not None or not startup_gc_enabled() or not gc.isenabled():
            return False
        mode = startup_gc_mode()
        if mode == "young":
            # Young cycles are still collected while young; nothing is promoted to a scan again.
            _thresholds = gc.get_threshold()
            gc.set_threshold(_thresholds[0], NEVER, NEVER)
        else:
            gc.disable()
        _paused_at = time.monotonic()
        _record = {"paused": True, "mode": mode, "paused_for": paused_for, "resumed_by": None}
        _deadline = threading.Timer(deadline_s, resume, args=(RESUMED_DEADLINE,))
        _deadline.daemon = True
        _deadline.start()
        return True


def is_paused() -> bool:
    """True from :func:`pause` until :func:`resume`."""
    return _paused_at is not None


def resume(reason: str, only_if_paused_for: str | None = None) -> dict | None:
    """Turn automatic collection back on, if :func:`pause` turned it off (for
    ``only_if_paused_for``, when given); idempotent."""
    with _lock:
        if _paused_at is None:
            return None
        if only_if_paused_for is not None and _record.get("paused_for") != only_if_paused_for:
            return None
        return _end_pause(reason)


def _end_pause(reason: str) -> dict:
    """Under the lock, while paused: collection back as it was; the record of the pause."""
    global _paused_at
    _deadline.cancel()
    _restore_collection()
    seconds = time.monotonic() - _paused_at
    _record.update(resumed_by=reason, seconds_paused=round(seconds, 3), frozen_objects=gc.get_freeze_count())
    if _record.get("paused_for") == IMPORT:
        _imports["pauses"] += 1
        _imports["seconds"] += seconds
    _paused_at = None
    return dict(_record)


def _restore_collection() -> None:
    global _thresholds
    if _thresholds is not None:
        gc.set_threshold(*_thresholds)
        _thresholds = None
    gc.enable()


def _after_fork_in_child() -> None:
    """A forked child has no deadline timer and is not the server being started."""
    global _paused_at, _record, _lock
    _lock = threading.Lock()
    if _paused_at is not None:
        _restore_collection()
        _paused_at = None
        _record = {"paused": False, "resumed_by": "forked child: collection on from its start"}


os.register_at_fork(after_in_child=_after_fork_in_child)


def collect_and_freeze() -> int | None:
    """While paused: collect once and freeze what survives (the imported modules, the
    config), so the explicit collections still to come in the start (the heap trim's,
    vLLM's after its profile run and in freeze_gc_heap) scan only what loading made.
    vLLM freezes the whole start-up heap at the end anyway. Returns the objects frozen,
    or None when not paused."""
    with _lock:
        if _paused_at is None:
            return None
        # Young mode has collected the start's short-lived cycles as they died; what is left
        # is frozen without a full scan. Paused, one full collection first.
        gc.collect(0 if _thresholds is not None else 2)
        gc.freeze()
        _record["frozen_before_load"] = gc.get_freeze_count()
        return _record["frozen_before_load"]


def record() -> dict:
    """What the lever did in this process, for the evidence."""
    imports = {"import_pauses": _imports["pauses"], "import_seconds_paused": round(_imports["seconds"], 3)}
    return {**_record, "paused_now": is_paused(), **imports}
