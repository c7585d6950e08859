"""The one-process server's step hand-off: the engine thread waits until the event loop has
streamed a step's tokens, never longer than its timeout, and only for steps with tokens."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_omni_edge.engine import in_process  # noqa: E402
from vllm_omni_edge.levers import LeverFlagError, step_handoff_enabled  # noqa: E402


def tokens_item():
    return (0, SimpleNamespace(outputs=[object()]))


@pytest.fixture
def loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop

    def stop():
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.call_soon(loop.stop)

    loop.call_soon_threadsafe(stop)
    thread.join(5)
    loop.close()


def streaming_consumer(loop, written: list):
    """A queue reader and a per-request stream, two tasks apart, as AsyncLLM's output handler
    and a request's generator are."""
    outputs: asyncio.Queue = asyncio.Queue()
    request: asyncio.Queue = asyncio.Queue()

    async def output_handler():
        while True:
            request.put_nowait(await outputs.get())

    async def stream():
        while True:
            written.append(await request.get())

    def start():
        loop.create_task(output_handler())
        loop.create_task(stream())

    loop.call_soon_threadsafe(start)
    return outputs


def test_the_step_returns_after_its_tokens_were_streamed(loop_thread):
    written: list = []
    outputs = streaming_consumer(loop_thread, written)
    bridge = in_process._OutputBridge(loop_thread, outputs.put_nowait, handoff=True)
    for step in range(20):
        item = tokens_item()
        bridge.put_nowait(item)
        assert written[-1] is item, f"step {step}: the engine went on before the chunk was written"


def test_without_the_handoff_the_step_does_not_wait(loop_thread):
    blocked = threading.Event()
    release = threading.Event()
    delivered = []

    def block():
        blocked.set()
        release.wait(10)

    loop_thread.call_soon_threadsafe(block)
    assert blocked.wait(5)
    in_process._OutputBridge(loop_thread, delivered.append, handoff=False).put_nowait(tokens_item())
    assert delivered == []  # handed over, not waited for
    release.set()


def test_a_busy_loop_delays_a_step_by_the_timeout_at_most(loop_thread):
    blocked = threading.Event()
    release = threading.Event()
    delivered = []

    def block():
        blocked.set()
        release.wait(10)

    loop_thread.call_soon_threadsafe(block)
    assert blocked.wait(5)
    # The loop is stuck; the step comes back on its own (the loop is released only after).
    in_process._OutputBridge(loop_thread, delivered.append, handoff=True).put_nowait(tokens_item())
    assert delivered == []
    release.set()


def test_steps_without_tokens_and_engine_death_are_not_waited_for(loop_thread):
    blocked = threading.Event()
    release = threading.Event()

    def block():
        blocked.set()
        release.wait(10)

    loop_thread.call_soon_threadsafe(block)
    assert blocked.wait(5)
    bridge = in_process._OutputBridge(loop_thread, lambda item: None, handoff=True)
    waits = []
    original = threading.Event.wait
    try:
        threading.Event.wait = lambda self, timeout=None: waits.append(timeout) or original(self, timeout)
        bridge.put_nowait((0, SimpleNamespace(outputs=[])))
        bridge.put_nowait(in_process.EngineCoreProc.ENGINE_CORE_DEAD)
    finally:
        threading.Event.wait = original
    assert waits == []
    release.set()


def test_the_flag(monkeypatch):
    monkeypatch.delenv("VLLM_OMNI_EDGE_STEP_HANDOFF", raising=False)
    assert step_handoff_enabled()
    monkeypatch.setenv("VLLM_OMNI_EDGE_STEP_HANDOFF", "0")
    assert not step_handoff_enabled()
    monkeypatch.setenv("VLLM_OMNI_EDGE_STEP_HANDOFF", "yes")
    with pytest.raises(LeverFlagError, match="STEP_HANDOFF"):
        step_handoff_enabled()
