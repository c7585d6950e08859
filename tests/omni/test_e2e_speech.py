"""Speech out on CPU, end to end: Qwen2.5-Omni thinker -> talker -> code2wav at tiny size.

The checkpoint is built locally from transformers' real Qwen2.5-Omni classes with random
weights (vllm_omni_edge/omni/tiny_models.py), so text and audio are noise; the tests check
that every stage runs on the CPU platform and that the answers are valid media.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, vllm_env
from tests.omni.omni_server import OmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SYSTEM = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)


@pytest.fixture(scope="session")
def tiny_omni_model() -> Path:
    from vllm_omni_edge.models.default_model import cache_root
    from vllm_omni_edge.omni.tiny_models import tiny_qwen2_5_omni

    return tiny_qwen2_5_omni(cache_root() / "tiny")


@pytest.fixture(scope="session")
def cpu_deploy(tmp_path_factory) -> Path:
    from vllm_omni_edge.platforms.cpu.deploy import cpu_deploy_config

    return cpu_deploy_config("qwen2_5_omni", tmp_path_factory.mktemp("deploy"))


def _check_wav(data: bytes) -> tuple[int, int]:
    import numpy as np
    import soundfile as sf

    audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000
    assert audio.ndim == 1 and audio.size > 0
    assert np.isfinite(audio).all()
    return audio.size, rate


def test_omni_python_api_returns_text_and_wav(tiny_omni_model, cpu_deploy, tmp_path):
    wav = tmp_path / "out.wav"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.omni.omni_probe", str(tiny_omni_model), str(cpu_deploy), str(wav)],
        cwd=REPO, env=vllm_env(), capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["text_token_ids"]) == 8 and result["text"]  # ignore_eos, max_tokens 8
    assert result["audio_samples"] > 0 and result["sample_rate"] == 24000
    _check_wav(wav.read_bytes())


@pytest.fixture(scope="module")
def omni_server(tiny_omni_model, cpu_deploy, tmp_path_factory):
    server = OmniServer(tiny_omni_model, tmp_path_factory.mktemp("omni") / "server.log",
                         "--deploy-config", str(cpu_deploy))
    try:
        server.wait_ready(1500)
        yield server
    finally:
        server.stop()


def _chat(server: OmniServer, modalities: list[str], **extra) -> httpx.Response:
    body = {
        "model": server.model_name(),
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}],
        "modalities": modalities,
        "max_tokens": 8,
        **extra,
    }
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=900)


def test_chat_completions_returns_text_and_a_valid_wav(omni_server):
    resp = _chat(omni_server, ["text", "audio"])
    assert resp.status_code == 200, resp.text[-2000:]
    choices = resp.json()["choices"]
    texts = [c["message"].get("content") for c in choices if c["message"].get("content")]
    audios = [c["message"]["audio"] for c in choices if c["message"].get("audio")]
    assert texts, choices
    assert audios, choices
    _check_wav(base64.b64decode(audios[0]["data"]))


def test_unsupported_output_modality_is_a_clear_error(omni_server):
    resp = _chat(omni_server, ["video"])
    assert resp.status_code == 400, resp.text[-2000:]
    assert "video" in resp.text.lower()
    # The server is still healthy afterwards (no hang, no dead stage).
    assert httpx.get(omni_server.base_url + "/health", timeout=10).status_code == 200
