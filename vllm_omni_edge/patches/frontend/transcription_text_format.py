"""``response_format=text`` on the audio endpoints answers plain text, as OpenAI's API does.

What: wraps ``OpenAIServingTranscription.create_transcription`` and
``OpenAIServingTranslation.create_translation``: when the request asked for ``text`` and the
result is a whole response (not an error, not a stream), its text is kept in a context
variable. The two API routers' ``JSONResponse`` name is replaced by one that answers that text
as ``text/plain`` instead of ``{"text": ...}``; every other response is built as before.
Why: vLLM accepts ``response_format=text`` but answers JSON, so the openai client's
``response_format="text"`` (documented to return the transcript as a string) returns the
JSON document, and ``curl -F response_format=text`` prints JSON.
Verified by: tests/test_transcription_text_format.py (the router answers text/plain only
for a ``text`` request; json, errors and other routes unchanged; idempotent);
tests/e2e/test_whisper_serve.py (the openai client's ``response_format="text"``).
Remove when: vLLM answers ``response_format=text`` with plain text.
"""

from __future__ import annotations

import contextvars

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import when_imported

SERVING = {
    "vllm.entrypoints.speech_to_text.transcription.serving": ("OpenAIServingTranscription", "create_transcription"),
    "vllm.entrypoints.speech_to_text.translation.serving": ("OpenAIServingTranslation", "create_translation"),
}
ROUTERS = (
    "vllm.entrypoints.speech_to_text.transcription.api_router",
    "vllm.entrypoints.speech_to_text.translation.api_router",
)

RECORD = PatchRecord(
    name="transcription_text_format",
    kind=Kind.FIX,
    target="OpenAIServingTranscription.create_transcription, OpenAIServingTranslation.create_translation; "
    "JSONResponse in vllm.entrypoints.speech_to_text.{transcription,translation}.api_router",
    process=Process.FRONTEND,
    why="vLLM answers response_format=text with a JSON document; OpenAI's API (and its client) "
    "answer plain text.",
    verified_by="tests/test_transcription_text_format.py; tests/e2e/test_whisper_serve.py "
    "(openai client, response_format='text').",
    remove_when="vLLM's audio routers answer response_format=text with text/plain.",
    upstream="none found",
)

# The transcript of a response_format=text request, set by the serving wrapper and read by the
# router's response factory in the same request task.
_plain_text: contextvars.ContextVar[str | None] = contextvars.ContextVar("edge_plain_text", default=None)


def apply() -> str:
    for module, (cls, method) in SERVING.items():
        when_imported(module, lambda m, cls=cls, method=method: _wrap_serving(getattr(m, cls), method))
    for module in ROUTERS:
        when_imported(module, _wrap_router)
    return "response_format=text answers text/plain on /v1/audio/transcriptions and /translations"


def _wrap_serving(cls, method: str) -> None:
    original = getattr(cls, method)
    if getattr(original, "_vllm_omni_edge_text", False):
        return

    async def wrapper(self, audio_data, request, raw_request=None, *args, **kwargs):
        _plain_text.set(None)
        result = await original(self, audio_data, request, raw_request, *args, **kwargs)
        if getattr(request, "response_format", None) == "text" and isinstance(getattr(result, "text", None), str) \
                and not hasattr(result, "error"):
            _plain_text.set(result.text)
        return result

    wrapper._vllm_omni_edge_text = True
    wrapper.__wrapped__ = original
    wrapper.__name__ = method
    setattr(cls, method, wrapper)


def _wrap_router(module) -> None:
    original = module.JSONResponse
    if getattr(original, "_vllm_omni_edge_text", False):
        return
    from fastapi.responses import PlainTextResponse

    def JSONResponse(content=None, status_code: int = 200, *args, **kwargs):  # noqa: N802 (the name it replaces)
        text = _plain_text.get()
        if text is not None and status_code == 200:
            _plain_text.set(None)
            return PlainTextResponse(text)
        return original(content=content, status_code=status_code, *args, **kwargs)

    JSONResponse._vllm_omni_edge_text = True
    JSONResponse.__wrapped__ = original
    module.JSONResponse = JSONResponse
