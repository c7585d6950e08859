"""Per-stage memory and latency of the tiny Qwen2.5-Omni speech pipeline on CPU: one artifact.

    python -m vllm_omni_edge_bench.harness.omni_stages --arms bf16,int4 --passes 3 --out DIR

Each pass starts ``Omni(...)`` in a fresh process (``... omni_stages pass``) on the tiny
random-weight checkpoint (``vllm_omni_edge/omni/tiny_models.py``) with the arm's CPU deploy
YAML (``bf16``: ``qwen2_5_omni``; ``int4``: ``qwen2_5_omni_int4``, thinker and talker in
cpu_int4). The memory ledger samples PSS over the pass's whole process tree; every process
is attributed to a stage by its title (``VLLM::StageEngineCoreProc_stage<N>...``) or the
nearest titled ancestor (the stage's workers), and the rest to the front end (the pass
process, which also runs vLLM-Omni's orchestrator) or "other". Steady PSS is read while the
pipeline idles after its requests (the ledger's steady window).

Latency per stage is vLLM-Omni's own per-request account (``StageRequestStats``:
``stage_gen_time_ms`` for each stage, from ``OrchestratorAggregator.build_and_log_summary``
with ``log_stats=True``), over a fixed request (thinker 8 tokens, talker 48 codec tokens,
both ``ignore_eos``, then code2wav); one warm-up request, then ``--requests`` measured
ones, whose median is the pass's figure. Passes run interleaved (A B A B); the artifact
gives the median and spread of the pass figures per arm. A pass that crashes or whose
stage workers' evidence does not show the arm's set-up (cpu_int4 kernels in the thinker
and talker workers for ``int4``, none for ``bf16``) makes the artifact "crashed" or
"invalid": no medians are written then.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

ARMS = {"bf16": "qwen2_5_omni", "int4": "qwen2_5_omni_int4"}
STAGES = (0, 1, 2)
STAGE_NAMES = {0: "thinker", 1: "talker", 2: "code2wav"}
INT4_STAGES = (0, 1)
STAGE_TITLE = re.compile(r"StageEngineCoreProc_stage(\d+)")
FRONTEND, OTHER = "frontend", "other"
MEMORY_FIELDS = ("pss", "pss_anon", "pss_file")
MIB = 1 << 20
# The fixed request: thinker tokens, talker codec tokens (both forced by ignore_eos).
THINKER_TOKENS, TALKER_TOKENS = 8, 48
PROMPT = (
    "<|im_start|>system\nYou are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, "
    "capable of perceiving auditory and visual inputs, as well as generating text and speech.<|im_end|>\n"
    "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
)


# ---------------------------------------------------------------------------
# Attribution (pure: unit-tested with a fake tree)
# ---------------------------------------------------------------------------

def stage_of_title(title: str) -> int | None:
    match = STAGE_TITLE.search(title or "")
    return int(match.group(1)) if match else None


def attribute_stages(processes: dict[str, dict], root_pid: int) -> dict[int, str]:
    """pid -> "stage<N>" (a stage process or a descendant of one), "frontend" (the root) or "other".

    ``processes`` is ``summarise_ledger(...)["processes"]`` (pid, ppid, title and the
    evidence's role per process).
    """
    by_pid = {int(p["pid"]): p for p in processes.values()}
    labels: dict[int, str] = {}
    for pid in by_pid:
        label, seen, current = OTHER, set(), pid
        while current in by_pid and current not in seen:
            seen.add(current)
            proc = by_pid[current]
            # The process title, or the process name the plugin's evidence recorded (same text).
            stage = stage_of_title(proc.get("title", ""))
            stage = stage if stage is not None else stage_of_title(proc.get("evidence_role") or "")
            if stage is not None:
                label = f"stage{stage}"
                break
            if current == root_pid:
                label = FRONTEND
                break
            current = by_pid[current].get("ppid")
        labels[pid] = label
    return labels


def group_memory(processes: dict[str, dict], labels: dict[int, str], window: str = "steady") -> dict[str, dict]:
    """Sum of each group's memory in one ledger window; a field any member lacks is None.

    A group whose members have no record in the window (gone before it) is None in all fields.
    """
    groups: dict[str, dict] = {}
    for key, proc in processes.items():
        label = labels.get(int(proc["pid"]), OTHER)
        group = groups.setdefault(label, {"pids": [], "missing": [], **{f: 0 for f in MEMORY_FIELDS}})
        group["pids"].append(int(proc["pid"]))
        record = proc.get(window)
        if record is None:
            group["missing"].append(int(proc["pid"]))
            continue
        for field in MEMORY_FIELDS:
            value = record.get(field)
            group[field] = None if value is None or group[field] is None else group[field] + value
    return groups


def stage_latency_rows(summary: dict) -> dict[int, dict]:
    """stage id -> {"gen_ms", "tokens_out", "wall_ms"} from one build_and_log_summary() dict."""
    rows: dict[int, dict] = {}
    overall = summary.get("overall_summary") or {}
    for request in summary.get("stage_table") or []:
        for row in request.get("stages") or []:
            stage = row.get("stage_id")
            if stage is None:
                continue
            rows[int(stage)] = {
                "gen_ms": row.get("stage_gen_time_ms"),
                "tokens_out": row.get("num_tokens_out"),
                "wall_ms": overall.get(f"e2e_stage_{int(stage)}_wall_time_ms"),
            }
    return rows


# ---------------------------------------------------------------------------
# Evidence checks
# ---------------------------------------------------------------------------

def workers_by_stage(evidence: dict) -> dict[int, list[dict]]:
    found: dict[int, list[dict]] = {}
    for worker in evidence.get("workers", []):
        stage = worker.get("omni_stage_id")
        if isinstance(stage, int):
            found.setdefault(stage, []).append(worker)
    return found


def arm_evidence_problems(arm: str, evidence: dict, labels: dict[int, str]) -> list[str]:
    """Why a pass does not show its arm's set-up in the stage workers' own evidence."""
    problems = []
    by_stage = workers_by_stage(evidence)
    for stage in STAGES:
        workers = by_stage.get(stage, [])
        if not workers:
            problems.append(f"no worker evidence from stage {stage} ({STAGE_NAMES[stage]})")
            continue
        for worker in workers:
            where = labels.get(worker.get("pid"))
            if where != f"stage{stage}":
                problems.append(f"stage {stage} worker evidence from pid {worker.get('pid')}, "
                                f"which the ledger attributes to {where}")
            kernels = worker.get("cpu_int4_kernels") or {}
            wants_int4 = arm == "int4" and stage in INT4_STAGES
            if wants_int4 and (worker.get("quantization") != "cpu_int4" or not kernels):
                problems.append(f"stage {stage} worker ran quantization={worker.get('quantization')!r}, "
                                f"cpu_int4 kernels {kernels}; the int4 arm asks for cpu_int4")
            if not wants_int4 and kernels:
                problems.append(f"stage {stage} worker ran cpu_int4 kernels {kernels}; arm {arm} asks for none")
    return problems


# ---------------------------------------------------------------------------
# Summary and report
# ---------------------------------------------------------------------------

def _spread(values: list[float]) -> dict | None:
    from vllm_omni_edge_bench.harness.stats import spread

    values = [v for v in values if v is not None]
    return spread(values) if values else None


def summarise_passes(records: list[dict], arms: list[str], passes: int) -> dict:
    """Medians and spread per arm and stage; refused (status not "ok") unless every pass is ok."""
    bad = [r for r in records if r["status"] != "ok"]
    missing = [(a, i) for a in arms for i in range(1, passes + 1)
               if not any(r["arm"] == a and r["pass_index"] == i for r in records)]
    if bad or missing:
        status = "crashed" if any(r["status"] == "crashed" for r in bad) else ("invalid" if bad else "incomplete")
        reasons = [f"pass {r['pass_index']} {r['arm']}: {r['status']}: {'; '.join(r['reasons'][:3])}" for r in bad]
        reasons += [f"pass {i} {a}: not run" for a, i in missing]
        return {"status": status, "reasons": reasons, "arms": None}
    out: dict[str, Any] = {}
    for arm in arms:
        mine = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["pass_index"])
        groups = sorted({g for r in mine for g in r["memory"]["steady"]}, key=_group_order)
        memory = {g: {f: _spread([r["memory"]["steady"].get(g, {}).get(f) for r in mine]) for f in MEMORY_FIELDS}
                  for g in groups}
        memory["tree"] = {f: _spread([(r["memory"]["tree_steady"] or {}).get(f) for r in mine])
                          for f in MEMORY_FIELDS}
        latency = {str(s): {k: _spread([r["latency"]["stages"].get(str(s), {}).get(k) for r in mine])
                            for k in ("gen_ms", "wall_ms", "tokens_out")} for s in STAGES}
        latency["request_ms"] = _spread([r["latency"]["request_ms"] for r in mine])
        out[arm] = {"passes": len(mine), "memory_steady": memory, "latency": latency,
                    "cpu_int4_kernels_by_stage": mine[0].get("cpu_int4_kernels_by_stage") or {},
                    "cpu_int4_other_layers": mine[0].get("cpu_int4_other_layers") or []}
    return {"status": "ok", "reasons": [], "arms": out}


def _group_order(label: str) -> tuple[int, str]:
    if label.startswith("stage"):
        return (1, label)
    return (0 if label == FRONTEND else 2, label)


def _mib(fig: dict | None) -> str:
    if not fig:
        return "n/a"
    return f"{fig['median'] / MIB:,.0f} [{fig['min'] / MIB:,.0f}–{fig['max'] / MIB:,.0f}]"


def _ms(fig: dict | None) -> str:
    if not fig:
        return "n/a"
    return f"{fig['median']:,.0f} [{fig['min']:,.0f}–{fig['max']:,.0f}]"


def _group_name(label: str) -> str:
    if label.startswith("stage"):
        stage = int(label[5:])
        return f"stage {stage} ({STAGE_NAMES.get(stage, '?')})"
    return {"tree": "whole tree", FRONTEND: "front end (Omni, orchestrator)"}.get(label, label)


def render_markdown(artifact: dict) -> str:
    summary = artifact["summary"]
    lines = [f"# Per-stage memory and latency: tiny Qwen2.5-Omni on CPU ({artifact['run']['started'][:10]})", ""]
    lines += [f"Arms: {', '.join(artifact['run']['arms'])}; {artifact['run']['passes']} passes each, interleaved; "
              f"{artifact['run']['requests']} measured requests per pass after one warm-up.", ""]
    if summary["status"] != "ok":
        lines += [f"**Status: {summary['status']}.** No medians: every pass must be ok.", ""]
        lines += [f"- {reason}" for reason in summary["reasons"]]
        return "\n".join(lines) + "\n"
    if artifact["run"]["busy_box"]:
        lines += ["**Latency measured on a busy box** (other jobs shared the 2 cores; load averages at "
                  "the start of each pass are in omni-stages.json). Memory is not affected by that; "
                  "latency is only a rough guide.", ""]
    lines += ["Steady PSS, MiB: median [min–max] over passes, read while the pipeline idled after its "
              "requests. Anon is the process's own memory (weights after conversion, KV, activations); "
              "file is mapped files (libraries, safetensors pages still mapped).", ""]
    lines += ["| arm | process group | PSS | anon | file |", "|---|---|---:|---:|---:|"]
    for arm, data in summary["arms"].items():
        for group, figs in data["memory_steady"].items():
            lines.append(f"| {arm} | {_group_name(group)} | {_mib(figs['pss'])} | {_mib(figs['pss_anon'])} | "
                         f"{_mib(figs['pss_file'])} |")
    lines += ["", "Latency per stage, ms: median [min–max] of the pass medians (vLLM-Omni's "
              "`StageRequestStats.stage_gen_time_ms`; request = whole `Omni.generate`).", ""]
    lines += ["| arm | stage | gen time | tokens out |", "|---|---|---:|---:|"]
    for arm, data in summary["arms"].items():
        for stage in STAGES:
            fig = data["latency"][str(stage)]
            tokens = fig["tokens_out"]["median"] if fig["tokens_out"] else "n/a"
            lines.append(f"| {arm} | {_group_name(f'stage{stage}')} | {_ms(fig['gen_ms'])} | {tokens} |")
        lines.append(f"| {arm} | whole request | {_ms(data['latency']['request_ms'])} | |")
    for arm, data in summary["arms"].items():
        kernels = {stage: k for stage, k in sorted(data["cpu_int4_kernels_by_stage"].items()) if k}
        if not kernels:
            continue
        lines += ["", f"cpu_int4 in arm {arm}, from the stage workers' evidence:", ""]
        lines += [f"- {_group_name(f'stage{stage}')}: {k}" for stage, k in kernels.items()]
        layers = data["cpu_int4_other_layers"]
        lines += [f"- stage {layer['stage']}: `{layer['prefix']}` → {layer['kernel']} ({layer['reason']})"
                  for layer in layers] or ["- no layer was left unquantized or sent to the dequantize fallback"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# One pass (runner side)
# ---------------------------------------------------------------------------

def _pass_record(arm: str, pass_index: int, seq: int, model: Path, deploy: Path, pass_dir: Path,
                 requests: int, timeout_s: float, interval_s: float, hold_s: float) -> dict:
    from vllm_omni_edge_bench.harness import pass_events, provenance
    from vllm_omni_edge_bench.harness.evidence import collect_evidence, roles_by_pid
    from vllm_omni_edge_bench.harness.ledger import MemoryLedger, summarise_ledger
    from vllm_omni_edge_bench.harness.runner import TERM_GRACE_S, _kill_tree, _log_tail, _reap_leftovers, classify

    evidence_dir = pass_dir / "evidence"
    evidence_dir.mkdir(parents=True)
    result_path, events_path, log_path = pass_dir / "result.json", pass_dir / "events.jsonl", pass_dir / "log.txt"
    command = [sys.executable, "-m", "vllm_omni_edge_bench.harness.omni_stages", "pass", "--model", str(model),
               "--deploy", str(deploy), "--out", str(result_path), "--events", str(events_path),
               "--requests", str(requests), "--hold-s", str(hold_s)]
    env = {**os.environ, "VLLM_OMNI_EDGE_EVIDENCE_DIR": str(evidence_dir), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(provenance.PROJECT_ROOT), os.environ.get("PYTHONPATH")]))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    started, load_average, t0 = provenance.now_iso(), os.getloadavg(), time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=provenance.PROJECT_ROOT, start_new_session=True)
    ledger, timed_out = MemoryLedger(proc.pid), False
    try:
        while proc.poll() is None:
            ledger.sample()
            if time.time() - t0 > timeout_s:
                timed_out = True
                _kill_tree(proc, ledger, TERM_GRACE_S)
                break
            time.sleep(interval_s)
        ledger.sample()
    except BaseException:
        _kill_tree(proc, ledger, 0.5)
        raise
    leftovers = _reap_leftovers(ledger)
    events = pass_events.read_events(events_path)
    evidence = collect_evidence(evidence_dir)
    result, result_error = None, None
    try:
        result = json.loads(result_path.read_text())
    except FileNotFoundError:
        pass
    except json.JSONDecodeError as error:
        result_error = f"unreadable result.json: {error}"
    ledger_summary = summarise_ledger(ledger, roles=roles_by_pid(evidence),
                                      first_token_t=events.get(pass_events.FIRST_TOKEN),
                                      workloads_done_t=events.get(pass_events.WORKLOADS_DONE),
                                      interval_s=interval_s)
    labels = attribute_stages(ledger_summary["processes"], ledger_summary["root_pid"])
    evidence_reasons = arm_evidence_problems(arm, evidence, labels) if result is not None else []
    status, reasons = classify(proc.returncode, timed_out, timeout_s, result, result_error, evidence_reasons,
                               _log_tail(log_path))
    steady = group_memory(ledger_summary["processes"], labels, "steady")
    if status == "ok":
        gone = {g: m["missing"] for g, m in steady.items() if g.startswith("stage") and m["missing"]}
        if gone or sorted(g for g in steady if g.startswith("stage")) != [f"stage{s}" for s in STAGES]:
            status, reasons = "invalid", [f"stage processes missing from the steady window: {gone or sorted(steady)}"]
    other_layers = [{"stage": w.get("omni_stage_id"), **layer}
                    for w in evidence.get("workers", []) for layer in w.get("cpu_int4_other_layers") or []]
    kernels = {str(w.get("omni_stage_id")): w.get("cpu_int4_kernels") for w in evidence.get("workers", [])}
    latency = (result or {}).get("latency") or {"stages": {}, "request_ms": None}
    return {
        "seq": seq, "pass_index": pass_index, "arm": arm, "deploy": str(deploy), "status": status,
        "reasons": reasons, "warnings": [f"killed leftover process {p['pid']} ({p['title']})" for p in leftovers]
        + list((result or {}).get("warnings", [])),
        "command": command, "started": started, "wall_s": time.time() - t0,
        "load_average_at_start": load_average, "returncode": proc.returncode, "events": events,
        "result": result, "memory": {"labels": {str(k): v for k, v in labels.items()}, "steady": steady,
                                     "peak": group_memory(ledger_summary["processes"], labels, "peak"),
                                     "tree_steady": ledger_summary["tree"]["steady"]},
        "latency": latency, "cpu_int4_kernels_by_stage": kernels, "cpu_int4_other_layers": other_layers,
        "ledger": ledger_summary, "evidence": evidence,
    }


def run(arms: list[str], passes: int, out: Path, model: Path | None, requests: int, timeout_s: float,
        interval_s: float, hold_s: float, busy_box: bool, log=print) -> dict:
    from vllm_omni_edge_bench.harness import provenance
    from vllm_omni_edge_bench.harness.runner import unused_dir
    from vllm_omni_edge_bench.harness.schedule import interleaved
    from vllm_omni_edge.atomic import atomic_write_bytes
    from vllm_omni_edge.platforms.cpu.deploy import cpu_deploy_config

    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise SystemExit(f"unknown arm(s) {unknown or arms}; choose from {', '.join(ARMS)}")
    if passes < 1:
        raise SystemExit(f"--passes must be at least 1, got {passes}")
    if model is None:
        from vllm_omni_edge.models.default_model import cache_root
        from vllm_omni_edge.omni.tiny_models import tiny_qwen2_5_omni

        model = tiny_qwen2_5_omni(cache_root() / "tiny")
    if not Path(model).is_dir():
        raise SystemExit(f"model {model} is not a directory")
    out = unused_dir(Path(out))
    (out / "passes").mkdir(parents=True)
    deploys = {arm: cpu_deploy_config(ARMS[arm]) for arm in arms}
    config_text = json.dumps({"arms": {a: str(deploys[a]) for a in arms}, "passes": passes, "model": str(model),
                              "requests": requests, "hold_s": hold_s, "interval_s": interval_s}, indent=2)
    record = provenance.collect(config_text)
    record["deploy_yaml"] = {a: Path(d).read_text() for a, d in deploys.items()}
    atomic_write_bytes(out / "provenance.json", json.dumps(record, indent=2, default=str).encode())
    records: list[dict] = []
    schedule = interleaved(arms, passes)

    def write_artifact() -> dict:
        # After every pass, so a run stopped early still leaves an "incomplete" artifact.
        artifact = {
            "run": {"started": record["started"], "finished": provenance.now_iso(), "arms": arms, "passes": passes,
                    "requests": requests, "model": str(model), "busy_box": busy_box,
                    "load_average_at_pass_starts": [r["load_average_at_start"] for r in records]},
            "summary": summarise_passes(records, arms, passes),
            "passes": [{k: r[k] for k in ("seq", "pass_index", "arm", "status", "reasons", "warnings", "wall_s",
                                          "load_average_at_start", "memory", "latency",
                                          "cpu_int4_kernels_by_stage", "cpu_int4_other_layers")}
                       for r in records],
        }
        atomic_write_bytes(out / "omni-stages.json", json.dumps(artifact, indent=2, default=str).encode())
        atomic_write_bytes(out / "omni-stages.md", render_markdown(artifact).encode())
        return artifact

    artifact = write_artifact()
    for scheduled in schedule:
        log(f"[{scheduled.seq}/{len(schedule)}] pass {scheduled.pass_index} {scheduled.arm} ...")
        rec = _pass_record(scheduled.arm, scheduled.pass_index, scheduled.seq, Path(model), Path(deploys[scheduled.arm]),
                           out / "passes" / scheduled.stem, requests, timeout_s, interval_s, hold_s)
        atomic_write_bytes(out / "passes" / scheduled.stem / "record.json",
                           json.dumps(rec, indent=2, default=str).encode())
        records.append(rec)
        artifact = write_artifact()
        log(f"    {rec['status']} in {rec['wall_s']:.0f} s {'; '.join(rec['reasons'][:2])}")
        if rec["status"] != "ok":
            break  # its medians are refused anyway; the box is shared
    log(f"artifact: {out} ({artifact['summary']['status']})")
    return artifact


# ---------------------------------------------------------------------------
# One pass (inside the pass process)
# ---------------------------------------------------------------------------

def _capture_stage_summaries() -> list[dict]:
    """Keep what vLLM-Omni's per-request metrics summary returns (it only logs it otherwise)."""
    from vllm_omni.metrics.stats import OrchestratorAggregator

    captured: list[dict] = []
    original = OrchestratorAggregator.build_and_log_summary

    def build_and_log_summary(self):
        summary = original(self)
        captured.append(summary)
        return summary

    OrchestratorAggregator.build_and_log_summary = build_and_log_summary
    return captured


def pass_main(args) -> int:
    from vllm_omni_edge_bench.harness import pass_events

    pass_events.emit(args.events, pass_events.STARTED)
    import torch
    from vllm import SamplingParams
    from vllm_omni import Omni

    captured = _capture_stage_summaries()
    omni = Omni(model=args.model, deploy_config=args.deploy, log_stats=True,
                stage_init_timeout=1800, init_timeout=2400)
    pass_events.emit(args.events, pass_events.ENGINE_READY)
    params = [
        SamplingParams(max_tokens=THINKER_TOKENS, temperature=0.0, ignore_eos=True),
        # The talker's forward writes sampling_metadata.prompt_token_ids, built only with a penalty.
        SamplingParams(max_tokens=TALKER_TOKENS, temperature=0.9, top_k=40, seed=1, repetition_penalty=1.05,
                       ignore_eos=True),
        SamplingParams(max_tokens=THINKER_TOKENS * 8),
    ]
    problems, measured = [], []
    for index in range(args.requests + 1):  # request 0 is the warm-up
        before = len(captured)
        t0 = time.monotonic()
        text, audio_samples = None, 0
        for out in omni.generate([{"prompt": PROMPT}], params, use_tqdm=False):
            if out.final_output_type == "text":
                text = out.outputs[0].text
            elif out.final_output_type == "audio":
                audio = (out.multimodal_output or {}).get("audio")
                if isinstance(audio, (list, tuple)):
                    audio = torch.cat([torch.as_tensor(a).reshape(-1) for a in audio])
                audio = torch.as_tensor(audio).float().reshape(-1)
                audio_samples = int(audio.numel()) if bool(torch.isfinite(audio).all()) else -1
        request_ms = (time.monotonic() - t0) * 1000.0
        if index == 0:
            pass_events.emit(args.events, pass_events.FIRST_TOKEN)
        if not text:
            problems.append(f"request {index}: no text output")
        if audio_samples <= 0:
            problems.append(f"request {index}: no finite audio ({audio_samples} samples)")
        rows = stage_latency_rows(captured[before]) if len(captured) > before else {}
        if index > 0:
            measured.append({"request_ms": request_ms, "stages": rows, "audio_samples": audio_samples})
    time.sleep(args.hold_s)  # the ledger's steady window: the pipeline idle, everything loaded
    pass_events.emit(args.events, pass_events.WORKLOADS_DONE)
    latency = {
        "request_ms": median(m["request_ms"] for m in measured),
        "stages": {str(s): {k: _median_or_none([m["stages"].get(s, {}).get(k) for m in measured])
                            for k in ("gen_ms", "wall_ms", "tokens_out")} for s in STAGES},
    }
    warnings = [f"vLLM-Omni reported no stage_gen_time_ms for stage {s}" for s in STAGES
                if latency["stages"][str(s)]["gen_ms"] is None]
    result = {"problems": problems, "warnings": warnings, "latency": latency, "requests": measured}
    Path(args.out).write_text(json.dumps(result, indent=2))
    omni.close()
    return 0


def _median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pass"]:
        parser = argparse.ArgumentParser(prog="omni_stages pass")
        parser.add_argument("--model", required=True)
        parser.add_argument("--deploy", required=True)
        parser.add_argument("--out", required=True)
        parser.add_argument("--events", required=True)
        parser.add_argument("--requests", type=int, default=3)
        parser.add_argument("--hold-s", type=float, default=5.0)
        return pass_main(parser.parse_args(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m vllm_omni_edge_bench.harness.omni_stages",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default="bf16,int4", help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--out", required=True, type=Path, help="artifact directory (suffixed -2 ... if it exists)")
    parser.add_argument("--model", type=Path, default=None, help="tiny Qwen2.5-Omni dir (built if omitted)")
    parser.add_argument("--requests", type=int, default=3, help="measured requests per pass (after 1 warm-up)")
    parser.add_argument("--timeout-s", type=float, default=2400.0, help="per pass")
    parser.add_argument("--interval-s", type=float, default=0.5, help="memory sampling interval")
    parser.add_argument("--hold-s", type=float, default=5.0, help="idle time read as steady state")
    parser.add_argument("--busy-box", action="store_true", help="label latency as measured on a busy box")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the running pass's process tree is killed too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    artifact = run([a.strip() for a in args.arms.split(",") if a.strip()], args.passes, args.out, args.model,
                   args.requests, args.timeout_s, args.interval_s, args.hold_s, args.busy_box)
    return 0 if artifact["summary"]["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
