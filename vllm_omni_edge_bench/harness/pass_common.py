"""What the pass modules share: figure records, the timed workloads, and ``main``.

Every engine's pass measures decode, prefill and TTFT the same way, through its own
``generate(prompt_tokens, max_tokens, purpose) -> request record`` (a dict with at least
``seconds``, ``prompt_tokens`` and ``gen_tokens``). Keeping the arithmetic here is what
makes figures from different engines comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from vllm_omni_edge_bench.harness import pass_events

WALL_DECODE = "wall clock: (n-1) / (t(n tokens) - t(1 token)), same prompt length"
WALL_ONE_TOKEN = "wall clock: one request with one token out"
WARMUP_GEN_TOKENS = 8
WALL_COLD_START = "wall clock: pass process creation (psutil) to first token returned"


def figure(value: float, unit: str, better: str, source: str) -> dict[str, Any]:
    return {"value": value, "unit": unit, "better": better, "source": source}


def start_up_timings(process_start: float, first_token_t: float, load_s: float, first_request_s: float
                     ) -> dict[str, float]:
    """What an in-process engine's start-up took: to the first token, the constructor, the first request."""
    return {"process_start_to_first_token_s": first_token_t - process_start,
            "engine_constructor_s": load_s, "first_request_s": first_request_s}


def start_up_figures(timings: dict[str, float], load_name: str, load_s: float, load_source: str
                     ) -> dict[str, dict[str, Any]]:
    """The ``cold_start`` workload's figures: process start to first token, and the engine's load."""
    return {"cold_start": figure(timings["process_start_to_first_token_s"], "s", "lower", WALL_COLD_START),
            load_name: figure(load_s, "s", "lower", load_source)}


def user_command_notes(environ: dict[str, str] | None = None) -> list[str]:
    """A user_command arm sets no variable; name those it inherited from the harness's own
    environment that change what vLLM or PyTorch do (the evidence directory aside)."""
    from vllm_omni_edge_bench.harness.grid import EVIDENCE_ENV
    from vllm_omni_edge_bench.harness.provenance import relevant_env

    inherited = [name for name in relevant_env(environ) if name != EVIDENCE_ENV]
    return [f"inherited from the harness's environment: {', '.join(inherited)}"] if inherited else []


def run_workloads(workloads: list[dict[str, Any]], run_one: Callable[[dict[str, Any]], dict[str, Any]],
                  start_up: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each workload's result, in order; ``cold_start`` reports the pass's start-up figures."""
    results = []
    for workload in workloads:
        result = run_one(workload)
        if workload["kind"] == "cold_start":
            result["figures"] = start_up
        results.append(result)
    return results


def timed_workload(workload: dict[str, Any], generate: Callable[..., dict[str, Any]],
                   problems: list[str]) -> tuple[list[dict], dict[str, dict], dict | None]:
    """Run a decode / prefill / ttft workload: (requests, figures, the full decode request)."""
    kind, label = workload["kind"], workload["label"]
    requests, figures, full = [], {}, None
    if workload.get("warmup"):
        # Same prompt length; a few generated tokens exercise the decode shapes already.
        gen = min(workload.get("gen_tokens", 1), WARMUP_GEN_TOKENS)
        requests.append(generate(workload["prompt_tokens"], gen, f"{label} warm-up"))
    if kind == "decode":
        n_prompt, n_gen = workload["prompt_tokens"], workload["gen_tokens"]
        with pass_events.timed_request():
            full = generate(n_prompt, n_gen, f"{label} decode")
        with pass_events.timed_request():
            one = generate(n_prompt, 1, f"{label} prompt only")
        requests += [full, one]
        decode_seconds = full["seconds"] - one["seconds"]
        if decode_seconds <= 0:
            problems.append(f"{label}: {n_gen} tokens took no longer than 1 ({decode_seconds:.4f} s)")
        else:
            figures[label] = figure((full["gen_tokens"] - 1) / decode_seconds, "tok/s", "higher", WALL_DECODE)
    elif kind in ("prefill", "ttft"):
        with pass_events.timed_request():
            one = generate(workload["prompt_tokens"], 1, label)
        requests.append(one)
        if kind == "prefill":
            figures[label] = figure(one["prompt_tokens"] / one["seconds"], "tok/s", "higher", WALL_ONE_TOKEN)
        else:
            figures[label] = figure(one["seconds"] * 1000, "ms", "lower", WALL_ONE_TOKEN)
    else:
        raise ValueError(f"{kind!r} is not a timed workload")
    return requests, figures, full


def pass_main(run_pass: Callable[[dict], dict], description: str, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--spec", required=True, type=Path, help="pass spec written by the runner")
    parser.add_argument("--out", required=True, type=Path, help="where to write the result JSON")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    pass_events.gate_timed_requests(spec)
    result = run_pass(spec)
    result.setdefault("problems", []).extend(pass_events.gate_problems)
    tmp = args.out.with_suffix(".partial")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    tmp.replace(args.out)  # a result file exists only if it is complete
    # The engine is shut down by run_pass. Leave without C++ static destructors: vLLM 0.30's
    # front end aborted in about 1 exit in 3 with "terminate called without an active
    # exception" after complete passes (2026-11-30-cpu-int4-default; the fidelity-bound test
    # on 2026-12-01, 2 of 6 runs), after every process had shut down cleanly; cause not
    # found (not reproduced under gdb). A crash before this point still fails the pass.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit("run a pass module (pass_vllm, pass_llamacpp, pass_vllm_server), not this one")
