"""A stand-in for pass_vllm with the same contract, so the runner can be tested in seconds.

It reads the spec, spawns a "worker" child holding some anonymous memory, writes
evidence like the plugin does, emits the phase events and writes a result. The
arm's llm_kwargs choose its behaviour:

    fake: ok | crash | hang | no_result | orphan | short_tokens
    tok_s: [v1, v2, v3]        decode figure of pass 1, 2, 3
    worker_mib: 32             anonymous memory the worker touches
    evidence: true             write process-/worker-<pid>.json
    timed_s: 0.5               a "timed request" of this long inside the workloads, through
                               pass_events.timed_request (events timed_start / timed_end)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vllm_omni_edge_bench.harness import pass_events
from vllm_omni_edge_bench.harness.pass_common import user_command_notes
from vllm_omni_edge_bench.harness.pass_vllm import llm_arguments, llm_command

BLOCK_ROUNDING = 0.996  # a KV budget is allocated in whole blocks, slightly under the request


def worker(mib: int, stay_after_parent: bool) -> None:
    held = bytearray(mib << 20)
    for i in range(0, len(held), 4096):  # touch every page so it is resident
        held[i] = 1
    print("resident", flush=True)  # the fake pass waits for this, as vLLM waits for its workers
    parent = os.getppid()
    while stay_after_parent or os.getppid() == parent:
        time.sleep(0.05)


def write_evidence(directory: Path, worker_pid: int, kwargs: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    records = {
        f"process-{os.getpid()}.json": {"pid": os.getpid(), "ppid": os.getppid(), "role": "frontend", "patches": {}},
        f"process-{worker_pid}.json": {"pid": worker_pid, "ppid": os.getpid(), "role": "VllmWorker-0", "patches": {}},
        f"worker-{worker_pid}.json": {
            "pid": worker_pid,
            "kv_cache_bytes": int(kwargs.get("kv_cache_memory_bytes", 0) * BLOCK_ROUNDING),
            "kv_num_blocks": 68,
            "rope": [{"max_position": 8192, "rows": 8192, "bytes": 1 << 20, "dtype": "bfloat16"}],
            "weights_bytes_by_dtype": {"bfloat16": 270078592},
            "amx_tiles": False,
            "compiled": not kwargs.get("enforce_eager", False),
            "torch_version": "fake",
            "vllm_version": "fake",
        },
    }
    for name, record in records.items():
        (directory / name).write_text(json.dumps(record))


def run(spec: dict, out: Path) -> int:
    kwargs = spec["llm_kwargs"]
    mode = kwargs.get("fake", "ok")
    events = spec["events_path"]
    pass_events.emit(events, pass_events.STARTED)
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.harness.fake_pass", "--worker", str(kwargs.get("worker_mib", 32)),
         "--stay" if mode == "orphan" else "--no-stay", "VLLM::Worker"],
        stdout=subprocess.PIPE, text=True,
    )
    # The worker's memory is resident before "loading" ends, however slow the box is to start
    # a Python process: the steady window must not see the worker still touching its pages.
    if child.stdout.readline().strip() != "resident":
        print(f"RuntimeError: worker died with {child.wait()} before its memory was resident", flush=True)
        return 1
    time.sleep(0.4)  # "loading": long enough for a few ledger samples
    if kwargs.get("evidence", True):
        write_evidence(Path(os.environ["VLLM_OMNI_EDGE_EVIDENCE_DIR"]), child.pid, kwargs)
    pass_events.emit(events, pass_events.ENGINE_READY)
    pass_events.emit(events, pass_events.FIRST_TOKEN)
    if mode == "crash":
        child.kill()
        print("RuntimeError: fake engine died", flush=True)
        return 3
    if mode == "hang":
        time.sleep(3600)
    time.sleep(0.4)  # "workloads": steady state
    if kwargs.get("timed_s"):
        pass_events.gate_timed_requests(spec)
        with pass_events.timed_request():
            pass_events.emit(events, "timed_start")
            time.sleep(kwargs["timed_s"])
            pass_events.emit(events, "timed_end")
        time.sleep(0.2)
    if child.poll() is not None:  # like vLLM's executor, notice a dead worker
        print(f"RuntimeError: worker died with {child.returncode}", flush=True)
        return 1
    pass_events.emit(events, pass_events.WORKLOADS_DONE)
    if mode == "no_result":
        return 0
    tok_s = kwargs.get("tok_s", [10.0, 10.0, 10.0])[spec["pass_index"] - 1]
    problems = ["tg16 decode: asked for 16+16 tokens, got 16+9 (stop)"] if mode == "short_tokens" else []
    result = {
        "engine": "fake",
        "arm": spec["arm"],
        "pass_index": spec["pass_index"],
        "versions": {"cpu_capability": "FAKE"},
        "frontend_config": {"enforce_eager": kwargs.get("enforce_eager")},
        "command": llm_command(llm_arguments(spec)),
        "notes": user_command_notes(dict(os.environ)) if spec.get("user_command") else [],
        "workloads": [
            {"kind": "decode", "label": "tg16", "params": {},
             "figures": {"tg16": {"value": tok_s, "unit": "tok/s", "better": "higher", "source": "fake"}}},
        ],
        "problems": problems,
    }
    out.write_text(json.dumps(result))
    if mode != "orphan":
        child.terminate()
        child.wait()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", type=int, help="run as the fake worker holding this many MiB")
    parser.add_argument("--stay", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("title", nargs="?")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.stay)
        return 0
    return run(json.loads(args.spec.read_text()), args.out)


if __name__ == "__main__":
    sys.exit(main())
