"""idle_trim: the heap is trimmed once each time the engine goes from busy to idle."""

from __future__ import annotations

import queue

from vllm_omni_edge.patches.worker import idle_trim


class FakeEngine:
    """An engine core with a scheduler's ``has_work`` and an input queue; each wait for work
    takes the next request queued (as vLLM's blocking wait does) or returns with none."""

    def __init__(self):
        self.input_queue = queue.Queue()
        self.pending = 0
        self.waits = 0

    def has_work(self):
        return self.pending > 0

    def _process_input_queue(self):
        self.waits += 1
        while not self.input_queue.empty():
            self.pending += self.input_queue.get_nowait()


def wrapped():
    trims = []

    def trim():
        trims.append(1)
        return {"trimmed": True}

    cls = type("Engine", (FakeEngine,), {})
    cls._process_input_queue = idle_trim.make_wrapper(FakeEngine._process_input_queue, trim)
    return cls(), trims


def test_no_trim_before_the_first_step():
    engine, trims = wrapped()
    engine._process_input_queue()
    engine._process_input_queue()
    assert trims == []


def test_trims_once_per_busy_to_idle_transition():
    engine, trims = wrapped()
    engine.input_queue.put(2)
    engine._process_input_queue()  # work arrives: a step follows
    engine.pending = 1
    engine._process_input_queue()  # still busy
    assert trims == []
    engine.pending = 0
    engine._process_input_queue()  # idle: trim
    engine._process_input_queue()  # still idle: no second trim
    assert len(trims) == 1
    engine.input_queue.put(1)
    engine._process_input_queue()
    engine.pending = 0
    engine._process_input_queue()
    assert len(trims) == 2


def test_no_trim_with_a_request_queued():
    engine, trims = wrapped()
    engine.input_queue.put(1)
    engine._process_input_queue()
    engine.pending = 0
    engine.input_queue.put(1)  # queued before the wait: not idle
    engine._process_input_queue()
    assert trims == []
    assert engine.pending == 1


def test_a_non_blocking_wait_without_work_arms_no_trim():
    engine, trims = wrapped()
    for _ in range(5):
        engine._process_input_queue()
    assert trims == [] and engine.waits == 5


def test_wraps_the_engine_core_once(monkeypatch):
    from vllm.v1.engine import core

    original = core.EngineCoreProc._process_input_queue
    monkeypatch.setattr(core.EngineCoreProc, "_process_input_queue", original)
    idle_trim._wrap(core)
    first = core.EngineCoreProc._process_input_queue
    idle_trim._wrap(core)
    assert core.EngineCoreProc._process_input_queue is first
    assert first is not original or getattr(original, "__edge_idle_trim__", False)


def test_trim_heap_without_collect_skips_gc(monkeypatch):
    import gc

    from vllm_omni_edge.levers import heap

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1))
    result = heap.trim_heap(collect=False)
    assert calls == []
    assert "trimmed" in result


def test_llm_run_engine_trims_once_after_it_returns_the_outputs():
    calls = []

    class FakeLLM:
        def _run_engine(self, *, use_tqdm=False):
            calls.append("run")
            return ["out"]

    original = FakeLLM._run_engine
    for _ in range(2):  # wrapped once
        idle_trim.wrap_method_once(FakeLLM, "_run_engine",
                                   lambda o: idle_trim.make_run_engine_wrapper(o, trim=lambda: calls.append("trim") or {"ok": 1}),
                                   marker="__edge_idle_trim__")
    assert FakeLLM._run_engine.__wrapped__ is original
    assert FakeLLM()._run_engine(use_tqdm=False) == ["out"]
    assert calls == ["run", "trim"] and idle_trim.last_idle_trim == {"ok": 1}


def test_the_real_llm_has_the_method_the_patch_wraps():
    from vllm.entrypoints import llm

    assert callable(llm.LLM._run_engine)
