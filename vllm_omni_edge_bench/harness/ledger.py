"""The memory ledger: PSS of a pass process and every descendant, sampled while it runs.

Why PSS and the whole tree:
- RSS counts every page of an mmap'd checkpoint and every shared torch ``.so`` once
  per process, so summing RSS over processes double-counts, and a single RSS can
  show a file the kernel may drop at any time as "used".
- With vLLM's default process model the model, KV cache and RoPE cache live in a
  spawned worker, not in the process that called ``LLM()``; reading the front end
  alone misses them. The tree is re-walked at every sample because workers appear
  after the engine starts.

PSS comes from ``/proc/PID/smaps_rollup``, split into anonymous, file-backed and
shared-memory parts. USS is derived from the same file (Private_Clean +
Private_Dirty) rather than psutil's ``memory_full_info()``, which reads the full
``smaps`` and would spend the measured box's CPU on the measurement.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from vllm_omni_edge.memory import FIELDS, parse_kb_lines, parse_smaps_rollup, tree_total  # noqa: F401

# A pass process that only drives a server (pass_vllm_server) says so in its
# evidence; it is listed per process but is not part of the engine's tree totals.
HARNESS_CLIENT = "harness_client"
STEADY_SAMPLES = 5  # ~1 s at the default interval: the last samples before the workloads end


def canonical_role(text: str, is_root: bool = False) -> str:
    """One vocabulary for a process title ("VLLM::Worker") or an evidence role ("VllmWorker-0")."""
    if text == HARNESS_CLIENT:
        return HARNESS_CLIENT
    if is_root or text == "frontend":
        return "frontend"
    if "EngineCore" in text:
        return "engine_core"
    if "Worker" in text:
        return "worker"
    if "resource_tracker" in text:
        return "resource_tracker"
    return "other"


@dataclass
class ProcessInfo:
    pid: int
    ppid: int | None
    create_time: float
    first_cmdline: str
    title: str = ""
    name: str = ""
    role: str = "other"
    first_seen: float = 0.0
    last_seen: float = 0.0
    vm_hwm: int | None = None  # kernel's peak RSS; file pages included, so auxiliary only
    cpu_series: list[tuple[float, float]] = field(default_factory=list)  # (t, user + system CPU s)
    errors: list[str] = field(default_factory=list)


class MemoryLedger:
    """Samples a process tree; call :meth:`sample` periodically, then :func:`summarise_ledger`."""

    def __init__(self, root_pid: int, clock=time.time):
        self.root_pid = root_pid
        self.clock = clock
        self.processes: dict[int, ProcessInfo] = {}
        self.samples: list[dict[str, Any]] = []  # {"t": float, "procs": {pid: memory}}
        self._handles: dict[int, psutil.Process] = {}

    def _tree(self) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.root_pid)
            found[root.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
        except psutil.NoSuchProcess:
            pass
        # A process orphaned by a crashed parent leaves the tree but still holds memory.
        for pid, handle in self._handles.items():
            if pid not in found and handle.is_running():
                found[pid] = handle
        return list(found.values())

    def sample(self) -> dict[str, Any]:
        now = self.clock()
        memory: dict[int, dict] = {}
        for proc in self._tree():
            record = self._read(proc, now)
            if record is not None:
                memory[proc.pid] = record
        sample = {"t": now, "procs": memory}
        self.samples.append(sample)
        return sample

    def _read(self, proc: psutil.Process, now: float) -> dict | None:
        try:
            info = self.processes.get(proc.pid)
            if info is None:
                with proc.oneshot():
                    info = ProcessInfo(
                        pid=proc.pid,
                        ppid=proc.ppid(),
                        create_time=proc.create_time(),
                        first_cmdline=" ".join(proc.cmdline()),
                        first_seen=now,
                    )
                self.processes[proc.pid] = info
                self._handles[proc.pid] = proc
            # vLLM sets the title (VLLM::Worker) after the process starts.
            info.name = proc.name()
            info.title = " ".join(proc.cmdline()).strip() or info.name
            info.role = canonical_role(info.title, proc.pid == self.root_pid)
            with open(f"/proc/{proc.pid}/smaps_rollup") as fh:
                record = parse_smaps_rollup(fh.read())
            with open(f"/proc/{proc.pid}/status") as fh:
                info.vm_hwm = parse_kb_lines(fh.read()).get("VmHWM", info.vm_hwm)
            times = proc.cpu_times()  # one read of /proc/PID/stat: cheap next to smaps_rollup
            info.cpu_series.append((now, times.user + times.system))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, FileNotFoundError, ProcessLookupError):
            return None  # vanished between the walk and the read
        except (psutil.AccessDenied, PermissionError) as error:
            if proc.pid in self.processes:
                self.processes[proc.pid].errors.append(f"{type(error).__name__} at {now:.1f}")
            return None
        if record is not None:
            info.last_seen = now
        return record

    def alive_pids(self) -> list[int]:
        return [pid for pid, handle in self._handles.items() if handle.is_running()]


def _steady_times(samples: list[dict[str, Any]], workloads_done_t: float | None) -> set[float]:
    """Times of the tree's last samples before the workloads ended: the steady-state window."""
    if workloads_done_t is None:
        return set()
    times = sorted(s["t"] for s in samples if s["t"] <= workloads_done_t and s["procs"])
    return set(times[-STEADY_SAMPLES:])


def _window_stats(records: list[tuple[float, dict]], first_token_t: float | None,
                  steady_times: set[float]) -> dict[str, Any]:
    """Peak during load, steady state and overall peak of one series of memory records.

    A peak is the whole record at the sample where PSS was highest, so its parts
    add up; steady state is the median of each field over the steady window's
    samples. A process absent from that window (gone before it) has no steady state.
    """
    def peak(window):
        return max(window, key=lambda item: item[1]["pss"])[1] if window else None

    load = [item for item in records if first_token_t is None or item[0] <= first_token_t]
    steady = None
    if steady_times:
        tail = [rec for t, rec in records if t in steady_times]
        if tail:
            steady = {
                name: (None if any(r[name] is None for r in tail) else int(statistics.median(r[name] for r in tail)))
                for name in FIELDS
            }
    return {
        "peak_load": peak(load) if first_token_t is not None else None,
        "steady": steady,
        "peak": peak(records),
    }


def cpu_seconds(series: list[tuple[float, float]], first_token_t: float | None,
                workloads_done_t: float | None) -> dict[str, float | None]:
    """CPU time one process used in all, and while the workloads ran (first token to done).

    Read at the samples, so each bound is late by at most one sampling interval.
    """
    def at(t: float) -> float | None:
        before = [cpu for when, cpu in series if when <= t]
        return before[-1] if before else None

    total = series[-1][1] if series else None
    during = None
    if first_token_t is not None and workloads_done_t is not None:
        start, end = at(first_token_t), at(workloads_done_t)
        if start is not None and end is not None:
            during = round(end - start, 3)
    return {"total": None if total is None else round(total, 3), "during_workloads": during}


def summarise_ledger(ledger: MemoryLedger, roles: dict[int, str] | None = None,
                     first_token_t: float | None = None, workloads_done_t: float | None = None,
                     interval_s: float | None = None) -> dict[str, Any]:
    """Per-process and whole-tree memory, plus a PSS timeline for plots.

    ``roles`` (pid -> role from the plugin's evidence) replaces guesses from titles;
    both are kept, so evidence that names the wrong process shows.
    """
    roles = roles or {}
    t0 = ledger.samples[0]["t"] if ledger.samples else 0.0
    steady_times = _steady_times(ledger.samples, workloads_done_t)
    processes = {}
    for pid, info in ledger.processes.items():
        series = [(s["t"], s["procs"][pid]) for s in ledger.samples if pid in s["procs"]]
        processes[str(pid)] = {
            "pid": pid,
            "ppid": info.ppid,
            "role": canonical_role(roles[pid], pid == ledger.root_pid) if pid in roles else info.role,
            "role_source": "evidence" if pid in roles else "title",
            "evidence_role": roles.get(pid),
            "title_role": info.role,
            "name": info.name,
            "title": info.title,
            "first_cmdline": info.first_cmdline[:500],
            "first_seen_s": round(info.first_seen - t0, 3),
            "last_seen_s": round(info.last_seen - t0, 3) if info.last_seen else None,
            "vm_hwm_bytes": info.vm_hwm,
            "cpu_s": cpu_seconds(info.cpu_series, first_token_t, workloads_done_t),
            "errors": info.errors,
            **_window_stats(series, first_token_t, steady_times),
        }
    clients = {pid for pid, p in processes.items() if p["role"] == HARNESS_CLIENT}
    engine_samples = [{"t": s["t"], "procs": {pid: rec for pid, rec in s["procs"].items() if str(pid) not in clients}}
                      for s in ledger.samples]
    tree_series = [(s["t"], tree_total(s["procs"])) for s in engine_samples if s["procs"]]
    return {
        "root_pid": ledger.root_pid,
        "interval_s": interval_s,
        "n_samples": len(ledger.samples),
        "max_processes": max((len(s["procs"]) for s in ledger.samples), default=0),
        "first_token_s": None if first_token_t is None else round(first_token_t - t0, 3),
        "workloads_done_s": None if workloads_done_t is None else round(workloads_done_t - t0, 3),
        "tree": _window_stats(tree_series, first_token_t, steady_times),
        "excluded_from_tree": sorted(int(pid) for pid in clients),
        "processes": processes,
        "timeline": [
            {"t": round(s["t"] - t0, 3), "pss": {str(pid): rec["pss"] for pid, rec in s["procs"].items()}}
            for s in engine_samples
        ],
    }
