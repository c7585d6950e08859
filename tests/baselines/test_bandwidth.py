"""The bandwidth ceiling: byte counting, array sizing, summaries, decode as a fraction of it."""

from __future__ import annotations

import json

import pytest

from vllm_omni_edge_bench.harness import bandwidth

MIB = 1 << 20


def test_stream_byte_counts():
    assert bandwidth.bytes_moved("copy", 1000) == 8000  # read a, write b
    assert bandwidth.bytes_moved("triad", 1000) == 12000  # read b and c, write a


def test_arrays_are_much_larger_than_the_last_level_cache():
    assert bandwidth.array_bytes_for(32 * MIB) == 256 * MIB
    assert bandwidth.array_bytes_for(None) == bandwidth.MIN_ARRAY_BYTES
    assert bandwidth.array_bytes_for(1 * MIB) == bandwidth.MIN_ARRAY_BYTES


def test_last_level_cache_from_sysfs(tmp_path):
    for index, size in (("index0", "32K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert bandwidth.last_level_cache_bytes(tmp_path) == 32 * MIB
    assert bandwidth.last_level_cache_bytes(tmp_path / "absent") is None


def test_summary_is_median_with_spread_in_gb_per_s():
    summary = bandwidth.summarise_runs(10 * 10**9, [1.0, 2.0, 4.0])
    assert summary["median_gbps"] == 5.0 and summary["min_gbps"] == 2.5 and summary["max_gbps"] == 10.0
    with pytest.raises(ValueError):
        bandwidth.summarise_runs(1, [])


def test_decode_ceiling_and_fraction():
    # 250 MB of weights per token at 10 GB/s: at most 40 tokens/s.
    assert bandwidth.decode_ceiling(250e6, 10.0) == pytest.approx(40.0)
    assert bandwidth.fraction_of_ceiling(30.0, 250e6, 10.0) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        bandwidth.decode_ceiling(0, 10.0)


def test_best_bandwidth_picks_threads_and_kernel():
    artifact = {"threads": {"1": {"copy": {"median_gbps": 8.0}, "triad": {"median_gbps": 9.0}},
                            "2": {"copy": {"median_gbps": 11.0}, "triad": {"median_gbps": 12.0}}}}
    assert bandwidth.best_bandwidth_gbps(artifact) == 11.0
    assert bandwidth.best_bandwidth_gbps(artifact, threads=1, kernel="triad") == 9.0


def test_measure_runs_every_thread_count_on_small_arrays():
    # Tiny arrays: this checks the bookkeeping, not the box (numbers come from the CLI only).
    result = bandwidth.measure(threads=(1, 2), runs=3, array_bytes=1 * MIB)
    assert set(result["threads"]) == {"1", "2"}
    for kernels in result["threads"].values():
        assert set(kernels) == {"copy", "triad"}
        assert all(k["runs"] == 3 and k["min_gbps"] <= k["median_gbps"] <= k["max_gbps"] for k in kernels.values())
    with pytest.raises(ValueError, match="at least 3"):
        bandwidth.measure(runs=2, array_bytes=MIB)


def test_cli_writes_an_artifact_with_provenance(tmp_path):
    out = tmp_path / "bw.json"
    assert bandwidth.main(["--out", str(out), "--threads", "1", "--runs", "3", "--array-mib", "1"]) == 0
    artifact = json.loads(out.read_text())
    assert artifact["array_bytes"] == MIB and "1" in artifact["threads"]
    assert {"started", "git", "cpu", "command"} <= set(artifact["provenance"])
