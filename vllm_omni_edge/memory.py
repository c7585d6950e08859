"""Whole-process-tree memory: PSS split into anon and file, from smaps_rollup.

vLLM runs the model in a worker process and mmaps the checkpoint, so RSS of one
process says little. PSS summed over the tree counts shared pages once.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

_KB = 1024


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` fields in bytes (e.g. 'Pss_Anon', 'Pss_File')."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[key.strip()] = int(parts[0]) * _KB
    return fields


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    name: str
    pss: int
    pss_anon: int
    pss_file: int
    pss_shmem: int
    uss: int


def process_memory(proc: psutil.Process) -> ProcessMemory | None:
    """One process's memory, or None if it is gone or unreadable."""
    try:
        with open(f"/proc/{proc.pid}/smaps_rollup") as fh:
            rollup = parse_smaps_rollup(fh.read())
        uss = proc.memory_full_info().uss
        name = proc.name()
    except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return ProcessMemory(
        pid=proc.pid,
        name=name,
        pss=rollup.get("Pss", 0),
        pss_anon=rollup.get("Pss_Anon", 0),
        pss_file=rollup.get("Pss_File", 0),
        pss_shmem=rollup.get("Pss_Shmem", 0),
        uss=uss,
    )


def tree_memory(root_pid: int) -> list[ProcessMemory]:
    """The root process and all its descendants, walked now."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    return [m for m in (process_memory(p) for p in procs) if m is not None]


def mib(n: int) -> float:
    return n / (1 << 20)
