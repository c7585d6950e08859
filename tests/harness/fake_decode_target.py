"""A stand-in for decode_profile's vLLM target: a two-process tree that "decodes" a token every 10 ms.

    python -m tests.harness.fake_decode_target --target SPEC --target-out JSON

It follows the target's contract (the ``decoding`` event, the stop file, the
result's ``pid`` / ``steps`` / ``requests``) so the orchestration and py-spy can be
tested in seconds. The child loops in ``fake_forward`` (mostly asleep, to keep the box quiet).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

from vllm_omni_edge_bench.harness.decode_profile import DECODING_EVENT, _emit


def fake_forward(stop_path: str, deadline: float) -> None:
    while not os.path.exists(stop_path) and time.time() < deadline:
        sum(i * i for i in range(200))  # a little work, mostly sleep: a light load on a shared box
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--target-out", required=True)
    args = parser.parse_args(argv)
    spec = json.loads(open(args.target).read())
    deadline = time.time() + spec["max_decode_s"]
    child = multiprocessing.get_context("spawn").Process(target=fake_forward, args=(spec["stop_path"], deadline))
    child.start()
    steps, requests = [], []
    _emit(spec["events_path"], DECODING_EVENT, pid=os.getpid())
    while not os.path.exists(spec["stop_path"]) and time.time() < deadline:
        index, start = len(requests), time.time()
        for _ in range(spec["gen_tokens"]):
            time.sleep(0.01)
            steps.append((time.time(), 1, index))
        requests.append({"start": start, "end": time.time(), "gen_tokens": spec["gen_tokens"]})
    child.join()
    result = {"pid": os.getpid(), "warmup": None, "requests": requests, "steps": steps, "stopped_by": "stop file",
              "versions": {"fake": True}}
    with open(args.target_out, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
