"""The runtime floor: what a vLLM process holds before it holds a model.

Each *profile* is a list of import steps that one process role of vLLM performs (the
API server, the engine core, the model worker) or a cumulative prefix of them (bare
Python, + torch, + vLLM, ...). Every profile runs in a fresh interpreter, which does
its steps, then reports ready and waits; this tool reads its ``smaps_rollup``
(PSS, anonymous/file split, USS) and kills it. Profiles run interleaved (A B C, A B C,
...) ``--runs`` times; medians with min-max are reported.

A lone process owns every page it maps, so its PSS equals its RSS. In vLLM's tree the
file-backed pages of the shared libraries (libtorch and friends) are split between
processes; the anonymous part is each process's own. Read ``pss_anon`` as what each
extra process costs, and ``pss_file`` as what the first one costs once.

    python -m vllm_omni_edge_bench.harness.floor --out RESULTS_DIR/floor.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_omni_edge_bench.harness.ledger import parse_smaps_rollup

READY = "floor-ready"
MIB = 1 << 20

# Import steps, cumulative within each profile. The role profiles mirror what each vLLM
# process imports for `vllm serve` on CPU (0.30): the API server, EngineCoreProc, and
# the CPU worker with its model runner. The tokenizer step loads the default model's.
STEPS: dict[str, str] = {
    "torch": "import torch",
    "vllm": "import vllm",
    "api_server": "import vllm.entrypoints.openai.api_server",
    "engine_core": "import vllm.v1.engine.core",
    "cpu_worker": "import vllm.v1.worker.cpu_worker, vllm.v1.worker.cpu_model_runner",
    "vllm_omni": "import vllm_omni",
    "tokenizer": (
        "from transformers import AutoTokenizer; "
        "from vllm_omni_edge.models.default_model import pull_default_model; "
        "_t = AutoTokenizer.from_pretrained(str(pull_default_model()))"
    ),
}
PROFILES: dict[str, list[str]] = {
    "python": [],
    "+torch": ["torch"],
    "+vllm": ["torch", "vllm"],
    "frontend (api_server + tokenizer)": ["torch", "vllm", "api_server", "tokenizer"],
    "engine core": ["torch", "vllm", "engine_core"],
    "worker (cpu_worker + runner)": ["torch", "vllm", "cpu_worker"],
    "+vllm_omni": ["torch", "vllm", "vllm_omni"],
}


def profile_script(steps: list[str]) -> str:
    body = "; ".join(STEPS[s] for s in steps) or "pass"
    return f"{body}\nimport sys, time\nprint({READY!r}, flush=True)\ntime.sleep(600)\n"


def measure_profile(steps: list[str], timeout_s: float = 300.0) -> dict[str, Any]:
    """Start a fresh interpreter that runs ``steps``, read its memory once it is ready, stop it."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", profile_script(steps)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while READY not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"profile {steps} exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            if time.perf_counter() - started > timeout_s:
                raise TimeoutError(f"profile {steps} not ready after {timeout_s} s")
        import_s = time.perf_counter() - started
        time.sleep(0.5)  # let lazily started threads settle
        memory = parse_smaps_rollup(Path(f"/proc/{proc.pid}/smaps_rollup").read_text())
        if memory is None:
            raise RuntimeError(f"profile {steps}: no smaps_rollup for pid {proc.pid}")
        return {**memory, "import_s": import_s}
    finally:
        proc.kill()
        proc.wait()


def summarise(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run(profiles: dict[str, list[str]], runs: int) -> dict[str, Any]:
    samples: dict[str, list[dict]] = {name: [] for name in profiles}
    for _ in range(runs):
        for name, steps in profiles.items():  # interleaved: every profile once per round
            samples[name].append(measure_profile(steps))
    result = {}
    for name, rows in samples.items():
        result[name] = {"steps": profiles[name], "imports": [STEPS[s] for s in profiles[name]],
                        "runs": rows}
        for key in ("pss", "pss_anon", "pss_file", "uss", "import_s"):
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                result[name][key] = summarise(values)
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = ["| process profile | PSS, MiB | of which anon | of which file | import time, s |", "|---|---|---|---|---|"]
    for name, row in result.items():
        def cell(key: str, scale: float = MIB, fmt: str = "{:,.0f}") -> str:
            s = row.get(key)
            if not s:
                return "—"
            return (fmt.format(s["median"] / scale) + " (" + fmt.format(s["min"] / scale) + "–"
                    + fmt.format(s["max"] / scale) + ")")
        lines.append(f"| {name} | {cell('pss')} | {cell('pss_anon')} | {cell('pss_file')} | "
                     f"{cell('import_s', 1, '{:.1f}')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON artifact to write (a .md table goes beside it)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="append", choices=list(PROFILES), help="only these profiles")
    args = parser.parse_args(argv)
    from vllm_omni_edge_bench.harness import provenance
    from vllm_omni_edge.atomic import atomic_write_bytes

    profiles = {k: v for k, v in PROFILES.items() if not args.profile or k in args.profile}
    started = provenance.now_iso()
    load_before = os.getloadavg()
    result = run(profiles, args.runs)
    artifact = {
        "profiles": result,
        "provenance": {"started": started, "finished": provenance.now_iso(), "git": provenance.git_state(),
                       "packages": provenance.package_versions(), "cpu": provenance.cpu_description(),
                       "memory": provenance.memory_description(), "env": provenance.relevant_env(),
                       "load_average_before": load_before, "load_average_after": os.getloadavg(),
                       "command": [sys.executable, "-m", __spec__.name, *(argv if argv is not None else sys.argv[1:])]},
    }
    atomic_write_bytes(args.out, json.dumps(artifact, indent=2, default=str).encode())
    table = markdown(result)
    atomic_write_bytes(args.out.with_suffix(".md"), table.encode())
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
