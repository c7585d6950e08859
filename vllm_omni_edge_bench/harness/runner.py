"""Runs a grid: each (pass, arm) in schedule order, in its own process tree, under the ledger.

A pass is
- ``crashed`` if it exits non-zero, is killed, times out or writes no result;
- ``invalid`` if it ran but not as its arm specified: the worker's evidence does
  not match the arm's ``expect``, or the workload did not get the tokens it asked for;
- ``ok`` otherwise.
By default the grid stops at the first pass that is not ``ok`` (its medians are
refused anyway, and the box is shared); ``keep_going`` runs the rest to see how
often it happens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any, Callable

from vllm_omni_edge_bench.harness import pass_events, provenance
from vllm_omni_edge_bench.harness.evidence import collect_evidence, evidence_problems, roles_by_pid
from vllm_omni_edge_bench.harness.grid import (EVIDENCE_ENV, SPEECH_ENGINES, Arm, Grid, GridError,
                                                resolve_arm_model)
from vllm_omni_edge_bench.harness.ledger import MemoryLedger, summarise_ledger
from vllm_omni_edge_bench.harness.schedule import ScheduledPass, interleaved
from vllm_omni_edge_bench.harness.stats import CRASHED, INVALID, NOT_RUN, OK, summarise

PASS_MODULES = {"vllm": "vllm_omni_edge_bench.harness.pass_vllm"}
IMPLEMENTED_WORKLOADS = {"vllm": {"decode", "prefill", "ttft", "cold_start", "fidelity"}}
PASS_MODULES["vllm-server"] = "vllm_omni_edge_bench.harness.pass_vllm_server"
IMPLEMENTED_WORKLOADS["vllm-server"] = {"decode", "prefill", "ttft", "cold_start", "server", "agent"}
PASS_MODULES["llamacpp"] = "vllm_omni_edge_bench.harness.pass_llamacpp"
IMPLEMENTED_WORKLOADS["llamacpp"] = {"decode", "prefill", "ttft", "cold_start", "fidelity"}
PASS_MODULES["speech-server"] = "vllm_omni_edge_bench.harness.pass_speech_server"
IMPLEMENTED_WORKLOADS["speech-server"] = {"speech"}
PASS_MODULES["faster-whisper"] = "vllm_omni_edge_bench.harness.pass_speech"
IMPLEMENTED_WORKLOADS["faster-whisper"] = {"speech"}
PASS_MODULES["whispercpp"] = "vllm_omni_edge_bench.harness.pass_speech"
IMPLEMENTED_WORKLOADS["whispercpp"] = {"speech"}


def _results_root() -> Path:
    """Runs are committed at the top of the checkout, outside every package; from an installed
    copy they land under the working directory."""
    checkout = Path(__file__).resolve().parents[2]
    return (checkout if (checkout / "pyproject.toml").exists() else Path.cwd()) / "results"


RESULTS_ROOT = _results_root()
TERM_GRACE_S = 5.0  # between SIGTERM and SIGKILL for a pass that overran
EXIT_GRACE_S = 10.0  # for children still shutting down after the pass process exited
LOG_TAIL_LINES = 40
GATE_POLL_S = 0.02  # how often the sampling loop looks at the ledger gate's markers (pass_events)

# Called after every ledger sample with (sample, ledger, process); tests use it to
# inject faults, the CLI could use it for progress.
Observer = Callable[[dict, MemoryLedger, subprocess.Popen], None]


@dataclass
class RunOptions:
    keep_going: bool = False
    sample_interval_s: float = 0.2
    # Reading smaps_rollup walks the page tables under the target's mmap lock: ~0.14 s of
    # CPU per read of a 1.5B-model worker here. Sampling every 0.2 s then took most of a
    # core from a 2-core box, so the gap grows until sampling costs at most this share of
    # the wall clock (peaks between samples are still bounded by VmHWM).
    max_sampler_cpu_share: float = 0.05
    observer: Observer | None = None
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)


def _fidelity_problems(grid: Grid) -> list[str]:
    """A fidelity reference is computed once, before the grid, never inside a timed pass."""
    problems = []
    for workload in grid.workloads:
        if workload.kind != "fidelity":
            continue
        from vllm_omni_edge_bench.harness import fidelity

        settings = fidelity.FidelitySettings.from_mapping(workload.model_dump())
        if not settings.reference_path().exists():
            problems.append(f"workload {workload.label}: reference {settings.reference_path()} does not exist")
        elif settings.reference_key() not in settings.cache():
            problems.append(f"workload {workload.label}: no cached reference; run `{settings.command()}` first")
    return problems


def check_runnable(grid: Grid) -> None:
    """Refuse before the first pass anything that could only crash every pass."""
    problems = []
    for arm in grid.arms:
        if arm.engine not in PASS_MODULES:
            problems.append(f"arm {arm.name}: engine {arm.engine!r} has no pass runner yet")
            continue
        model = Path(resolve_arm_model(arm))
        if not model.exists():
            hint = (" (run `vllm-omni-edge models pull-default` to build the default model)"
                    if arm.model == "default" else
                    f" (run `vllm-omni-edge models pull {arm.model}`)" if arm.engine in SPEECH_ENGINES else "")
            problems.append(f"arm {arm.name}: model {model} does not exist{hint}")
        for workload in grid.workloads:
            if workload.kind not in IMPLEMENTED_WORKLOADS[arm.engine]:
                problems.append(f"workload {workload.kind}: not implemented for {arm.engine} passes yet")
    problems += _fidelity_problems(grid)
    if problems:
        raise GridError("\n".join(sorted(set(problems))))


def default_out_dir(grid: Grid, root: Path = RESULTS_ROOT) -> Path:
    """``results/<date>-<grid name>``, suffixed -2, -3 ... rather than overwriting."""
    return unused_dir(root / f"{date.today().isoformat()}-{grid.name}")


def unused_dir(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3`` ... : never an existing results directory."""
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def _pass_env(arm: Arm, evidence_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    overlay = {**arm.env, EVIDENCE_ENV: str(evidence_dir), "PYTHONUNBUFFERED": "1"}
    env = {**os.environ, **overlay}
    # The pass imports this package; it need not be installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(provenance.PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    return env, overlay


def _kill_tree(proc: subprocess.Popen, ledger: MemoryLedger, grace_s: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(proc.pid, sig)  # the pass runs in its own session
        except ProcessLookupError:
            pass
        for pid in ledger.alive_pids():  # and anything that left the group
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait_s
        while time.time() < deadline and (proc.poll() is None or ledger.alive_pids()):
            time.sleep(0.1)
        if proc.poll() is not None and not ledger.alive_pids():
            return


def _reap_leftovers(ledger: MemoryLedger) -> list[dict[str, Any]]:
    """Wait for children still shutting down; kill and report any that stay."""
    deadline = time.time() + EXIT_GRACE_S
    while ledger.alive_pids() and time.time() < deadline:
        time.sleep(0.2)
    leftovers = []
    for pid in ledger.alive_pids():
        info = ledger.processes.get(pid)
        leftovers.append({"pid": pid, "title": info.title if info else "?"})
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return leftovers


def _log_tail(path: Path) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    return lines[-LOG_TAIL_LINES:]


def _crash_gist(tail: list[str]) -> str:
    """The line of the log most likely to say why: the last one naming an error."""
    for line in reversed(tail):
        if "Error" in line or "error" in line or "Killed" in line or "died" in line:
            return line.strip()[:300]
    return tail[-1].strip()[:300] if tail else "no output"


def classify(returncode: int | None, timed_out: bool, timeout_s: float, result: dict | None,
             result_error: str | None, evidence_reasons: list[str], log_tail: list[str]) -> tuple[str, list[str]]:
    crash = []
    if timed_out:
        crash.append(f"timed out after {timeout_s:g} s")
    elif returncode is not None and returncode < 0:
        crash.append(f"killed by {signal.Signals(-returncode).name}")
    elif returncode:
        crash.append(f"exited with code {returncode}")
    if result is None:
        crash.append(f"wrote no result ({result_error})" if result_error else "wrote no result")
    if crash:
        return CRASHED, crash + [f"log: {_crash_gist(log_tail)}"]
    invalid = list(result.get("problems", [])) + evidence_reasons
    return (INVALID, invalid) if invalid else (OK, [])


def run_pass(grid: Grid, scheduled: ScheduledPass, out_dir: Path, options: RunOptions) -> dict[str, Any]:
    arm = grid.arm(scheduled.arm)
    pass_dir = out_dir / "passes" / scheduled.stem
    evidence_dir = pass_dir / "evidence"
    evidence_dir.mkdir(parents=True)
    spec = {
        "arm": arm.name,
        "engine": arm.engine,
        "pass_index": scheduled.pass_index,
        "seq": scheduled.seq,
        "model": resolve_arm_model(arm),
        "llm_kwargs": arm.llm_kwargs,
        "user_command": arm.user_command,
        "workloads": [{**w.model_dump(), "label": w.label} for w in grid.workloads],
        "events_path": str(pass_dir / "events.jsonl"),
        "ledger_gate": True,  # the ledger reads nothing while a timed request runs (pass_events)
    }
    if arm.engine == "llamacpp":
        from vllm_omni_edge_bench.harness.pass_llamacpp import prepare_spec

        spec = prepare_spec(spec, arm)  # token ids made here, so the pass never imports transformers
    elif arm.engine in SPEECH_ENGINES:
        from vllm_omni_edge_bench.harness.pass_speech import prepare_spec as prepare_speech_spec

        spec = prepare_speech_spec(spec, arm)  # whisper.cpp's file converted here, untimed, outside the ledger
    spec_path, result_path, log_path = pass_dir / "spec.json", pass_dir / "result.json", pass_dir / "log.txt"
    _write_json(spec_path, spec)
    env, overlay = _pass_env(arm, evidence_dir)
    command = [sys.executable, "-m", PASS_MODULES[arm.engine], "--spec", str(spec_path), "--out", str(result_path)]

    started, load_average = provenance.now_iso(), os.getloadavg()
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=provenance.PROJECT_ROOT, start_new_session=True)
    ledger = MemoryLedger(proc.pid)
    gate = pass_events.LedgerGate(spec["events_path"])
    timed_out = False
    try:
        next_tick = time.time()
        sampler_cpu_s, samples, held_off = 0.0, 0, 0
        while True:
            now = time.time()
            if gate.asked() or now >= next_tick:
                with gate.read() as may_read:
                    held_off += not may_read  # a timed request runs: try again at the next poll
                    if may_read:
                        cpu_before = time.process_time()
                        sample = ledger.sample()
                        sample_cpu_s = time.process_time() - cpu_before
                        sampler_cpu_s, samples = sampler_cpu_s + sample_cpu_s, samples + 1
                        gate.answered()
                        next_tick = now + max(options.sample_interval_s,
                                              sample_cpu_s / options.max_sampler_cpu_share)
                        if options.observer:
                            options.observer(sample, ledger, proc)
            if proc.poll() is not None:
                ledger.sample()  # the tree after the pass: what it left behind
                break
            if time.time() - t0 > grid.timeout_s:
                timed_out = True
                _kill_tree(proc, ledger, TERM_GRACE_S)
                break
            due_in = next_tick - time.time()  # <= 0 while a timed request holds a due sample off
            time.sleep(GATE_POLL_S if due_in <= 0 else min(GATE_POLL_S, due_in))
    except BaseException:
        _kill_tree(proc, ledger, 0.5)  # never leave a pass running behind an interrupted harness
        raise
    finally:
        gate.clean()
    leftovers = _reap_leftovers(ledger)
    wall_s = time.time() - t0

    events = pass_events.read_events(spec["events_path"])
    evidence = collect_evidence(evidence_dir)
    result, result_error = None, None
    try:
        result = json.loads(result_path.read_text())
    except FileNotFoundError:
        pass
    except json.JSONDecodeError as error:
        result_error = f"unreadable result.json: {error}"
    ledger_summary = summarise_ledger(
        ledger, roles=roles_by_pid(evidence), first_token_t=events.get(pass_events.FIRST_TOKEN),
        workloads_done_t=events.get(pass_events.WORKLOADS_DONE), interval_s=options.sample_interval_s,
    )
    tail = _log_tail(log_path)
    reasons_from_evidence = evidence_problems(evidence, arm.expect, tree_pids=set(ledger.processes))
    status, reasons = classify(proc.returncode, timed_out, grid.timeout_s, result, result_error,
                               reasons_from_evidence, tail)
    return {
        "seq": scheduled.seq,
        "pass_index": scheduled.pass_index,
        "arm": arm.name,
        "status": status,
        "reasons": reasons,
        "warnings": [f"killed leftover process {p['pid']} ({p['title']})" for p in leftovers],
        "command": command,
        "env_overlay": overlay,
        "expect": arm.expect,
        "spec": spec,
        "started": started,
        "finished": provenance.now_iso(),
        "wall_s": wall_s,
        "load_average_at_start": load_average,
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "events": events,
        "result": result,
        "ledger": ledger_summary,
        # What measuring cost the box: the harness's own CPU for the memory samples.
        "sampler": {"samples": samples, "cpu_s": sampler_cpu_s, "held_off_polls": held_off,
                    "cpu_share_of_wall": sampler_cpu_s / wall_s if wall_s > 0 else None},
        "evidence": evidence,
        "log_tail": tail,
    }


def prime_arms(grid: Grid, out_dir: Path, options: RunOptions) -> tuple[dict[str, str], str | None]:
    """One unmeasured pass per vLLM arm (``prime``): its compile artifact and the files it reads
    are then there for every measured pass, whatever arm ran first. Returns each primed arm's
    status, and why the grid cannot run if a prime crashed (its arm would crash every pass).
    A prime may be invalid by design: it is the start that compiles, where the passes expect
    to load the artifact (``compile_cache.aot_loaded``); the passes check their own evidence."""
    statuses: dict[str, str] = {}
    for arm in grid.arms:
        if arm.engine == "llamacpp" or arm.engine in ("faster-whisper", "whispercpp"):
            continue  # nothing cached between starts but the page cache, which the passes share
        scheduled = ScheduledPass(seq=0, pass_index=0, arm=arm.name)
        record = run_pass(grid, scheduled, out_dir / "prime", options)
        statuses[arm.name] = record["status"]
        _write_json(out_dir / "prime" / "passes" / f"{scheduled.stem}.json", record)
        options.log(f"[prime] {arm.name}: {record['status']} ({record['wall_s']:.0f} s)")
        if record["status"] == CRASHED:
            return statuses, f"not run: the prime pass of {arm.name} was {record['status']}: " + \
                "; ".join(record["reasons"][:2])
    return statuses, None


def _not_run(scheduled: ScheduledPass, why: str) -> dict[str, Any]:
    return {"seq": scheduled.seq, "pass_index": scheduled.pass_index, "arm": scheduled.arm,
            "status": NOT_RUN, "reasons": [why]}


def _one_line(record: dict[str, Any], total: int) -> str:
    head = f"[{record['seq']}/{total}] pass {record['pass_index']} {record['arm']}: {record['status']}"
    if record["status"] == NOT_RUN:
        return head
    figures = []
    for workload in (record.get("result") or {}).get("workloads", []):
        for name, fig in workload["figures"].items():
            figures.append(f"{name} {fig['value']:.4g} {fig['unit']}")
    steady = ((record.get("ledger") or {}).get("tree") or {}).get("steady")
    if steady:
        figures.append(f"tree PSS {steady['pss'] / (1 << 20):,.0f} MiB")
    detail = "; ".join(record["reasons"][:2]) if record["reasons"] else ", ".join(figures)
    return f"{head} ({record['wall_s']:.0f} s) {detail}"


def run_grid(grid: Grid, grid_text: str, out_dir: Path, options: RunOptions,
             overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every pass, write the artifacts, return the summary."""
    check_runnable(grid)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty; results are never overwritten")
    record = provenance.collect(grid_text)  # before the results directory makes the tree dirty
    (out_dir / "passes").mkdir(parents=True, exist_ok=True)
    (out_dir / "grid.yaml").write_text(grid_text)
    record["overrides"] = overrides or {}
    record["effective_grid"] = grid.model_dump()
    _write_json(out_dir / "provenance.json", record)

    schedule = interleaved(grid.arm_names, grid.passes, grid.rotate_start, grid.reverse_alternate)
    records: list[dict[str, Any]] = []
    stop: str | None = None
    try:
        if grid.prime:
            record["primed"], stop = prime_arms(grid, out_dir, options)
        for scheduled in schedule:
            if stop:
                result = _not_run(scheduled, stop)
            else:
                result = run_pass(grid, scheduled, out_dir, options)
                if result["status"] != OK and not options.keep_going:
                    stop = f"not run: pass {scheduled.pass_index} {scheduled.arm} was {result['status']}"
            _write_json(out_dir / "passes" / f"{scheduled.stem}.json", result)
            records.append(result)
            options.log(_one_line(result, len(schedule)))
    except KeyboardInterrupt:
        done = {r["seq"] for r in records}
        for scheduled in schedule:
            if scheduled.seq not in done:
                records.append(_not_run(scheduled, "not run: interrupted"))
                _write_json(out_dir / "passes" / f"{scheduled.stem}.json", records[-1])
        raise
    finally:
        summary = summarise(records, grid.arm_names, grid.control, grid.passes)
        _write_json(out_dir / "summary.json", summary)
        record["finished"] = provenance.now_iso()
        _write_json(out_dir / "provenance.json", record)
    return summary
