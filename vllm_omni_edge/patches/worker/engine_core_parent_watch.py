"""Stop vLLM's engine-core process when the process that started it is gone.

What: in a process named ``EngineCore`` / ``EngineCore_DP<n>`` (vLLM's engine core), starts
a daemon thread that waits on ``multiprocessing.parent_process().sentinel`` and, when the
parent has exited, sends its own process SIGTERM: vLLM's shutdown path
(``EngineCoreProc.run_engine_core``'s signal handler; before that handler is installed,
the default action ends the process). Other processes are left alone.
Why: vLLM 0.30's engine core does not watch its parent (its workers do, through a death
pipe in ``multiproc_executor``). When the front end dies without shutting it down
(SIGKILL, the OOM killer, ``os._exit``), the engine core lives on: it keeps its memory
(~1 GiB with SmolLM2 in the two-process layout, where the model is in it) and polls at
3-8 % of a core. Two such orphans ran for 40 min on this box, under three of our grids,
after an exploration script left with ``os._exit``. A restarted server would then hold
the model twice.
Verified by: tests/test_engine_core_parent_watch.py (a spawned child named EngineCore
exits when its parent leaves with ``os._exit``; a child with another name is not
watched; starting twice starts one thread).
Remove when: vLLM's engine core exits when its parent does (a death pipe like its workers').
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import wait

from vllm_omni_edge.log import get_logger
from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

logger = get_logger("patches.engine_core_parent_watch")

THREAD_NAME = "EdgeParentWatch"

RECORD = PatchRecord(
    name="engine_core_parent_watch",
    kind=Kind.FIX,
    target="vllm.v1.engine.core.EngineCoreProc.run_engine_core (its process)",
    process=Process.WORKER,
    why="vLLM's engine core outlives a front end that dies without shutting it down (SIGKILL, "
    "OOM killer): it keeps its memory and polls; two orphans ran 40 min here.",
    verified_by="tests/test_engine_core_parent_watch.py (spawned EngineCore child exits after "
    "its parent's os._exit; other processes untouched; one thread).",
    remove_when="vLLM's engine core watches its parent process.",
    upstream="https://github.com/vllm-project/vllm/issues/55510",
)


def is_engine_core(name: str) -> bool:
    return name == "EngineCore" or name.startswith("EngineCore_DP")


def apply() -> str:
    name = multiprocessing.current_process().name
    if not is_engine_core(name):
        return f"not an engine core ({name}): nothing to watch"
    return "watching the parent" if start_watch() else "already watching the parent"


def start_watch() -> bool:
    """Start the watcher thread in this process unless it runs already; False if it does."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    if any(t.name == THREAD_NAME for t in threading.enumerate()):
        return False
    threading.Thread(target=_wait_then_stop, args=(parent.sentinel, parent.pid),
                     name=THREAD_NAME, daemon=True).start()
    return True


def _wait_then_stop(sentinel: int, parent_pid: int | None) -> None:
    wait([sentinel])
    logger.warning("engine core: parent process %s exited without stopping it; shutting down", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)
