"""compile_choice: eager where the decoder stack runs decode, compiled elsewhere, the user's word wins."""

from __future__ import annotations

import json
import types

import pytest

from vllm_omni_edge.levers import compile_choice as cc

LLAMA_INT4 = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576,
              "quantization_config": {"quant_method": "cpu_int4", "group_size": 32, "zero_point": "float"}}


def checkpoint(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.fixture
def stack_kernel(monkeypatch):
    """This CPU routes to a kernel the decoder stack calls (whatever box the tests run on)."""
    monkeypatch.setattr(cc, "routed_kernel", lambda config: "avx512_w4a8_rows16")


def test_a_cpu_int4_llama_runs_eager_where_the_stack_runs(tmp_path, stack_kernel):
    decision = cc.decide("auto", checkpoint(tmp_path, LLAMA_INT4), None, user_chose=False)
    assert decision.eager and "decoder stack" in decision.reason


@pytest.mark.parametrize("change, why", [
    ({"architectures": ["GemmaForCausalLM"]}, "is not one the decoder stack runs"),
    ({"quantization_config": {}}, "not cpu_int4"),
    ({"architectures": ["WhisperForConditionalGeneration"]}, "is not one the decoder stack runs"),
])
def test_models_the_stack_does_not_run_stay_compiled(tmp_path, stack_kernel, change, why):
    decision = cc.decide("auto", checkpoint(tmp_path, {**LLAMA_INT4, **change}), None, user_chose=False)
    assert not decision.eager and why in decision.reason


def test_online_quantization_counts_as_cpu_int4(tmp_path, stack_kernel):
    config = {**LLAMA_INT4, "quantization_config": None}
    assert cc.decide("auto", checkpoint(tmp_path, config), "cpu_int4", user_chose=False).eager
    assert not cc.decide("auto", checkpoint(tmp_path, config), None, user_chose=False).eager


def test_a_kernel_the_stack_does_not_call_stays_compiled(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "routed_kernel", lambda config: "int4pack")
    decision = cc.decide("auto", checkpoint(tmp_path, LLAMA_INT4), None, user_chose=False)
    assert not decision.eager and "int4pack" in decision.reason


def test_the_routed_kernel_is_this_cpus(tmp_path):
    from vllm_omni_edge.patches.worker.decoder_stack import KERNELS

    kernel = cc.routed_kernel(LLAMA_INT4)
    assert kernel is None or isinstance(kernel, str)
    expected, why = cc.stack_expected(checkpoint(tmp_path, LLAMA_INT4), None)
    assert expected == (kernel in KERNELS), why


@pytest.mark.parametrize("kw", [{"lora": True}, {"speculative": True}, {"workers": 2}])
def test_lora_speculation_and_several_workers_stay_compiled(tmp_path, stack_kernel, kw):
    assert not cc.decide("auto", checkpoint(tmp_path, LLAMA_INT4), None, user_chose=False, **kw).eager


def test_the_flag_and_the_user_win(tmp_path, stack_kernel, monkeypatch):
    model = checkpoint(tmp_path, LLAMA_INT4)
    assert not cc.decide("on", model, None, user_chose=False).eager
    assert cc.decide("off", checkpoint(tmp_path, {"architectures": ["GemmaForCausalLM"]}), None,
                     user_chose=False).eager
    decision = cc.decide("auto", model, None, user_chose=True)
    assert not decision.eager and decision.reason == "yours"
    monkeypatch.setenv("VLLM_OMNI_EDGE_DECODER_STACK", "0")
    assert not cc.decide("auto", model, None, user_chose=False).eager


def engine_args(model, **given):
    """EngineArgs' fields compile_choice reads, at their defaults unless given (building real
    EngineArgs would load the plugin's patches into this test process)."""
    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import EngineArgs

    fields = EngineArgs.__dataclass_fields__
    args = types.SimpleNamespace(
        model=model, quantization=None, enforce_eager=fields["enforce_eager"].default,
        compilation_config=CompilationConfig(), optimization_level=fields["optimization_level"].default,
        tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, enable_lora=False,
        speculative_config=None)
    for name, value in given.items():
        setattr(args, name, value)
    return args


def test_engine_args_take_the_decision_once_and_keep_the_users(tmp_path, stack_kernel):
    from vllm.config import CompilationConfig

    from vllm_omni_edge.patches.frontend import compile_choice as patch

    model = checkpoint(tmp_path, LLAMA_INT4)
    args = engine_args(model)
    assert patch.choose(args).eager and args.enforce_eager
    assert patch.choose(args) is None  # decided once: a second create_engine_config keeps it
    for given in ({"enforce_eager": True}, {"compilation_config": CompilationConfig(mode=3)},
                  {"optimization_level": 3}):
        args = engine_args(model, **given)
        decision = patch.choose(args)
        assert not decision.eager and decision.reason == "yours", given
    args = engine_args(model, tensor_parallel_size=2)
    assert not patch.choose(args).eager and not args.enforce_eager


def test_a_bad_flag_value_is_refused_by_name(tmp_path, stack_kernel, monkeypatch):
    from vllm_omni_edge import envs
    from vllm_omni_edge.patches.frontend import compile_choice as patch

    monkeypatch.setenv("VLLM_OMNI_EDGE_COMPILE", "maybe")
    args = engine_args(checkpoint(tmp_path, LLAMA_INT4))
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_EDGE_COMPILE='maybe': expected one of auto, on, off"):
        patch.choose(args)
    assert not args.enforce_eager
