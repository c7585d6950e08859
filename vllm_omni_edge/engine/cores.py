"""Which cores the model runs on when it shares a process with the engine loop.

The worker's rule in vLLM's layout (``utils/ompmultiprocessing.py``): the usable cores minus the
last ``VLLM_CPU_NUM_OF_RESERVED_CPU``, which stay for the front end.
"""

from __future__ import annotations

import os

from vllm_omni_edge.cpu_features import usable_cores

RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def engine_thread_binding(cores: list[int], reserved: int) -> dict[str, str]:
    """OpenMP settings for a model that runs on all but the last ``reserved`` cores."""
    if reserved >= len(cores):
        raise ValueError(f"{RESERVED_ENV}={reserved} leaves none of the {len(cores)} usable cores for the model")
    kept = cores[: len(cores) - reserved]
    return {"OMP_NUM_THREADS": str(len(kept)), "GOMP_CPU_AFFINITY": " ".join(map(str, kept))}


def model_cores() -> list[int] | None:
    """The cores the model thread runs on, or None when the user bound OpenMP themselves."""
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("GOMP_CPU_AFFINITY"):
        return None  # the user's binding (read by libgomp at load) wins
    cores = sorted(os.sched_getaffinity(0))[: usable_cores()]
    binding = engine_thread_binding(cores, int(os.environ.get(RESERVED_ENV) or 0))
    return [int(c) for c in binding["GOMP_CPU_AFFINITY"].split()]
