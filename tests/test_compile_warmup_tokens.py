"""The compiled warm-up patch: a short dummy batch, vLLM's own value restored, evidence kept."""

from __future__ import annotations

import types

import pytest

from vllm_omni_edge.levers import LeverFlagError
from vllm_omni_edge.patches.worker import compile_warmup_tokens


def fake_runner_module(mode: int = 2):
    class CPUModelRunner:
        def __init__(self):
            self.max_num_tokens = 2048
            self.vllm_config = types.SimpleNamespace(compilation_config=types.SimpleNamespace(mode=mode))
            self.seen = []

        def warming_up_model(self):
            if self.vllm_config.compilation_config.mode == 0:
                return
            self.seen.append(self.max_num_tokens)  # what profile_run would read

    return types.SimpleNamespace(CPUModelRunner=CPUModelRunner)


@pytest.fixture(autouse=True)
def no_flag_no_record(monkeypatch):
    monkeypatch.delenv("VLLM_OMNI_EDGE_COMPILE_WARMUP", raising=False)
    monkeypatch.setattr(compile_warmup_tokens, "last_warmup_tokens", None)


def test_the_warm_up_sees_16_tokens_and_the_runner_keeps_its_own_value():
    module = fake_runner_module()
    compile_warmup_tokens._wrap(module)
    runner = module.CPUModelRunner()
    runner.warming_up_model()
    assert runner.seen == [16] and runner.max_num_tokens == 2048
    assert compile_warmup_tokens.last_warmup_tokens == 16


def test_the_value_comes_back_when_the_warm_up_fails():
    module = fake_runner_module()

    def failing(self):
        raise RuntimeError("compile failed")

    module.CPUModelRunner.warming_up_model = failing
    compile_warmup_tokens._wrap(module)
    runner = module.CPUModelRunner()
    with pytest.raises(RuntimeError, match="compile failed"):
        runner.warming_up_model()
    assert runner.max_num_tokens == 2048 and compile_warmup_tokens.last_warmup_tokens is None


def test_full_flag_runs_vllms_size_and_records_it(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_COMPILE_WARMUP", "full")
    module = fake_runner_module()
    compile_warmup_tokens._wrap(module)
    runner = module.CPUModelRunner()
    runner.warming_up_model()
    assert runner.seen == [2048] and compile_warmup_tokens.last_warmup_tokens == 2048
    monkeypatch.setenv("VLLM_OMNI_EDGE_COMPILE_WARMUP", "tiny")
    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_COMPILE_WARMUP='tiny'"):
        runner.warming_up_model()


def test_eager_records_no_warm_up_and_small_budgets_are_not_raised():
    eager = fake_runner_module(mode=0)
    compile_warmup_tokens._wrap(eager)
    eager.CPUModelRunner().warming_up_model()
    assert compile_warmup_tokens.last_warmup_tokens is None
    module = fake_runner_module()
    compile_warmup_tokens._wrap(module)
    runner = module.CPUModelRunner()
    runner.max_num_tokens = 8
    runner.warming_up_model()
    assert runner.seen == [8] and runner.max_num_tokens == 8


def test_wrapping_twice_wraps_once():
    module = fake_runner_module()
    compile_warmup_tokens._wrap(module)
    first = module.CPUModelRunner.warming_up_model
    compile_warmup_tokens._wrap(module)
    assert module.CPUModelRunner.warming_up_model is first


def test_on_vllm_itself_the_warm_up_reads_max_num_tokens_through_profile_run():
    import inspect

    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    assert "self.profile_run()" in inspect.getsource(cpu_model_runner.CPUModelRunner.warming_up_model)
    assert "self.max_num_tokens, is_profile=True" in inspect.getsource(
        gpu_model_runner.GPUModelRunner.profile_run)
