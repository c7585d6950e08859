"""Exit non-zero when the API server stops because the engine died.

What: wraps ``terminate_if_errored`` (the API server's watchdog and its engine-error
handler) to note when it shuts the HTTP server down because the engine is dead, and
logs one line saying so. ``vllm-omni-edge serve`` then exits with status 1
(``ENGINE_DEATH_EXIT_CODE``).
Why: in vLLM 0.30, when a worker or the engine core dies, the watchdog sets
``server.should_exit`` and ``run_server`` returns normally, so ``vllm serve`` exits 0
(measured on this box after SIGKILL of ``VLLM::Worker``). A supervisor such as
systemd with ``Restart=on-failure`` treats 0 as a clean stop and does not restart.
Verified by: tests/test_reliability_units.py (the wrapper notes engine death and
nothing else); tests/e2e/test_reliability.py kills the worker mid-stream and checks
the exit status.
Remove when: vLLM's API server exits non-zero after engine death.
"""

from __future__ import annotations

from vllm_omni_edge.log import get_logger
from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

ENGINE_DEATH_EXIT_CODE = 1
# terminate_if_errored is defined in the launcher and imported by name by the handler.
TARGET_MODULES = (
    "vllm.entrypoints.launchers.launcher",
    "vllm.entrypoints.serve.exception_handling.handlers.vllm_error",
)

RECORD = PatchRecord(
    name="engine_death_exit",
    kind=Kind.FIX,
    target="vllm.entrypoints.launchers.launcher.terminate_if_errored (and its import "
    "in serve.exception_handling.handlers.vllm_error)",
    process=Process.FRONTEND,
    why="After the engine dies the API server shuts down with exit status 0, so "
    "systemd's Restart=on-failure would not restart it.",
    verified_by="tests/test_reliability_units.py; tests/e2e/test_reliability.py (worker "
    "SIGKILL mid-stream: stream error, /health 503, exit status 1).",
    remove_when="vLLM's API server exits non-zero after engine death.",
    upstream="https://github.com/vllm-project/vllm/issues/48966",
)

_engine_died = False


def engine_died() -> bool:
    """True once this process shut its HTTP server down because the engine died."""
    return _engine_died


def wrap_terminate_if_errored(original):
    def terminate_if_errored(server, engine):
        global _engine_died
        result = original(server, engine)
        if server.should_exit and engine.errored and not engine.is_running and not _engine_died:
            _engine_died = True
            get_logger("engine_death_exit").error(
                "vllm-omni-edge: the engine died; the API server is shutting down and will "
                "exit with status %d", ENGINE_DEATH_EXIT_CODE)
        return result

    return terminate_if_errored


def _wrap(module) -> None:
    wrap_method_once(module, "terminate_if_errored", wrap_terminate_if_errored)


def apply() -> str:
    pending = [name for name in TARGET_MODULES if not when_imported(name, _wrap)]
    return "API server notes engine death for a non-zero exit" + (
        " (on import)" if pending else "")
