"""Where a served decode's CPU went: the server's threads and the client, over one request.

On a box with as many cores as the model's OpenMP team, everything else a served token
costs (the API server's event loop, other server threads, the client reading the stream)
runs on the team's cores. ``snapshot`` reads the CPU time of every thread of a server tree
(psutil: ``/proc/PID/task/TID/stat``) and of this process; ``split`` turns two snapshots
into shares of the wall time between them, by role:

- ``server main thread``: the root process's main thread. In the one-process layout it runs
  the API server's event loop (HTTP, detokenizing, streaming); in vLLM's layout the same
  loop, with the engine and model in other processes;
- ``server other threads``: the root process's other threads (the one-process layout's engine
  thread and the model's OpenMP team, which spin while they wait);
- ``server other processes``: the rest of the tree (vLLM's engine core and worker);
- ``client``: this process (the harness's streaming client).

A share is CPU seconds over wall seconds, so the shares of a 2-core box sum to at most 2.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

ROLES = ("server main thread", "server other threads", "server other processes", "client")


@dataclass(frozen=True)
class CpuSnapshot:
    t: float  # perf_counter
    client_cpu_s: float  # this process's process_time
    root_pid: int
    # (pid, tid) -> user + system seconds of that thread
    threads: dict[tuple[int, int], float] = field(default_factory=dict)


def snapshot(root_pid: int) -> CpuSnapshot:
    """CPU time of every thread of ``root_pid`` and its descendants, and of this process."""
    import psutil

    threads: dict[tuple[int, int], float] = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        try:
            for th in proc.threads():
                threads[(proc.pid, th.id)] = th.user_time + th.system_time
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # gone between the listing and the read: it has no share to give
    return CpuSnapshot(t=time.perf_counter(), client_cpu_s=time.process_time(), root_pid=root_pid,
                       threads=threads)


def role_of(root_pid: int, pid: int, tid: int) -> str:
    if pid != root_pid:
        return "server other processes"
    return "server main thread" if tid == pid else "server other threads"


def split(before: CpuSnapshot, after: CpuSnapshot) -> dict:
    """Shares of the wall time between two snapshots, by role (see the module docstring).

    A thread that appeared in between counts from zero; one that ended is not counted (its
    last CPU time is unknown), so a share can only be understated.
    """
    if after.root_pid != before.root_pid:
        raise ValueError(f"snapshots of different trees: {before.root_pid} and {after.root_pid}")
    wall = after.t - before.t
    if wall <= 0:
        raise ValueError(f"the second snapshot is not later than the first (wall {wall:.6f} s)")
    cpu = dict.fromkeys(ROLES, 0.0)
    for key, seconds in after.threads.items():
        cpu[role_of(after.root_pid, *key)] += max(0.0, seconds - before.threads.get(key, 0.0))
    cpu["client"] = max(0.0, after.client_cpu_s - before.client_cpu_s)
    return {"wall_s": wall, "cpu_s": cpu, "share_of_wall": {role: s / wall for role, s in cpu.items()}}
