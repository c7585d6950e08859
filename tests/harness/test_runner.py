"""The runner against fake_pass.py: real processes, real ledger, no vLLM."""

import json
import os
import signal
import time

import psutil
import pytest

from vllm_omni_edge_bench.harness import runner
from vllm_omni_edge_bench.harness.grid import GridError, parse_grid
from vllm_omni_edge_bench.harness.report import load_artifacts, render_markdown
from tests.harness.conftest import fake_grid, grid_dict, quiet_options

MIB = 1 << 20


def run(tmp_path, grid, **options):
    out = tmp_path / "results"
    summary = runner.run_grid(grid, "name: unit\n", out, quiet_options(**options))
    passes = {p.stem: json.loads(p.read_text()) for p in sorted((out / "passes").glob("*.json"))}
    return summary, passes, out


def test_a_clean_grid_writes_every_artifact_and_summarises(tmp_path, fake_engine):
    grid = fake_grid(tmp_path, {"tok_s": [10, 20, 40], "worker_mib": 48}, {"tok_s": [5, 10, 20], "worker_mib": 16})
    summary, passes, out = run(tmp_path, grid)
    assert summary["status"] == "ok", summary
    assert (out / "grid.yaml").read_text() == "name: unit\n"
    assert json.loads((out / "summary.json").read_text()) == summary
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["finished"] and provenance["effective_grid"]["name"] == "unit"
    assert list(passes) == ["01-a", "01-b", "02-a", "02-b", "03-a", "03-b"]
    assert [p["seq"] for p in passes.values()] == [1, 2, 3, 4, 5, 6]
    assert summary["arms"]["b"]["tg16"]["ratio_vs_control"]["median"] == pytest.approx(0.5)

    first = passes["01-a"]
    assert first["env_overlay"]["VLLM_OMNI_EDGE_EVIDENCE_DIR"].endswith("passes/01-a/evidence")
    assert len(first["evidence"]["workers"]) == 1
    roles = {p["role"]: p for p in first["ledger"]["processes"].values()}
    assert roles["worker"]["role_source"] == "evidence"
    # The worker's 48 MiB is in the tree's steady PSS, and not in the front end's.
    assert roles["worker"]["steady"]["pss_anon"] >= 48 * MIB
    # Tree and per-process steady figures are medians over samples, so they agree to a page or two.
    both = roles["worker"]["steady"]["pss"] + roles["frontend"]["steady"]["pss"]
    assert first["ledger"]["tree"]["steady"]["pss"] >= both - MIB
    assert summary["arms"]["a"]["worker PSS steady"]["median"] > summary["arms"]["b"]["worker PSS steady"]["median"]


def test_a_crash_stops_the_grid_and_refuses_medians(tmp_path, fake_engine):
    summary, passes, _ = run(tmp_path, fake_grid(tmp_path, {}, {"fake": "crash"}))
    assert summary["status"] == "crashed" and "arms" not in summary
    assert passes["01-b"]["status"] == "crashed"
    assert "exited with code 3" in passes["01-b"]["reasons"][0]
    assert any("fake engine died" in reason for reason in passes["01-b"]["reasons"])
    assert {p["status"] for stem, p in passes.items() if stem not in ("01-a", "01-b")} == {"not_run"}


def test_keep_going_runs_every_pass_but_still_refuses(tmp_path, fake_engine):
    summary, passes, _ = run(tmp_path, fake_grid(tmp_path, {}, {"fake": "crash"}), keep_going=True)
    assert [p["status"] for p in passes.values()] == ["ok", "crashed"] * 3
    assert summary["status"] == "crashed" and summary["pass_counts"]["crashed"] == 3


def test_a_pass_that_overruns_is_killed_with_its_tree(tmp_path, fake_engine):
    grid = fake_grid(tmp_path, {"fake": "hang"}, {}, timeout_s=2)
    summary, passes, _ = run(tmp_path, grid)
    record = passes["01-a"]
    assert record["status"] == "crashed" and record["timed_out"]
    assert record["reasons"][0] == "timed out after 2 s"
    for pid in record["ledger"]["processes"]:
        assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE


def test_no_result_is_a_crash_even_with_exit_code_zero(tmp_path, fake_engine):
    summary, passes, _ = run(tmp_path, fake_grid(tmp_path, {"fake": "no_result"}, {}))
    assert passes["01-a"]["returncode"] == 0
    assert passes["01-a"]["status"] == "crashed" and "wrote no result" in passes["01-a"]["reasons"][0]


def test_evidence_that_contradicts_the_arm_makes_the_pass_invalid(tmp_path, fake_engine):
    grid = parse_grid({
        **grid_dict(),
        "arms": [
            {"name": "a", "model": str(tmp_path), "expect": {"compiled": False, "kv_cache_bytes": "~192MiB"},
             "llm_kwargs": {"enforce_eager": True, "kv_cache_memory_bytes": "192MiB"}},
            {"name": "b", "model": str(tmp_path), "expect": {"compiled": True},
             "llm_kwargs": {"enforce_eager": True}},
        ],
    })
    summary, passes, _ = run(tmp_path, grid)
    assert passes["01-a"]["status"] == "ok"
    assert passes["01-b"]["status"] == "invalid"
    assert passes["01-b"]["reasons"] == [
        f"worker {passes['01-b']['evidence']['workers'][0]['pid']}: compiled: expected True, evidence says False"]
    assert summary["status"] == "invalid"


def test_missing_evidence_is_invalid_only_when_the_arm_expects_some(tmp_path, fake_engine):
    grid = parse_grid({
        **grid_dict(),
        "arms": [
            {"name": "a", "model": str(tmp_path), "llm_kwargs": {"evidence": False}},
            {"name": "b", "model": str(tmp_path), "llm_kwargs": {"evidence": False}, "expect": {"compiled": False}},
        ],
    })
    _, passes, _ = run(tmp_path, grid)
    assert passes["01-a"]["status"] == "ok"
    assert passes["01-b"]["status"] == "invalid" and "no worker evidence" in passes["01-b"]["reasons"][0]


def test_a_workload_that_got_fewer_tokens_is_invalid(tmp_path, fake_engine):
    _, passes, _ = run(tmp_path, fake_grid(tmp_path, {"fake": "short_tokens"}, {}))
    assert passes["01-a"]["status"] == "invalid" and "got 16+9" in passes["01-a"]["reasons"][0]


def test_leftover_processes_are_killed_and_reported(tmp_path, fake_engine):
    _, passes, _ = run(tmp_path, fake_grid(tmp_path, {"fake": "orphan"}, {}))
    warnings = passes["01-a"]["warnings"]
    assert len(warnings) == 1 and "VLLM::Worker" in warnings[0]
    pid = int(warnings[0].split()[3])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_killing_the_worker_mid_run_crashes_the_grid(tmp_path, fake_engine):
    killed = []

    def kill_worker(sample, ledger, proc):
        for pid, info in ledger.processes.items():
            if info.role == "worker" and pid in sample["procs"] and not killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    summary, passes, _ = run(tmp_path, fake_grid(tmp_path, {}, {}), observer=kill_worker)
    assert len(killed) == 1 and str(killed[0]) in passes["01-a"]["ledger"]["processes"]
    assert passes["01-a"]["status"] == "crashed" and "worker died" in passes["01-a"]["reasons"][-1]
    assert summary["status"] == "crashed" and "arms" not in summary


def test_results_are_never_overwritten(tmp_path, fake_engine):
    out = tmp_path / "results"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    with pytest.raises(FileExistsError):
        runner.run_grid(fake_grid(tmp_path, {}, {}), "", out, quiet_options())
    assert runner.default_out_dir(parse_grid(grid_dict()), root=tmp_path).name.endswith("-unit")
    (tmp_path / runner.default_out_dir(parse_grid(grid_dict()), root=tmp_path).name).mkdir()
    assert runner.default_out_dir(parse_grid(grid_dict()), root=tmp_path).name.endswith("-unit-2")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["arms"][0].update(model="/nonexistent/model"), "does not exist"),
        (lambda d: d["arms"][1].update(engine="llamacpp", model="/nonexistent/m.gguf", llm_kwargs={},
                                       llamacpp={"tokenizer": "default"}),
         "model /nonexistent/m.gguf does not exist"),
        (lambda d: d.update(workloads=[{"server": {"clients": 2}}]), "server: not implemented"),
    ],
)
def test_grids_that_could_only_crash_are_refused_before_any_pass(tmp_path, change, message):
    data = grid_dict()
    change(data)
    with pytest.raises(GridError, match=message):
        runner.check_runnable(parse_grid(data))


def test_classify():
    assert runner.classify(-9, False, 60, None, None, [], ["x", "Killed"])[1][:2] == ["killed by SIGKILL", "wrote no result"]
    assert runner.classify(0, False, 60, {"problems": []}, None, ["worker 1: compiled ..."], []) == (
        "invalid", ["worker 1: compiled ..."])
    assert runner.classify(0, False, 60, {"problems": []}, None, [], []) == ("ok", [])


def test_costly_memory_samples_are_spaced_to_cap_the_samplers_cpu(tmp_path, fake_engine, monkeypatch):
    grid = fake_grid(tmp_path, {"tok_s": [10, 10, 10], "worker_mib": 16}, {"tok_s": [10, 10, 10], "worker_mib": 16},
                     passes=3)
    original = runner.MemoryLedger.sample

    def costly_sample(self):
        spin_until = time.process_time() + 0.02  # 20 ms of CPU per sample, like a big worker's smaps_rollup
        while time.process_time() < spin_until:
            pass
        return original(self)

    monkeypatch.setattr(runner.MemoryLedger, "sample", costly_sample)
    _, passes, _ = run(tmp_path, grid, max_sampler_cpu_share=0.05)
    for record in passes.values():
        sampler = record["sampler"]
        assert sampler["samples"] >= 1 and sampler["cpu_s"] >= 0.02 * sampler["samples"] * 0.9
        # 0.05 s nominal interval would spend ~30 % of the wall sampling; the cap keeps it near 5 %.
        assert sampler["cpu_share_of_wall"] < 0.12, sampler


def test_prime_runs_each_arm_once_unmeasured_before_the_passes(tmp_path, fake_engine):
    summary, passes, out = run(tmp_path, fake_grid(tmp_path, {}, {}, prime=True))
    assert summary["status"] == "ok"
    assert list(passes) == ["01-a", "01-b", "02-a", "02-b", "03-a", "03-b"]  # primes are not passes
    primes = {p.stem: json.loads(p.read_text()) for p in (out / "prime" / "passes").glob("*.json")}
    assert {stem: p["status"] for stem, p in primes.items()} == {"00-a": "ok", "00-b": "ok"}
    first_measured = min(p["started"] for p in passes.values())
    assert all(p["finished"] <= first_measured for p in primes.values())
    assert json.loads((out / "provenance.json").read_text())["primed"] == {"a": "ok", "b": "ok"}


def test_a_prime_that_crashes_stops_the_grid_before_any_pass(tmp_path, fake_engine):
    summary, passes, out = run(tmp_path, fake_grid(tmp_path, {}, {"fake": "crash"}, prime=True))
    assert summary["status"] != "ok"
    assert {p["status"] for p in passes.values()} == {"not_run"}
    assert all("prime pass of b was crashed" in p["reasons"][0] for p in passes.values())
    assert json.loads((out / "provenance.json").read_text())["primed"] == {"a": "ok", "b": "crashed"}


def test_an_invalid_prime_does_not_stop_the_grid(tmp_path, fake_engine):
    # The prime is the start that compiles; the passes then expect to load the artifact.
    grid = parse_grid({**grid_dict(prime=True), "arms": [
        {"name": "a", "model": str(tmp_path), "llm_kwargs": {"fake": "ok"}},
        {"name": "b", "model": str(tmp_path), "llm_kwargs": {}, "expect": {"no_such_key": 1}}]})
    summary, passes, out = run(tmp_path, grid)
    assert json.loads((out / "provenance.json").read_text())["primed"] == {"a": "ok", "b": "invalid"}
    assert passes["01-a"]["status"] == "ok" and passes["01-b"]["status"] == "invalid"
    header = next(line for line in render_markdown(load_artifacts(out)).splitlines() if line.startswith("- primed"))
    assert "a ok, b invalid (" in header and "no_such_key" in header  # the report says why


def _sample_times(pass_dir, record):
    """Absolute wall-clock times of a pass's ledger samples, from the timeline and its first-token mark."""
    events = [json.loads(line) for line in (pass_dir / "events.jsonl").read_text().splitlines()]
    marks = {e["event"]: e["t"] for e in events}
    t0 = marks["first_token"] - record["ledger"]["first_token_s"]
    return [t0 + point["t"] for point in record["ledger"]["timeline"]], marks


def test_the_ledger_reads_nothing_during_a_timed_request_and_samples_right_after(tmp_path, fake_engine):
    grid = fake_grid(tmp_path, {"timed_s": 0.6}, {"timed_s": 0.6})
    summary, passes, out = run(tmp_path, grid)
    assert summary["status"] == "ok", summary
    for stem, record in passes.items():
        times, marks = _sample_times(out / "passes" / stem, record)
        start, end = marks["timed_start"], marks["timed_end"]
        # At 0.05 s a sample, ~12 would have fallen inside the request; none did (times to the ms).
        assert not [t for t in times if start + 0.002 < t < end - 0.002], (stem, start, end, times)
        # Held off once a poll, not in a busy loop: ~0.6 s / GATE_POLL_S polls.
        assert 0 < record["sampler"]["held_off_polls"] <= 0.6 / runner.GATE_POLL_S * 1.5 + 5, record["sampler"]
        # The pass waited for a sample of the tree as the request left it.
        after = [t for t in times if t > end - 0.002]
        assert after and after[0] - end < 0.15, (stem, end, after[:3])
        assert not list((out / "passes").glob(f"{stem}/events.jsonl.*")), "gate markers left behind"


def test_without_the_gate_a_timed_request_does_not_wait_for_the_ledger(tmp_path):
    from vllm_omni_edge_bench.harness import pass_events

    events = tmp_path / "events.jsonl"
    pass_events.gate_timed_requests({"events_path": str(events)})  # no ledger_gate: off
    start = time.monotonic()
    with pass_events.timed_request():
        assert not pass_events.marker(events, pass_events.QUIET).exists()
    assert time.monotonic() - start < 0.5 and not list(tmp_path.iterdir())


def test_a_gated_request_with_no_runner_answering_goes_on_and_says_so(tmp_path, monkeypatch):
    from vllm_omni_edge_bench.harness import pass_events

    monkeypatch.setattr(pass_events, "GATE_WAIT_S", 0.1)
    monkeypatch.setattr(pass_events, "gate_problems", [])
    events = tmp_path / "events.jsonl"
    pass_events.gate_timed_requests({"events_path": str(events), "ledger_gate": True})
    try:
        with pass_events.timed_request():
            assert pass_events.marker(events, pass_events.QUIET).exists()
    finally:
        pass_events.gate_timed_requests({"events_path": str(events)})
    assert not pass_events.marker(events, pass_events.QUIET).exists()
    assert pass_events.gate_problems == ["ledger gate: the request for a sample after the request still there after 0 s"]
