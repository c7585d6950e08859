"""Let a process waiting on vLLM's shared-memory queue sleep instead of spinning.

What: wraps ``SpinCondition.__init__`` so every reader of a shared-memory
``MessageQueue`` busy-waits ``VLLM_OMNI_EDGE_SHM_SPIN_S`` seconds after a read
(default 0; vLLM's is 1 s) before it blocks on the queue's zmq notify socket.
Why: on a 2-core box the stock 1 s of ``sched_yield`` polling keeps the engine core
(waiting for the worker's step output) on a core for the whole of decode: the decode
profile (``2026-11-30-decode-profile-loaded``) put 77 % of the engine core's samples in
``sched_yield``. That core is then taken from the model (``reserved-cores`` grid: giving
the worker both cores cut decode to 0.51×). The writer sends a notification after every
enqueue (``MessageQueue.enqueue``), and the socket is CONFLATE, so a reader that blocks
still wakes on each message; it pays one poll wake-up (tens of µs) per step instead.
A lost wake-up made this unsafe on its own: in the w4a8-qwen grid (2026-12-01, three
processes, one model core) the engine core sat in ``poll`` waiting for a step output
the worker had already written, while the worker waited for the next step, both idle,
until vLLM's recheck interval expired: decode fell to 0.64 tok/s. (vLLM's own 1 s spin
never relies on the notification during decode, which hides the race.) So for
``RECENT_READ_S`` after a read the blocking poll is capped at ``POLL_CAP_MS``: a
missed notification costs at most that, and a reader waiting between steps still
sleeps (one wake-up per millisecond, not a ``sched_yield`` loop). Idle readers block as
before once the window has passed.
Flag: ``VLLM_OMNI_EDGE_SHM_SPIN_S`` (seconds, ≥ 0); ``1`` restores vLLM's behaviour.
Verified by: tests/test_shm_reader_wait.py (a real MessageQueue pair: readers get the
setting, messages arrive with no spinning, a reader blocked in poll uses no CPU); the
harness figure ``engine_core CPU s in workloads`` in the edge-default grid's A/B arms.
Remove when: vLLM makes the busy-loop time configurable or adapts it on CPU (0.30.0
hard-codes ``busy_loop_s=1``).
"""

from __future__ import annotations

import time

from vllm_omni_edge.evidence import note_shm_reader
from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.distributed.device_communicators.shm_broadcast"

RECORD = PatchRecord(
    name="shm_reader_wait",
    kind=Kind.LEVER,
    target="vllm.distributed.device_communicators.shm_broadcast.SpinCondition.__init__ and .wait",
    process=Process.WORKER,  # readers live in the engine core and in each worker
    why="vLLM's shm queue readers poll sched_yield for 1 s after each read: a whole core of a 2-core box during decode; "
        "blocking instead needs a short poll cap after a read, or a missed notification stalls a step.",
    verified_by="tests/test_shm_reader_wait.py (real MessageQueue; a missed notification costs <= the cap); "
        "engine_core CPU s in the edge-default A/B.",
    remove_when="vLLM makes SpinCondition.busy_loop_s configurable or adaptive on CPU.",
    upstream="https://github.com/vllm-project/vllm/pull/52814",
)

# After a read, block for at most this long per poll (bounds a missed notification).
POLL_CAP_MS = 1
RECENT_READ_S = 1.0


def apply() -> str:
    from vllm_omni_edge.levers import shm_spin_seconds

    seconds = shm_spin_seconds()
    now = when_imported(TARGET_MODULE, lambda module: _wrap(module, seconds))
    return f"shm queue readers spin {seconds:g} s after a read, then block" + ("" if now else " (on import)")


def _wrap(module, seconds: float) -> None:
    def make(original):
        def __init__(self, is_reader, *args, **kwargs):
            original(self, is_reader, *args, **kwargs)
            if is_reader:
                self.busy_loop_s = seconds
                note_shm_reader(seconds)  # the process record now names the setting

        return __init__

    wrap_method_once(module.SpinCondition, "__init__", make)

    def make_wait(original):
        def wait(self, timeout_ms=None):
            if self.is_reader and time.monotonic() <= self.last_read + RECENT_READ_S:
                timeout_ms = POLL_CAP_MS if timeout_ms is None else min(timeout_ms, POLL_CAP_MS)
            return original(self, timeout_ms=timeout_ms)
        return wait

    wrap_method_once(module.SpinCondition, "wait", make_wait)
