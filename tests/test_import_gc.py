"""Automatic collection held back while vLLM's package and its LLM module import, and CPython's
again after; a server's or an engine's own start-up pause is left alone or takes over."""

from __future__ import annotations

import gc

import pytest

from tests.e2e.probe import run_script_probe
from vllm_omni_edge.levers import STARTUP_GC_ENV, startup_gc
from vllm_omni_edge.patches.import_hook import InstallOnce

# In a fresh interpreter (the venv's .pth installs the hooks): the thresholds seen inside
# vllm.config's body (imported by vllm.entrypoints.llm) and after the import, and the record.
PROBE = (
    "import gc, json\n"
    "from vllm_omni_edge.patches.import_hook import before_imported\n"
    "inside = []\n"
    "before_imported('vllm.config', lambda module: inside.append(list(gc.get_threshold())))\n"
    "start = list(gc.get_threshold())\n"
    "from vllm import LLM\n"
    "from vllm_omni_edge.levers import startup_gc\n"
    "print('PROBE-RESULT ' + json.dumps({'start': start, 'inside': inside, 'after': list(gc.get_threshold()),\n"
    "      'enabled': gc.isenabled(), 'record': startup_gc.record()}))\n"
)


def test_collection_is_young_while_vllm_imports_and_cpythons_after():
    on = run_script_probe(PROBE)
    assert on["inside"] == [[on["start"][0], startup_gc.NEVER, startup_gc.NEVER]], on["inside"]
    assert on["after"] == on["start"] and on["enabled"]
    record = on["record"]
    assert record["import_pauses"] == 2 and record["import_seconds_paused"] > 0, record
    assert record["paused_for"] == "import" and record["resumed_by"] == startup_gc.RESUMED_IMPORTED
    assert not record["paused_now"]


@pytest.mark.parametrize("flag", [{"VLLM_OMNI_EDGE_IMPORT_GC": "0"}, {STARTUP_GC_ENV: "0"}])
def test_the_flags_leave_collection_as_cpythons(flag):
    off = run_script_probe(PROBE, **flag)
    assert off["inside"] == [off["start"]] and off["after"] == off["start"]
    assert off["record"]["import_pauses"] == 0 and not off["record"]["paused"]


@pytest.fixture
def young(monkeypatch):
    monkeypatch.setenv(STARTUP_GC_ENV, "young")
    monkeypatch.delenv("VLLM_OMNI_EDGE_IMPORT_GC", raising=False)
    thresholds = gc.get_threshold()
    assert gc.isenabled() and not startup_gc.is_paused()
    yield thresholds
    startup_gc.resume("test teardown")
    gc.set_threshold(*thresholds)
    gc.enable()


def test_an_engine_start_takes_over_from_an_import_and_restores_cpythons_thresholds(young):
    from vllm_omni_edge.patches.common import import_gc

    pauses = startup_gc.record()["import_pauses"]
    import_gc._pause(None)
    assert startup_gc.record()["paused_for"] == startup_gc.IMPORT
    assert startup_gc.pause(paused_for="engine")  # the engine's own pause ends the import's
    assert startup_gc.record()["import_pauses"] == pauses + 1
    import_gc._resume(None)  # the import finishing later does not end the engine's pause
    assert startup_gc.is_paused() and startup_gc.record()["paused_for"] == "engine"
    startup_gc.resume("engine ready", only_if_paused_for="engine")
    assert gc.get_threshold() == young  # CPython's, not the import pause's


def test_an_import_leaves_a_servers_pause_alone(young):
    from vllm_omni_edge.patches.common import import_gc

    assert startup_gc.pause()  # the CLI's, for serve
    import_gc._pause(None)
    import_gc._resume(None)
    assert startup_gc.is_paused() and startup_gc.record()["paused_for"] == "server"
    assert gc.get_threshold() == (young[0], startup_gc.NEVER, startup_gc.NEVER)


@pytest.mark.parametrize("variable", ["VLLM_OMNI_EDGE_IMPORT_GC", STARTUP_GC_ENV])
def test_a_bad_flag_value_is_named_and_leaves_collection_and_the_other_hooks_alone(monkeypatch, variable):
    from vllm_omni_edge.patches.common import import_gc

    monkeypatch.setenv(variable, "2")
    monkeypatch.setattr(import_gc, "_once", InstallOnce())
    message = import_gc.install()
    assert variable in message and "'2'" in message, message
    assert not startup_gc.is_paused()
