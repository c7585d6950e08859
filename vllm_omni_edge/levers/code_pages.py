"""Unmap the clean code pages of loaded libraries, so only the code that runs again is resident.

Importing torch, vLLM and their extensions runs the libraries' start-up code (op
registrations, static initialisers, import-time Python C extensions) once. Those pages of
``libtorch_cpu.so`` and the rest stay mapped in the process, and count in its RSS and PSS,
though nothing executes them again. ``madvise(MADV_DONTNEED)`` on a private file mapping
whose pages are all clean unmaps them; a later access faults the page back in from the page
cache (from the file if it was evicted) with the same contents. Mappings with any private
(copy-on-write) or dirty page are left alone: unmapping would lose what was written. Only
the segments of mapped ELF objects are touched: the executable ones, and the read-only
segments of the same files.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
import re
from dataclasses import dataclass
from pathlib import Path

MADV_DONTNEED = 4
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)\s*(.*)$")
_FIELD = re.compile(r"^(\w+):\s+(\d+) kB$")
_RSS_FILE = re.compile(r"^RssFile:\s+(\d+) kB$", re.MULTILINE)
_DIRTY_FIELDS = ("Anonymous", "Private_Dirty", "Shared_Dirty", "Swap", "Locked")


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str
    inode: int
    path: str
    fields: dict

    @property
    def rss_bytes(self) -> int:
        return self.fields.get("Rss", 0) * 1024


def read_smaps(text: str) -> list[Mapping]:
    """The mappings of a ``/proc/PID/smaps`` text, with their kB fields."""
    mappings: list[Mapping] = []
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            start, end, perms, inode, path = header.groups()
            current = Mapping(int(start, 16), int(end, 16), perms, int(inode), path.strip(), {})
            mappings.append(current)
            continue
        field = _FIELD.match(line)
        if field and current is not None:
            current.fields[field.group(1)] = int(field.group(2))
    return mappings


def droppable(mappings: list[Mapping]) -> list[Mapping]:
    """Clean, resident, file-backed segments of ELF objects that have an executable segment."""
    executable_files = {m.path for m in mappings if m.perms == "r-xp" and m.inode and m.path.startswith("/")}
    return [
        m for m in mappings
        if m.path in executable_files and m.perms in ("r-xp", "r--p") and m.inode
        and m.rss_bytes > 0 and all(m.fields.get(k, 0) == 0 for k in _DIRTY_FIELDS)
    ]


@functools.cache
def _madvise():
    if platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def rss_file_bytes(status: Path = Path("/proc/self/status")) -> int:
    match = _RSS_FILE.search(status.read_text())
    if match is None:
        raise RuntimeError(f"no RssFile line in {status}")
    return int(match.group(1)) * 1024


def drop_clean_code_pages(smaps: Path = Path("/proc/self/smaps")) -> dict:
    """Unmap this process's clean library code pages; what it found and what it released."""
    madvise = _madvise()
    if madvise is None:
        return {"dropped": False, "reason": f"{platform.system()} has no MADV_DONTNEED on file pages"}
    before = rss_file_bytes()
    chosen = droppable(read_smaps(smaps.read_text()))
    failed = sum(1 for m in chosen if madvise(m.start, m.end - m.start, MADV_DONTNEED) != 0)
    after = rss_file_bytes()
    return {"dropped": True, "mappings": len(chosen), "failed": failed,
            "resident_bytes_seen": sum(m.rss_bytes for m in chosen),
            "rss_file_before": before, "rss_file_after": after, "released_bytes": before - after}
