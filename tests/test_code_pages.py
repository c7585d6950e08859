"""levers/code_pages.py and patches/worker/startup_code_pages.py: unmap clean start-up code."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from vllm_omni_edge.levers import code_pages
from vllm_omni_edge.patches.worker import startup_code_pages

SMAPS = textwrap.dedent("""\
    55d0a0000000-55d0a0100000 r--p 00000000 08:01 1001 /usr/bin/python3.11
    Rss:                 512 kB
    Anonymous:             0 kB
    Private_Dirty:         0 kB
    55d0a0100000-55d0a0400000 r-xp 00100000 08:01 1001 /usr/bin/python3.11
    Rss:                2048 kB
    Anonymous:             0 kB
    Private_Dirty:         0 kB
    55d0a0400000-55d0a0500000 r--p 00400000 08:01 1001 /usr/bin/python3.11
    Rss:                 128 kB
    Anonymous:           128 kB
    Private_Dirty:       128 kB
    7f0000000000-7f0000400000 r-xp 00000000 08:01 2002 /lib/libtorch_cpu.so
    Rss:                4096 kB
    Anonymous:             0 kB
    Private_Dirty:         0 kB
    Swap:                  0 kB
    7f0000400000-7f0000500000 r-xp 00400000 08:01 2002 /lib/libtorch_cpu.so
    Rss:                   0 kB
    Anonymous:             0 kB
    7f0000500000-7f0000600000 rw-p 00500000 08:01 2002 /lib/libtorch_cpu.so
    Rss:                1024 kB
    Anonymous:          1024 kB
    7f0000600000-7f0000700000 r--p 00000000 08:01 3003 /models/weights.safetensors
    Rss:                1024 kB
    Anonymous:             0 kB
    7f0000700000-7f0000800000 r-xp 00000000 08:01 4004 /lib/patched.so
    Rss:                1024 kB
    Anonymous:             4 kB
    Private_Dirty:         4 kB
    7f0000800000-7f0000900000 r-xp 00000000 08:01 5005 /lib/locked.so
    Rss:                1024 kB
    Locked:             1024 kB
    7f0000900000-7f0000a00000 rw-p 00000000 00:00 0
    Rss:                1024 kB
    Anonymous:          1024 kB
    7ffc00000000-7ffc00001000 r-xp 00000000 00:00 0 [vdso]
    Rss:                   4 kB
    """)


def test_it_picks_only_clean_resident_segments_of_executable_objects():
    mappings = code_pages.read_smaps(SMAPS)
    assert len(mappings) == 11
    chosen = [(hex(m.start), m.perms, m.path) for m in code_pages.droppable(mappings)]
    assert chosen == [
        ("0x55d0a0000000", "r--p", "/usr/bin/python3.11"),  # read-only segment of an executable object
        ("0x55d0a0100000", "r-xp", "/usr/bin/python3.11"),
        ("0x7f0000000000", "r-xp", "/lib/libtorch_cpu.so"),
    ]
    # Not: the relocated (private, dirty) read-only segment, the empty one, writable data, a
    # mapped data file (no executable segment), code with a patched page, locked pages,
    # anonymous memory, the vDSO.


def test_in_a_real_process_it_releases_file_pages_and_the_code_still_runs():
    check = textwrap.dedent("""\
        import json, torch
        from vllm_omni_edge.levers.code_pages import drop_clean_code_pages
        a = torch.randn(64, 64)
        expected = (a @ a).sum().item()
        result = drop_clean_code_pages()
        again = torch.randn(64, 64)  # runs code that was unmapped
        print(json.dumps({**result, "same": (a @ a).sum().item() == expected,
                          "works": float((again @ again.T).diagonal().min()) >= 0}))
        """)
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dropped"] and result["failed"] == 0
    assert result["mappings"] > 10
    # torch's libraries had tens of MiB resident; most of it was start-up code.
    assert result["released_bytes"] > 16 * 2**20, result
    assert result["same"] and result["works"]


def test_the_wrapper_drops_after_the_warm_up_and_wraps_once():
    calls = []

    def original(self):
        calls.append("warm-up")
        return "result"

    wrapped = startup_code_pages.make_wrapper(original, drop=lambda: calls.append("drop") or {"dropped": True})
    assert wrapped(object()) == "result"
    assert calls == ["warm-up", "drop"]
    assert startup_code_pages.last_drop == {"dropped": True}

    class Worker:
        def compile_or_warm_up_model(self):
            return None

    module = type(sys)("fake_cpu_worker")
    module.CPUWorker = Worker
    startup_code_pages._wrap(module)
    first = Worker.compile_or_warm_up_model
    startup_code_pages._wrap(module)
    assert Worker.compile_or_warm_up_model is first


def test_the_flag_turns_it_off(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_CODE_PAGES", "0")
    assert "left mapped" in startup_code_pages.apply()
