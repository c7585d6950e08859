"""Choose how many cores vLLM keeps away from the model on small boxes.

What: sets ``VLLM_CPU_NUM_OF_RESERVED_CPU`` in the front end's environment (the
engine core and workers inherit it) when the user has not set it, from a table
of measured defaults keyed on the number of usable cores.
Why: vLLM reserves 1 core on x86 for the front end and engine core
(``utils/ompmultiprocessing.py``). On a 2-core box that halves the cores the
model runs on, so we measured whether giving the worker both cores pays. It
does not for decode: the engine core polls for the worker's output on a core of
its own, and with no reservation it competes with the worker's OpenMP threads.
Measured (``MEASUREMENT``): decode with 0 reserved was 0.51x (0.42-0.59) of 1
reserved; prefill 1.17x (0.76-2.04). So 2 cores keep vLLM's 1 reserved core,
now as a measured choice. The table holds only core counts that were measured;
for other counts vLLM's own default stands. That reason holds only where an engine-core
process polls beside the worker: in a layout whose model runs in the process that also runs
the engine loop (the one-process server and in-process ``LLM()``, both the defaults; the
worker in the engine core) nothing polls, and the reserved core only idled half the box:
the one-process server ran its model on one core (``MEASUREMENT_ONE_PROCESS``), so those
layouts reserve 0. (vLLM's in-process ``LLM()`` worker ran 2 threads with 1 reserved anyway.)
When a layout patch falls back to vLLM's processes (the configuration needs them), it calls
``reserve_for_vllm_layout`` before they are spawned.
Verified by: the harness grids ``vllm_omni_edge_bench/harness/grids/reserved-cores.yaml`` and
``reserved-cores-one-process.yaml`` (quoted in ``MEASUREMENT``, ``MEASUREMENT_ONE_PROCESS``), and tests/test_patches.py (the worker's
OMP binding follows the chosen value; the user's setting always wins).
Remove when: vLLM sizes its reservation by core count itself (not as of 0.30.0).
"""

from __future__ import annotations

import os

from vllm_omni_edge import envs
from vllm_omni_edge.cpu_features import usable_cores
from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"

# usable cores -> reserved cores, only for counts we measured.
MEASURED_DEFAULTS: dict[int, int] = {2: 1}

MEASUREMENT = (
    "results/2026-11-30-reserved-cores: 2-core AVX2 EPYC, "
    "eager, SmolLM2-135M bf16, 3 interleaved passes; see docs/edge/reserved-cores.md"
)
# Layouts with no engine-core process beside the model: reserve nothing.
ONE_PROCESS_RESERVED = 0
MEASUREMENT_ONE_PROCESS = (
    "results/2026-12-03-reserved-cores-one-process: 2-core AMX Xeon, "
    "compiled, SmolLM2-135M cpu_int4, one-process server, 1 reserved vs 0"
)

RECORD = PatchRecord(
    name="reserved_cores",
    kind=Kind.LEVER,
    target=f"env {ENV} (read by vllm/utils/ompmultiprocessing.py)",
    process=Process.FRONTEND,
    why="The reservation decides how many cores the model runs on; on small boxes it is "
    "set from measurement (2 cores: 1 reserved, measured 2x decode vs 0, in vLLM's three "
    "processes; 0 where the model shares its process with the engine loop: 1.42x decode on the one-process server).",
    verified_by="harness grid reserved-cores.yaml; tests/test_patches.py checks the "
    "worker's binding and that a user setting wins.",
    remove_when="vLLM chooses its reservation from the core count itself.",
    upstream="none found",
)


def default_reserved_cores(cores: int) -> int | None:
    """The measured default for this many cores, or None to keep vLLM's."""
    return MEASURED_DEFAULTS.get(cores)


def engine_loop_beside_the_model() -> str | None:
    """The layout, when the model runs in the process of the engine loop (nothing polls on a
    core of its own beside it), else None (vLLM's three processes)."""
    from vllm_omni_edge.levers import in_process_engine, single_process_enabled

    if single_process_enabled():
        return "one process (the server's default; LLM() runs in-process by default too)"
    if in_process_engine():
        return "in-process engine"
    return None


# Set when this module chose the value (not the user), so a later switch of layout may change it.
_CHOSEN_HERE = "VLLM_OMNI_EDGE_RESERVED_CPU_CHOSEN"


def reserve_for_vllm_layout() -> str:
    """Before vLLM's own processes are spawned in a process that expected one process (the
    configuration needed vLLM's layout): the three-process value, unless the user set one.
    Called by the layout patches (single_process, llm_in_process) when they fall back."""
    if not envs.get(_CHOSEN_HERE):
        return f"{ENV}={os.environ.get(ENV, '')!r} set by the user; left alone"
    return _reserve_for_three_processes()


def apply() -> str:
    if os.environ.get(ENV, "") != "":
        # The user's, or a parent process's choice that this child inherited.
        return f"{ENV}={os.environ[ENV]} already set; left alone"
    envs.set_env(_CHOSEN_HERE, True)
    layout = engine_loop_beside_the_model()
    if layout is not None:
        os.environ[ENV] = str(ONE_PROCESS_RESERVED)
        return f"{layout}: reserving {ONE_PROCESS_RESERVED} ({MEASUREMENT_ONE_PROCESS})"
    return _reserve_for_three_processes()


def _reserve_for_three_processes() -> str:
    cores = usable_cores()
    chosen = default_reserved_cores(cores)
    if chosen is None:
        os.environ.pop(ENV, None)
        return f"{cores} cores: no measurement for this count; vLLM's default kept"
    os.environ[ENV] = str(chosen)
    return f"{cores} cores: reserving {chosen} ({MEASUREMENT})"
