"""A spoken question answered in one HTTP request: Whisper -> SmolLM2-135M (cpu_int4) on vLLM-Omni.

``vllm-omni serve ROOT --omni`` on the pipeline root of whisper-base and SmolLM2-135M-Instruct,
both cpu_int4 (vllm_omni_edge/omni/spoken_question.py), then /v1/chat/completions with the committed
question tests/fixtures/speech/capital.wav ("What is the capital of France?") as a base64
``input_audio`` part. Two stage processes start one after the other (about 3 minutes on an
idle 2-core box, more under load), so this is ``slow``.
"""

from __future__ import annotations

import httpx
import pytest

from tests.omni.omni_server import OmniServer
from tests.omni.spoken_question_measure import chat_body
from tests.speech import wav

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_omni_edge.models.default_model import DEFAULT_MODEL, WHISPER_BASE, pull_cpu_int4_model
    from vllm_omni_edge.omni.spoken_question import build_pipeline_dir

    root = build_pipeline_dir(pull_cpu_int4_model(WHISPER_BASE), pull_cpu_int4_model(DEFAULT_MODEL),
                              tmp_path_factory.mktemp("root"))
    srv = OmniServer(root, tmp_path_factory.mktemp("spoken") / "serve.log")
    try:
        srv.wait_ready(2400)
    except Exception:
        srv.stop()
        raise
    yield srv
    assert srv.stop() is not None


def chat(server, body, timeout=600) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=timeout)


def test_spoken_question_is_answered(server):
    response = chat(server, chat_body(server.model_name(), wav("capital").read_bytes(), return_stage_metrics=True))
    assert response.status_code == 200, response.text
    body = response.json()
    answer = body["choices"][0]["message"]["content"]
    assert "paris" in answer.lower(), answer
    assert body["choices"][0]["finish_reason"] == "stop", answer  # ended at the model's end of turn
    stages = body["metrics"]["stage_metrics"]
    assert stages["0"]["stage_name"] == "asr" and stages["0"]["num_tokens_out"] > 0
    assert stages["1"]["stage_name"] == "answer"
    log = server.log_path.read_text(errors="replace")
    assert "capital of France" in log  # the logged transcript
    # Both stages load cpu_int4: Whisper's 66 linears, its embedding and tied head; SmolLM2's 120 + 2.
    assert "cpu_int4: 68 layers" in log and "cpu_int4: 122 layers" in log
    assert "'fallback': 0" in log and "'fallback': 1" not in log


def test_a_request_without_audio_is_a_400_naming_it(server):
    body = {"model": server.model_name(), "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    response = chat(server, body, timeout=120)
    assert response.status_code == 400 and "exactly one audio part" in response.text, response.text
    assert server.health() == 200
