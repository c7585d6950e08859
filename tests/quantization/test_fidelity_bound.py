"""cpu_int4's output quality on the default model stays within a bound set from measurement.

The harness scores the default format (group 32, float offsets, head included; here
quantized at load, the same ``quantize`` the builder runs) against the bf16
transformers reference on the shipped text: KL(reference || cpu_int4) per position
and the share of positions whose top-1 token agrees.

Bounds, from ``benchmarks/edge_harness/results/2026-11-30-quality-default`` (767 positions,
3 passes, deterministic): KLD mean 0.0645 nats, same top-1 80.7 %. They leave room for
kernel rounding between CPUs, and fail on the regressions seen before: group 128
(0.298 nats) and group 64 with integer zero points (0.309 nats, 61.4 %).
"""

from __future__ import annotations

import json

import pytest
import yaml

from benchmarks.edge_harness import cli, fidelity

pytestmark = pytest.mark.e2e

MAX_KLD_MEAN = 0.10  # nats
MIN_SAME_TOP1 = 75.0  # %
MAX_TOKENS = 768


@pytest.mark.timeout(1200)
def test_default_format_stays_within_the_measured_quality_bound(tmp_path, default_model):
    # The reference is cached by content (model, text, windows); computing it takes seconds.
    assert fidelity.main(["reference", "--model", "default", "--max-tokens", str(MAX_TOKENS)]) == 0
    grid = {
        "name": "fidelity-bound",
        "passes": 1,
        "control": "int4",
        "timeout_s": 900,
        "arms": [{
            "name": "int4",
            "model": "default",
            "llm_kwargs": {"enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_bytes": "192MiB",
                           "quantization": "cpu_int4"},
            "expect": {"quantization": "cpu_int4", "cpu_int4_kernels.lm_head:int4pack": 1,
                       "cpu_int4_kernels.fallback": 0},
        }],
        "workloads": [{"fidelity": {"max_tokens": MAX_TOKENS, "reference": "default"}}],
    }
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump(grid))
    out = tmp_path / "results"
    code = cli.main(["run", str(grid_file), "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert code == cli.EXIT_OK, summary
    figures = summary["arms"]["int4"]
    kld = figures["fidelity KLD mean"]["median"]
    same_top1 = figures["fidelity same top-1"]["median"]
    assert kld <= MAX_KLD_MEAN, f"KLD mean {kld:.4f} nats exceeds the bound {MAX_KLD_MEAN}"
    assert same_top1 >= MIN_SAME_TOP1, f"same top-1 {same_top1:.1f}% is below the bound {MIN_SAME_TOP1}%"
