"""The harness on real vLLM: a tiny clean grid, and a grid whose worker is killed.

Minutes each (one vLLM start is ~1 minute on a 2-core box); run with -m e2e.
"""

import json
import os
import signal

import psutil
import pytest

from vllm_omni_edge_bench.harness import cli, pass_events, runner
from vllm_omni_edge_bench.harness.grid import parse_grid
from vllm_omni_edge_bench.harness.report import write_report

pytestmark = pytest.mark.e2e

EAGER = {"enforce_eager": True, "max_model_len": 512, "kv_cache_memory_bytes": "192MiB"}
WORKLOADS = ["cold_start", {"decode": {"prompt_tokens": 16, "gen_tokens": 16, "warmup": False}},
             {"prefill": {"prompt_tokens": 64, "warmup": False}}]


VLLM_LAYOUT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def tiny_grid(name: str, workloads=WORKLOADS, timeout_s: float = 400):
    return {
        "name": name,
        "passes": 3,
        "control": "eager-a",
        "timeout_s": timeout_s,
        "arms": [
            # vLLM's layout: the ledger must walk the tree to the worker that holds the model.
            {"name": "eager-a", "model": "default", "llm_kwargs": EAGER, "env": VLLM_LAYOUT},
            # The plugin's worker evidence must show the budget and eager mode reached the worker.
            {"name": "eager-b", "model": "default", "llm_kwargs": EAGER, "env": VLLM_LAYOUT,
             "expect": {"kv_cache_bytes": "~192MiB", "compiled": False}},
        ],
        "workloads": workloads,
    }


# Six vLLM passes: ~5 min quiet, ~10 min on a loaded box, so outside CI's default subset.
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_tiny_grid_end_to_end(tmp_path, default_model):
    grid_file = tmp_path / "tiny.yaml"
    import yaml

    grid_file.write_text(yaml.safe_dump(tiny_grid("e2e-tiny")))
    out = tmp_path / "results"
    code = cli.main(["run", str(grid_file), "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert code == cli.EXIT_OK, summary
    for name in ("grid.yaml", "provenance.json", "summary.json", "report.md", "figures.png", "memory-timeline.png"):
        assert (out / name).stat().st_size > 0, name
    assert len(list((out / "passes").glob("*.json"))) == 6

    for arm in ("eager-a", "eager-b"):
        figures = summary["arms"][arm]
        assert {"cold_start", "load", "tg16", "pp64", "tree PSS steady", "worker PSS steady"} <= set(figures)
        assert figures["tg16"]["min"] > 0 and figures["pp64"]["min"] > 0
        # The model lives in the worker: its PSS is most of the weights (~257 MiB) plus the KV cache.
        assert figures["worker PSS steady"]["min"] > 192 << 20
    record = json.loads((out / "passes" / "01-eager-b.json").read_text())
    roles = {p["role"] for p in record["ledger"]["processes"].values()}
    assert {"frontend", "engine_core", "worker"} <= roles
    decode = record["result"]["workloads"][1]["requests"]
    assert [r["gen_tokens"] for r in decode] == [16, 1]
    assert "# e2e-tiny: ok" in (out / "report.md").read_text()


@pytest.mark.timeout(900)
def test_killing_the_worker_mid_run_crashes_the_grid(tmp_path, default_model):
    out = tmp_path / "results"
    workloads = [{"decode": {"prompt_tokens": 16, "gen_tokens": 256}}]
    grid = parse_grid(tiny_grid("e2e-kill", workloads=workloads, timeout_s=300))
    killed = []

    def kill_worker_after_first_token(sample, ledger, proc):
        events = pass_events.read_events(out / "passes" / "01-eager-a" / "events.jsonl")
        if killed or pass_events.FIRST_TOKEN not in events:
            return
        for pid, info in ledger.processes.items():
            if info.role == "worker" and pid in sample["procs"]:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    # Sample often whatever it costs: this checks crash handling, not a measurement, and the
    # measurement-time cap spaces samples (seconds apart on a loaded box) past a short decode.
    options = runner.RunOptions(observer=kill_worker_after_first_token, sample_interval_s=0.1,
                                max_sampler_cpu_share=1.0)
    summary = runner.run_grid(grid, "name: e2e-kill\n", out, options)
    assert killed, "the worker was never seen after the first token"
    assert summary["status"] == "crashed" and "arms" not in summary
    record = json.loads((out / "passes" / "01-eager-a.json").read_text())
    assert record["status"] == "crashed"
    assert record["result"] is None and pass_events.WORKLOADS_DONE not in record["events"]
    for pid in record["ledger"]["processes"]:  # nothing of the pass is left running
        assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    text = write_report(out).read_text()
    assert "# e2e-kill: crashed" in text and "No medians" in text
