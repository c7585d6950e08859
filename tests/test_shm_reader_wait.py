"""The shm queue reader patch, on a real vLLM MessageQueue between two processes.

The writer sends a message, waits 1.5 s, sends another. The reader (a spawned
process, as vLLM's engine core and workers are) measures the CPU it used between
the two. Stock vLLM spins on sched_yield for 1 s after a read; with the patch the
reader blocks on the notify socket and still receives every message.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

from vllm_omni_edge.levers import LeverFlagError, shm_spin_seconds

GAP_S = 1.5


def _reader(handle, spin_setting: str, results) -> None:
    import os

    os.environ["VLLM_OMNI_EDGE_SHM_SPIN_S"] = spin_setting
    from vllm_omni_edge.patches.base import apply_patch_module

    outcome = apply_patch_module("vllm_omni_edge.patches.worker.shm_reader_wait")
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from vllm_omni_edge import evidence

    queue = MessageQueue.create_from_handle(handle, 0)
    queue.wait_until_ready()
    first = queue.dequeue()
    cpu_before = time.process_time()
    second = queue.dequeue()
    results.put({"outcome": outcome.status, "messages": [first, second],
                 "idle_cpu_s": time.process_time() - cpu_before,
                 "busy_loop_s": queue._spin_condition.busy_loop_s,
                 "recorded": evidence._shm_reader_busy_loop_s()})


def _run_pair(spin_setting: str) -> dict:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=2)
    reader = context.Process(target=_reader, args=(writer.export_handle(), spin_setting, results))
    reader.start()
    try:
        writer.wait_until_ready()
        writer.enqueue({"step": 1})
        time.sleep(GAP_S)
        writer.enqueue({"step": 2})
        return results.get(timeout=60)
    finally:
        reader.join(timeout=30)
        if reader.is_alive():
            reader.kill()


@pytest.mark.timeout(180)
def test_a_blocked_reader_uses_no_cpu_and_still_gets_every_message():
    patched, stock = _run_pair("0"), _run_pair("1")
    for run in (patched, stock):
        assert run["outcome"] == "applied"
        assert run["messages"] == [{"step": 1}, {"step": 2}]
    assert patched["busy_loop_s"] == 0.0 and patched["recorded"] == [0.0]
    assert stock["busy_loop_s"] == 1.0
    # Stock spins for the first second of the gap; the patched reader sleeps in poll.
    assert stock["idle_cpu_s"] > 0.3, stock
    assert patched["idle_cpu_s"] < 0.1, patched


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_a_spin_setting_that_is_not_seconds_is_refused(monkeypatch, value):
    monkeypatch.setenv("VLLM_OMNI_EDGE_SHM_SPIN_S", value)
    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_SHM_SPIN_S"):
        shm_spin_seconds()


def test_the_default_is_to_block_at_once(monkeypatch):
    monkeypatch.delenv("VLLM_OMNI_EDGE_SHM_SPIN_S", raising=False)
    assert shm_spin_seconds() == 0.0
    monkeypatch.setenv("VLLM_OMNI_EDGE_SHM_SPIN_S", "0.002")
    assert shm_spin_seconds() == 0.002


def test_a_missed_notification_costs_at_most_the_poll_cap_after_a_read():
    # The writer is bound but never notifies: what a lost wake-up looks like to the reader.
    # (A reader connected to an inproc address nobody binds made zmq_ctx_term abort about
    # 1 run in 8, so the writer end exists, as in vLLM, and every socket is closed first.)
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    from vllm_omni_edge.patches.worker import shm_reader_wait

    shm_reader_wait._wrap(shm_broadcast, 0.0)  # idempotent: a no-op if already applied
    context = zmq.Context()
    address = "inproc://edge-missed-notify"
    writer = shm_broadcast.SpinCondition(False, context, address)
    condition = shm_broadcast.SpinCondition(True, context, address, busy_loop_s=0)
    try:
        condition.record_read()
        start = time.monotonic()
        condition.wait(timeout_ms=2000)
        assert time.monotonic() - start < 0.2  # capped at POLL_CAP_MS, not vLLM's 2 s
        condition.last_read -= shm_reader_wait.RECENT_READ_S + 1  # idle since long ago
        start = time.monotonic()
        condition.wait(timeout_ms=300)
        assert time.monotonic() - start >= 0.25  # an idle reader blocks as before
    finally:
        for socket in (condition.read_cancel_socket, condition.write_cancel_socket,
                       condition.local_notify_socket, writer.local_notify_socket):
            socket.close(linger=0)
        context.term()
