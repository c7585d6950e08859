"""The fused gated SiLU MLP op and the patch that routes vLLM's MLPs to it.

The op must compute what the three calls it replaces compute (gate_up on rows16, vLLM's
SiluAndMul, down on rows16) with the same roundings, so the reference is those calls; and
the patch must take only MLPs it can run, leaving every other MLP on vLLM's code.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.quantization.helpers import int4_layer, relative_error
from vllm_omni_edge.patches.worker import fused_silu_mlp as patch
from vllm_omni_edge.quantization.kernels import Avx512VnniRows16W4A8Kernel, CpuFeatures, Int4PackCpuKernel, native
from vllm_omni_edge.quantization.kernels.w4a8_avx512 import silu_mlp

VNNI_OK, VNNI_WHY = Avx512VnniRows16W4A8Kernel.can_implement(
    CpuFeatures.detect(), 32, 64, 16, torch.float32, float_zero=True)
needs_vnni = pytest.mark.skipif(not VNNI_OK, reason=f"avx512_w4a8_rows16 cannot run here: {VNNI_WHY}")


def _rows16(N, K, group_size, act_dtype, seed):
    layer, dense = int4_layer(N, K, group_size, act_dtype, seed)
    kernel = Avx512VnniRows16W4A8Kernel()
    kernel.process_weights(layer)
    layer.int4_kernel = kernel
    layer.bias = None
    return layer, dense


def _mlp(H, I, group_size=32, act_dtype=torch.bfloat16, seed=0):
    gate_up, gate_up_dense = _rows16(2 * I, H, group_size, act_dtype, seed)
    down, down_dense = _rows16(H, I, group_size, act_dtype, seed + 1)
    return gate_up, down, gate_up_dense, down_dense


def _three_calls(gate_up, down, x):
    """What vLLM runs without the patch: two rows16 linears and SiluAndMul (fp32 inside)."""
    kernel = Avx512VnniRows16W4A8Kernel()
    y = kernel.apply(gate_up, x, None)
    i = y.shape[-1] // 2
    h = (torch.nn.functional.silu(y[..., :i].float()) * y[..., i:].float()).to(x.dtype)
    return kernel.apply(down, h, None)


@needs_vnni
@pytest.mark.parametrize("rows", [1, 3, 4, 17])
@pytest.mark.parametrize("H,I,group_size", [(64, 96, 32), (576, 1536, 32), (256, 512, 128)])
def test_op_matches_the_three_calls(rows, H, I, group_size):
    gate_up, down, _, _ = _mlp(H, I, group_size)
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    with torch.inference_mode():
        fused, three = silu_mlp(gate_up, down, x).float(), _three_calls(gate_up, down, x).float()
    assert fused.shape == (rows, H)
    # Same integer products and roundings; only exp differs (polynomial vs libm) by < 1e-6
    # relative, which can move a bf16 rounding of h by one ulp.
    assert relative_error(fused, three) < 2e-3
    assert (fused == three).float().mean() > 0.9


@needs_vnni
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_op_near_the_exact_product(act_dtype):
    gate_up, down, gate_up_dense, down_dense = _mlp(128, 256, act_dtype=act_dtype)
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(7)).to(act_dtype)
    with torch.inference_mode():
        fused = silu_mlp(gate_up, down, x)
    y = x.float() @ gate_up_dense.T
    exact = (torch.nn.functional.silu(y[..., :256]) * y[..., 256:]) @ down_dense.T
    assert fused.shape == (2, 5, 128) and fused.dtype == act_dtype
    assert relative_error(fused, exact) < 0.03  # activation rounding to int8 twice


@needs_vnni
def test_op_refuses_mismatched_weights():
    gate_up, down, _, _ = _mlp(64, 96)
    op = torch.ops.edge_cpu_int4.w4a8_vnni_rows16_silu_mlp
    x = torch.randn(1, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"\(down\).*does not match K=96"):
        op(x, gate_up.qweight, gate_up.scales, gate_up.zeros, 32,
           gate_up.qweight, gate_up.scales, gate_up.zeros, 32)
    with pytest.raises(RuntimeError, match=r"\(gate_up\).*does not match K=32"):
        op(x[:, :32], gate_up.qweight, gate_up.scales, gate_up.zeros, 32, down.qweight, down.scales, down.zeros, 32)


@needs_vnni
def test_fake_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    gate_up, down, _, _ = _mlp(64, 96)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.edge_cpu_int4.w4a8_vnni_rows16_silu_mlp(
            torch.empty(5, 64, dtype=torch.bfloat16), gate_up.qweight, gate_up.scales, gate_up.zeros, 32,
            down.qweight, down.scales, down.zeros, 32)
    assert tuple(out.shape) == (5, 64)


class _Mlp(torch.nn.Module):
    """The shape of vLLM's LlamaMLP / Qwen2MLP: gate_up_proj, act_fn, down_proj."""

    def __init__(self, gate_up, down, act_fn):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up, down, act_fn

    def forward(self, x):  # vLLM's three calls, for the fallback check
        return ("vllm", x)


@pytest.fixture(scope="module")
def silu_and_mul():
    activation = pytest.importorskip("vllm.model_executor.layers.activation")
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # a CustomOp reads the config when built
        return activation.SiluAndMul()


@needs_vnni
def test_eligibility(silu_and_mul):
    gate_up, down, _, _ = _mlp(64, 96)
    assert patch.fusable(_Mlp(gate_up, down, silu_and_mul))
    assert not patch.fusable(_Mlp(gate_up, down, torch.nn.GELU()))  # another activation

    other, _ = int4_layer(64, 96, 32, torch.bfloat16, 3)
    other.int4_kernel, other.bias = Int4PackCpuKernel(), None  # not rows16
    assert not patch.fusable(_Mlp(gate_up, other, silu_and_mul))

    with_bias, _, _, _ = _mlp(64, 96)
    with_bias.bias = torch.zeros(192)
    assert not patch.fusable(_Mlp(with_bias, down, silu_and_mul))

    split, _, _, _ = _mlp(64, 96)
    split.tp_size = 2
    assert not patch.fusable(_Mlp(split, down, silu_and_mul))

    dense, _, _, _ = _mlp(64, 96)
    dense.dense_weight = torch.zeros(192, 64)  # the second layout's prefill copy
    assert not patch.fusable(_Mlp(dense, down, silu_and_mul))


@needs_vnni
def test_patched_forward_fuses_or_falls_back(silu_and_mul):
    class Target(_Mlp):
        pass

    wrap = patch._wrapper_for("Target")
    module = types.SimpleNamespace(Target=Target)
    wrap(module)
    wrap(module)  # idempotent: wrapped once
    assert Target.forward.__edge_wrapped__ and Target.forward.__wrapped__ is _Mlp.forward

    gate_up, down, _, _ = _mlp(64, 96)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        out = Target(gate_up, down, silu_and_mul)(x)
        assert torch.equal(out, silu_mlp(gate_up, down, x))
        assert Target(gate_up, down, torch.nn.GELU())(x)[0] == "vllm"


def test_flag_keeps_vllm_code(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_FUSED_MLP", "0")
    assert patch.apply() == "vLLM's MLP calls kept (flag)"
    monkeypatch.setenv("VLLM_OMNI_EDGE_FUSED_MLP", "maybe")
    from vllm_omni_edge.levers import LeverFlagError

    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_FUSED_MLP"):
        patch.apply()


@needs_vnni
def test_count_for_evidence(silu_and_mul):
    pytest.importorskip("vllm.model_executor.models.llama")
    import vllm.model_executor.models.llama as llama

    patch._wrapper_for("LlamaMLP")(llama)
    gate_up, down, _, _ = _mlp(64, 96)
    mlp = llama.LlamaMLP.__new__(llama.LlamaMLP)
    torch.nn.Module.__init__(mlp)
    mlp.gate_up_proj, mlp.down_proj, mlp.act_fn = gate_up, down, silu_and_mul
    class OwnForward(llama.LlamaMLP):
        def forward(self, x):
            return x

    other = OwnForward.__new__(OwnForward)
    torch.nn.Module.__init__(other)
    other.gate_up_proj, other.down_proj, other.act_fn = gate_up, down, silu_and_mul
    # Neither a module of another class nor a LlamaMLP subclass with its own forward runs ours.
    model = torch.nn.Sequential(mlp, _Mlp(gate_up, down, silu_and_mul), other)
    assert patch.fused_mlp_count(model) == 1
    mlp.act_fn = torch.nn.GELU()
    assert patch.fused_mlp_count(model) == 0
