"""A compiled model's second start loads vLLM's saved artifact instead of compiling again.

vLLM 0.30 on CPU saved the artifact but failed to load it ("'function' object has no
attribute 'finalize_loading'") and recompiled on every start; ``compile_cache_load``
fixes the load; ``compile_warmup_tokens`` shortens the warm-up that follows;
``isa_probe_memo`` answers inductor's ISA probes of the second start from the first's, and
and ``precompiled_header_memo`` its precompiled-header path. Two compiled
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
                        VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
                        VLLM_OMNI_EDGE_CACHE=str(tmp_path / "edge-cache"),
                        VLLM_OMNI_EDGE_COMPILE="on")  # compile_choice would run this model eager
        assert run.returncode == 0, run.log
        [worker] = run.workers
        assert worker["compiled"], worker["compilation_mode"]
        assert worker["compile_warmup_tokens"] == 16  # compile_warmup_tokens, on by default
        counts = {k: worker["compile_cache"][k] for k in ("aot_compiled", "aot_loaded")}
        runs.append((run, counts, worker["isa_probes"], worker["precompiled_headers"]))
    ((first, first_cache, first_probes, first_pch),
     (second, second_cache, second_probes, second_pch)) = runs
    assert first_cache == {"aot_compiled": 1, "aot_loaded": 0}, first.log
    assert second_cache == {"aot_compiled": 0, "aot_loaded": 1}, second.log
    assert "Compiling model again" not in second.log
    assert second.text == first.text and first.text
    assert first_probes["probed"] > 0 and first_probes["remembered"] == 0, first_probes
    assert second_probes == {"remembered": first_probes["probed"], "probed": 0}, second_probes
    # The first start preprocessed the header (to compile its kernels); the second loads them
    # with the header's path from the memo, and no preprocessor run.
    assert first_pch["preprocessed"] > 0 and first_pch["remembered"] == 0, first_pch
    # (The first start compiles, so it may load more libraries than the second: counts differ.)
    assert second_pch["preprocessed"] == 0 and second_pch["remembered"] > 0, second_pch
