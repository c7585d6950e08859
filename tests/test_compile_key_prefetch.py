"""compile_key_prefetch: inductor's torch/triton key hashed in the background, same values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_omni_edge.patches.worker import compile_key_prefetch as patch


def config(mode):
    return SimpleNamespace(compilation_config=SimpleNamespace(mode=mode))


def test_only_a_compiled_model_with_the_inductor_key_wants_it(monkeypatch):
    from vllm.config import CompilationMode

    monkeypatch.setenv("VLLM_USE_MEGA_AOT_ARTIFACT", "1")
    assert patch.wants_inductor_key(config(CompilationMode.VLLM_COMPILE))
    assert not patch.wants_inductor_key(config(CompilationMode.NONE))
    monkeypatch.setenv("VLLM_USE_MEGA_AOT_ARTIFACT", "0")
    assert not patch.wants_inductor_key(config(CompilationMode.VLLM_COMPILE))


def test_prefetched_keys_are_the_keys():
    from torch._inductor.codecache import torch_key, triton_key

    direct = (triton_key(), torch_key())
    triton_key.clear()
    torch_key.clear()
    patch.prefetch_inductor_key()
    assert patch.started
    assert (triton_key(), torch_key()) == direct


@pytest.mark.parametrize("wanted", [True, False])
def test_runner_init_starts_the_prefetch_only_when_wanted(monkeypatch, wanted):
    calls = []
    monkeypatch.setattr(patch, "wants_inductor_key", lambda vllm_config: wanted)
    monkeypatch.setattr(patch, "prefetch_inductor_key", lambda: calls.append("prefetch"))

    class Runner:
        def __init__(self, vllm_config, device):
            calls.append("init")

    module = SimpleNamespace(CPUModelRunner=Runner)
    patch._wrap(module)
    patch._wrap(module)  # idempotent
    Runner(config(None), "cpu")
    assert calls == (["prefetch", "init"] if wanted else ["init"])
