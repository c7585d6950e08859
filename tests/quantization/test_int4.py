"""The number format: round trip, error bound, packing, and the errors it raises."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_edge.quantization import int4
from vllm_omni_edge.quantization.int4 import Int4FormatError


@pytest.mark.parametrize("group_size", int4.SUPPORTED_GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_within_half_a_step_integer_zero_points(group_size, dtype):
    gen = torch.Generator().manual_seed(group_size)
    # Rows of very different magnitude, so scales span several binades.
    w = (torch.randn(48, 512, generator=gen) * torch.rand(48, 1, generator=gen) * 4).to(dtype)
    qweight, scales, zeros = int4.quantize(w, group_size, zero_point="int")

    assert qweight.shape == (48, 256) and qweight.dtype == torch.uint8
    assert scales.shape == zeros.shape == (48, 512 // group_size)
    assert scales.dtype == int4.SCALE_DTYPE and zeros.dtype == torch.uint8
    assert int(zeros.max()) <= 15 and int(int4.unpack_nibbles(qweight).max()) <= 15

    err = (int4.dequantize(qweight, scales, zeros) - w.float()).abs()
    step = scales.float().repeat_interleave(group_size, dim=1)
    assert bool((err <= 0.5 * step).all()), float((err / step).max())
    rel = float((err.norm() / w.float().norm()))
    assert rel < 0.12  # ~0.08-0.11 for Gaussian weights at these group sizes


@pytest.mark.parametrize("group_size", int4.SUPPORTED_GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_float_offsets_within_half_a_step_plus_offset_rounding(group_size, dtype):
    gen = torch.Generator().manual_seed(group_size + 1)
    w = (torch.randn(48, 512, generator=gen) * torch.rand(48, 1, generator=gen) * 4).to(dtype)
    qweight, scales, offsets = int4.quantize(w, group_size, zero_point="float")
    assert scales.dtype == offsets.dtype == int4.SCALE_DTYPE and offsets.shape == scales.shape

    groups = w.float().reshape(48, -1, group_size)
    rounding = (offsets.float() - groups.amin(-1)).abs()  # the offset's bf16 rounding
    err = (int4.dequantize(qweight, scales, offsets) - w.float()).abs()
    bound = (0.5 * scales.float() + rounding).repeat_interleave(group_size, dim=1)
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())


def test_float_offsets_spend_all_16_levels_on_a_one_sided_group():
    w = torch.linspace(1.0, 2.0, 64).reshape(1, 64)  # integer zero points widen this to [0, 2]
    float_err = (int4.dequantize(*int4.quantize(w, 64, zero_point="float")) - w).abs().max()
    int_err = (int4.dequantize(*int4.quantize(w, 64, zero_point="int")) - w).abs().max()
    assert float(float_err) <= 0.5 / 15 + 1e-2 and float(float_err) < 0.6 * float(int_err)


def test_weights_from_a_q4_1_grid_are_restored_almost_exactly():
    """GGUF Q4_1 blocks (32 values, w = d*q + m, q in 0..15 using both ends) fit the float format."""
    gen = torch.Generator().manual_seed(7)
    d = (torch.rand(16, 4, 1, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16).float()
    m = (-torch.rand(16, 4, 1, generator=gen) * 0.1).to(torch.bfloat16).float()
    q = torch.randint(0, 16, (16, 4, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1's quantizer maps the block's min and max to 0 and 15
    w = (q * d + m).reshape(16, 128)
    back = int4.dequantize(*int4.quantize(w, 32, zero_point="float"))
    assert float((back - w).norm() / w.norm()) < 5e-3
    integer = int4.dequantize(*int4.quantize(w, 32, zero_point="int"))
    assert float((integer - w).norm() / w.norm()) > 10 * float((back - w).norm() / w.norm())


def test_unknown_zero_point_mode_is_named():
    with pytest.raises(Int4FormatError, match="zero_point 'symmetric' is not supported"):
        int4.quantize(torch.randn(4, 64), 32, zero_point="symmetric")


def test_one_sided_and_zero_groups_are_exact_enough():
    w = torch.zeros(3, 64)
    w[1] = torch.linspace(1.0, 2.0, 64)  # all positive: range widened to include 0
    w[2, :32] = -3.0  # constant negative group, zero group beside it
    qweight, scales, zeros = int4.quantize(w, 32, zero_point="int")
    back = int4.dequantize(qweight, scales, zeros)
    assert torch.equal(back[0], torch.zeros(64))
    assert torch.equal(back[2, 32:], torch.zeros(32))
    assert torch.allclose(back[2, :32], torch.full((32,), -3.0), atol=0.5 * float(scales[2, 0]))
    assert float((back[1] - w[1]).abs().max()) <= 0.5 * float(scales[1].max())


def test_pack_layout_low_nibble_is_even_k():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = int4.pack_nibbles(q)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(int4.unpack_nibbles(packed), q)


def test_group_size_for_falls_back_only_to_smaller_divisors():
    assert int4.group_size_for(4096, 128) == 128
    assert int4.group_size_for(576, 128) == 64  # SmolLM2's hidden size
    assert int4.group_size_for(96, 256) == 32
    assert int4.group_size_for(1536, 64) == 64  # never larger than asked
    with pytest.raises(Int4FormatError, match="K=40 is not a multiple"):
        int4.group_size_for(40, 128, what="model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("bad", [16, 48, 512, 0])
def test_unsupported_group_size_is_named(bad):
    with pytest.raises(Int4FormatError, match=f"group size {bad} is not supported"):
        int4.quantize(torch.randn(4, 512), bad)


def test_group_size_must_divide_k():
    with pytest.raises(Int4FormatError, match="group size 128 does not divide in_features K=576"):
        int4.quantize(torch.randn(4, 576), 128, what="w")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_unsupported_dtype_is_named(dtype):
    with pytest.raises(Int4FormatError, match="dtype"):
        int4.quantize(torch.zeros(4, 64).to(dtype), 32, what="lm_head")


def test_non_finite_weights_are_refused():
    w = torch.randn(4, 64)
    w[2, 5] = float("nan")
    with pytest.raises(Int4FormatError, match="NaN or infinite"):
        int4.quantize(w, 32, what="x")


def test_check_triple_catches_inconsistent_tensors():
    q, s, z = int4.quantize(torch.randn(8, 256), 64)
    assert int4.check_triple(q, s, z, "ok") == 64
    with pytest.raises(Int4FormatError, match="inconsistent shapes"):
        int4.check_triple(q, s[:, :2], z, "bad")
    with pytest.raises(Int4FormatError, match="uint8"):
        int4.check_triple(q.int(), s, z, "bad")
