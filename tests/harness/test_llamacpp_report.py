"""The report for llama.cpp passes: what ran, and decode against the bandwidth ceiling."""

from __future__ import annotations

import json

from vllm_omni_edge_bench.harness import report

MIB = 1 << 20


def llamacpp_record(arm="llama", status="ok", size=100 * MIB):
    worker = {"llama_cpp_python": "0.3.36", "weight_buffer_types": ["CPU_Mapped", "CPU_REPACK"],
              "settings": {"print_info.file type": "Q4_0"}, "n_threads": 2, "flash_attn": "auto",
              "repacked_tensors": 210, "repack_layouts": ["q4_0_8x8"], "model_size_bytes": size}
    return {"arm": arm, "status": status, "result": {"engine": "llamacpp", "versions": {"cpu_capability": "AVX2"}},
            "evidence": {"workers": [worker]}}


def vllm_record(arm="us", size=256 * MIB):
    worker = {"compiled": True, "weights_bytes_by_dtype": {"torch.bfloat16": size}}
    return {"arm": arm, "status": "ok", "result": {"engine": "vllm", "versions": {"cpu_capability": "AVX2"}},
            "evidence": {"workers": [worker]}}


def test_backend_of_a_llamacpp_pass_says_which_buffers_and_kernels_ran():
    text = report.backend_of_pass(llamacpp_record())
    assert text.startswith("llama.cpp 0.3.36 AVX2")
    assert "weights CPU_Mapped+CPU_REPACK" in text and "Q4_0" in text and "2 threads" in text
    assert "210 tensors repacked (q4_0_8x8)" in text
    bare = llamacpp_record()
    bare["evidence"] = {"workers": []}
    assert report.backend_of_pass(bare) == "llama.cpp AVX2 (no evidence)"


def test_weight_bytes_per_token_from_each_engines_evidence():
    assert report.weight_bytes_per_token(llamacpp_record(size=123)) == 123
    assert report.weight_bytes_per_token(vllm_record(size=456)) == 456
    assert report.weight_bytes_per_token({"evidence": {"workers": []}}) is None


def test_ceiling_table_only_with_a_bandwidth_artifact(tmp_path):
    summary = {"arms": {
        "us": {"tg128": {"median": 25.0, "unit": "tok/s"}, "tg128 (engine)": {"median": 26.0, "unit": "tok/s"},
               "pp512": {"median": 900.0, "unit": "tok/s"}},
        "llama": {"tg128": {"median": 100.0, "unit": "tok/s"}}}}
    art = {"dir": tmp_path, "summary": summary, "passes": [vllm_record(size=250 * 10**6),
                                                             llamacpp_record(size=100 * 10**6)]}
    assert report._ceiling_table(art) == []
    (tmp_path / report.BANDWIDTH_FILE).write_text(json.dumps(
        {"threads": {"1": {"copy": {"median_gbps": 8.0}}, "2": {"copy": {"median_gbps": 10.0}}}}))
    lines = report._ceiling_table(art)
    assert "10.0 GB/s" in lines[0]
    rows = [line for line in lines if line.startswith("| us") or line.startswith("| llama")]
    assert len(rows) == 2  # decode only: not the engine-timed duplicate, not prefill
    assert "| us | tg128 | 25.0 tok/s |" in rows[0] and "40.0 tok/s | 62% |" in rows[0]
    assert "| llama | tg128 | 100.0 tok/s |" in rows[1] and "100.0 tok/s | 100% |" in rows[1]


def test_each_arm_against_llamacpp_pass_by_pass():
    def fig(values):
        return {"values": values, "median": sorted(values)[len(values) // 2], "unit": "tok/s"}

    summary = {"arms": {
        "control": {"tg128": fig([30.0, 30.0, 30.0]), "cold_start": {"values": [9.0, 9.0, 9.0], "unit": "s"}},
        "us": {"tg128": fig([90.0, 120.0, 110.0]), "pp512": fig([500.0, 600.0, 700.0]),
               "tg128 (engine)": fig([1.0, 1.0, 1.0])},
        "llama": {"tg128": fig([100.0, 100.0, 100.0]), "tg128 (engine)": fig([2.0, 2.0, 2.0]),
                  "pp512": fig([250.0, 0.0, 350.0])}}}
    grid = {"arms": [{"name": "control", "engine": "vllm"}, {"name": "us", "engine": "vllm"},
                     {"name": "llama", "engine": "llamacpp"}]}
    lines = report._llamacpp_table({"summary": summary, "grid": grid})
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    # Paired by pass (0.9, 1.2, 1.1), not a ratio of medians; a zero llama.cpp pass leaves pp512 out;
    # the engine-timed duplicate and non-rate figures are not compared.
    assert rows == ["| control | tg128 | llama | 0.300× (0.300–0.300) | 0 of 3 |",
                    "| us | tg128 | llama | 1.100× (0.900–1.200) | 2 of 3 |"]
    assert report._llamacpp_table({"summary": summary, "grid": {"arms": grid["arms"][:2]}}) == []
