"""vLLM's AMX attention kernels on an AMX CPU, in a real worker process.

Without ``torch._C._cpu._init_amx()`` vLLM's AMX attention dies with SIGILL at
``tilezero``; our ``amx_tile_permission`` patch asks Linux for the tile state in
every process. These tests run where the CPU has AMX; elsewhere they say why not.
(An earlier "wrong answer" seen here was a near tie on the first token flipped by
bf16 rounding, not a kernel fault: ``2026-12-01-attention-isa-default`` measured the
same KLD on amx and vec. So the test checks that it decodes, not which side of the tie wins.)
"""

from __future__ import annotations

import pytest

from vllm_omni_edge.cpu_features import cpu_flags, cpu_model_name
from vllm_omni_edge.routing.cpu_classes import cpu_class

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.amx,
    pytest.mark.skipif(
        "amx_tile" not in cpu_flags(),
        reason=f"this CPU ({cpu_model_name()}, class {cpu_class()}) has no AMX tiles, "
        "so vLLM's AMX attention path cannot run here",
    ),
]


def test_bf16_attention_runs_amx_in_the_worker(default_model, tmp_path):
    from tests.e2e.probe import run_probe

    # bf16 with a block size divisible by 32 is what makes vLLM pick "amx".
    run = run_probe(default_model, tmp_path / "evidence", {"dtype": "bfloat16"})
    assert run.returncode == 0, run.log  # a SIGILL (no AMX permission) would show as -4
    assert len(run.text.split()) >= 3, run.text  # it decodes words, not nothing
    [worker] = run.workers
    assert worker["attention_isa"] == ["amx"], worker["attention_isa"]
    [record] = [p for p in run.processes if p["pid"] == worker["pid"]]
    assert record["patch_details"]["amx_tile_permission"] == "AMX tile state granted"
