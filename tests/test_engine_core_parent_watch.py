"""The engine core's parent watch: an orphaned engine core stops, other processes do not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from tests.conftest import REPO
from vllm_omni_edge.patches.worker import engine_core_parent_watch


def orphan(name: str) -> tuple[int, int]:
    """(pid, watcher threads) of a child named ``name`` whose parent left with os._exit."""
    # Read one line, not to EOF: the orphan inherits the pipe and holds it open.
    parent = subprocess.Popen([sys.executable, "-m", "tests.parent_watch_helper", name], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    out = parent.stdout.readline().split()
    assert parent.wait(timeout=120) == 0 and len(out) == 2, out
    parent.stdout.close()
    return int(out[0]), int(out[1])


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def test_an_engine_core_whose_parent_died_stops():
    pid, watchers = orphan("EngineCore")
    assert watchers == 1
    assert gone_within(pid, 10), f"engine core {pid} outlived its parent"


def test_another_process_is_not_watched():
    pid, watchers = orphan("VllmWorker-0")
    try:
        assert watchers == 0
        assert not gone_within(pid, 2)
    finally:
        os.kill(pid, signal.SIGKILL)


def test_engine_core_names():
    assert engine_core_parent_watch.is_engine_core("EngineCore")
    assert engine_core_parent_watch.is_engine_core("EngineCore_DP1")
    assert not engine_core_parent_watch.is_engine_core("MainProcess")
    assert "not an engine core" in engine_core_parent_watch.apply()
