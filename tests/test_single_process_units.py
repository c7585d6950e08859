"""The single-process layout's flags and decisions, without starting vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_omni_edge.cli import serve
from vllm_omni_edge.levers import (
    SINGLE_PROCESS_ENV,
    LeverFlagError,
    single_process_enabled,
)
from vllm_omni_edge.engine import cores
from vllm_omni_edge.patches.frontend import single_process


@pytest.fixture(autouse=True)
def clean_layout_env(monkeypatch):
    for name in (SINGLE_PROCESS_ENV, "OMP_NUM_THREADS", "GOMP_CPU_AFFINITY",
                 cores.RESERVED_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(name, raising=False)


def test_one_process_is_the_default_and_garbage_is_refused(monkeypatch):
    assert single_process_enabled() is True
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "0")
    assert single_process_enabled() is False
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "1")
    assert single_process_enabled() is True
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "yes")
    with pytest.raises(LeverFlagError, match=f"{SINGLE_PROCESS_ENV}='yes'"):
        single_process_enabled()


def test_vllms_layout_asked_for_turns_the_default_off(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert single_process_enabled() is False


def test_serve_flags_are_ours_not_vllms(monkeypatch):
    args, chosen = serve.take_layout_flag(["model", "--single-process", "--port", "1"])
    assert (args, chosen) == (["model", "--port", "1"], True)
    assert serve.take_layout_flag(["model", "--multi-process"]) == (["model"], False)
    assert serve.take_layout_flag(["model"]) == (["model"], None)
    with pytest.raises(serve.ServeSetupError, match="--single-process and --multi-process"):
        serve.take_layout_flag(["model", "--multi-process", "--single-process"])
    serve._select_process_layout(single_process=False)
    assert single_process_enabled() is False
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


def test_vllms_layout_when_asked_or_needed(monkeypatch):
    calls, reserved = [], []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "vllm's client"

    from vllm_omni_edge.patches.frontend import reserved_cores

    monkeypatch.setattr(reserved_cores, "reserve_for_vllm_layout", lambda: reserved.append(1))
    make = single_process.wrap_make_async_mp_client(original)
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "0")  # --multi-process
    assert make("config", "executor", True, client_count=1, client_index=0, renderer=None) == "vllm's client"
    assert calls == [(("config", "executor", True),
                      {"client_addresses": None, "client_count": 1, "client_index": 0, "renderer": None})]
    # By default, a configuration one process cannot host gets vLLM's layout and its reserved core.
    monkeypatch.delenv(SINGLE_PROCESS_ENV)
    assert make(SimpleNamespace(parallel_config=parallel(world_size=2)), "executor", True) == "vllm's client"
    assert len(calls) == 2 and reserved == [1]
    # Asked for by name, it is refused before anything is built.
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "1")
    with pytest.raises(single_process.SingleProcessConfigError):
        make(SimpleNamespace(parallel_config=parallel(world_size=2)), "executor", True)
    assert len(calls) == 2


def test_model_cores_leave_the_reserved_ones(monkeypatch):
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    monkeypatch.setattr(cores, "usable_cores", lambda: 4)
    monkeypatch.setenv(cores.RESERVED_ENV, "1")
    assert cores.model_cores() == [0, 1, 2]
    monkeypatch.setenv(cores.RESERVED_ENV, "0")
    assert cores.model_cores() == [0, 1, 2, 3]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cores.model_cores() is None  # the user's own binding wins

