"""vLLM's AMX attention kernel in a real worker process, after our permission patch.

Without ``torch._C._cpu._init_amx()`` the first forward pass dies with SIGILL at
``tilezero``. This runs that kernel where the CPU has AMX; elsewhere it says why not.
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


def test_amx_attention_runs_in_the_worker(default_model, tmp_path):
    from tests.e2e.probe import run_probe

    # bf16 with a block size divisible by 32 is what makes CPU_ATTN pick "amx".
    run = run_probe(default_model, tmp_path / "evidence", {"dtype": "bfloat16"})
    assert run.returncode == 0, run.log  # a SIGILL would show as -4
    assert "Paris" in run.text
    [worker] = run.workers
    assert worker["attention_isa"] == ["amx"], worker["attention_isa"]
    [record] = [p for p in run.processes if p["pid"] == worker["pid"]]
    assert record["patch_details"]["amx_tile_permission"] == "AMX tile state granted"
