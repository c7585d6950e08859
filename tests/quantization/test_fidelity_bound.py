"""cpu_int4's output quality on the default model stays within a bound set from measurement.

The harness scores the default format (group 32, float offsets, head included; here
quantized at load, the same ``quantize`` the builder runs) against the bf16
transformers reference on the shipped text: KL(reference || cpu_int4) per position
and the share of positions whose top-1 token agrees.

Bounds, from ``results/2026-11-30-quality-default`` (767 positions,
3 passes, deterministic): KLD mean 0.0645 nats, same top-1 80.7 %. They leave room for
kernel rounding between CPUs, and fail on the regressions seen before: group 128
(0.298 nats) and group 64 with integer zero points (0.309 nats, 61.4 %).
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_edge_bench.harness import fidelity
from vllm_omni_edge_bench.harness.grid import Grid
from vllm_omni_edge_bench.harness.runner import RunOptions, check_runnable, run_pass
from vllm_omni_edge_bench.harness.schedule import ScheduledPass
from vllm_omni_edge_bench.harness.stats import figures_of_pass
from vllm_omni_edge.quantization import int4
from vllm_omni_edge.quantization.kernels import CpuFeatures, choose_kernel

pytestmark = pytest.mark.e2e

MAX_KLD_MEAN = 0.10  # nats
MIN_SAME_TOP1 = 75.0  # %
MAX_TOKENS = 768


@pytest.mark.timeout(1200)
def test_default_format_stays_within_the_measured_quality_bound(tmp_path, default_model):
    # The reference is cached by content (model, text, windows); computing it takes seconds.
    assert fidelity.main(["reference", "--model", "default", "--max-tokens", str(MAX_TOKENS)]) == 0
    # Scores are deterministic, so one pass suffices here; a grid (which publishes medians)
    # needs three, so the test runs the harness's pass runner, evidence checks included.
    # The router's kernel on this CPU: the bound holds for what users get by default.
    head_kernel = choose_kernel(CpuFeatures.detect(), int4.DEFAULT_GROUP_SIZE, 576, 49152, torch.bfloat16,
                                float_zero=True)[0].name
    grid = Grid.model_validate({
        "name": "fidelity-bound",
        "control": "int4",
        "timeout_s": 900,
        "arms": [{
            "name": "int4",
            "model": "default",
            "llm_kwargs": {"enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_bytes": "192MiB",
                           "quantization": "cpu_int4"},
            "expect": {"quantization": "cpu_int4", f"cpu_int4_kernels.lm_head:{head_kernel}": 1,
                       "cpu_int4_kernels.fallback": 0},
        }],
        "workloads": [{"fidelity": {"max_tokens": MAX_TOKENS, "reference": "default"}}],
    })
    check_runnable(grid)
    record = run_pass(grid, ScheduledPass(seq=1, pass_index=1, arm="int4"), tmp_path, RunOptions())
    assert record["status"] == "ok", (record["reasons"], record["log_tail"])
    figures = figures_of_pass(record)
    kld = figures["fidelity KLD mean"]["value"]
    same_top1 = figures["fidelity same top-1"]["value"]
    assert kld <= MAX_KLD_MEAN, f"KLD mean {kld:.4f} nats exceeds the bound {MAX_KLD_MEAN}"
    assert same_top1 >= MIN_SAME_TOP1, f"same top-1 {same_top1:.1f}% is below the bound {MIN_SAME_TOP1}%"
