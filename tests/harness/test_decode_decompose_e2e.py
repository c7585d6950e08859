"""decode_decompose on real vLLM: the default model's step split by stubbing, in one process.

About a minute on a 2-core box; run with -m e2e.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_omni_edge_bench.harness import provenance

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_a_real_decomposition_stubs_every_layers_ops(tmp_path, default_model):
    # The README's quantize-at-load command on the bf16 checkpoint: the cpu_int4 ops run.
    out = tmp_path / "decompose"
    done = subprocess.run([sys.executable, "-m", "vllm_omni_edge_bench.harness.decode_decompose",
                           "--model", str(default_model), "--rounds", "3", "--gen-tokens", "16",
                           "--llm-kwargs", '{"max_model_len": 512, "quantization": "cpu_int4"}',
                           "--out", str(out)], cwd=provenance.PROJECT_ROOT, capture_output=True, text=True,
                          timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "decode_decompose.json").read_text())
    calls = record["stub_calls_per_step"]
    layers = 30  # SmolLM2-135M
    assert calls["attention-stubbed"] == {"vllm::unified_attention_with_output": layers}
    # Routed rows16 on AVX-512 VNNI boxes (q/k/v + o, and the fused MLP), four linear calls elsewhere.
    assert sum(calls["linears-stubbed"].values()) in (2 * layers + layers, 4 * layers)
    assert calls["both-stubbed"] == {**calls["attention-stubbed"], **calls["linears-stubbed"]}
    arms = record["arms"]
    # Stubbing takes work away: every stubbed forward is shorter than the real one.
    for arm in ("attention-stubbed", "linears-stubbed", "both-stubbed"):
        assert arms[arm]["forward_ms"]["median"] < arms["real"]["forward_ms"]["median"], arm
    parts = record["parts_ms"]
    assert parts["linear ops"] > 0 and parts["attention op"] > 0 and parts["graph's own work"] > 0
    assert parts["step"] == arms["real"]["step_ms"]["median"]
    assert "| part of a decode step |" in (out / "decode_decompose.md").read_text()
