"""Make ``--api-key`` / ``VLLM_API_KEY`` guard every route that serves the model.

What: wraps ``AuthenticationMiddleware.__call__`` so that every HTTP/WebSocket path
except the probes in ``OPEN_PATHS`` needs the bearer key; vLLM's own check then
runs unchanged.
Why: vLLM 0.30 guards only paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` (``entrypoints/serve/middleware/authenticate.py::GUARDED_PREFIX``).
Measured on this box with ``--api-key`` set: ``POST /invocations`` (SageMaker) ran a
completion without a key, and ``/tokenize``, ``/detokenize``, ``/generative_scoring``
and ``/scale_elastic_ep`` answered too. Guarding by default (an allow-list of probes)
also covers routes a later vLLM adds.
Verified by: tests/test_reliability_units.py (which paths need a key);
tests/e2e/test_reliability.py enumerates the live server's routes from its log and
asks each with no key, a wrong key and the right key.
Remove when: vLLM authenticates every model-serving route (not as of 0.30.0).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.entrypoints.serve.middleware.authenticate"

# Liveness/readiness probes and scrapers, which carry no key; they serve no model.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/load", "/version"})

RECORD = PatchRecord(
    name="api_key_all_routes",
    kind=Kind.FIX,
    target="vllm.entrypoints.serve.middleware.authenticate.AuthenticationMiddleware.__call__",
    process=Process.FRONTEND,
    why="vLLM's API key guards only /v1, /v2, /inference, /cohere; /invocations served "
    "completions without the key.",
    verified_by="tests/test_reliability_units.py; tests/e2e/test_reliability.py (every "
    "route of the live server, no key / wrong key / right key).",
    remove_when="vLLM guards every model-serving route.",
    upstream="https://github.com/vllm-project/vllm/issues/58144",
)


def requires_api_key(path: str) -> bool:
    return path.rstrip("/") not in OPEN_PATHS


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap_call)
    return "API key required on every route but " + ", ".join(sorted(OPEN_PATHS)) + (
        "" if now else " (on import)")


def _wrap_call(module) -> None:
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse

    def make(original):
        def __call__(self, scope, receive, send):
            if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
                path = scope["path"].removeprefix(scope.get("root_path", ""))
                if requires_api_key(path) and not self.verify_token(Headers(scope=scope)):
                    # The same answer vLLM gives on the paths it guards itself.
                    return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(
                        scope, receive, send)
            return original(self, scope, receive, send)

        return __call__

    wrap_method_once(module.AuthenticationMiddleware, "__call__", make)
