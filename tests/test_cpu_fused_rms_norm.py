"""The fused CPU RMSNorm lever: vLLM's ``_C`` kernels behind the IR ops, eager only."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm_omni_edge.patches.worker import cpu_fused_rms_norm as patch

HIDDEN = 576  # SmolLM2-135M
EPS = 1e-5


@pytest.fixture(scope="module")
def ir():
    from vllm import ir
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "rms_norm"):
        pytest.skip("this vLLM build's _C has no rms_norm kernel")
    patch.register_impls()
    return ir


def _config(mode_name: str):
    from vllm.config.compilation import CompilationMode

    return SimpleNamespace(compilation_config=SimpleNamespace(mode=getattr(CompilationMode, mode_name)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm_matches_native(ir, dtype, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, HIDDEN, dtype=dtype) * 3
    weight = torch.randn(HIDDEN, dtype=dtype)
    x_before = x.clone()
    native = ir.ops.rms_norm.impls["native"].impl_fn(x, weight, EPS)
    fused = ir.ops.rms_norm.impls[patch.PROVIDER].impl_fn(x, weight, EPS)
    torch.testing.assert_close(fused, native, **ir.ops.rms_norm.get_tolerance(dtype))
    assert torch.equal(x, x_before), "rms_norm must not write its input"
    assert fused.shape == x.shape and fused.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_without_weight_matches_native(ir, dtype):
    x = torch.randn(7, HIDDEN, dtype=dtype)
    native = ir.ops.rms_norm.impls["native"].impl_fn(x, None, EPS)
    fused = ir.ops.rms_norm.impls[patch.PROVIDER].impl_fn(x, None, EPS)
    torch.testing.assert_close(fused, native, **ir.ops.rms_norm.get_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7])
def test_fused_add_rms_norm_matches_native_in_place(ir, dtype, rows):
    """Same returned tensors as native, and the inputs updated in place as vLLM's vllm_c does:
    x holds the normed output, x_residual the sum."""
    torch.manual_seed(10 + rows)
    x = torch.randn(rows, HIDDEN, dtype=dtype)
    residual = torch.randn(rows, HIDDEN, dtype=dtype)
    weight = torch.randn(HIDDEN, dtype=dtype)
    native_out, native_residual = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(
        x.clone(), residual.clone(), weight, EPS)

    impl = ir.ops.fused_add_rms_norm.impls[patch.PROVIDER]
    assert impl.inplace
    out, new_residual = impl.impl_fn(x, residual, weight, EPS)
    tol = ir.ops.fused_add_rms_norm.get_tolerance(dtype)
    torch.testing.assert_close(out, native_out, **tol)
    torch.testing.assert_close(new_residual, native_residual, **tol)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()

    # The functional path (what the default IR overload uses) leaves the inputs alone.
    x2, residual2 = torch.randn(rows, HIDDEN, dtype=dtype), torch.randn(rows, HIDDEN, dtype=dtype)
    before = (x2.clone(), residual2.clone())
    impl.func_impl_fn(x2, residual2, weight, EPS)
    assert torch.equal(x2, before[0]) and torch.equal(residual2, before[1])


def test_strided_or_mismatched_inputs_go_to_native(ir):
    """The CPU kernel reads dense rows: a strided view would give wrong numbers, so refuse it."""
    weight = torch.randn(HIDDEN, dtype=torch.bfloat16)
    wide = torch.randn(7, 2 * HIDDEN, dtype=torch.bfloat16)
    strided = wide[:, :HIDDEN]
    dense = strided.contiguous()
    rms, fadd = ir.ops.rms_norm, ir.ops.fused_add_rms_norm
    with rms.set_priority([patch.PROVIDER, "native"]), fadd.set_priority([patch.PROVIDER, "native"]):
        assert rms.dispatch(dense, weight, EPS).provider == patch.PROVIDER
        assert rms.dispatch(strided, weight, EPS).provider == "native"
        assert rms.dispatch(dense, weight, EPS, HIDDEN // 2).provider == "native"
        assert rms.dispatch(dense, weight.float(), EPS).provider == "native"
        assert fadd.dispatch(dense, dense.clone(), weight, EPS).provider == patch.PROVIDER
        assert fadd.dispatch(dense, strided, weight, EPS).provider == "native"
        assert fadd.dispatch(strided, dense, weight, EPS).provider == "native"
        # Through the public op the strided input still gets the right answer.
        torch.testing.assert_close(
            rms(strided, weight, EPS), rms.impls["native"].impl_fn(dense, weight, EPS),
            **rms.get_tolerance(torch.bfloat16))


def test_dispatch_counts_calls(ir):
    before = patch.calls["rms_norm"]
    x, weight = torch.randn(1, HIDDEN), torch.randn(HIDDEN)
    with ir.ops.rms_norm.set_priority([patch.PROVIDER, "native"]):
        ir.ops.rms_norm(x, weight, EPS)
    assert patch.calls["rms_norm"] == before + 1


def test_priority_prefers_edge_impl_only_when_eager(ir):
    from vllm.config.kernel import IrOpPriorityConfig

    eager = patch.prefer_edge_impls(IrOpPriorityConfig.with_default(["native"]), _config("NONE"))
    assert eager.rms_norm == [patch.PROVIDER, "native"]
    assert eager.fused_add_rms_norm == [patch.PROVIDER, "native"]
    assert eager.gelu_and_mul_sparse == ["native"]
    compiled = patch.prefer_edge_impls(IrOpPriorityConfig.with_default(["native"]), _config("DYNAMO_TRACE_ONCE"))
    assert compiled.rms_norm == ["native"]


_PRIORITY_PROBE = """
import json, sys
from types import SimpleNamespace
from vllm.config.compilation import CompilationMode
from vllm_omni_edge.patches.base import apply_patch_module
from vllm.platforms.cpu import CpuPlatform
from vllm import ir
outcome = apply_patch_module("vllm_omni_edge.patches.worker.cpu_fused_rms_norm")
cfg = SimpleNamespace(compilation_config=SimpleNamespace(mode=CompilationMode.NONE))
print("RESULT " + json.dumps({"status": outcome.status, "detail": outcome.detail,
    "rms_norm": CpuPlatform.get_default_ir_op_priority(cfg).rms_norm,
    "registered": "edge_cpu_c" in ir.ops.rms_norm.impls}))
"""


@pytest.mark.parametrize("flag, expected", [("0", ["native"]), ("1", ["edge_cpu_c", "native"])])
def test_flag_switches_cpu_platform_priority(flag, expected):
    """Fresh interpreter per flag value: the patch applies once per process."""
    from tests.conftest import vllm_env

    proc = subprocess.run([sys.executable, "-c", _PRIORITY_PROBE], capture_output=True, text=True,
                          timeout=300, env=vllm_env(VLLM_OMNI_EDGE_FUSED_RMS_NORM=flag))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["status"] == "applied", result
    assert result["rms_norm"] == expected
    assert result["registered"] is (flag == "1")


def test_bad_flag_value_is_named():
    from vllm_omni_edge.levers import LeverFlagError, fused_rms_norm_enabled

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_OMNI_EDGE_FUSED_RMS_NORM", raising=False)
        assert not fused_rms_norm_enabled(), "off by default (the kernel truncates the residual)"
        mp.setenv("VLLM_OMNI_EDGE_FUSED_RMS_NORM", "yes")
        with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_FUSED_RMS_NORM"):
            fused_rms_norm_enabled()


@pytest.mark.e2e
@pytest.mark.slow  # two engine loads, ~5 min
def test_default_model_runs_fused_norm_with_same_greedy_text(default_model, tmp_path):
    from tests.e2e.probe import run_probe

    fused = run_probe(default_model, tmp_path / "fused", VLLM_OMNI_EDGE_FUSED_RMS_NORM="1")
    assert fused.returncode == 0 and fused.text, fused.log
    stock = run_probe(default_model, tmp_path / "stock", VLLM_OMNI_EDGE_FUSED_RMS_NORM="0")
    assert stock.returncode == 0 and stock.text, stock.log

    (fused_worker,), (stock_worker,) = fused.workers, stock.workers
    assert fused_worker["rms_norm_impl"] == "edge_cpu_c", fused_worker
    assert fused_worker["fused_add_rms_norm_impl"] == "edge_cpu_c", fused_worker
    assert stock_worker["rms_norm_impl"] == "native", stock_worker
    assert stock_worker["rms_norm_edge_calls"] == {"rms_norm": 0, "fused_add_rms_norm": 0}
    if fused.text != stock.text:
        # Seen on 0.30.0: the CPU kernel rounds the bf16 residual sum toward zero, native
        # to nearest, and the bias over 30 layers flips SmolLM2's greedy answer. This is
        # why the lever is off by default; it needs a KLD fidelity arm, not text equality.
        pytest.xfail(f"greedy text differs: fused {fused.text!r} vs stock {stock.text!r}")
