"""The OpenAI server in one process: the default layout (no layout flag given).

One server serves the module's tests (a start costs ~60 s here); the engine-fault
test starts its own, through ``fault_injected_serve.py``, because it kills it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.conftest import vllm_env
from tests.e2e.fault_injected_serve import FAULT_FILE_ENV, FAULT_MESSAGE
from tests.e2e.test_reliability import HANG_BOUND_S, metric, wait_for
from tests.e2e.streaming import stream_in_background
from tests.e2e.test_server import SERVER_ARGS, start_server
from vllm_omni_edge.cli.demo import SERVED_NAME, ServerProcess, ask_streaming, free_port
from vllm_omni_edge.cpu_features import usable_cores
from vllm_omni_edge.levers import startup_gc
from vllm_omni_edge.patches.frontend import reserved_cores
from vllm_omni_edge.models.default_model import SMOKE_QUESTION

pytestmark = pytest.mark.e2e

CLIENTS = 4
# The default layout, with room for every concurrent client in one batch (the edge default is 2).
SINGLE_PROCESS = ["--max-num-seqs", str(CLIENTS)]
FAULT_SCRIPT = Path(__file__).with_name("fault_injected_serve.py")


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.delenv(reserved_cores.ENV, raising=False)
    monkeypatch_module.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch_module.delenv("GOMP_CPU_AFFINITY", raising=False)
    srv = start_server(default_model, tmp_path_factory.mktemp("single"), "single", SINGLE_PROCESS)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def evidence(server, prefix: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(server.evidence_dir.glob(f"{prefix}-*.json"))]


def stream_completion(server, max_tokens: int):
    return httpx.stream(
        "POST", server.base_url + "/v1/completions", timeout=HANG_BOUND_S,
        json={"model": SERVED_NAME, "prompt": "Tell me a long story.", "stream": True,
              "stream_options": {"include_usage": True},
              "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})


def test_the_server_is_one_process(server):
    root = psutil.Process(server.proc.pid)
    assert root.children(recursive=True) == []
    # The engine runs on a thread of it: more threads than the event loop alone.
    assert root.num_threads() > 1


def test_the_model_runs_in_the_api_server_process(server):
    [process] = evidence(server, "process")
    assert process["pid"] == server.proc.pid and process["role"] == "frontend"
    assert process["patches"]["single_process"] == "applied"
    [worker] = evidence(server, "worker")
    assert worker["pid"] == server.proc.pid  # the model was built and run by the server itself
    assert worker["kv_cache_bytes"] <= 192 << 20
    reserved = reserved_cores.ONE_PROCESS_RESERVED  # no engine-core process polls beside it
    assert worker["torch_threads"] == usable_cores() - reserved
    assert "the engine core and the model run in the API-server process" in server.log_tail(10_000)


def test_collection_was_paused_for_the_start_and_is_on_when_serving(server):
    # levers/startup_gc.py: paused by the CLI, one collect-and-freeze before the model
    # load, on again after the server's own freeze_gc_heap.
    [worker] = evidence(server, "worker")
    assert worker["startup_gc"]["paused_now"] is True and worker["startup_gc"]["frozen_before_load"] > 0
    assert worker["startup_gc"]["mode"] == "young"  # the default
    [process] = evidence(server, "process")
    assert process["patches"]["startup_gc"] == "applied"
    record = process["startup_gc"]
    assert record["paused"] and not record["paused_now"]
    assert record["resumed_by"] == startup_gc.RESUMED_SERVER_READY
    assert record["frozen_objects"] >= worker["startup_gc"]["frozen_before_load"]


def test_the_renderer_pool_started_with_one_tokenizer_copy(server):
    # patches/frontend/tokenizer_pool.py: vLLM asks for renderer_num_workers + 1 = 2 copies;
    # one is made up front (the concurrent-clients test below makes the pool grow for real).
    [process] = evidence(server, "process")
    assert process["patches"]["tokenizer_pool"] == "applied"
    assert process["tokenizer_pool"] == [{"asked": 2, "made_up_front": 1}]


def test_streamed_chat_answers(server):
    text, tokens, ttft, _ = ask_streaming(server.base_url, SMOKE_QUESTION, 24,
                                          out=None)
    assert "Paris" in text and tokens > 0 and ttft > 0
    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": SMOKE_QUESTION}],
        temperature=0, max_tokens=24)
    assert reply.choices[0].message.content == text


def test_concurrent_clients_are_batched(server):
    max_tokens = 256  # long enough that no stream ends before the last one is scheduled
    start = threading.Barrier(CLIENTS + 1)
    counts: list[int] = []
    errors: list[str] = []

    def client():
        start.wait()
        try:
            with stream_completion(server, max_tokens) as stream:
                events = [json.loads(line[6:]) for line in stream.iter_lines()
                          if line.startswith("data: {")]
            counts.append(events[-1]["usage"]["completion_tokens"])
        except Exception as err:  # reported below, with the others
            errors.append(repr(err))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    start.wait()
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, metric(server, "vllm:num_requests_running"))
        time.sleep(0.1)
    assert not errors, errors
    assert counts == [max_tokens] * CLIENTS  # every client got its whole answer
    assert peak == CLIENTS  # all four were in the running batch at once
    assert metric(server, "vllm:num_requests_running") == 0


def test_client_disconnect_aborts_and_frees_kv(server):
    max_tokens = 400
    generated_before = metric(server, "vllm:generation_tokens_total")
    with stream_completion(server, max_tokens) as stream:
        events = (line for line in stream.iter_lines() if line)
        for _ in range(3):
            assert next(events).startswith("data: {")
        running = metric(server, "vllm:num_requests_running")
        kv_in_use = metric(server, "vllm:kv_cache_usage_perc")
    assert running == 1 and kv_in_use > 0
    wait_for(lambda: metric(server, "vllm:num_requests_running") == 0,
             "the aborted request leaving the running set")
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert metric(server, "vllm:generation_tokens_total") - generated_before < max_tokens


class FaultInjectedServer(ServerProcess):
    """``vllm-omni-edge serve`` through fault_injected_serve.py (its __init__ differs only in the command)."""

    def __init__(self, model: str, port: int, extra_args: list[str], log_path: Path, env):
        self.port = port
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(FAULT_SCRIPT), model, "--port", str(port), *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def test_engine_fault_fails_health_and_exits_non_zero(default_model, tmp_path):
    trigger = tmp_path / "fault-now"
    server = FaultInjectedServer(str(default_model), free_port(), [*SERVER_ARGS, *SINGLE_PROCESS],
                                 tmp_path / "fault.log", env=vllm_env(**{FAULT_FILE_ENV: str(trigger)}))
    try:
        server.wait_ready(600)
        result, started, consumer = stream_in_background(lambda: stream_completion(server, 400))
        assert started.wait(HANG_BOUND_S) and "exception" not in result
        trigger.touch()
        health: list = []

        def server_gone() -> bool:
            try:
                health.append(httpx.get(server.base_url + "/health", timeout=5).status_code)
            except httpx.HTTPError:
                health.append("refused")
            return server.proc.poll() is not None

        wait_for(server_gone, "the server exiting after its engine died", step_s=0.1)
        consumer.join(HANG_BOUND_S)
        assert not consumer.is_alive(), "the in-flight request hangs"
        errors = [line for line in result.get("lines", []) if '"error"' in line]
        assert errors or "exception" in result, result
        assert 503 in health, health
        assert server.proc.returncode == 1
        log = server.log_tail(10_000)
        assert FAULT_MESSAGE in log and "the engine died" in log
    finally:
        server.stop()
