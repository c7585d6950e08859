"""LLM()'s default layout on CPU: in-process for one engine with one worker (llm_in_process)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from vllm_omni_edge.levers import VLLM_MULTIPROCESSING_ENV
from vllm_omni_edge.patches.frontend import llm_in_process

LLM_CLASS = SimpleNamespace(name="LLM_CLASS")
SERVER = SimpleNamespace(name="OPENAI_API_SERVER")


def args(**kw):
    return SimpleNamespace(**{"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                              "distributed_executor_backend": None, **kw})


@pytest.fixture
def build(monkeypatch):
    """The wrapper around a stand-in from_engine_args that records the variable it saw."""
    monkeypatch.delenv(VLLM_MULTIPROCESSING_ENV, raising=False)
    from vllm_omni_edge.levers import startup_gc
    from vllm_omni_edge.patches.frontend import engine_start_gc, reserved_cores

    held, reserved = [], []
    monkeypatch.setattr(startup_gc, "is_paused", lambda: False)
    monkeypatch.setattr(engine_start_gc, "hold_collection_for_engine_start", lambda: held.append(1))
    monkeypatch.setattr(reserved_cores, "reserve_for_vllm_layout", lambda: reserved.append(1))
    seen = []
    wrapped = llm_in_process.wrap_from_engine_args(
        lambda cls, engine_args, *a, **k: seen.append(os.environ.get(VLLM_MULTIPROCESSING_ENV)) or "engine")
    return lambda engine_args, usage: (wrapped(object, engine_args, usage_context=usage), seen, held, reserved)


def test_llm_runs_in_process_and_the_environment_is_put_back(build):
    result, seen, held, reserved = build(args(), LLM_CLASS)
    assert result == "engine" and seen == ["0"] and held == [1] and reserved == []
    assert VLLM_MULTIPROCESSING_ENV not in os.environ  # children started later are unaffected


@pytest.mark.parametrize("engine_args,reason", [
    (args(tensor_parallel_size=2), "tensor_parallel_size=2"),
    (args(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
    (args(data_parallel_size=2), "data_parallel_size=2"),
    (args(distributed_executor_backend="ray"), "distributed_executor_backend='ray'"),
])
def test_configurations_one_process_cannot_host_keep_vllms_layout(build, engine_args, reason):
    assert llm_in_process.needs_vllm_layout(engine_args) == [reason]
    _, seen, held, reserved = build(engine_args, LLM_CLASS)
    assert seen == [None] and held == [] and reserved == [1]


def test_the_users_variable_and_other_callers_are_left_alone(build, monkeypatch):
    _, seen, _, _ = build(args(), SERVER)  # not LLM(): e.g. an engine built for a server
    assert seen == [None]
    monkeypatch.setenv(VLLM_MULTIPROCESSING_ENV, "1")
    _, seen, held, _ = build(args(), LLM_CLASS)
    assert seen[-1] == "1" and held == []


def test_patch_is_applied_once(monkeypatch):
    class Engine:
        @classmethod
        def from_engine_args(cls, engine_args, usage_context=None):
            return cls

    module = SimpleNamespace(LLMEngine=Engine)
    llm_in_process._wrap(module)
    first = Engine.from_engine_args
    llm_in_process._wrap(module)
    assert Engine.from_engine_args.__func__ is first.__func__
    assert Engine.from_engine_args(args(), usage_context=SERVER) is Engine  # still a classmethod
