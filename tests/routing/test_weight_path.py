"""The router: table loading, ranking per phase, and the kernel order it sets."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_omni_edge.routing import weight_path
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


def test_a_broken_table_is_a_clear_error(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    with pytest.raises(weight_path.RoutingTableError, match="unreadable"):
        weight_path.load_table(bad)


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


def test_every_cpu_class_has_a_row_measured_or_assumed():
    from vllm_omni_edge.routing.cpu_classes import CPU_CLASSES

    from vllm_omni_edge_bench.harness.routing_table import ASSUMED

    assert set(json.loads(ASSUMED.read_text())["classes"]) == set(CPU_CLASSES)
    assert {r.cpu_class for r in weight_path.load_table()} == set(CPU_CLASSES)
