"""Answers remembered across starts, each valid only while its stamp holds.

A start-up memo (``patches/worker/isa_probe_memo.py``, ``precompiled_header_memo.py``, ``torch_key_memo.py``)
keeps, in one JSON file under the user cache, what an expensive check answered, with a
stamp of everything the answer depends on (files by size and mtime, the interpreter,
torch, the CPU). A later start with the same stamp takes the answer from the file;
any difference means the check runs again. Only answers worth keeping are written; a
corrupt or unwritable file costs the memo, never the start.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from vllm_omni_edge.log import get_logger

logger = get_logger("stamped_memo")


def file_stamp(path: str | os.PathLike) -> list[int] | None:
    """Size and mtime of a file, or None if it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


@functools.cache
def environment_stamp() -> dict:
    """What every answer of this process depends on: interpreter, torch, CPU."""
    import torch

    from vllm_omni_edge.cpu_features import cpu_flags, cpu_model_name

    libtorch = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    return {
        # The interpreter binary, whichever of its names (python, python3) started us.
        "python": os.path.realpath(sys.executable),
        "torch": torch.__version__,
        "libtorch_cpu": [str(libtorch), file_stamp(libtorch)],
        "cpu": cpu_model_name(),
        "cpu_flags": " ".join(sorted(cpu_flags())),
    }


class StampedMemo:
    """One memo file: ``key -> entry``; an entry counts only if it equals what is asked."""

    def __init__(self, *relative: str):
        self.relative = relative
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        from vllm_omni_edge.cache_paths import cache_root

        return cache_root().joinpath(*self.relative)

    def entries(self) -> dict[str, Any]:
        # Read on every lookup (a few small reads a start), so another process's entries count.
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> Any:
        return self.entries().get(key)

    def put(self, key: str, entry: Any) -> None:
        from vllm_omni_edge.atomic import atomic_write_bytes

        with self._lock:
            entries = self.entries()
            entries[key] = entry
            try:
                atomic_write_bytes(self.path, json.dumps(entries, indent=1, sort_keys=True).encode())
            except OSError as err:  # a read-only cache costs the next start the check, nothing else
                logger.warning("cannot write %s: %s", self.path, err)
