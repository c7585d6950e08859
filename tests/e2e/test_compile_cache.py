"""A compiled model's second start loads vLLM's saved artifact instead of compiling again.

vLLM 0.30 on CPU saved the artifact but failed to load it ("'function' object has no
attribute 'finalize_loading'") and recompiled on every start; ``compile_cache_load``
fixes the load; ``compile_warmup_tokens`` shortens the warm-up that follows. Two compiled
starts of the default model (~2.5 min): slow.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_second_compiled_start_loads_the_artifact_and_answers_the_same(default_model, tmp_path):
    from tests.e2e.probe import run_probe

    runs = []
    for start in ("first", "second"):
        run = run_probe(default_model, tmp_path / start, {"enforce_eager": False}, timeout=900,
                        VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
        assert run.returncode == 0, run.log
        [worker] = run.workers
        assert worker["compiled"], worker["compilation_mode"]
        assert worker["compile_warmup_tokens"] == 16  # compile_warmup_tokens, on by default
        assert not worker["inductor_cpp_wrapper"]  # the C++ wrapper is opt-in
        runs.append((run, worker["compile_cache"]))
    (first, first_cache), (second, second_cache) = runs
    assert first_cache == {"aot_compiled": 1, "aot_loaded": 0}, first_cache
    assert second_cache == {"aot_compiled": 0, "aot_loaded": 1}, second.log
    assert "Compiling model again" not in second.log
    assert second.text == first.text and first.text
