"""Phase markers a pass process appends to a file, read back by the runner.

The ledger samples on wall-clock time (``time.time()``, shared by all processes),
so "peak during load" is simply the samples before the ``first_token`` marker.
One JSON object per line, flushed at once, so a crash loses nothing written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

STARTED = "started"
ENGINE_READY = "engine_ready"  # the engine constructor returned
FIRST_TOKEN = "first_token"  # the first request's first token is back: load is over
WORKLOADS_DONE = "workloads_done"


def emit(path: Path | str, event: str, **details) -> float:
    now = time.time()
    with open(path, "a") as fh:
        fh.write(json.dumps({"event": event, "t": now, **details}) + "\n")
        fh.flush()
    return now


def read_events(path: Path | str) -> dict[str, float]:
    """Event name -> time of its first occurrence; a torn last line is ignored."""
    times: dict[str, float] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return times
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        times.setdefault(record["event"], record["t"])
    return times
