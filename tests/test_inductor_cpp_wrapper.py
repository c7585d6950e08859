"""The compiled model's C++ wrapper: when it is turned on, what the user keeps, and the early hook."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from vllm_omni_edge.patches.frontend import inductor_cpp_wrapper as patch


def _compilation(backend="inductor", mode=2, **inductor):
    return types.SimpleNamespace(backend=backend, mode=mode, inductor_compile_config=dict(inductor))


@pytest.fixture
def string_layer_names(monkeypatch):
    monkeypatch.setattr(patch, "layer_names_are_strings", lambda: True)


def test_off_by_default(string_layer_names, monkeypatch):
    monkeypatch.delenv("VLLM_OMNI_EDGE_CPP_WRAPPER", raising=False)
    assert patch.wants_cpp_wrapper(_compilation()) == (False, "Python wrapper kept (flag)")


def test_with_the_flag_an_inductor_compile_gets_the_cpp_wrapper(string_layer_names, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_CPP_WRAPPER", "1")
    assert patch.wants_cpp_wrapper(_compilation()) == (True, "inductor's C++ wrapper")


@pytest.mark.parametrize("compilation, flag, reason", [
    (_compilation(), "0", "flag"),
    (_compilation(backend="eager"), "1", "not compiled with inductor"),
    (_compilation(cpp_wrapper=False), "1", "cpp_wrapper=False set by the user"),
    (_compilation(cpp_wrapper=True), "1", "already set"),
])
def test_left_alone(string_layer_names, monkeypatch, compilation, flag, reason):
    monkeypatch.setenv("VLLM_OMNI_EDGE_CPP_WRAPPER", flag)
    use, why = patch.wants_cpp_wrapper(compilation)
    assert not use and reason in why


def test_opaque_layer_names_keep_the_python_wrapper_and_say_how_to_fix_it(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_CPP_WRAPPER", "1")
    monkeypatch.setattr(patch, "layer_names_are_strings", lambda: False)
    use, why = patch.wants_cpp_wrapper(_compilation())
    assert not use and "VLLM_USE_LAYERNAME=0" in why


def test_a_bad_flag_value_is_refused(monkeypatch):
    from vllm_omni_edge.levers import LeverFlagError

    monkeypatch.setenv("VLLM_OMNI_EDGE_CPP_WRAPPER", "yes")
    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_CPP_WRAPPER"):
        patch.wants_cpp_wrapper(_compilation())


def _fake_platform_module():
    calls = []

    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            calls.append(vllm_config)

    return types.SimpleNamespace(CpuPlatform=CpuPlatform), calls


def test_the_wrapped_config_check_sets_it_once_and_only_for_compiled_models(string_layer_names, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_CPP_WRAPPER", "1")
    module, calls = _fake_platform_module()
    patch._wrap(module)
    patch._wrap(module)  # idempotent
    compiled = types.SimpleNamespace(model_config=object(), compilation_config=_compilation())
    eager = types.SimpleNamespace(model_config=object(), compilation_config=_compilation(mode=0))
    module.CpuPlatform.check_and_update_config(compiled)
    module.CpuPlatform.check_and_update_config(eager)
    assert calls == [compiled, eager]  # vLLM's own check ran, once each
    assert compiled.compilation_config.inductor_compile_config == {"cpp_wrapper": True}
    assert eager.compilation_config.inductor_compile_config == {}


def test_it_wraps_beside_another_patch_of_the_same_method(string_layer_names, monkeypatch):
    """kv_budget wraps the same classmethod and marks it with the generic __edge_wrapped__."""
    monkeypatch.setenv("VLLM_OMNI_EDGE_CPP_WRAPPER", "1")
    module, calls = _fake_platform_module()
    original = module.CpuPlatform.check_and_update_config.__func__

    def kv_budget_like(cls, vllm_config):
        original(cls, vllm_config)

    kv_budget_like.__edge_wrapped__ = True
    module.CpuPlatform.check_and_update_config = classmethod(kv_budget_like)
    patch._wrap(module)
    config = types.SimpleNamespace(model_config=object(), compilation_config=_compilation())
    module.CpuPlatform.check_and_update_config(config)
    assert calls == [config] and config.compilation_config.inductor_compile_config["cpp_wrapper"]


def _layer_name_mode_in_a_fresh_interpreter(**env) -> str:
    """What vLLM chose for its attention ops' layer names, with this venv's start-up hooks."""
    code = ("import vllm.utils.torch_utils as t, os; "
            "print('MODE', 'opaque' if t._USE_LAYERNAME else 'str', os.environ.get('VLLM_USE_LAYERNAME'))")
    full_env = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_LAYERNAME", "VLLM_OMNI_EDGE_CPP_WRAPPER")}
    run = subprocess.run([sys.executable, "-c", code], env={**full_env, **env}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    [line] = [l for l in run.stdout.splitlines() if l.startswith("MODE ")]
    return line.split(" ", 1)[1]


def test_with_the_flag_the_venv_start_up_hook_gives_vllm_string_layer_names():
    """scripts/setup.sh's .pth installs patches/early.py in every interpreter, before `import vllm`."""
    assert _layer_name_mode_in_a_fresh_interpreter(VLLM_OMNI_EDGE_CPP_WRAPPER="1") == "str 0"


def test_by_default_or_by_the_users_own_choice_vllm_decides():
    assert _layer_name_mode_in_a_fresh_interpreter() == "opaque None"
    assert _layer_name_mode_in_a_fresh_interpreter(VLLM_OMNI_EDGE_CPP_WRAPPER="1",
                                                   VLLM_USE_LAYERNAME="1") == "opaque 1"
