"""One pass of a speech-server arm: ``vllm-omni-edge serve MODEL``, the user's literal command, as a child.

    python -m vllm_omni_edge_bench.harness.pass_speech_server --spec spec.json --out result.json

The server is started exactly as a user types it (plus ``--port P``): the venv's
``vllm-omni-edge`` script, ``serve``, the embedded model's name, no other flag and no variable
of the harness's own (an inherited ``VLLM_*``/``OMP_*`` is named in ``result.notes``). The pass
waits for ``/health``, asks ``/v1/models`` for the served name, sends one transcription (its
answer is the ``first_token`` event), then runs the speech workload (speech.py) through the
openai client's ``audio.transcriptions.create`` (multipart ``file``, ``language``,
``temperature`` 0, ``response_format`` json), one client per stream thread. The WAV bytes are
read before any clock starts.

As in pass_vllm_server, this process is only a client: it writes evidence naming itself
``harness_client`` (out of the tree totals) and never imports vllm; the server's processes write
their own evidence. A server that exits before it is stopped makes the pass crash.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from vllm_omni_edge_bench.harness import pass_events
from vllm_omni_edge_bench.harness.pass_common import pass_main, run_workloads, start_up_figures, user_command_notes
from vllm_omni_edge_bench.harness.pass_vllm_server import (READY_TIMEOUT_S, STOP_GRACE_S, ServerDied, _served_model,
                                                          _versions, shell_command, write_client_evidence)

SERVER_READY_SOURCE = "wall clock: server process spawned to /health answering 200"


def server_argv_prefix() -> list[str]:
    """The console script a user of this venv types: ``vllm-omni-edge serve``."""
    return [str(Path(sys.executable).with_name("vllm-omni-edge")), "serve"]


class TranscriptionClient:
    """openai clients, one per thread, against one server."""

    def __init__(self, base_url: str, model: str, language: str, timeout_s: float):
        self.base_url, self.model, self.language, self.timeout_s = base_url, model, language, timeout_s
        self._local = threading.local()

    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            from openai import OpenAI

            client = OpenAI(base_url=self.base_url + "/v1", api_key="EMPTY", timeout=self.timeout_s, max_retries=0)
            self._local.client = client
        return client

    def transcribe(self, name: str, data: bytes) -> str:
        result = self._client().audio.transcriptions.create(
            model=self.model, file=(name, data, "audio/wav"), language=self.language, temperature=0.0,
            response_format="json")
        return result.text.strip()


def run_pass(spec: dict[str, Any]) -> dict[str, Any]:
    import psutil

    from vllm_omni_edge.cli.demo import ServerProcess, free_port
    from vllm_omni_edge_bench.harness import speech

    events = spec["events_path"]
    pass_events.emit(events, pass_events.STARTED)
    process_start = psutil.Process().create_time()
    write_client_evidence()
    speech_workloads = [w for w in spec["workloads"] if w["kind"] == "speech"]
    languages = {w["language"] for w in speech_workloads} or {"en"}
    if len(languages) > 1:
        raise ValueError(f"speech workloads of one grid ask for different languages: {sorted(languages)}")
    data: dict[str, bytes] = {}
    for workload in speech_workloads:
        for clip in speech.load_clips(workload["fixtures"]):
            data[str(clip.path)] = clip.path.read_bytes()
    timeout_s = max((w["request_timeout_s"] for w in speech_workloads), default=300.0)

    environ = dict(os.environ)
    pass_dir = Path(events).parent
    spawn = time.time()
    server = ServerProcess(spec["model_name"], free_port(), [], pass_dir / "server.log", env=environ,
                           argv_prefix=server_argv_prefix())
    died = None
    try:
        try:
            ready_s = server.wait_ready(READY_TIMEOUT_S)
        except RuntimeError:
            print(f"server log tail:\n{server.log_tail(40)}", flush=True)
            raise
        pass_events.emit(events, pass_events.ENGINE_READY)
        models = _served_model(server.base_url, spec["model_name"])
        client = TranscriptionClient(server.base_url, models.get("id", spec["model_name"]), languages.pop(), timeout_s)
        first_path = next(iter(data), None)
        first_start = time.perf_counter()
        first_text = client.transcribe(Path(first_path).name, data[first_path]) if first_path else None
        first_s = time.perf_counter() - first_start
        first_t = pass_events.emit(events, pass_events.FIRST_TOKEN)
        timings = {"process_start_to_first_result_s": first_t - process_start, "server_spawn_to_ready_s": ready_s,
                   "server_spawn_to_first_result_s": first_t - spawn, "first_request_s": first_s}
        problems: list[str] = []

        def run_one(workload: dict[str, Any]) -> dict[str, Any]:
            if workload["kind"] == "cold_start":
                return {"kind": "cold_start", "label": workload["label"], "params": workload, "figures": {},
                        "requests": []}
            if workload["kind"] != "speech":
                raise NotImplementedError(f"workload {workload['kind']!r} is not implemented for speech-server passes")
            result, bad = speech.run_workload(
                workload, lambda clip: client.transcribe(clip.path.name, data[str(clip.path)]))
            problems.extend(bad)
            code = server.proc.poll()
            if code is not None:
                raise ServerDied(f"the server died during the pass (exit code {code}); log {server.log_path}")
            return result

        start_up = start_up_figures({"process_start_to_first_token_s": timings["process_start_to_first_result_s"]},
                                    "server ready", ready_s, SERVER_READY_SOURCE)
        workloads = run_workloads(spec["workloads"], run_one, start_up)
        pass_events.emit(events, pass_events.WORKLOADS_DONE)
    finally:
        died = server.proc.poll()
        stopped_code = server.stop(STOP_GRACE_S)
    if died is not None:
        raise ServerDied(f"the server died during the pass (exit code {died}); log {server.log_path}")
    return {
        "engine": "speech-server",
        "arm": spec["arm"],
        "pass_index": spec["pass_index"],
        "pid": os.getpid(),
        "model": spec["model"],
        "command": shell_command(server.proc.args),
        "notes": user_command_notes(environ),
        "server": {"argv": server.proc.args, "served_model": models, "pid": server.proc.pid,
                   "exit_code_after_stop": stopped_code, "log": str(server.log_path)},
        "versions": _versions(),
        "timings": timings,
        "first_request": {"seconds": first_s, "text": first_text},
        "workloads": workloads,
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    return pass_main(run_pass, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
