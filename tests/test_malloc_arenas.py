"""malloc_arenas: a process that imports vLLM runs its threads in one glibc arena."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vllm_omni_edge.patches.common import malloc_arenas as patch

# A fresh interpreter of this venv (its .pth installs the interpreter hooks): import vllm, then
# four threads each malloc and free a block; count the arenas glibc reports.
PROBE = textwrap.dedent("""
    import ctypes, os, re, tempfile, threading
    import vllm
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.fopen.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    barrier = threading.Barrier(4)
    def work():
        barrier.wait()
        blocks = [libc.malloc(64 << 10) for _ in range(16)]
        barrier.wait()
        for b in blocks:
            libc.free(b)
    threads = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    path = tempfile.mktemp()
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    from vllm_omni_edge.patches.common import malloc_arenas
    print("ARENAS", len(re.findall(r'<heap nr="', open(path).read())), malloc_arenas.record())
    os.unlink(path)
""")

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or __import__("platform").libc_ver()[0] != "glibc",
    reason="glibc arenas")


def _arenas(**env) -> tuple[int, str]:
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-2000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("ARENAS"))
    return int(line.split()[1]), line


@glibc_only
def test_threads_of_a_vllm_process_share_one_arena():
    arenas, line = _arenas(VLLM_OMNI_EDGE_MALLOC_ARENAS="1")
    assert arenas == 1, line
    assert "'limit': 1" in line and "'set': True" in line, line


@glibc_only
def test_zero_leaves_glibc_its_arena_per_thread():
    arenas, line = _arenas(VLLM_OMNI_EDGE_MALLOC_ARENAS="0")
    assert arenas > 1, line  # the control: without the limit the threads take their own
    assert "'set': False" in line, line


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(patch, "_state", {})


def test_not_glibc_gives_a_reason_and_no_call(fresh, monkeypatch):
    monkeypatch.setattr(patch.platform, "libc_ver", lambda: ("musl", "1.2"))
    monkeypatch.setattr(patch.ctypes, "CDLL", lambda *a, **k: pytest.fail("no libc call off glibc"))
    monkeypatch.setenv("VLLM_OMNI_EDGE_MALLOC_ARENAS", "1")
    state = patch.limit_arenas()
    assert state["set"] is False and "musl" in state["reason"]
    assert "left as they are" in patch.apply()


def test_called_once_per_process(fresh, monkeypatch):
    calls = []

    class Libc:
        def mallopt(self, option, value):
            calls.append((option.value, value.value))
            return 1

    monkeypatch.setattr(patch.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(patch.ctypes, "CDLL", lambda *a, **k: Libc())
    monkeypatch.setenv("VLLM_OMNI_EDGE_MALLOC_ARENAS", "2")
    assert patch.limit_arenas() == {"limit": 2, "set": True, "reason": None}
    patch.limit_arenas()
    assert patch.apply() == "glibc arenas limited to 2"
    assert calls == [(patch.M_ARENA_MAX, 2)]


def test_bad_flag_names_the_variable(fresh, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_MALLOC_ARENAS", "many")
    with pytest.raises(Exception, match="VLLM_OMNI_EDGE_MALLOC_ARENAS"):
        patch.limit_arenas()
