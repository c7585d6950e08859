"""A tiny grid with llama.cpp arms on the default model's GGUF, through the real runner.

llama.cpp only (no vLLM start): a few minutes with the fidelity reference. Run with -m e2e.
"""

from __future__ import annotations

import json

import pytest
import yaml

from vllm_omni_edge_bench.harness import cli, fidelity

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FIDELITY = {"window": 64, "stride": 32, "max_tokens": 160}


@pytest.mark.timeout(1800)
def test_tiny_llamacpp_grid_end_to_end(tmp_path, default_model):
    cache = tmp_path / "fidelity-cache"
    args = ["reference", "--window", "64", "--stride", "32", "--max-tokens", "160", "--cache", str(cache),
            "--threads", "1"]
    assert fidelity.main(args) == 0
    grid = {
        "name": "e2e-llamacpp",
        "passes": 3,
        "control": "llama-mmap",
        "timeout_s": 600,
        "arms": [
            # One thread: on a shared 2-core box, OpenMP's barriers make 2 threads crawl.
            {"name": "llama-mmap", "engine": "llamacpp", "llamacpp": {"n_threads": 1, "n_ctx": 512},
             "expect": {"n_threads": 1, "weights_mmapped": True, "amx_weights": False,
                        "tokenizer.same_text_for_ids": True}},
            {"name": "llama-copy", "engine": "llamacpp", "llamacpp": {"n_threads": 1, "n_ctx": 512, "use_mmap": False},
             "expect": {"weights_mmapped": False, "use_mmap": False}},
        ],
        "workloads": ["cold_start", {"decode": {"prompt_tokens": 16, "gen_tokens": 16}},
                      {"prefill": {"prompt_tokens": 64}}, {"ttft": {"prompt_tokens": 16}},
                      {"fidelity": {**FIDELITY, "cache_dir": str(cache)}}],
    }
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump(grid))
    out = tmp_path / "results"
    code = cli.main(["run", str(grid_file), "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert code == cli.EXIT_OK, summary

    for arm in ("llama-mmap", "llama-copy"):
        figures = summary["arms"][arm]
        assert {"cold_start", "load", "tg16", "pp64", "ttft16", "fidelity KLD mean", "fidelity same top-1",
                "tree PSS steady"} <= set(figures), sorted(figures)
        assert figures["tg16"]["min"] > 0 and figures["pp64"]["min"] > 0
        # The shipped Q4_1 file is what the bf16 reference was dequantized from: llama.cpp
        # must agree with it on most next tokens (compute differs, weights do not).
        assert figures["fidelity same top-1"]["min"] > 80, figures["fidelity same top-1"]

    # Mapped weights are file-backed PSS; copied ones are anonymous (the Q4_1 file is ~88 MiB).
    def file_backed(arm):
        figures = summary["arms"][arm]
        return figures["tree PSS steady"]["median"] - figures["tree PSS_Anon steady"]["median"]

    assert file_backed("llama-mmap") > file_backed("llama-copy") + (50 << 20)
    assert summary["arms"]["llama-copy"]["tree PSS_Anon steady"]["median"] > (
        summary["arms"]["llama-mmap"]["tree PSS_Anon steady"]["median"] + (50 << 20))

    record = json.loads((out / "passes" / "01-llama-mmap.json").read_text())
    worker = record["evidence"]["workers"][0]
    assert worker["pid"] == record["result"]["pid"]
    assert worker["compiled_features"]["CPU"], worker["system_info"]
    assert worker["buffers"]["KV"] and worker["buffers"]["model"]
    assert record["result"]["resolved_options"]["n_threads"] == 1
    report = (out / "report.md").read_text()
    assert "llama.cpp 0.3.36" in report and "weights CPU_Mapped" in report
