"""What this CPU can do, read once from /proc/cpuinfo and PyTorch."""

from __future__ import annotations

import functools
import os


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def usable_cores() -> int:
    """Cores this process may run on (affinity), not the host's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_class() -> str:
    """The coarse class routing tables are keyed on."""
    flags = cpu_flags()
    if "amx_tile" in flags and "amx_int8" in flags:
        return "x86-amx"
    if "avx512_vnni" in flags or "avx512_bf16" in flags:
        return "x86-avx512-vnni"
    if "avx512f" in flags:
        return "x86-avx512"
    if "avx2" in flags:
        return "x86-avx2"
    return "other"
