import subprocess
import sys
import time

from vllm_omni_edge_bench.harness.ledger import (
    MemoryLedger,
    canonical_role,
    parse_kb_lines,
    parse_smaps_rollup,
    summarise_ledger,
)
from tests.harness.conftest import FIXTURES

KIB = 1024


def test_rollup_of_a_worker_splits_pss():
    memory = parse_smaps_rollup((FIXTURES / "smaps_rollup_worker.txt").read_text())
    assert memory["pss"] == 1004816 * KIB
    assert memory["pss_anon"] == 928300 * KIB
    assert memory["pss_file"] == 75680 * KIB
    assert memory["pss_shmem"] == 836 * KIB
    assert memory["pss_anon"] + memory["pss_file"] + memory["pss_shmem"] == memory["pss"]
    assert memory["uss"] == (82860 + 929216) * KIB  # Private_Clean + Private_Dirty
    assert memory["rss"] == 1268112 * KIB


def test_old_kernels_report_no_split_rather_than_zero():
    memory = parse_smaps_rollup((FIXTURES / "smaps_rollup_kernel_4_19.txt").read_text())
    assert memory["pss"] == 612004 * KIB
    assert memory["pss_anon"] is None and memory["pss_file"] is None and memory["pss_shmem"] is None
    assert memory["swap_pss"] == 1024 * KIB


def test_a_zombie_has_no_memory_record():
    assert parse_smaps_rollup((FIXTURES / "smaps_rollup_zombie.txt").read_text()) is None


def test_status_peak_rss():
    assert parse_kb_lines((FIXTURES / "status_worker.txt").read_text())["VmHWM"] == 1268112 * KIB


def test_roles_from_titles_and_evidence_share_one_vocabulary():
    assert canonical_role("VLLM::Worker") == canonical_role("VllmWorker-0") == "worker"
    assert canonical_role("VLLM::EngineCore") == canonical_role("EngineCore") == "engine_core"
    assert canonical_role("python -m x", is_root=True) == "frontend"


def mem(pss, anon=None):
    anon = pss if anon is None else anon
    return {"pss": pss, "pss_anon": anon, "pss_file": pss - anon, "pss_shmem": 0, "uss": pss, "rss": 2 * pss,
            "swap_pss": 0}


def synthetic_ledger():
    """Front end 100 all along; a worker appears at t=2, peaks at 900 while loading, settles at 500."""
    ledger = MemoryLedger(root_pid=1)
    from vllm_omni_edge_bench.harness.ledger import ProcessInfo

    ledger.processes = {1: ProcessInfo(1, 0, 0.0, "python -m pass", title="python -m pass", role="frontend"),
                        2: ProcessInfo(2, 1, 0.0, "spawn", title="VLLM::Worker", role="worker")}
    worker = {2: 300, 3: 900, 4: 600, 5: 500, 6: 500, 7: 510, 8: 500, 9: 490, 10: 500, 11: 2000}
    for t in range(0, 12):
        procs = {1: mem(100)}
        if t in worker:
            procs[2] = mem(worker[t], anon=worker[t] - 10)
        ledger.samples.append({"t": 1000.0 + t, "procs": procs})
    return ledger


def test_windows_peak_during_load_steady_and_overall():
    summary = summarise_ledger(synthetic_ledger(), first_token_t=1004.0, workloads_done_t=1010.0)
    tree = summary["tree"]
    assert tree["peak_load"]["pss"] == 1000  # t=3: 100 + 900
    assert tree["peak_load"]["pss_anon"] == 990  # the parts come from the same sample
    assert tree["steady"]["pss"] == 600  # median of t=6..10 sums: 600 610 600 590 600
    assert tree["peak"]["pss"] == 2100  # t=11, after the workloads
    worker = summary["processes"]["2"]
    assert worker["steady"]["pss"] == 500 and worker["peak_load"]["pss"] == 900
    assert summary["first_token_s"] == 4.0 and summary["max_processes"] == 2


def test_a_process_gone_before_the_steady_window_has_no_steady_state():
    ledger = synthetic_ledger()
    from vllm_omni_edge_bench.harness.ledger import ProcessInfo

    # A short-lived helper seen once during load (vLLM spawns some) must not get a steady state.
    ledger.processes[3] = ProcessInfo(3, 1, 0.0, "spawn_main", title="python -c spawn_main", role="other")
    ledger.samples[1]["procs"][3] = mem(170)
    summary = summarise_ledger(ledger, first_token_t=1004.0, workloads_done_t=1010.0)
    helper = summary["processes"]["3"]
    assert helper["steady"] is None and helper["peak"]["pss"] == 170
    assert summary["tree"]["steady"]["pss"] == 600


def test_without_markers_there_is_no_load_peak_or_steady_state():
    summary = summarise_ledger(synthetic_ledger())
    assert summary["tree"]["peak_load"] is None and summary["tree"]["steady"] is None
    assert summary["tree"]["peak"]["pss"] == 2100


def test_evidence_roles_replace_title_guesses():
    summary = summarise_ledger(synthetic_ledger(), roles={2: "VllmWorker-0"})
    worker = summary["processes"]["2"]
    assert worker["role"] == "worker" and worker["role_source"] == "evidence" and worker["evidence_role"] == "VllmWorker-0"
    assert summary["processes"]["1"]["role_source"] == "title"


def test_real_tree_is_rewalked_and_vanishing_children_are_tolerated():
    # A parent that starts a child after a moment, then the child exits: the ledger
    # must see it appear and must not fail when it is gone.
    script = (
        "import subprocess, sys, time; time.sleep(0.3); "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; b = bytearray(8 << 20); time.sleep(0.6)']); "
        "c.wait(); time.sleep(0.3)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    ledger = MemoryLedger(proc.pid)
    counts = []
    while proc.poll() is None:
        counts.append(len(ledger.sample()["procs"]))
        time.sleep(0.05)
    ledger.sample()  # after the root is gone: no error, nothing left
    assert counts[0] == 1 and max(counts) == 2
    last_with_child = len(counts) - 1 - counts[::-1].index(2)
    assert 1 in counts[last_with_child + 1:]  # the root alone again, once the child is gone
    assert ledger.samples[-1]["procs"] == {}
    child = next(info for pid, info in ledger.processes.items() if pid != proc.pid)
    assert child.vm_hwm >= 8 << 20
    assert all(rec["pss"] > 0 for s in ledger.samples for rec in s["procs"].values())


def test_an_orphan_is_still_counted_after_its_parent_dies():
    # The parent lingers so a sampler on a loaded box sees the child before it is orphaned.
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(4)']); "
              "time.sleep(1)")
    proc = subprocess.Popen([sys.executable, "-c", script])
    ledger = MemoryLedger(proc.pid)
    deadline = time.time() + 5
    while len(ledger.processes) < 2 and time.time() < deadline:
        ledger.sample()
        time.sleep(0.02)
    proc.wait()
    orphan_pids = [pid for pid in ledger.processes if pid != proc.pid]
    assert orphan_pids, "the child was never seen"
    assert set(ledger.sample()["procs"]) == set(orphan_pids)
    assert ledger.alive_pids() == orphan_pids


def test_cpu_seconds_in_all_and_while_the_workloads_ran():
    from vllm_omni_edge_bench.harness.ledger import cpu_seconds

    series = [(1000.0, 1.0), (1004.0, 3.0), (1007.0, 4.5), (1010.0, 9.0), (1011.0, 9.5)]
    assert cpu_seconds(series, 1004.5, 1010.0) == {"total": 9.5, "during_workloads": 6.0}
    assert cpu_seconds(series, None, None) == {"total": 9.5, "during_workloads": None}
    assert cpu_seconds(series, 999.0, 1010.0)["during_workloads"] is None  # no sample before the first token
    assert cpu_seconds([], 1004.0, 1010.0) == {"total": None, "during_workloads": None}


def test_a_busy_child_shows_its_cpu_time_and_an_idle_one_does_not():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"])
    ledgers = {"busy": MemoryLedger(busy.pid), "idle": MemoryLedger(idle.pid)}
    while busy.poll() is None or idle.poll() is None:
        for ledger in ledgers.values():
            ledger.sample()
        time.sleep(0.05)
    used = {name: summarise_ledger(ledger)["processes"][str(ledger.root_pid)]["cpu_s"]["total"]
            for name, ledger in ledgers.items()}
    assert used["busy"] > 0.25 and used["idle"] < 0.2, used
