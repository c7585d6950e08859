"""The router: table loading, ranking per phase, the generated table, and the kernel order it sets."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_omni_edge.routing import generate, weight_path
from vllm_omni_edge.routing.weight_path import Row, decide


def row(cpu_class, phase, path, ms, status="measured"):
    return Row(cpu_class, phase, path, status, ms, ms, ms, "artifact.json" if status == "measured" else "why")


def test_decode_ranking_picks_the_kernel_and_prefill_is_reported_separately():
    rows = (row("x86-avx2", "decode", "int4pack", 40.0), row("x86-avx2", "decode", "dequant", 900.0),
            row("x86-avx2", "decode", "dense", 30.0),
            row("x86-avx2", "prefill", "dense", 1000.0), row("x86-avx2", "prefill", "int4pack", 3000.0))
    d = decide("x86-avx2", rows)
    # The dense copy is a second layout, not a kernel: never the layer's kernel.
    assert d.decode_order == ("int4pack", "dequant") and d.status == "measured"
    assert d.prefill_order == ("dense", "int4pack")
    assert "3.00x faster on dense" in d.prefill_note and "LAYOUTS=two" in d.prefill_note


def spread(cpu_class, phase, path, median, low, high):
    return Row(cpu_class, phase, path, "measured", median, low, high, "artifact.json")


def test_decode_ties_within_the_spread_go_by_prefill():
    # avx2_w4a8 has the best decode median, but rows16's range overlaps it: a tie that
    # rows16's 2.7x faster prefill breaks. int4pack's best pass is slower than the
    # fastest's worst: not tied, it stays behind.
    rows = (spread("x86-amx", "decode", "avx2_w4a8", 11.1, 9.4, 12.4),
            spread("x86-amx", "decode", "avx512_w4a8_rows16", 12.3, 9.5, 12.8),
            spread("x86-amx", "decode", "int4pack", 16.0, 14.3, 16.0),
            spread("x86-amx", "prefill", "avx512_w4a8_rows16", 854.0, 673.0, 1143.0),
            spread("x86-amx", "prefill", "int4pack", 2195.0, 2074.0, 2444.0),
            spread("x86-amx", "prefill", "avx2_w4a8", 2536.0, 2410.0, 3672.0))
    assert decide("x86-amx", rows).decode_order == ("avx512_w4a8_rows16", "avx2_w4a8", "int4pack")
    # Without the overlap the decode median decides, whatever prefill says.
    apart = (spread("x86-amx", "decode", "avx2_w4a8", 11.1, 10.9, 11.3),
             spread("x86-amx", "decode", "avx512_w4a8_rows16", 12.3, 11.8, 12.8)) + rows[2:]
    assert decide("x86-amx", apart).decode_order == ("avx2_w4a8", "avx512_w4a8_rows16", "int4pack")


def test_measured_rows_outrank_assumed_ones_and_unknown_classes_get_the_any_cpu_row():
    rows = (row("x86-amx", "decode", "amx_w4a8", None, "assumed"), row("x86-amx", "decode", "int4pack", 5.0),
            row("other", "decode", "dequant", None, "assumed"))
    assert decide("x86-amx", rows).decode_order == ("int4pack",)
    d = decide("riscv", rows)
    assert d.decode_order == ("dequant",) and d.status == "assumed"


def test_generated_table_keeps_the_newest_artifact_and_fills_unmeasured_classes(tmp_path):
    def artifact(name, started, int4pack_ms):
        path = tmp_path / name
        path.write_text(json.dumps({
            "provenance": {"started": started}, "model": "default", "cpu_class": "x86-avx2",
            "result": {"threads": 1, "summary": {
                "decode": {"int4pack": {"median_ms": int4pack_ms, "min_ms": 1, "max_ms": 2, "passes_ms": [1, 2, 3]},
                           "dequant": {"median_ms": 500.0, "min_ms": 1, "max_ms": 2, "passes_ms": [1, 2, 3]}}}},
        }))
        return path

    table = generate.build_table([artifact("new.json", "2026-11-30T12:00", 10.0),
                                  artifact("old.json", "2026-11-29T12:00", 99.0)])
    mine = [r for r in table["rows"] if r["cpu_class"] == "x86-avx2"]
    assert {r["path"]: r["median_ms"] for r in mine} == {"int4pack": 10.0, "dequant": 500.0}
    assert all(r["status"] == "measured" and "new.json" in r["source"] for r in mine)
    amx = [r for r in table["rows"] if r["cpu_class"] == "x86-amx"]
    assert amx and all(r["status"] == "assumed" and "field-notes" in r["source"] for r in amx)
    rows = tuple(Row(**r) for r in table["rows"])
    assert decide("x86-avx2", rows).decode_order == ("int4pack", "dequant")


def test_newest_artifact_replaces_a_phase_whole_and_subsets_are_refused(tmp_path):
    def artifact(name, started, decode, complete=True):
        path = tmp_path / name
        path.write_text(json.dumps({
            "provenance": {"started": started}, "model": "default", "cpu_class": "x86-avx2", "complete": complete,
            "result": {"threads": 1, "summary": {"decode": {
                p: {"median_ms": ms, "min_ms": ms, "max_ms": ms, "passes_ms": [ms] * 3} for p, ms in decode.items()}}},
        }))
        return path

    old = artifact("old.json", "2026-11-29T12:00", {"int4pack": 20.0, "dequant": 500.0})
    new = artifact("new.json", "2026-11-30T12:00", {"int4pack": 25.0, "avx2_w4a8": 8.0})
    mine = [r for r in generate.build_table([old, new])["rows"] if r["cpu_class"] == "x86-avx2"]
    # The old run's dequant time is not ranked against the new run's times.
    assert {r["path"]: r["median_ms"] for r in mine} == {"int4pack": 25.0, "avx2_w4a8": 8.0}
    subset = artifact("subset.json", "2026-12-01T12:00", {"avx2_w4a8": 7.0}, complete=False)
    with pytest.raises(generate.IncompleteArtifactError, match="subset"):
        generate.build_table([old, subset])


def test_a_broken_table_is_a_clear_error(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    with pytest.raises(weight_path.RoutingTableError, match="unreadable"):
        weight_path.load_table(bad)


def test_shipped_table_is_generated_from_committed_artifacts():
    from pathlib import Path

    table = json.loads(weight_path.TABLE_PATH.read_text())
    assert table["generated_by"].startswith("python -m vllm_omni_edge.routing.generate")
    root = Path(generate.__file__).resolve().parents[2]
    for r in table["rows"]:
        if r["status"] == "measured":
            relative = r["source"].split(" (")[0]
            assert not relative.startswith("/"), f"{relative}: not an artifact in the repository"
            artifact = root / relative
            assert artifact.is_file(), f"{r['source']} is not a committed artifact"


def test_choose_kernel_follows_the_router_order(monkeypatch):
    from vllm_omni_edge.quantization import kernels
    from vllm_omni_edge.quantization.kernels import CpuFeatures, choose_kernel

    features = CpuFeatures(capability="AVX2", amx=False, vllm_w4a8_op=False)
    monkeypatch.setattr(kernels, "routed_order", lambda _features: ("dequant", "int4pack"))
    monkeypatch.setattr(kernels, "route_summary", lambda _features: "test route")
    chosen, reason = choose_kernel(features, 32, 256, 64, torch.bfloat16, float_zero=True)
    assert chosen.name == "dequant" and "router: test route" in reason
    monkeypatch.setattr(kernels, "routed_order", lambda _features: ("int4pack", "dequant"))
    assert choose_kernel(features, 32, 256, 64, torch.bfloat16, float_zero=True)[0].name == "int4pack"


def test_the_route_follows_the_features_class_not_only_this_machine():
    from vllm_omni_edge.cpu_features import CpuFeatures
    from vllm_omni_edge.routing.cpu_classes import routing_class

    assert routing_class(CpuFeatures("AVX512", amx=True, vllm_w4a8_op=True)) == "x86-amx"
    assert routing_class(CpuFeatures("AVX2", amx=False, vllm_w4a8_op=False)) == "x86-avx2"
    assert routing_class(CpuFeatures("DEFAULT", amx=False, vllm_w4a8_op=False)) == "other"


def test_the_table_ranks_only_paths_the_plugin_has():
    from vllm_omni_edge.quantization.kernels import KERNELS

    assert set(weight_path.PATHS) == set(KERNELS) | {weight_path.DENSE}
    assert {r.path for r in weight_path.load_table()} <= set(weight_path.PATHS)


def test_paths_an_artifact_timed_that_no_longer_exist_are_left_out(tmp_path):
    path = tmp_path / "a.json"
    times = {"median_ms": 1.0, "min_ms": 1.0, "max_ms": 1.0, "passes_ms": [1.0] * 3}
    path.write_text(json.dumps({
        "provenance": {"started": "2026-11-30T12:00"}, "model": "default", "cpu_class": "x86-avx2",
        "result": {"threads": 1, "summary": {"decode": {"int4pack": times, "retired_kernel": times}}},
    }))
    assert [r["path"] for r in generate.rows_from_artifact(path)] == ["int4pack"]


def test_shipped_table_is_what_the_generator_makes_from_its_artifacts():
    from pathlib import Path

    shipped = json.loads(weight_path.TABLE_PATH.read_text())
    root = Path(generate.__file__).resolve().parents[2]
    sources = sorted({r["source"].split(" (")[0] for r in shipped["rows"] if r["status"] == "measured"})
    assert generate.build_table([root / s for s in sources]) == shipped


def test_every_cpu_class_has_a_row_measured_or_assumed():
    from vllm_omni_edge.routing.cpu_classes import CPU_CLASSES

    assert set(generate.ASSUMED) == set(CPU_CLASSES)
    assert {r.cpu_class for r in weight_path.load_table()} == set(CPU_CLASSES)
