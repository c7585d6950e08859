"""vLLM's attention kernels on an AMX CPU, in a real worker process.

Without ``torch._C._cpu._init_amx()`` vLLM's AMX attention dies with SIGILL at
``tilezero``; with it, it runs but decodes wrong answers here, so by default our
``cpu_attention_isa`` patch runs bf16 attention on the vec kernels. These tests run
where the CPU has AMX; elsewhere they say why not.
"""

from __future__ import annotations

import pytest

from vllm_omni_edge.cpu_features import cpu_class, cpu_flags, cpu_model_name

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.amx,
    pytest.mark.skipif(
        "amx_tile" not in cpu_flags(),
        reason=f"this CPU ({cpu_model_name()}, class {cpu_class()}) has no AMX tiles, "
        "so vLLM's AMX attention path cannot run here",
    ),
]


def test_bf16_attention_runs_vec_by_default_and_answers(default_model, tmp_path):
    from tests.e2e.probe import run_probe

    # bf16 with a block size divisible by 32 is what makes vLLM pick "amx"; our
    # cpu_attention_isa patch turns that into "vec" (AMX decoded wrong answers here).
    run = run_probe(default_model, tmp_path / "evidence", {"dtype": "bfloat16"})
    assert run.returncode == 0, run.log
    assert "Paris" in run.text, run.text
    [worker] = run.workers
    assert worker["attention_isa"] == ["vec"], worker["attention_isa"]


def test_amx_attention_runs_in_the_worker_when_asked(default_model, tmp_path):
    from tests.e2e.probe import run_probe

    run = run_probe(default_model, tmp_path / "evidence", {"dtype": "bfloat16"},
                    VLLM_OMNI_EDGE_AMX_ATTENTION="1")
    assert run.returncode == 0, run.log  # a SIGILL (no AMX permission) would show as -4
    assert run.text  # what it answers is the upstream bug the default avoids
    [worker] = run.workers
    assert worker["attention_isa"] == ["amx"], worker["attention_isa"]
    [record] = [p for p in run.processes if p["pid"] == worker["pid"]]
    assert record["patch_details"]["amx_tile_permission"] == "AMX tile state granted"
