"""The harness through the OpenAI server: a tiny 2-arm `engine: vllm-server` grid, 3 passes.

Six server starts (~1-2 min each on a quiet 2-core box, 5+ under load); run with -m "e2e and slow".
"""

import json
import os

import pytest
import yaml

from vllm_omni_edge_bench.harness import cli, thread_cpu

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EAGER = {"enforce_eager": True, "max_model_len": 512, "kv_cache_memory_bytes": "192MiB"}
AGENT_TASKS = ["pick-weather", "args-timer", "json-sentiment"]
SERVER = "server2x4@mix16-48"
VLLM_LAYOUT = {"VLLM_OMNI_EDGE_SINGLE_PROCESS": "0"}


def server_grid() -> dict:
    return {
        "name": "e2e-server",
        "passes": 3,
        "control": "srv-a",
        "timeout_s": 900,  # server start alone took 330 s on this shared box under load
        "arms": [
            # vLLM's three processes: the ledger must find the model in the server's worker.
            {"name": "srv-a", "engine": "vllm-server", "model": "default", "llm_kwargs": EAGER, "env": VLLM_LAYOUT},
            {"name": "srv-b", "engine": "vllm-server", "model": "default", "llm_kwargs": EAGER, "env": VLLM_LAYOUT,
             "expect": {"kv_cache_bytes": "~192MiB", "compiled": False}},
        ],
        "workloads": [
            "cold_start",
            {"ttft": {"prompt_tokens": 32, "warmup": False}},
            {"decode": {"prompt_tokens": 16, "gen_tokens": 16, "warmup": False}},
            {"server": {"clients": 2, "requests": 4, "prompt_tokens_mix": [16, 48], "gen_tokens": 8,
                        "warmup": False}},
            {"agent": {"tasks": AGENT_TASKS, "max_tokens": 48}},
        ],
    }


@pytest.mark.timeout(5400)
def test_server_grid_end_to_end(tmp_path, default_model):
    grid_file = tmp_path / "server.yaml"
    grid_file.write_text(yaml.safe_dump(server_grid()))
    out = tmp_path / "results"
    code = cli.main(["run", str(grid_file), "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert code == cli.EXIT_OK, summary

    expected = {"cold_start", "server ready", "server start to first token", "engine init (vLLM log)",
                "ttft32", "tg16", f"{SERVER} output", f"{SERVER} requests",
                f"{SERVER} TTFT p50", f"{SERVER} TTFT p99", f"{SERVER} ITL p50", f"{SERVER} completed",
                f"{SERVER} errored", f"{SERVER} preemptions", "agent[3] score", "agent[3] score tool_selection",
                "agent[3] score tool_arguments", "agent[3] score json_schema", "tree PSS steady",
                "worker PSS steady"}
    for arm in ("srv-a", "srv-b"):
        figures = summary["arms"][arm]
        assert expected <= set(figures), expected - set(figures)
        assert figures[f"{SERVER} completed"]["values"] == [4, 4, 4]
        assert figures[f"{SERVER} errored"]["values"] == [0, 0, 0]
        assert figures[f"{SERVER} output"]["min"] > 0 and figures["tg16"]["min"] > 0
        assert all(0 <= v <= 1 for v in figures["agent[3] score"]["values"])
        # The model lives in the server's worker, not in the client that drives it.
        assert figures["worker PSS steady"]["min"] > 192 << 20
        # vLLM's layout: the decode's CPU is in the engine and worker processes, and in the
        # client reading the stream; the shares cannot exceed the box's cores.
        split = {role: figures[f"tg16 CPU, {role}"]["values"] for role in thread_cpu.ROLES}
        assert min(split["server other processes"]) > 0 and min(split["client"]) > 0
        assert all(sum(v) <= 100 * (os.cpu_count() or 1) * 1.05 for v in zip(*split.values()))
    assert summary["arms"]["srv-b"][f"{SERVER} output"]["ratio_vs_control"]["median"] > 0

    record = json.loads((out / "passes" / "01-srv-b.json").read_text())
    processes = record["ledger"]["processes"].values()
    roles = {p["role"] for p in processes}
    assert {"harness_client", "frontend", "engine_core", "worker"} <= roles
    client = [p["pid"] for p in processes if p["role"] == "harness_client"]
    assert client == [record["result"]["pid"]] and record["ledger"]["excluded_from_tree"] == client
    result = record["result"]
    assert result["server"]["exit_code_after_stop"] is not None
    assert "--enforce-eager" in result["server"]["command_flags"]
    server = next(w for w in result["workloads"] if w["kind"] == "server")
    assert server["server_load"]["prompt_lengths"] == [16, 48, 16, 48]
    assert [o["status"] for o in server["server_load"]["outcomes"]] == ["completed"] * 4
    agent = next(w for w in result["workloads"] if w["kind"] == "agent")["agent"]
    assert [t["id"] for t in agent["tasks"]] == AGENT_TASKS
    assert [t["mode"] for t in agent["tasks"]] == ["required", "named", "json_schema"]
    assert all(t["checks"] and "reply" in t for t in agent["tasks"])

    report = (out / "report.md").read_text()
    assert "# e2e-server: ok" in report
    assert f"{SERVER} output" in report and "agent[3] score" in report and "harness_client" in report
