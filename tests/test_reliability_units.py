"""The pure logic behind the server's reliability defaults: request guard, port check,
API-key routes, engine-death exit status. The live server is tested in
tests/e2e/test_reliability.py."""

from __future__ import annotations

import importlib
import socket
import time
import types

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from vllm_omni_edge.cli import request_guard
from vllm_omni_edge.cli.request_guard import (
    MAX_REQUEST_BYTES_ENV,
    RequestGuard,
    body_problem,
    max_request_bytes,
)
from vllm_omni_edge.cli.serve import (
    REQUEST_GUARD,
    ServeSetupError,
    _check_listen_address,
    check_port_free,
    edge_serve_argv,
)
from vllm_omni_edge.cli.serving_defaults import option_value
from vllm_omni_edge.patches.frontend import api_key_all_routes, engine_death_exit

BAD_TOOL = {"type": "function",
            "function": {"name": "lookup", "parameters": {"type": "banana"}}}
GOOD_TOOL = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


async def echo(request: Request):
    body = await request.body()
    return JSONResponse({"bytes": len(body), "disconnected": await request.is_disconnected()})


def guarded_client(limit: int) -> TestClient:
    app = Starlette(routes=[Route("/v1/echo", echo, methods=["POST", "GET"])])
    app.add_middleware(RequestGuard, max_body_bytes=limit)
    return TestClient(app)


def test_body_limit_defaults_and_reads_the_environment():
    assert max_request_bytes({}) == 8 << 20
    assert max_request_bytes({MAX_REQUEST_BYTES_ENV: "1024"}) == 1024
    for bad in ("0", "-3", "lots"):
        with pytest.raises(ValueError, match=MAX_REQUEST_BYTES_ENV):
            max_request_bytes({MAX_REQUEST_BYTES_ENV: bad})


def test_a_body_over_the_limit_is_a_413_naming_the_limit():
    client = guarded_client(1000)
    reply = client.post("/v1/echo", content=b"x" * 1001)
    assert reply.status_code == 413
    message = reply.json()["error"]["message"]
    assert "1001 bytes" in message and "at most 1000 bytes" in message
    assert MAX_REQUEST_BYTES_ENV in message


def test_a_chunked_body_is_cut_off_at_the_limit():
    client = guarded_client(1000)
    reply = client.post("/v1/echo", content=iter([b"x" * 600, b"x" * 600]))
    assert reply.status_code == 413
    assert "passed 1000 bytes" in reply.json()["error"]["message"]


def test_a_body_within_the_limit_reaches_the_app_whole():
    client = guarded_client(1000)
    reply = client.post("/v1/echo", content=b"{}" + b" " * 998)
    assert reply.status_code == 200 and reply.json() == {"bytes": 1000, "disconnected": False}
    assert client.get("/v1/echo").status_code == 200


def test_non_utf8_json_is_a_400_naming_the_byte():
    problem = body_problem(b'{"prompt": "h\xffi"}', "application/json")
    assert problem.status == 400
    assert "not valid UTF-8" in problem.message and "0xff at offset 13" in problem.message
    # Other media types are not ours to judge.
    assert body_problem(b"\xff\xfe", "audio/wav") is None
    reply = guarded_client(1000).post("/v1/echo", content=b'{"a": "\xfe"}',
                                      headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "UTF-8" in reply.json()["error"]["message"]


@pytest.mark.parametrize("payload", [
    {"tools": [BAD_TOOL]},  # OpenAI chat
    {"tools": [{"type": "function", "name": "lookup", "parameters": {"type": "banana"}}]},
    {"tools": [{"name": "lookup", "input_schema": {"properties": 5}}]},  # Anthropic
])
def test_a_tool_schema_that_is_not_json_schema_is_named(payload):
    problem = request_guard.tool_schema_problem(payload)
    assert problem is not None and problem.status == 400
    assert "tools[0]" in problem.message and "'lookup'" in problem.message
    assert "not a valid JSON Schema" in problem.message


def test_valid_tool_schemas_and_other_bodies_pass():
    import json

    assert request_guard.tool_schema_problem({"tools": [GOOD_TOOL]}) is None
    assert body_problem(json.dumps({"tools": [GOOD_TOOL]}).encode(), "application/json") is None
    assert body_problem(b'{"tools": [', "application/json") is None  # vLLM names JSON errors
    assert body_problem(b'{"prompt": "caf\xc3\xa9"}', "application/json; charset=utf-8") is None


def test_option_value_follows_argparse_last_wins():
    assert option_value(["--port", "1", "--port=2"], "--port") == "2"
    assert option_value(["--portal", "3"], "--port") is None


def test_a_taken_port_is_one_line_naming_it():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ServeSetupError) as err:
            check_port_free("127.0.0.1", port)
    message = str(err.value)
    assert f"port {port} is already in use" in message and "\n" not in message
    check_port_free("127.0.0.1", port)  # free again once the holder closes


def test_listen_check_reads_host_and_port_and_leaves_the_rest_to_vllm():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        with pytest.raises(ServeSetupError, match=f"port {port} "):
            _check_listen_address(["model", "--host", "127.0.0.1", f"--port={port}"])
        _check_listen_address(["model", "--port", port, "--uds", "/tmp/edge.sock"])
        _check_listen_address(["model", "--port", "eighty"])  # vLLM's parser names it


def test_serve_argv_adds_the_request_guard(default_model):
    argv = edge_serve_argv([str(default_model)])
    assert argv[argv.index("--middleware") + 1] == REQUEST_GUARD
    module, name = REQUEST_GUARD.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is RequestGuard


def test_only_probes_are_open_without_the_api_key():
    for path in ("/health", "/ping", "/metrics", "/load", "/version", "/health/"):
        assert not api_key_all_routes.requires_api_key(path)
    for path in ("/invocations", "/tokenize", "/detokenize", "/v1/models", "/docs",
                 "/openapi.json", "/scale_elastic_ep", "/", "/healthz"):
        assert api_key_all_routes.requires_api_key(path)


def test_vllm_auth_middleware_guards_every_route_once_patched():
    authenticate = importlib.import_module(api_key_all_routes.TARGET_MODULE)
    api_key_all_routes._wrap_call(authenticate)
    api_key_all_routes._wrap_call(authenticate)  # idempotent

    async def ok(request):
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"])
                            for p in ("/invocations", "/tokenize", "/v1/models", "/health")])
    app.add_middleware(authenticate.AuthenticationMiddleware, tokens=["right"])
    client = TestClient(app)
    for path in ("/invocations", "/tokenize", "/v1/models"):
        assert client.post(path).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer right"}).status_code == 200
    assert client.get("/health").status_code == 200


@pytest.fixture
def fresh_death_flag(monkeypatch):
    monkeypatch.setattr(engine_death_exit, "_engine_died", False)


@pytest.mark.parametrize("errored, running, exits, died", [
    (True, False, True, True),     # engine dead: the watchdog stops the server
    (False, True, False, False),   # healthy
    (True, False, False, False),   # VLLM_KEEP_ALIVE_ON_ENGINE_DEATH: server stays up
    (False, True, True, False),    # ordinary shutdown (SIGINT) is not a death
])
def test_engine_death_is_noted_only_when_it_stops_the_server(
        fresh_death_flag, errored, running, exits, died):
    server = types.SimpleNamespace(should_exit=False)
    engine = types.SimpleNamespace(errored=errored, is_running=running)

    def original(server, engine):
        if exits:
            server.should_exit = True

    engine_death_exit.wrap_terminate_if_errored(original)(server, engine)
    assert engine_death_exit.engine_died() is died


def test_stop_process_group_stops_the_whole_group():
    import signal
    import subprocess

    import psutil

    from vllm_omni_edge.cli.demo import stop_process_group

    # A parent that ignores SIGINT and a child that would outlive it.
    proc = subprocess.Popen(["sh", "-c", "trap '' INT; sleep 300 & wait"], start_new_session=True)
    child_deadline = time.monotonic() + 5
    while not psutil.Process(proc.pid).children() and time.monotonic() < child_deadline:
        time.sleep(0.05)
    [child] = psutil.Process(proc.pid).children()
    assert stop_process_group(proc, grace_s=0.5) is not None
    assert proc.returncode in (-signal.SIGTERM, -signal.SIGKILL)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
