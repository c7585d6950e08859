import json

import pytest

from vllm_omni_edge_bench.harness.evidence import (
    collect_evidence,
    evidence_problems,
    parse_expectation,
    roles_by_pid,
)
from vllm_omni_edge_bench.harness.sizes import parse_size

# From a real worker: a 192 MiB budget allocated as 68 whole blocks.
WORKER = {
    "pid": 6816,
    "kv_cache_bytes": 200540160,
    "kv_num_blocks": 68,
    "rope": [{"max_position": 8192, "rows": 8192, "bytes": 1048576, "dtype": "bfloat16"}],
    "weights_bytes_by_dtype": {"bfloat16": 270078592},
    "amx_tiles": False,
    "compiled": False,
}


def evidence(*workers, processes=(), unreadable=()):
    return {"dir": "/x/evidence", "workers": list(workers), "processes": list(processes), "unreadable": list(unreadable)}


@pytest.mark.parametrize(
    "text, expected",
    [("192MiB", 201326592), ("192 MiB", 201326592), ("1GiB", 1 << 30), ("4G", 4 << 30), ("1.5KiB", 1536),
     ("2MB", 2_000_000), (4096, 4096), ("512", 512)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["192 furlongs", "MiB", "-1", True, 1.5, "0.3B", "4g", "192m"])
def test_parse_size_refuses(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_exact_size_is_exact():
    assert parse_expectation("kv_cache_bytes", "192MiB").violation(201326592) is None
    assert "200540160" in parse_expectation("kv_cache_bytes", "192MiB").violation(200540160)


def test_approximate_size_accepts_block_rounding_but_not_a_silent_override():
    near = parse_expectation("kv_cache_bytes", "~192MiB")
    assert near.violation(200540160) is None
    # VLLM_CPU_KVCACHE_SPACE=1 silently replaced the budget with 1 GiB.
    assert near.violation(1073479680) is not None


@pytest.mark.parametrize(
    "written, actual, ok",
    [("<=192MiB", 200540160, True), ("<=192MiB", 201326593, False), (">= 1GiB", 1 << 30, True),
     ("<8193", 8192, True), (">8192", 8192, False), ("== AVX2", "AVX2", True), ("bfloat16", "float16", False)],
)
def test_comparisons(written, actual, ok):
    assert (parse_expectation("k", written).violation(actual) is None) is ok


def test_a_flag_is_not_a_count():
    assert parse_expectation("compiled", False).violation(0) is not None
    assert parse_expectation("compiled", False).violation(False) is None
    assert parse_expectation("kv_num_blocks", 1).violation(True) is not None


def test_no_expectations_and_no_evidence_is_fine():
    assert evidence_problems(evidence(), {}) == []


def test_expectations_without_evidence_make_the_pass_invalid():
    problems = evidence_problems(evidence(), {"compiled": False})
    assert len(problems) == 1 and "no worker evidence" in problems[0] and "compiled" in problems[0]


def test_matching_evidence_passes_with_dotted_and_list_keys():
    expect = {"kv_cache_bytes": "~192MiB", "compiled": False, "rope.0.rows": 8192,
              "weights_bytes_by_dtype.bfloat16": ">200MiB"}
    assert evidence_problems(evidence(WORKER), expect) == []


def test_each_mismatch_and_missing_key_is_a_reason():
    problems = evidence_problems(evidence(WORKER), {"rope.0.rows": 512, "compiled": True, "rope.1.rows": 512})
    assert len(problems) == 3
    assert any("rope.0.rows: expected 512, evidence says 8192" in p for p in problems)
    assert any("has no rope.1.rows" in p for p in problems)


def test_every_worker_must_match():
    other = {**WORKER, "pid": 7000, "compiled": True}
    problems = evidence_problems(evidence(WORKER, other), {"compiled": False})
    assert problems == ["worker 7000: compiled: expected False, evidence says True"]


def test_worker_evidence_from_outside_the_tree_is_refused_even_without_expectations():
    assert evidence_problems(evidence(WORKER), {}, tree_pids={1, 2}) != []
    assert evidence_problems(evidence(WORKER), {}, tree_pids={6816}) == []


def test_unreadable_evidence_counts_when_the_arm_expects_something():
    problems = evidence_problems(evidence(WORKER, unreadable=["worker-9.json: bad"]), {"compiled": False})
    assert problems == ["unreadable evidence: worker-9.json: bad"]


def test_collect_reads_the_plugin_files(tmp_path):
    (tmp_path / "process-10.json").write_text(json.dumps({"pid": 10, "ppid": 1, "role": "frontend", "patches": {}}))
    (tmp_path / "process-6816.json").write_text(json.dumps({"pid": 6816, "ppid": 10, "role": "VllmWorker-0"}))
    (tmp_path / "worker-6816.json").write_text(json.dumps(WORKER))
    (tmp_path / "worker-99.json").write_text("{torn")
    collected = collect_evidence(tmp_path)
    assert [w["pid"] for w in collected["workers"]] == [6816]
    assert len(collected["processes"]) == 2
    assert collected["unreadable"][0].startswith("worker-99.json")
    assert roles_by_pid(collected) == {10: "frontend", 6816: "VllmWorker-0"}


def test_collect_from_a_missing_dir_is_empty(tmp_path):
    assert collect_evidence(tmp_path / "nope")["workers"] == []
