"""Phase markers a pass process appends to a file, read back by the runner, and the gate that
keeps the memory ledger out of timed requests.

The ledger samples on wall-clock time (``time.time()``, shared by all processes),
so "peak during load" is simply the samples before the ``first_token`` marker.
One JSON object per line, flushed at once, so a crash loses nothing written.

The gate. Reading ``/proc/PID/smaps_rollup`` walks the target's page tables in the kernel, on
one of the box's cores, for as long as the process is large: tens of milliseconds for a vLLM
engine, far less for llama.cpp. On a 2-core box an engine's two compute threads then wait for
the core the read took, so a ledger reading during a timed request slowed the measured engine,
and a larger engine more than a smaller one. With the gate on (the runner sets
``ledger_gate`` in the spec), a pass wraps each timed request in :func:`timed_request`:
- before the request it makes ``<events>.quiet`` and waits for a read under way
  (``<events>.reading``) to finish; the runner starts no read while ``.quiet`` exists;
- after it, it removes ``.quiet``, makes ``<events>.sample`` and waits until the runner
  has sampled the tree and removed it, so the ledger sees the engine as each request left it.
The runner's half is :class:`LedgerGate`. Each side makes its own marker before it looks at
the other's, so one of them always sees the other.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Iterator

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


QUIET = ".quiet"  # the pass: a timed request runs
READING = ".reading"  # the runner: the ledger is reading the tree
WANTED = ".sample"  # the pass: sample the tree now, I wait
GATE_WAIT_S = 60.0  # longer than any ledger sample; past it the pass goes on and says so
POLL_S = 0.002

_gated_events: str | None = None
gate_problems: list[str] = []


def marker(events_path: Path | str, suffix: str) -> Path:
    return Path(str(events_path) + suffix)


def gate_timed_requests(spec: dict) -> None:
    """Called once by a pass process: gate its timed requests when the runner asked for it."""
    global _gated_events
    _gated_events = spec["events_path"] if spec.get("ledger_gate") else None


def _wait_gone(path: Path, what: str) -> None:
    deadline = time.monotonic() + GATE_WAIT_S
    while path.exists():
        if time.monotonic() > deadline:
            gate_problems.append(f"ledger gate: {what} still there after {GATE_WAIT_S:.0f} s")
            return
        time.sleep(POLL_S)


@contextlib.contextmanager
def timed_request() -> Iterator[None]:
    """Run one timed request with the ledger kept out of it (a no-op when the gate is off)."""
    events = _gated_events
    if events is None:
        yield
        return
    quiet, wanted = marker(events, QUIET), marker(events, WANTED)
    quiet.touch()
    _wait_gone(marker(events, READING), "a ledger read begun before the request")
    try:
        yield
    finally:
        quiet.unlink(missing_ok=True)
        wanted.touch()
        _wait_gone(wanted, "the request for a sample after the request")


class LedgerGate:
    """The runner's half of the gate for one pass."""

    def __init__(self, events_path: Path | str):
        self.quiet = marker(events_path, QUIET)
        self.reading = marker(events_path, READING)
        self.wanted = marker(events_path, WANTED)

    def asked(self) -> bool:
        return self.wanted.exists()

    @contextlib.contextmanager
    def read(self) -> Iterator[bool]:
        """Yields True when the ledger may read now: no timed request runs, or the pass asked."""
        self.reading.touch()
        try:
            yield self.asked() or not self.quiet.exists()
        finally:
            self.reading.unlink(missing_ok=True)

    def answered(self) -> None:
        self.wanted.unlink(missing_ok=True)

    def clean(self) -> None:
        for path in (self.quiet, self.reading, self.wanted):
            path.unlink(missing_ok=True)
