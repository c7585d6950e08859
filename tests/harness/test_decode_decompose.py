"""decode_decompose: the subtraction it reports, its stubs' output shapes, and its refusals."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_edge_bench.harness import decode_decompose as dd


def _arm(forward, head=0.5, step=6.0):
    return {"forward_ms": forward, "head_ms": head, "step_ms": step, "tok_s": 1000 / step}


def test_parts_are_the_differences_between_arms():
    medians = {"real": _arm(4.4, head=0.55, step=6.0), "attention-stubbed": _arm(3.6),
               "linears-stubbed": _arm(1.35), "both-stubbed": _arm(0.75)}
    parts = dd.derive(medians)
    assert parts["graph's own work"] == pytest.approx(0.75)
    assert parts["attention op"] == pytest.approx(0.60)
    assert parts["linear ops"] == pytest.approx(2.85)
    assert parts["forward, the parts together beyond their sum"] == pytest.approx(4.4 - 0.75 - 0.60 - 2.85)
    assert parts["head (compute_logits)"] == pytest.approx(0.55)
    assert parts["step outside forward and head"] == pytest.approx(6.0 - 4.4 - 0.55)
    # The step is the real arm's, and the parts of the real step add up to it.
    assert parts["step"] == 6.0
    summed = sum(v for k, v in parts.items() if k != "step")
    assert summed == pytest.approx(parts["step"])


@pytest.mark.parametrize("op, args, shape", [
    (("edge_cpu_int4", "w4a8_vnni_rows16_mm"), (torch.zeros(3, 64), torch.zeros(96, 32)), (3, 96)),
    (("edge_cpu_int4", "w4a8_mm"), (torch.zeros(1, 64), torch.zeros(48, 32)), (1, 48)),
    # silu_mlp: x, gate_up (qweight, scales, offsets, group), down qweight is argument 5.
    (("edge_cpu_int4", "w4a8_vnni_rows16_silu_mlp"),
     (torch.zeros(2, 64), torch.zeros(256, 32), None, None, 32, torch.zeros(64, 64)), (2, 64)),
])
def test_a_linear_stub_returns_the_ops_output_shape(op, args, shape):
    assert dd.LINEAR_OPS[op](*args) == shape


def test_the_linear_stub_reuses_one_output_per_shape_and_counts_calls():
    stubs = dd.Stubs.__new__(dd.Stubs)
    stubs.calls, stubs._outputs = dd.Counter(), {}
    stub = stubs._linear_stub("k", dd.LINEAR_OPS[("edge_cpu_int4", "w4a8_vnni_rows16_mm")])
    x, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.uint8)
    first, second = stub(x, w, None, None, 32), stub(x, w, None, None, 32)
    assert first is second and first.shape == (1, 16) and first.dtype == torch.bfloat16
    assert stubs.calls["k"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "2"], "--rounds must be at least 3"),
    (["--gen-tokens", "8"], "--gen-tokens must be at least 16"),
    (["--llm-kwargs", "{nope"], "--llm-kwargs is not JSON"),
    (["--llm-kwargs", '{"model": "x"}'], "without 'model'"),
    (["--model", "/nonexistent/model"], "does not exist"),
])
def test_bad_arguments_are_refused_naming_the_problem(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        dd.main([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
