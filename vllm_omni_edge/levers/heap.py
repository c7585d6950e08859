"""Return freed heap to the OS (glibc ``malloc_trim``), and say how much it returned."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import platform
import re
from pathlib import Path

_RSS_ANON = re.compile(r"^RssAnon:\s+(\d+) kB$", re.MULTILINE)


def rss_anon_bytes(status: Path = Path("/proc/self/status")) -> int:
    match = _RSS_ANON.search(status.read_text())
    if match is None:
        raise RuntimeError(f"no RssAnon line in {status}")
    return int(match.group(1)) * 1024


@functools.cache
def _libc():
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def trim_heap(collect: bool = True) -> dict:
    """``gc.collect()`` (unless ``collect`` is False) then ``malloc_trim(0)``; anonymous RSS
    before and after."""
    libc = _libc()
    if libc is None:
        return {"trimmed": False, "reason": f"libc is {platform.libc_ver()[0] or 'unknown'}, not glibc"}
    if collect:
        gc.collect()
    before = rss_anon_bytes()
    returned_pages = bool(libc.malloc_trim(0))
    after = rss_anon_bytes()
    return {"trimmed": True, "released_bytes": before - after, "rss_anon_before": before,
            "rss_anon_after": after, "malloc_trim_released": returned_pages}
