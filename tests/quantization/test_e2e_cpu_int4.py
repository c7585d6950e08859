"""The real default model, built as cpu_int4, answering through ``vllm.LLM`` in spawned workers.

Needs the plugin's general entry point to register cpu_int4 in every process
(``vllm_omni_edge.quantization.register_cpu_int4``); nothing in this test does it.
"""

from __future__ import annotations

import pytest


@pytest.mark.e2e
def test_default_model_as_cpu_int4_answers_paris(default_model, tmp_path):
    from tests.e2e.probe import run_probe
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint

    out = tmp_path / "smollm2-cpu-int4"
    report = build_cpu_int4_checkpoint(default_model, out, group_size=128, progress=False)
    # Tied: int8 embedding rows and the head its own 4-bit copy (the builder's default for it).
    assert report.embedding == "int8" and not report.tensors.get("emb+head 4-bit")

    run = run_probe(out, tmp_path / "evidence")
    assert "Unknown quantization method: cpu_int4" not in run.log, (
        "cpu_int4 is not registered in vLLM's front end: the plugin entry point must call "
        "vllm_omni_edge.quantization.register_cpu_int4()"
    )
    assert run.returncode == 0, run.log
    assert "Paris" in run.text, run.text

    [worker] = run.workers
    assert worker["quantization"] == "cpu_int4"
    by_dtype = worker["weights_bytes_by_dtype"]
    # 4-bit linears + the head (~60 MiB of uint8), int8 embedding rows (~27 MiB); bf16 left is
    # scales, offsets, norms and the RoPE table -- no bf16 embedding, linear layer or head.
    assert by_dtype.get("uint8", 0) > 55 << 20, by_dtype
    assert by_dtype.get("int8", 0) > 25 << 20, by_dtype
    assert by_dtype.get("bfloat16", 0) < 20 << 20, by_dtype


@pytest.mark.e2e
def test_default_model_on_avx2_w4a8_answers_paris_in_the_worker(default_model, tmp_path):
    from tests.e2e.probe import run_probe
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint
    from vllm_omni_edge.quantization.kernels import native

    loaded, why = native.load_library()
    if not loaded:
        pytest.skip(f"avx2_w4a8 op unavailable: {why}")
    out = tmp_path / "smollm2-cpu-int4-g32"
    build_cpu_int4_checkpoint(default_model, out, group_size=32, progress=False)
    run = run_probe(out, tmp_path / "evidence", VLLM_OMNI_EDGE_INT4_KERNEL="avx2_w4a8")
    assert run.returncode == 0, run.log
    assert "Paris" in run.text, run.text
    [worker] = run.workers
    # Every linear layer and the head ran on the C++ op, in the worker process.
    # The tied head's default: int8 embedding rows, the head its own 4-bit copy.
    expected = {"linear:avx2_w4a8": 120, "lm_head:avx2_w4a8": 1, "embedding:gather_int8": 1,
                "fallback": 0, "dense_prefill_copy": 0, "group_codes": 0, "six_bit": 0}
    assert worker["cpu_int4_kernels"] == expected, worker["cpu_int4_kernels"]
