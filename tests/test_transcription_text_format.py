"""patches/frontend/transcription_text_format.py: response_format=text answers text/plain."""

from __future__ import annotations

import asyncio
import importlib
import types

import pytest
from fastapi.responses import JSONResponse, PlainTextResponse

from vllm_omni_edge.patches.frontend import transcription_text_format as patch


class _Serving:
    async def create_transcription(self, audio_data, request, raw_request=None):
        if request.response_format == "bad":
            return types.SimpleNamespace(error=types.SimpleNamespace(code=400), text=None)
        return types.SimpleNamespace(text="the quick brown fox")


def _router():
    return types.SimpleNamespace(JSONResponse=JSONResponse)


def _handle(serving, router, response_format, status_code=200):
    """What vLLM's route does: await the serving call, then build the response."""
    async def route():
        request = types.SimpleNamespace(response_format=response_format)
        result = await serving.create_transcription(b"", request, None)
        return router.JSONResponse(content={"text": result.text}, status_code=status_code)
    return asyncio.run(route())


@pytest.fixture
def wrapped():
    serving_cls = type("Serving", (_Serving,), {})
    router = _router()
    for _ in range(2):  # idempotent
        patch._wrap_serving(serving_cls, "create_transcription")
        patch._wrap_router(router)
    assert serving_cls.create_transcription.__wrapped__ is _Serving.create_transcription
    assert router.JSONResponse.__wrapped__ is JSONResponse
    return serving_cls(), router


def test_text_is_answered_as_plain_text(wrapped):
    response = _handle(*wrapped, "text")
    assert isinstance(response, PlainTextResponse)
    assert response.body == b"the quick brown fox" and response.media_type == "text/plain"


@pytest.mark.parametrize("fmt", ["json", "verbose_json"])
def test_other_formats_stay_json(wrapped, fmt):
    response = _handle(*wrapped, fmt)
    assert type(response) is JSONResponse and b'"text"' in response.body


def test_an_error_stays_json_with_its_status(wrapped):
    response = _handle(*wrapped, "bad", status_code=400)
    assert type(response) is JSONResponse and response.status_code == 400


def test_a_text_request_does_not_leak_into_the_next_request(wrapped):
    serving, router = wrapped
    assert isinstance(_handle(serving, router, "text"), PlainTextResponse)
    assert type(_handle(serving, router, "json")) is JSONResponse


def test_vllms_names_the_patch_replaces_exist():
    for module, (cls, method) in patch.SERVING.items():
        assert callable(getattr(getattr(importlib.import_module(module), cls), method))
    for module in patch.ROUTERS:
        assert importlib.import_module(module).JSONResponse is not None
