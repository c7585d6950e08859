"""whisper-base built as cpu_int4, served by `vllm-omni-edge serve whisper-base:cpu_int4`.

Every linear of vLLM's Whisper (encoder and decoder, self- and cross-attention, fc1/fc2) must
run on a cpu_int4 kernel in the server's own worker (its evidence), and the committed speech
fixtures must be transcribed within the float checkpoint's bound.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.conftest import vllm_env
from tests.e2e.test_whisper_serve import FIXTURE_WER_MAX
from tests.speech import sentences, wav, wer
from vllm_omni_edge.cli.demo import ServerProcess, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NAME = "whisper-base:cpu_int4"
SERVED = "whisper-int4"  # not NAME: serve rewrites arguments equal to the embedded name
# The bound is the float checkpoint's (tests/e2e/test_whisper_serve.py): 4-bit weights must not
# cost a transcript more than the float model is allowed. The per-fixture transcripts of both are
# in docs/edge/speech.md; a quantization that broke a layer (a shard in the wrong rows, a k bias
# not zero) answers noise, far above the bound.


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_omni_edge.models.default_model import WHISPER_BASE, pull_cpu_int4_model

    checkpoint = pull_cpu_int4_model(WHISPER_BASE)
    log_dir = tmp_path_factory.mktemp("whisper-int4")
    evidence = log_dir / "evidence"
    srv = ServerProcess(NAME, free_port(), ["--served-model-name", SERVED, "--enforce-eager"],
                        log_dir / "serve.log", env=vllm_env(VLLM_OMNI_EDGE_EVIDENCE_DIR=str(evidence)))
    srv.checkpoint, srv.evidence_dir = checkpoint, evidence
    try:
        srv.wait_ready(600)
    except Exception:
        srv.stop()
        raise
    yield srv
    assert srv.stop() is not None


def transcribe(server, key: str) -> str:
    response = httpx.post(server.base_url + "/v1/audio/transcriptions",
                          data={"model": SERVED, "language": "en", "temperature": "0"},
                          files={"file": ("audio.wav", wav(key).read_bytes(), "audio/wav")}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["text"].strip()


def test_fixtures_are_transcribed_within_the_float_bound(server):
    refs = sentences()
    hyps = [transcribe(server, key) for key in refs]
    assert wer(list(refs.values()), hyps) <= FIXTURE_WER_MAX, hyps


def test_every_whisper_linear_ran_on_a_cpu_int4_kernel(server):
    from vllm_omni_edge.quantization.kernels import CpuFeatures, choose_kernel

    config = json.loads((server.checkpoint / "config.json").read_text())
    # vLLM's layers: encoder qkv_proj, out_proj, fc1, fc2; decoder the same plus the
    # cross-attention's q_proj, kv_proj, out_proj. The head stays tied to the float embedding.
    linears = 4 * config["encoder_layers"] + 7 * config["decoder_layers"]
    d = config["d_model"]
    routed = choose_kernel(CpuFeatures.detect(), config["quantization_config"]["group_size"], d, d,
                           torch.float32, float_zero=True)[0].name
    [worker] = [json.loads(p.read_text()) for p in server.evidence_dir.glob("worker-*.json")]
    assert worker["quantization"] == "cpu_int4"
    assert worker["cpu_int4_kernels"] == {f"linear:{routed}": linears, "fallback": 0, "dense_prefill_copy": 0}
    assert worker["cpu_int4_other_layers"] == []
    by_dtype = worker["weights_bytes_by_dtype"]
    # The linears' weights at 4 bits (half a byte each) are the only uint8 tensors: self-attention
    # q/k/v/out (4 d x d), cross-attention's four more in the decoder, fc1 and fc2 (2 d x ffn).
    enc, dec, ffn = config["encoder_layers"], config["decoder_layers"], config["encoder_ffn_dim"]
    weights = enc * (4 * d * d + 2 * d * ffn) + dec * (8 * d * d + 2 * d * ffn)
    assert by_dtype.get("uint8", 0) == weights // 2, by_dtype
