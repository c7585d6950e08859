"""The package's own PSS reading (the demo's; the harness ledger builds on it)."""

from __future__ import annotations

import os
import subprocess
import sys

from vllm_omni_edge.memory import FIELDS, process_tree_memory, tree_total


def test_tree_memory_covers_the_children_and_sums_them():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(32 << 20); time.sleep(30)"])
    try:
        import time

        deadline = time.time() + 20
        while time.time() < deadline:
            records = process_tree_memory(os.getpid())
            if child.pid in records and records[child.pid]["pss_anon"] > 30 << 20:
                break
            time.sleep(0.1)
        assert set(records) >= {os.getpid(), child.pid}
        assert records[child.pid]["pss_anon"] > 30 << 20  # its 32 MiB buffer
        total = tree_total(records)
        assert set(total) == set(FIELDS)
        assert total["pss"] == sum(r["pss"] for r in records.values())
    finally:
        child.kill()
        child.wait()
