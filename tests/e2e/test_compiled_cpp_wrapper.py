"""A compiled model run by inductor's C++ wrapper answers as its Python wrapper does.

patches/frontend/inductor_cpp_wrapper.py turns the C++ wrapper on (and str layer names,
which it needs); ``VLLM_OMNI_EDGE_CPP_WRAPPER=0`` keeps the Python one. Same fused kernels,
so the same greedy tokens; the worker evidence says which wrapper ran. Two compiles of the
default model into empty caches (~5 min): slow.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_cpp_wrapper_gives_the_python_wrappers_greedy_answer(default_model, tmp_path):
    from tests.e2e.probe import run_probe

    runs = {}
    for arm, flag in (("python", "0"), ("cpp", "1")):
        run = run_probe(default_model, tmp_path / arm, {"enforce_eager": False}, timeout=900,
                        VLLM_CACHE_ROOT=str(tmp_path / f"vllm-cache-{arm}"), VLLM_OMNI_EDGE_CPP_WRAPPER=flag)
        assert run.returncode == 0, run.log
        [worker] = run.workers
        assert worker["compiled"] and worker["compile_cache"]["aot_compiled"] == 1, worker["compile_cache"]
        runs[arm] = (run, worker)
    (python, python_worker), (cpp, cpp_worker) = runs["python"], runs["cpp"]
    assert python_worker["inductor_cpp_wrapper"] is False and python_worker["layer_names_are_strings"] is False
    assert cpp_worker["inductor_cpp_wrapper"] is True and cpp_worker["layer_names_are_strings"] is True
    assert cpp.text == python.text and python.text
