"""Per-stage PSS and latency of the spoken-question pipeline over HTTP: one JSON artifact.

    python -m tests.omni.spoken_question_measure --answer default --passes 3 --out DIR

Each pass starts ``vllm-omni serve ROOT --omni`` (tests/omni/omni_server.py) on the pipeline
root of whisper-base (its cpu_int4 build; ``--asr float``: the float checkpoint) and the answer
model's cpu_int4 checkpoint, sends one warm-up request
and then ``--requests`` measured ones (``tests/fixtures/speech/capital.wav`` as an
``input_audio`` part, ``return_stage_metrics``), then reads PSS over the server's whole
process tree (psutil ``memory_full_info().pss``) with the pipeline idle. Processes are
attributed to a stage by their title (``VLLM::StageEngineCoreProc_stage<N>``) or the nearest
titled ancestor (the stage's workers); the API server (which also runs vLLM-Omni's
orchestrator) is the front end.

Latency per request: ``asr_ms`` is stage 0's ``stage_gen_time_ms`` (audio -> transcript,
Whisper's encoder and decoder), ``answer_ms`` stage 1's (transcript -> answer),
``e2e_ms`` the client's wall time for the HTTP request. A pass's figure is the median of
its requests; the artifact gives the median and range of the pass figures.
"""

from __future__ import annotations

import argparse
import base64
import json
import time
from pathlib import Path
from statistics import median

import httpx

from vllm_omni_edge_bench.harness import provenance
from vllm_omni_edge_bench.harness.omni_stages import attribute_stages
from tests.omni.omni_server import OmniServer
from tests.speech import wav

MIB = 1 << 20
QUESTION = "capital"


def chat_body(model: str, audio: bytes, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(audio).decode(), "format": "wav"}}]}],
        **extra}


def ask(server: OmniServer, model: str, audio: bytes, timeout: float = 600) -> dict:
    start = time.perf_counter()
    response = httpx.post(server.base_url + "/v1/chat/completions",
                          json=chat_body(model, audio, return_stage_metrics=True), timeout=timeout)
    e2e_ms = (time.perf_counter() - start) * 1000
    response.raise_for_status()
    body = response.json()
    stages = (body.get("metrics") or {}).get("stage_metrics") or {}
    return {
        "answer": body["choices"][0]["message"]["content"],
        "e2e_ms": e2e_ms,
        "asr_ms": stages.get("0", {}).get("stage_gen_time_ms"),
        "answer_ms": stages.get("1", {}).get("stage_gen_time_ms"),
        "asr_tokens": stages.get("0", {}).get("num_tokens_out"),
        "answer_tokens": stages.get("1", {}).get("num_tokens_out"),
    }


def tree_pss(root_pid: int) -> dict[str, dict]:
    """PSS (MiB) per group (stage0, stage1, frontend, other) and the whole tree."""
    import psutil

    root = psutil.Process(root_pid)
    procs = [root, *root.children(recursive=True)]
    info, pss = {}, {}
    for proc in procs:
        try:
            title = " ".join(proc.cmdline()) or proc.name()
            info[str(proc.pid)] = {"pid": proc.pid, "ppid": proc.ppid(), "title": title}
            pss[proc.pid] = proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    labels = attribute_stages(info, root_pid)
    groups: dict[str, dict] = {}
    for pid, value in pss.items():
        group = groups.setdefault(labels.get(pid, "other"), {"pss_mib": 0.0, "processes": 0})
        group["pss_mib"] += value / MIB
        group["processes"] += 1
    groups["tree"] = {"pss_mib": sum(pss.values()) / MIB, "processes": len(pss)}
    return groups


def one_pass(root: Path, log: Path, requests: int, settle_s: float) -> dict:
    start = time.perf_counter()
    server = OmniServer(root, log)
    try:
        server.wait_ready(2400)
        ready_s = time.perf_counter() - start
        model = server.model_name()
        audio = wav(QUESTION).read_bytes()
        warmup = ask(server, model, audio)
        measured = [ask(server, model, audio) for _ in range(requests)]
        time.sleep(settle_s)
        memory = tree_pss(server.proc.pid)
    finally:
        server.stop()
    figures = {key: median(r[key] for r in measured) for key in ("e2e_ms", "asr_ms", "answer_ms")}
    return {"ready_s": ready_s, "warmup": warmup, "requests": measured, "median": figures, "memory": memory}


def summarise(passes: list[dict]) -> dict:
    def spread(values):
        return {"median": median(values), "min": min(values), "max": max(values)}

    latency = {key: spread([p["median"][key] for p in passes]) for key in ("e2e_ms", "asr_ms", "answer_ms")}
    groups = sorted({g for p in passes for g in p["memory"]})
    memory = {g: spread([p["memory"][g]["pss_mib"] for p in passes if g in p["memory"]]) for g in groups}
    return {"latency_ms": latency, "pss_mib": memory, "ready_s": spread([p["ready_s"] for p in passes])}


def main(argv: list[str] | None = None) -> int:
    from vllm_omni_edge.models.default_model import (
        EMBEDDED_MODELS, WHISPER_BASE, pull_cpu_int4_model, pull_model,
    )
    from vllm_omni_edge.omni.spoken_question import build_pipeline_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answer", default="default", choices=sorted(EMBEDDED_MODELS))
    parser.add_argument("--asr", default="cpu_int4", choices=("cpu_int4", "float"),
                        help="stage 0's Whisper: the cpu_int4 build (default) or the float checkpoint")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = provenance.now_iso()
    asr = pull_cpu_int4_model(WHISPER_BASE) if args.asr == "cpu_int4" else pull_model(WHISPER_BASE)
    root = build_pipeline_dir(asr, pull_cpu_int4_model(EMBEDDED_MODELS[args.answer]))
    passes = []
    for index in range(args.passes):
        record = one_pass(root, args.out / f"serve-{index}.log", args.requests, args.settle_s)
        passes.append(record)
        print(json.dumps({"pass": index, **record["median"], "ready_s": record["ready_s"],
                          "tree_pss_mib": record["memory"]["tree"]["pss_mib"],
                          "answer": record["requests"][0]["answer"]}), flush=True)
    artifact = {"answer_model": args.answer, "asr": args.asr, "root": str(root), "passes": passes,
                "summary": summarise(passes),
                "provenance": {"started": started, "finished": provenance.now_iso(), "git": provenance.git_state(),
                               "packages": provenance.package_versions(), "cpu": provenance.cpu_description(),
                               "memory": provenance.memory_description(), "env": provenance.relevant_env()}}
    (args.out / "spoken_question.json").write_text(json.dumps(artifact, indent=2) + "\n")
    print(json.dumps(artifact["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
