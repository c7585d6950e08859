"""Start ``llm_probe.py`` with an evidence directory and read back what vLLM did; or run a
probe script of a test's own and read back the JSON it printed."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import vllm_env

PROBE = Path(__file__).with_name("llm_probe.py")
SMALL = {"max_model_len": 512, "kv_cache_memory_bytes": 192 << 20, "enforce_eager": True}


@dataclass
class ProbeRun:
    returncode: int
    text: str | None
    processes: list[dict]
    workers: list[dict]
    log: str


def run_probe(model: Path, evidence: Path, llm_kwargs=None, timeout=600, **env) -> ProbeRun:
    """``llm_kwargs`` update SMALL; a key set to None is left out (vLLM's default)."""
    kwargs = {k: v for k, v in {**SMALL, **(llm_kwargs or {})}.items() if v is not None}
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(model), json.dumps(kwargs)],
        env=vllm_env(VLLM_OMNI_EDGE_EVIDENCE_DIR=str(evidence), **env),
        capture_output=True, text=True, timeout=timeout,
    )
    text = None
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE-RESULT "):
            text = json.loads(line.removeprefix("PROBE-RESULT "))["text"]
    load = lambda pattern: [json.loads(p.read_text()) for p in sorted(evidence.glob(pattern))]  # noqa: E731
    return ProbeRun(proc.returncode, text, load("process-*.json"), load("worker-*.json"),
                    proc.stdout[-4000:] + proc.stderr[-8000:])


def run_script_probe(code: str, *args: str, timeout: int = 900, **env: str) -> dict:
    """Run ``code`` (Python that prints one ``PROBE-RESULT <json>`` line) in a fresh interpreter with
    ``args`` as its argv and ``env`` added; the printed JSON. Fails the test with the child's stderr
    if it printed none."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=vllm_env(**env))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("PROBE-RESULT "))
