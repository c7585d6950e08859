"""Reject unsupported output modalities on a one-stage diffusion server's chat endpoint (HTTP 400).

What: wraps ``OmniOpenAIServingChat.create_chat_completion`` so that, when the server runs a
single diffusion stage (``_diffusion_mode``), a request whose ``modalities`` name an output the
pipeline does not produce gets a 400 "Unsupported output modalities ... Supported modalities:
...", the same rule and message vLLM-Omni applies to every other pipeline (the engine's output
modalities, plus "text").
Why: vLLM-Omni checks ``modalities`` only after it has routed diffusion-mode requests to its
image path, so on the tiny SD3 server ``/v1/chat/completions`` with ``"modalities":
["audio"]`` was not rejected: it silently generated an image at the model's default size
(1024 x 1024, 28 steps), which on a 2-core CPU ran past a 120 s client timeout (seen on this
box, 2026-11-30).
Verified by: tests/omni/test_e2e_image.py::test_unsupported_output_modality_is_a_clear_error
(400 naming "audio"; /health 200 after).
Remove when: vLLM-Omni validates ``modalities`` before its diffusion chat path.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm_omni.entrypoints.openai.serving_chat"

RECORD = PatchRecord(
    name="diffusion_chat_modalities",
    kind=Kind.OMNI,
    target=f"{TARGET_MODULE}.OmniOpenAIServingChat.create_chat_completion",
    process=Process.FRONTEND,
    why="On a one-stage diffusion server, chat requests skip vLLM-Omni's output-modality check: "
    "'modalities': ['audio'] generated a default-size image (minutes on CPU) instead of a 400.",
    verified_by="tests/omni/test_e2e_image.py::test_unsupported_output_modality_is_a_clear_error.",
    remove_when="vLLM-Omni validates 'modalities' before its diffusion chat path.",
    vllm_versions=("0.30.0",),
    package="vllm-omni",
    upstream="none found",
)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "diffusion chat checks modalities" + ("" if now else " (on import)")


def unsupported_modalities(requested, engine_modalities) -> tuple[list[str], list[str]]:
    """(unsupported, allowed): vLLM-Omni's rule for one-stage diffusion, engine outputs plus text."""
    allowed = {m for m in engine_modalities or () if m is not None} | {"text"}
    if not isinstance(requested, list):
        return [], sorted(allowed)
    return sorted({m for m in requested if isinstance(m, str)} - allowed), sorted(allowed)


def check_modalities_first(original):
    async def create_chat_completion(self, request, raw_request=None):
        if getattr(self, "_diffusion_mode", False) and getattr(request, "modalities", None):
            unsupported, allowed = unsupported_modalities(
                request.modalities, getattr(self.engine_client, "output_modalities", None))
            if unsupported:
                return self._create_error_response(
                    f"Unsupported output modalities {', '.join(unsupported)} for this model. "
                    f"Supported modalities: {', '.join(allowed)}")
        return await original(self, request, raw_request)

    return create_chat_completion


def _wrap(module) -> None:
    wrap_method_once(module.OmniOpenAIServingChat, "create_chat_completion", check_modalities_first)
