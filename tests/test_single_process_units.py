"""The single-process layout's flags and decisions, without starting vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_omni_edge.cli import serve
from vllm_omni_edge.levers import (
    SINGLE_PROCESS_ENV,
    WORKER_IN_ENGINE_ENV,
    LeverFlagError,
    single_process_enabled,
)
from vllm_omni_edge.patches.frontend import single_process


@pytest.fixture(autouse=True)
def clean_layout_env(monkeypatch):
    for name in (SINGLE_PROCESS_ENV, WORKER_IN_ENGINE_ENV, "OMP_NUM_THREADS", "GOMP_CPU_AFFINITY",
                 single_process.RESERVED_ENV):
        monkeypatch.delenv(name, raising=False)


def test_flag_is_off_by_default_and_refuses_garbage(monkeypatch):
    assert single_process_enabled() is False
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "1")
    assert single_process_enabled() is True
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "yes")
    with pytest.raises(LeverFlagError, match=f"{SINGLE_PROCESS_ENV}='yes'"):
        single_process_enabled()


def test_one_process_and_two_processes_together_are_refused(monkeypatch):
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "1")
    monkeypatch.setenv(WORKER_IN_ENGINE_ENV, "1")
    with pytest.raises(LeverFlagError, match=f"{SINGLE_PROCESS_ENV}=1 and {WORKER_IN_ENGINE_ENV}=1"):
        single_process_enabled()
    with pytest.raises(serve.ServeSetupError, match="two different process layouts"):
        serve._select_process_layout(single_process=False)


def test_serve_flag_is_ours_not_vllms(monkeypatch):
    args, chosen = serve.take_single_process_flag(["model", "--single-process", "--port", "1"])
    assert (args, chosen) == (["model", "--port", "1"], True)
    assert serve.take_single_process_flag(["model"]) == (["model"], False)
    serve._select_process_layout(single_process=True)
    assert single_process_enabled() is True


def parallel(world_size=1, dp=1, fault_tolerance=False):
    return SimpleNamespace(world_size=world_size, data_parallel_size=dp,
                           enable_fault_tolerance=fault_tolerance)


def test_what_one_process_cannot_serve_is_named():
    single_process.check_servable(parallel(), client_count=1)
    with pytest.raises(single_process.SingleProcessConfigError) as err:
        single_process.check_servable(parallel(world_size=2, dp=2), client_count=3)
    message = str(err.value)
    assert "world size 2" in message and "data_parallel_size=2" in message
    assert "3 API server processes" in message


def test_without_the_flag_vllms_client_is_made_unchanged(monkeypatch):
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "vllm's client"

    make = single_process.wrap_make_async_mp_client(original)
    assert make("config", "executor", True, client_count=1, client_index=0, renderer=None) == "vllm's client"
    assert calls == [(("config", "executor", True),
                      {"client_addresses": None, "client_count": 1, "client_index": 0, "renderer": None})]
    # With the flag, an unservable configuration is refused before anything is built.
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "1")
    with pytest.raises(single_process.SingleProcessConfigError):
        make(SimpleNamespace(parallel_config=parallel(world_size=2)), "executor", True)
    assert len(calls) == 1


def test_model_cores_leave_the_reserved_ones(monkeypatch):
    monkeypatch.setattr(single_process.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    monkeypatch.setattr(single_process, "usable_cores", lambda: 4)
    monkeypatch.setenv(single_process.RESERVED_ENV, "1")
    assert single_process.model_cores() == [0, 1, 2]
    monkeypatch.setenv(single_process.RESERVED_ENV, "0")
    assert single_process.model_cores() == [0, 1, 2, 3]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert single_process.model_cores() is None  # the user's own binding wins
