"""thread_cpu: the served decode's CPU split by role (server main thread, other threads,
other processes, client)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vllm_omni_edge_bench.harness import thread_cpu
from vllm_omni_edge_bench.harness.thread_cpu import CpuSnapshot

ROOT = 100


def snap(t: float, client: float, threads: dict[tuple[int, int], float], root: int = ROOT) -> CpuSnapshot:
    return CpuSnapshot(t=t, client_cpu_s=client, root_pid=root, threads=threads)


def test_split_assigns_each_thread_to_its_role():
    before = snap(10.0, 1.0, {(ROOT, ROOT): 2.0, (ROOT, 101): 5.0, (200, 200): 1.0, (ROOT, 102): 3.0})
    after = snap(12.0, 1.5, {(ROOT, ROOT): 2.2, (ROOT, 101): 6.8, (200, 200): 1.4, (300, 301): 0.6})
    out = thread_cpu.split(before, after)
    assert out["wall_s"] == pytest.approx(2.0)
    cpu = out["cpu_s"]
    assert cpu["server main thread"] == pytest.approx(0.2)
    # 102 ended in between: not counted (its last time is unknown); none of its time is made up
    assert cpu["server other threads"] == pytest.approx(1.8)
    # 300 appeared in between: counted from zero
    assert cpu["server other processes"] == pytest.approx(0.4 + 0.6)
    assert cpu["client"] == pytest.approx(0.5)
    assert out["share_of_wall"]["server other threads"] == pytest.approx(0.9)
    assert set(out["share_of_wall"]) == set(thread_cpu.ROLES)


def test_split_refuses_a_bad_window_or_two_trees():
    a = snap(5.0, 0.0, {})
    with pytest.raises(ValueError, match="not later"):
        thread_cpu.split(a, snap(5.0, 0.0, {}))
    with pytest.raises(ValueError, match="different trees"):
        thread_cpu.split(a, snap(6.0, 0.0, {}, root=ROOT + 1))


def test_a_thread_whose_time_went_back_counts_zero():
    out = thread_cpu.split(snap(0.0, 0.0, {(ROOT, 7): 3.0}), snap(1.0, 0.0, {(ROOT, 7): 2.0}))
    assert out["cpu_s"]["server other threads"] == 0.0


CHILD = textwrap.dedent("""
    import subprocess, sys, threading, time
    def spin(seconds):
        t = time.thread_time()
        while time.thread_time() - t < seconds:
            pass
    sys.stdin.readline()                      # start when the parent has its first snapshot
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import sys, time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass\\n"
        "print('spun', flush=True)\\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    spun = threading.Event()
    def work():
        spin(0.4)
        spun.set()
        time.sleep(60)
    threading.Thread(target=work, daemon=True).start()
    spin(0.2)                                  # the main thread
    spun.wait(); grandchild.stdout.readline()
    print("done", flush=True)                  # everyone has spun and is still alive
    time.sleep(60)
""")


def test_snapshot_reads_a_real_tree_by_role():
    import psutil

    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = thread_cpu.snapshot(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        after = thread_cpu.snapshot(child.pid)
    finally:
        for proc in psutil.Process(child.pid).children(recursive=True):
            proc.kill()
        child.kill()
        child.wait()
    cpu = thread_cpu.split(before, after)["cpu_s"]
    # CPU each spun on its own clock, so these hold however busy the box is. /proc counts in
    # clock ticks (10 ms), so a reading may be up to two ticks short; the upper bounds leave
    # room for interpreter start-up (the grandchild's) and thread switches.
    tick = 0.03
    assert 0.2 - tick <= cpu["server main thread"] < 0.6
    assert 0.4 - tick <= cpu["server other threads"] < 0.8
    assert 0.3 - tick <= cpu["server other processes"] < 1.5
    assert 0.0 <= cpu["client"] < 0.2  # this test process only waited


def test_snapshot_of_a_gone_tree_is_empty():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert thread_cpu.snapshot(child.pid).threads == {}
