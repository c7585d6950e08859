"""The startup_gc lever: automatic collection paused while a server starts, on again after."""

from __future__ import annotations

import gc
import multiprocessing
import time
import weakref

import pytest

from vllm_omni_edge.cli.vllm_entry import pause_collection_for_start, starts_a_server
from vllm_omni_edge.levers import STARTUP_GC_ENV, startup_gc
from vllm_omni_edge.patches import CLI_PATCHES
from vllm_omni_edge.patches.base import PatchOutcome
from vllm_omni_edge.patches.frontend import startup_gc as patch


@pytest.fixture(autouse=True)
def clean_gc_state(monkeypatch):
    monkeypatch.setenv(STARTUP_GC_ENV, "pause")  # the tests of the paused form; young says so
    assert gc.isenabled() and not startup_gc.is_paused()
    yield
    startup_gc.resume("test teardown")
    gc.unfreeze()
    gc.enable()


def test_pause_turns_collection_off_until_resume():
    assert startup_gc.pause()
    assert not gc.isenabled() and startup_gc.is_paused()
    assert not startup_gc.pause()  # once
    record = startup_gc.record()
    assert {k: record[k] for k in ("paused", "mode", "paused_for", "resumed_by", "paused_now")} == {
        "paused": True, "mode": "pause", "paused_for": "server", "resumed_by": None, "paused_now": True}
    assert {"import_pauses", "import_seconds_paused"} <= record.keys()  # patches/common/import_gc.py's
    done = startup_gc.resume("because")
    assert gc.isenabled() and not startup_gc.is_paused()
    assert done["resumed_by"] == "because" and done["seconds_paused"] >= 0
    assert startup_gc.resume("again") is None  # idempotent
    assert startup_gc.record()["paused_now"] is False


def test_young_mode_collects_young_cycles_and_never_scans_old_objects(monkeypatch):
    monkeypatch.setenv(STARTUP_GC_ENV, "young")
    before = gc.get_threshold()
    assert startup_gc.pause()
    assert gc.isenabled() and startup_gc.is_paused() and startup_gc.record()["mode"] == "young"
    assert gc.get_threshold() == (before[0], startup_gc.NEVER, startup_gc.NEVER)

    class Node:
        pass

    garbage = Node()
    garbage.self = garbage
    collected = weakref.ref(garbage)
    del garbage
    full_before = gc.get_stats()[2]["collections"]
    keep = [Node() for _ in range(before[0] * 3)]  # enough allocations for young collections
    assert collected() is None  # a young cycle is collected automatically while "paused"
    frozen = startup_gc.collect_and_freeze()
    assert frozen > 0 and gc.get_stats()[2]["collections"] == full_before  # no full scan
    startup_gc.resume("because")
    assert gc.get_threshold() == before and gc.isenabled()
    del keep


def test_young_is_the_default_and_1_keeps_meaning_pause(monkeypatch):
    from vllm_omni_edge.levers import startup_gc_mode

    monkeypatch.delenv(STARTUP_GC_ENV)
    assert startup_gc_mode() == "young"
    monkeypatch.setenv(STARTUP_GC_ENV, "1")
    assert startup_gc_mode() == "pause"


def test_flag_off_leaves_collection_on(monkeypatch):
    monkeypatch.setenv(STARTUP_GC_ENV, "0")
    assert not startup_gc.pause()
    assert gc.isenabled() and not startup_gc.is_paused()


def test_collection_someone_else_turned_off_is_left_to_them():
    gc.disable()
    try:
        assert not startup_gc.pause()
        assert startup_gc.resume("not ours") is None
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_deadline_resumes_a_start_that_never_got_ready():
    assert startup_gc.pause(deadline_s=0.05)
    for _ in range(100):
        if not startup_gc.is_paused():
            break
        time.sleep(0.02)
    assert gc.isenabled() and startup_gc.record()["resumed_by"] == startup_gc.RESUMED_DEADLINE


def test_collect_and_freeze_only_while_paused():
    assert startup_gc.collect_and_freeze() is None and gc.get_freeze_count() == 0
    startup_gc.pause()

    class Node:
        pass

    garbage = Node()
    garbage.self = garbage
    collected = weakref.ref(garbage)
    del garbage
    frozen = startup_gc.collect_and_freeze()
    assert collected() is None  # the cycle was collected before the freeze
    assert frozen > 0 and gc.get_freeze_count() > 0
    assert startup_gc.record()["frozen_before_load"] == frozen


def _collection_enabled_in_child(queue):
    queue.put(gc.isenabled())


def test_a_forked_child_collects_from_its_start():
    startup_gc.pause()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_collection_enabled_in_child, args=(queue,))
    child.start()
    enabled = queue.get(timeout=60)
    child.join(60)
    assert enabled is True
    assert startup_gc.is_paused()  # the parent is still starting


def test_server_freeze_resumes_after_vllms_own_collect_and_freeze():
    seen = {}

    def vllm_freeze():
        seen["enabled_during"] = gc.isenabled()

    startup_gc.pause()
    patch.wrap_freeze_gc_heap(vllm_freeze)()
    assert seen == {"enabled_during": False}
    assert gc.isenabled() and startup_gc.record()["resumed_by"] == startup_gc.RESUMED_SERVER_READY


def test_server_freeze_without_a_pause_is_vllms():
    calls = []
    before = startup_gc.record()
    patch.wrap_freeze_gc_heap(lambda: calls.append(1))()
    assert calls == [1] and gc.isenabled() and startup_gc.record() == before


def test_worker_init_collects_and_freezes_once_when_paused():
    class Worker:
        def init_device(self):
            return "device"

    init_device = patch.wrap_init_device(Worker.init_device)
    assert init_device(Worker()) == "device" and gc.get_freeze_count() == 0
    startup_gc.pause()
    assert init_device(Worker()) == "device" and gc.get_freeze_count() > 0


@pytest.mark.parametrize("status,resumed", [("applied", False), ("skipped-version", True), ("failed", True)])
def test_a_patch_not_in_force_resumes_at_once(monkeypatch, status, resumed):
    from vllm_omni_edge.patches import base

    monkeypatch.setattr(base, "_OUTCOMES", {patch.RECORD.name: PatchOutcome(patch.RECORD.name, status)})
    startup_gc.pause()
    patch.resume_unless_in_force()
    assert startup_gc.is_paused() is not resumed
    if resumed:
        assert startup_gc.record()["resumed_by"] == startup_gc.RESUMED_PATCH_NOT_APPLIED


def test_only_a_server_start_pauses():
    assert starts_a_server(["serve", "model", "--port", "8000"])
    assert not starts_a_server(["serve", "--help"]) and not starts_a_server(["serve", "--help=all"])
    assert not starts_a_server(["bench", "serve"]) and not starts_a_server([])
    assert "vllm_omni_edge.patches.frontend.startup_gc" in CLI_PATCHES


def test_a_bad_flag_value_is_named_and_pauses_nothing(monkeypatch):
    monkeypatch.setenv(STARTUP_GC_ENV, "maybe")
    with pytest.raises(SystemExit, match=f"vllm serve: {STARTUP_GC_ENV}='maybe': expected one of young, 1, pause, 0"):
        pause_collection_for_start("vllm serve")
    assert gc.isenabled() and not startup_gc.is_paused()
