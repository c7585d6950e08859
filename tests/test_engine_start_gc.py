"""engine_start_gc: collection held back while an engine core starts in an LLM() process."""

from __future__ import annotations

import gc

import pytest

from vllm_omni_edge.levers import STARTUP_GC_ENV, startup_gc
from vllm_omni_edge.patches import PLUGIN_PATCHES
from vllm_omni_edge.patches.frontend import engine_start_gc as patch


@pytest.fixture(autouse=True)
def clean_gc_state(monkeypatch):
    monkeypatch.delenv(STARTUP_GC_ENV, raising=False)  # the default, young
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    hooked = []
    monkeypatch.setattr(patch, "when_imported", lambda module, fn: hooked.append(module))
    assert gc.isenabled() and not startup_gc.is_paused()
    yield hooked
    startup_gc.resume("test teardown")
    gc.unfreeze()
    gc.enable()


class FakeProcess:
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("parent,name,multiprocessing_env,builds", [
    (None, "MainProcess", "0", True),  # LLM() with the in-process engine
    (None, "MainProcess", "1", False),  # LLM()'s front end: the engine is a child
    (object(), "EngineCore", "1", True),  # vLLM's engine-core child
    (object(), "EngineCore_DP0", "1", True),
    (object(), "Worker_TP0", "1", False),  # a worker child: no engine core to resume it
])
def test_only_a_process_that_builds_the_engine_core_holds_collection_back(
        monkeypatch, parent, name, multiprocessing_env, builds):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing_env)
    monkeypatch.setattr(patch.multiprocessing, "parent_process", lambda: parent)
    monkeypatch.setattr(patch.multiprocessing, "current_process", lambda: FakeProcess(name))
    assert patch.builds_engine_core_here() is builds
    patch.apply()
    assert startup_gc.is_paused() is builds


def test_llm_start_pauses_young_and_resumes_after_the_engine_cores_freeze(clean_gc_state):
    threshold = gc.get_threshold()
    assert "held back until the engine core's freeze_gc_heap" in patch.apply()
    assert clean_gc_state == [patch.ENGINE_MODULE, patch.WORKER_MODULE]
    assert startup_gc.is_paused() and gc.get_threshold()[1:] == (startup_gc.NEVER, startup_gc.NEVER)
    assert startup_gc.record()["paused_for"] == "engine"
    seen = {}

    def vllm_freeze():
        seen["paused_during"] = startup_gc.is_paused()

    patch.wrap_engine_freeze(vllm_freeze)()
    assert seen == {"paused_during": True}  # vLLM's own collect-and-freeze ran first
    assert not startup_gc.is_paused() and gc.get_threshold() == threshold
    assert startup_gc.record()["resumed_by"] == startup_gc.RESUMED_ENGINE_READY


def test_a_serve_start_keeps_its_own_pause_until_server_ready(clean_gc_state):
    assert startup_gc.pause()  # what the CLI does first for `serve`
    assert "already held back in this process for the server start" in patch.apply()
    assert clean_gc_state == []
    patch.wrap_engine_freeze(lambda: None)()
    assert startup_gc.is_paused() and startup_gc.record()["paused_for"] == "server"


def test_flag_off_leaves_collection_on(monkeypatch, clean_gc_state):
    monkeypatch.setenv(STARTUP_GC_ENV, "0")
    assert "collection left on" in patch.apply()
    assert gc.isenabled() and not startup_gc.is_paused() and clean_gc_state == []


def test_the_engine_freeze_without_a_pause_is_vllms():
    calls = []
    patch.wrap_engine_freeze(lambda: calls.append(1))()
    assert calls == [1] and gc.isenabled() and not startup_gc.is_paused()


def test_it_is_a_plugin_patch_applied_in_every_process():
    assert "vllm_omni_edge.patches.frontend.engine_start_gc" in PLUGIN_PATCHES
    assert patch.RECORD.vllm_versions == ("0.30.0",)


def test_the_worker_evidence_says_how_the_pause_ended(monkeypatch, tmp_path):
    import json

    from vllm_omni_edge import evidence

    monkeypatch.setenv(evidence.EVIDENCE_ENV, str(tmp_path))
    patch.apply()
    worker_record = tmp_path / f"worker-{__import__('os').getpid()}.json"
    worker_record.write_text(json.dumps({"pid": 1, "startup_gc": startup_gc.record()}))  # at warm-up
    assert json.loads(worker_record.read_text())["startup_gc"]["paused_now"] is True
    patch.wrap_engine_freeze(lambda: None)()
    written = json.loads(worker_record.read_text())
    assert written["pid"] == 1
    assert written["startup_gc"]["resumed_by"] == startup_gc.RESUMED_ENGINE_READY
    assert written["startup_gc"]["paused_now"] is False


def test_no_worker_record_no_evidence_written(monkeypatch, tmp_path):
    from vllm_omni_edge import evidence

    monkeypatch.setenv(evidence.EVIDENCE_ENV, str(tmp_path))
    assert evidence.update_worker_evidence(startup_gc={}) is None
    assert not list(tmp_path.glob("worker-*.json"))


def test_applying_twice_pauses_and_hooks_once(clean_gc_state):
    patch.apply()
    assert "already held back in this process for the engine start" in patch.apply()
    assert clean_gc_state == [patch.ENGINE_MODULE, patch.WORKER_MODULE]  # hooked once
    import types

    calls = []
    engine_module = types.SimpleNamespace(freeze_gc_heap=lambda: calls.append("vllm"))
    patch._wrap_engine(engine_module)
    wrapped = engine_module.freeze_gc_heap
    patch._wrap_engine(engine_module)  # a second hook is a no-op
    assert engine_module.freeze_gc_heap is wrapped
    engine_module.freeze_gc_heap()
    assert calls == ["vllm"] and not startup_gc.is_paused()


def test_a_bad_flag_value_is_named_and_pauses_nothing(monkeypatch):
    from vllm_omni_edge.levers import LeverFlagError

    monkeypatch.setenv(STARTUP_GC_ENV, "maybe")
    with pytest.raises(LeverFlagError, match=f"{STARTUP_GC_ENV}='maybe': expected one of young, 1, pause, 0"):
        patch.apply()  # apply_patch_module records it as this patch's failure, naming the value
    assert gc.isenabled() and not startup_gc.is_paused()
