"""A stage process of a running omni server dies: requests fail fast and /health says so.

Uses the speech pipeline (Qwen2.5-Omni thinker -> talker -> code2wav at tiny size), because a
one-stage pipeline such as the image one runs its diffusion stage inside the API server
process (vLLM-Omni inlines a lone stage), so there is no stage process to lose.
The last stage (code2wav) is killed with SIGKILL, as an OOM kill or a crash would.
"""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from tests.omni.omni_server import OmniServer
from tests.omni.test_e2e_speech import SYSTEM, cpu_deploy, tiny_omni_model  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# A dead stage must fail a request, and /health must stop answering 200, within this.
FAILURE_DEADLINE_S = 120
KILLED_STAGE = 2  # code2wav


def stage_process(server: OmniServer, stage_id: int) -> psutil.Process:
    """The server's engine-core process of one stage (vLLM-Omni titles it ``StageEngineCoreProc_stage<N>_...``)."""
    title = f"StageEngineCoreProc_stage{stage_id}_"
    found, seen = [], []
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        seen.append(cmdline[:80])
        if title in cmdline:
            found.append(child)
    assert len(found) == 1, f"expected one process titled {title}*, found {len(found)} among: {seen}"
    return found[0]


def test_a_dead_stage_fails_the_next_request_fast_and_health_reports_it(tiny_omni_model, cpu_deploy, tmp_path):  # noqa: F811
    server = OmniServer(tiny_omni_model, tmp_path / "server.log", "--deploy-config", str(cpu_deploy))
    try:
        server.wait_ready(1500)
        model = server.model_name()
        stage_process(server, KILLED_STAGE).kill()

        body = {"model": model, "modalities": ["text", "audio"], "max_tokens": 8,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]}
        started = time.monotonic()
        try:
            resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=FAILURE_DEADLINE_S)
            assert resp.status_code >= 500, resp.text[-2000:]
        except httpx.TransportError:
            pass  # refused or cut because the server is shutting down: a failure too, and not a hang
        assert time.monotonic() - started < FAILURE_DEADLINE_S

        deadline = time.monotonic() + FAILURE_DEADLINE_S
        while time.monotonic() < deadline and server.health() == 200:
            time.sleep(1)
        assert server.health() != 200, server.tail()
        if server.proc.poll() is not None:  # a server that stops must say it failed
            assert server.proc.returncode != 0, server.tail()
    finally:
        server.stop()
