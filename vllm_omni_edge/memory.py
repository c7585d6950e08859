"""PSS of a process and its descendants, read from ``/proc/PID/smaps_rollup``.

PSS, not RSS: summed over processes it counts shared pages (torch's libraries, shm
queues) once, and it is split into anonymous, file-backed and shared-memory parts.
The demo prints it for the server it started; the harness's memory ledger samples it
over a whole pass.
"""

from __future__ import annotations

import re

import psutil

FIELDS = ("pss", "pss_anon", "pss_file", "pss_shmem", "uss", "rss", "swap_pss")
_KB_LINE = re.compile(r"^(\w+):\s+(\d+)\s+kB\s*$")


def parse_kb_lines(text: str) -> dict[str, int]:
    """``Name:   123 kB`` lines (smaps_rollup, status) as bytes, keyed by name."""
    values = {}
    for line in text.splitlines():
        match = _KB_LINE.match(line.strip())
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    return values


def parse_smaps_rollup(text: str) -> dict[str, int | None] | None:
    """Memory of one process from its smaps_rollup text; None if it has no mappings.

    Kernels before 5.7 have no Pss_Anon/Pss_File/Pss_Shmem: those are None, not 0,
    so a missing split is never reported as "no anonymous memory".
    """
    kb = parse_kb_lines(text)
    if "Pss" not in kb:
        return None  # zombie or kernel thread: empty rollup
    private = [kb.get("Private_Clean"), kb.get("Private_Dirty")]
    return {
        "pss": kb["Pss"],
        "pss_anon": kb.get("Pss_Anon"),
        "pss_file": kb.get("Pss_File"),
        "pss_shmem": kb.get("Pss_Shmem"),
        "uss": None if None in private else sum(private) + kb.get("Private_Hugetlb", 0),
        "rss": kb.get("Rss"),
        "swap_pss": kb.get("SwapPss"),
    }


def tree_total(procs: dict[int, dict]) -> dict[str, int | None]:
    """Sum one sample's per-process records; a field unknown for any process is None."""
    total: dict[str, int | None] = {}
    for name in FIELDS:
        values = [record[name] for record in procs.values()]
        total[name] = None if not values or None in values else sum(values)
    return total


def read_process(pid: int) -> dict[str, int | None] | None:
    """One process's memory record, or None if it is gone or has no mappings."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            return parse_smaps_rollup(fh.read())
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_tree_memory(root_pid: int) -> dict[int, dict]:
    """Memory records of ``root_pid`` and every descendant alive now, by pid."""
    root = psutil.Process(root_pid)
    records = {}
    for proc in [root, *root.children(recursive=True)]:
        record = read_process(proc.pid)
        if record is not None:
            records[proc.pid] = record
    return records
