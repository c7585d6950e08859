"""decode_profile on real vLLM: a short profile of the default model in the default 3-process layout.

About 2 minutes on a 2-core box (one vLLM start, a few seconds of sampling); run with -m e2e.
"""

from __future__ import annotations

import json

import pytest

from vllm_omni_edge_bench.harness import decode_profile
from vllm_omni_edge_bench.harness.stack_categories import FORWARD_CATEGORIES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_a_real_decode_profile_attributes_every_sample(tmp_path, default_model):
    out = tmp_path / "profile"
    code = decode_profile.main(["--model", str(default_model), "--layout", "three", "--duration", "8",
                                "--settle", "3", "--rate", "50", "--gen-tokens", "64", "--out", str(out)])
    assert code == 0
    for name in ("decode_profile.json", "decode_profile.md", "pyspy.raw.gz"):
        assert (out / name).stat().st_size > 0, name
    record = json.loads((out / "decode_profile.json").read_text())
    assert record["problems"] == []
    window = record["window"]
    assert window["tokens"] >= decode_profile.MIN_WINDOW_TOKENS and window["ms_per_token"] > 0
    processes = {p["role"]: p for p in record["profile"]["processes"]}
    # py-spy followed the whole tree: the caller, the engine core and the worker that holds the model.
    assert {"frontend", "engine_core", "worker"} <= set(processes)
    for process in record["profile"]["processes"]:
        for thread in process["threads"]:
            # Every sample lands in exactly one category, and a thread's column adds up to the token.
            assert sum(thread["samples_by_category"].values()) == thread["samples"]
            assert sum(thread["ms_per_token"].values()) == pytest.approx(window["ms_per_token"])
    worker = next(t for t in processes["worker"]["threads"] if t["main"])
    counts = worker["samples_by_category"]
    assert counts.get("linear", 0) > 0, counts
    assert sum(counts.get(c, 0) for c in FORWARD_CATEGORIES) > 0.2 * worker["busy_samples"], counts
    # The rules know the worker's busy stacks: little is left unattributed.
    assert counts.get("other", 0) < 0.1 * worker["busy_samples"], record["unmatched"]
    # The worker's evidence is in the artifact: the samples came from the run that loaded this model.
    assert record["evidence"]["workers"], record["evidence"]
