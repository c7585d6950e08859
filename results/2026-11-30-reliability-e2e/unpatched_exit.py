"""Exit status of `vllm serve` after its worker is SIGKILLed, without the edge exit fix.

Run from the repo root: `.venv/bin/python benchmarks/edge_harness/results/
2026-11-30-reliability-e2e/unpatched_exit.py > unpatched-exit.json`. Uses our `vllm`
console script (vLLM's CLI plus the CLI patches); only `vllm-omni-edge serve` turns the
engine death into exit status 1, so this shows vLLM's own status.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))
from tests.conftest import vllm_env  # noqa: E402
from vllm_omni_edge.cli.demo import free_port  # noqa: E402
from vllm_omni_edge.models.default_model import pull_default_model  # noqa: E402

port = free_port()
work = Path(tempfile.mkdtemp(prefix="unpatched-exit-"))
evidence = work / "evidence"
cmd = [str(REPO / ".venv/bin/vllm"), "serve", str(pull_default_model()), "--host", "127.0.0.1",
       "--port", str(port), "--max-model-len", "512", "--kv-cache-memory-bytes", "192M",
       "--enforce-eager"]
with open(work / "server.log", "wb") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=vllm_env(VLLM_OMNI_EDGE_EVIDENCE_DIR=str(evidence)))
    try:
        start = time.monotonic()
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() - start > 900:
                sys.exit(f"server did not start; log: {work / 'server.log'}")
            time.sleep(1)
        records = [json.loads(p.read_text()) for p in evidence.glob("process-*.json")]
        victim = next(r["pid"] for r in records if r["role"].startswith("VllmWorker"))
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(300)
        print(json.dumps({"command": "vllm serve (our console script, no exit-status fix)",
                          "exit_code": proc.returncode,
                          "seconds_kill_to_exit": round(time.monotonic() - killed, 1)}))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
