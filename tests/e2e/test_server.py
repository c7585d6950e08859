"""The OpenAI-compatible server, started the way a user starts it."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from openai import BadRequestError, OpenAI

from tests.conftest import vllm_env
from vllm_omni_edge.cli.demo import SERVED_NAME, ServerProcess, ask_streaming, free_port
from vllm_omni_edge.models.default_model import SMOKE_QUESTION

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 512
SERVER_ARGS = ["--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-cache-memory-bytes", "192M", "--enforce-eager"]


def start_server(model, log_dir, name, extra=(), **env):
    """A server on a free port with evidence in ``log_dir/<name>-evidence``; ready or stopped."""
    evidence = log_dir / f"{name}-evidence"
    server = ServerProcess(str(model), free_port(), [*SERVER_ARGS, *extra], log_dir / f"{name}.log",
                           env=vllm_env(VLLM_OMNI_EDGE_EVIDENCE_DIR=str(evidence), **env))
    server.evidence_dir = evidence
    try:
        server.wait_ready(600)
    except Exception:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    srv = start_server(default_model, tmp_path_factory.mktemp("server"), "first")
    yield srv
    assert srv.stop() is not None


def chat(server, question=SMOKE_QUESTION, max_tokens=24):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": question}],
        temperature=0, max_tokens=max_tokens,
    )
    return reply.choices[0].message.content


def test_greedy_answer_names_paris(server):
    assert "Paris" in chat(server)


def test_streamed_answer_matches_the_unstreamed_one(server):
    text, tokens, ttft, _ = ask_streaming(server.base_url, SMOKE_QUESTION,
                                          24, out=None)
    assert text == chat(server) and tokens > 0 and ttft > 0


def test_prompt_longer_than_max_model_len_is_a_400_naming_the_limit(server):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "word " * 2000}],
            max_tokens=8,
        )
    assert err.value.status_code == 400
    assert str(MAX_MODEL_LEN) in str(err.value)
    assert "Paris" in chat(server)  # and the server keeps serving


def test_a_second_server_does_not_disturb_the_first(server, default_model, tmp_path):
    before = chat(server)
    second = start_server(default_model, tmp_path, "second")
    try:
        assert second.port != server.port
        assert "Paris" in chat(second)
        assert chat(server) == before
    finally:
        second.stop()
    assert chat(server) == before
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_missing_model_path_is_one_clear_line(tmp_path):
    missing = tmp_path / "no-such-model"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_omni_edge.cli.main", "serve", str(missing)],
        capture_output=True, text=True, timeout=120, env=vllm_env(),
    )
    assert proc.returncode != 0
    assert str(missing) in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert time.monotonic() - start < 60
