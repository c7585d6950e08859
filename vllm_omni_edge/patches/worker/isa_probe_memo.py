"""Remember inductor's ISA load probes across starts instead of spawning one Python per ISA.

What: wraps ``torch._inductor.cpu_vec_isa.VecISA._probe_load``, the check that spawns
a child ``python -c`` to ``dlopen`` the small test library inductor builds for each
vector ISA. A successful probe is written to ``<cache>/inductor/isa_probes.json``,
keyed by the library's path and stamped with what the answer depends on: the
library's size and mtime, the interpreter (its real path), torch's version and its
``libtorch_cpu`` (path, size and mtime), this CPU's model and flags. A later probe of
the same library with the same stamp answers from the file; anything else (a new
stamp, a failed or timed out probe, an unreadable file) runs the probe as stock torch
does. Failures are never remembered.
Why: inductor checks each ISA once per process (``valid_vec_isa_list``, AMX, AVX-512
VNNI, AVX-512 and AVX2 on this Xeon: 10 probes with their bf16/fp16 variants), on the
critical path of every compiled start, including one that loads its compiled model
from vLLM's cache: 2.4 s of child Pythons on this busy box, ~1.2 s quiet. The answer
cannot change while the library, torch and the CPU stay the same.
Flag: ``VLLM_OMNI_EDGE_ISA_PROBE_MEMO=0`` probes every time (the A/B arm).
Verified by: tests/test_isa_probe_memo.py (a remembered probe spawns nothing; a changed
library, torch library or CPU, and a failed probe, spawn it again; the file is written
atomically and a corrupt one is ignored; torch's ISA list is the same with and without
the memo); evidence ``isa_probes`` (remembered vs run) in the start-up grids.
Remove when: torch caches the probe result on disk, or stops probing in a subprocess
(torch 2.13's ``VecISA._probe_load``).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported
from vllm_omni_edge.stamped_memo import StampedMemo, environment_stamp, file_stamp

TARGET_MODULE = "torch._inductor.cpu_vec_isa"

RECORD = PatchRecord(
    name="isa_probe_memo",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.VecISA._probe_load",
    process=Process.WORKER,  # probed where the model is compiled or its compiled code loaded
    why="Inductor spawns a Python per vector ISA to dlopen a test library, on every compiled "
    "start (10 probes, 1.2-2.4 s here); the answer is fixed while library, torch and CPU are.",
    verified_by="tests/test_isa_probe_memo.py; evidence isa_probes in the start-up grids.",
    remove_when="torch remembers the probe on disk or stops probing in a subprocess.",
    upstream="none found",
)

# Probes in this process: answered from the file, or run (evidence / tests).
counts = {"remembered": 0, "probed": 0}
MEMO = StampedMemo("inductor", "isa_probes.json")


def memo_path():
    return MEMO.path


def probe_stamp(library: str) -> dict | None:
    """What a probe's answer depends on; None if the library cannot be stat'ed."""
    library_stamp = file_stamp(library)
    if library_stamp is None:
        return None
    # The child links the library against this libtorch (torch's lib dir on its path).
    return {"library": library_stamp, **environment_stamp()}


def remember(library: str, stamp: dict) -> None:
    MEMO.put(library, stamp)


def is_remembered(library: str, stamp: dict | None) -> bool:
    return stamp is not None and MEMO.get(library) == stamp


def _wrap(module) -> None:
    def make(original):
        def _probe_load(self, output_path):
            stamp = probe_stamp(output_path)
            if is_remembered(output_path, stamp):
                counts["remembered"] += 1
                return True
            counts["probed"] += 1
            loaded = original(self, output_path)
            if loaded and stamp is not None:
                remember(output_path, stamp)
            return loaded

        return _probe_load

    wrap_method_once(module.VecISA, "_probe_load", make)


def apply() -> str:
    from vllm_omni_edge.levers import isa_probe_memo_enabled

    if not isa_probe_memo_enabled():
        return "VLLM_OMNI_EDGE_ISA_PROBE_MEMO=0: inductor probes every ISA in a child process"
    now = when_imported(TARGET_MODULE, _wrap)
    return "inductor's ISA load probes remembered across starts" + ("" if now else " (on import)")
