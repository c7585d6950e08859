"""patches/frontend/diffusion_chat_modalities.py, without a server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from vllm_omni_edge.patches.frontend.diffusion_chat_modalities import check_modalities_first, unsupported_modalities


def test_rule_is_engine_outputs_plus_text():
    assert unsupported_modalities(["audio", "image"], ["image", None]) == (["audio"], ["image", "text"])
    assert unsupported_modalities(["text", "image"], ["image"]) == ([], ["image", "text"])
    assert unsupported_modalities(None, ["image"])[0] == []


class FakeServing:
    def __init__(self, diffusion_mode: bool):
        self._diffusion_mode = diffusion_mode
        self.engine_client = SimpleNamespace(output_modalities=["image"])

    def _create_error_response(self, message):
        return ("error", message)


async def _original(self, request, raw_request=None):
    return "generated"


def _call(serving, modalities):
    wrapped = check_modalities_first(_original)
    return asyncio.run(wrapped(serving, SimpleNamespace(modalities=modalities)))


def test_diffusion_server_rejects_an_unsupported_modality_by_name():
    kind, message = _call(FakeServing(diffusion_mode=True), ["audio"])
    assert kind == "error"
    assert "Unsupported output modalities audio" in message and "Supported modalities: image, text" in message


def test_supported_modalities_and_other_pipelines_pass_through():
    assert _call(FakeServing(diffusion_mode=True), ["image"]) == "generated"
    assert _call(FakeServing(diffusion_mode=True), None) == "generated"
    assert _call(FakeServing(diffusion_mode=False), ["audio"]) == "generated"  # vLLM-Omni checks these itself
