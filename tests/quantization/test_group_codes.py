"""8-bit group codes (quantization/group_codes.py): the reference encoding, the C++ op that makes
them at load (bit for bit the reference's), the weights they stand for, and bad input."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_edge.quantization import group_codes, int4
from vllm_omni_edge.quantization.int4 import Int4FormatError
from vllm_omni_edge.quantization.kernels import Avx512VnniRows16W4A8Kernel, CpuFeatures, native
from vllm_omni_edge.quantization.kernels.w4a8_avx512 import interleave_rows16, rows16_group_codes

LOADED, WHY = native.load_library()
VNNI_OK, VNNI_WHY = Avx512VnniRows16W4A8Kernel.can_implement(
    CpuFeatures.detect(), 32, 64, 16, torch.float32, float_zero=True) if LOADED else (False, WHY)
needs_vnni = pytest.mark.skipif(not VNNI_OK, reason=f"avx512_w4a8_rows16 cannot run here: {VNNI_WHY}")


def stored(N, K, g=32, seed=0):
    """A stored triple with the cases the encoding branches on: a group with only positive weights
    (offset > 0: a mixed-sign superblock), a constant group, and a row of zeros."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.05
    w[3, :g] = w[3, :g].abs() + 0.01
    w[5, g:2 * g] = 0.02
    w[7] = 0
    return int4.quantize(w, g)


def tile_layout(t: torch.Tensor) -> torch.Tensor:
    """[N, C] in row order -> the ops' [tile][C][16 rows] (as [N, C])."""
    n = t.shape[0]
    return t.reshape(n // 16, 16, -1).transpose(1, 2).reshape(n, -1)


def test_superblocks_take_the_largest_divisor_up_to_eight():
    assert [group_codes.superblock_groups(g) for g in (1, 2, 6, 8, 18, 48, 280, 35, 13)] == [1, 2, 6, 8, 6, 8, 8, 7, 1]
    with pytest.raises(Int4FormatError, match="at least one group"):
        group_codes.superblock_groups(0)


def test_codes_stand_for_values_within_half_a_factor():
    _, scales, offsets = stored(64, 1536)
    codes_s, codes_o, factors = group_codes.encode(scales, offsets)
    s, o = group_codes.decode(codes_s, codes_o, factors)
    sb = group_codes.superblock_groups(scales.shape[1])
    d = factors[..., 0].float().repeat_interleave(sb, dim=1)
    m = factors[..., 1].float().abs().repeat_interleave(sb, dim=1)
    assert ((s - scales.float()).abs() <= d / 2).all()
    assert ((o - offsets.float()).abs() <= m / 2 + 1e-12).all()
    # Row 3's first superblock has a group with offset > 0: int8 codes under M > 0; the others
    # have none above 0: magnitudes under M < 0. Row 7 (all zeros) stands for zeros.
    assert factors[3, 0, 1] > 0 and (factors[:3, :, 1] < 0).all()
    assert (o[7] == 0).all()


def test_a_q4k_grid_comes_back_on_its_own_grid():
    """Scales d * sc and offsets -dmin * m with 6-bit codes (a GGUF Q4_K super-block): the fit over 63
    finds d and dmin, and the decoded values are the stored ones exactly."""
    gen = torch.Generator().manual_seed(3)
    n, groups = 16, 48
    d = torch.tensor([2.0 ** -9]).to(torch.bfloat16).float()
    sc = torch.randint(1, 64, (n, groups), generator=gen).float()
    sc[:, ::8] = 63  # each superblock's largest code
    m = torch.randint(0, 64, (n, groups), generator=gen).float()
    m[:, ::8] = 63
    scales, offsets = (sc * d).to(torch.bfloat16), (-m * d * 2).to(torch.bfloat16)
    codes_s, codes_o, factors = group_codes.encode(scales, offsets)
    s, o = group_codes.decode(codes_s, codes_o, factors)
    assert torch.equal(s, scales.float()) and torch.equal(o, offsets.float())
    assert torch.equal(codes_s.float(), sc) and torch.equal(codes_o.float(), m)


def test_weights_move_little_and_a_constant_group_costs_its_superblock_nothing():
    qweight, scales, offsets = stored(96, 576)
    before = int4.dequantize(qweight, scales, offsets)
    after = group_codes.dequantize(qweight, *group_codes.encode(scales, offsets, qweight))
    assert float((after - before).norm() / before.norm()) < 0.01
    # Row 5's second group is constant (stored scale 1, codes 0): with the qweight it takes scale 0
    # and its superblock's factor fits the other groups; without it, the placeholder sets the factor.
    row = lambda w: float((w[5] - before[5]).norm() / before[5].norm())  # noqa: E731
    blind = group_codes.dequantize(qweight, *group_codes.encode(scales, offsets))
    assert row(after) < 0.01 < row(blind)


def test_bad_input_is_named():
    s = torch.ones(16, 8, dtype=torch.bfloat16)
    with pytest.raises(Int4FormatError, match="one \\[N, G\\]"):
        group_codes.encode(s, s[:, :4])
    with pytest.raises(Int4FormatError, match="finite scales >= 0"):
        group_codes.encode(-s, s)
    with pytest.raises(Int4FormatError, match="finite scales >= 0"):
        group_codes.encode(s, s * float("nan"))


@needs_vnni
@pytest.mark.parametrize("N,K,g", [(16, 32, 32), (48, 576, 32), (64, 1536, 32), (32, 8960, 32), (16, 1024, 256),
                                   (32, 1152, 64)])
def test_the_load_op_makes_the_reference_codes_in_the_tile_layout(N, K, g):
    qweight, scales, offsets = stored(N, K, g, seed=N + K)
    codes_s, codes_o, factors = group_codes.encode(scales, offsets, qweight)
    packed, op_s, op_o, op_f = rows16_group_codes(qweight, scales, offsets)
    assert op_s.dtype == op_o.dtype == torch.uint8 and op_f.dtype == torch.bfloat16
    assert torch.equal(op_s, tile_layout(codes_s)) and torch.equal(op_o, tile_layout(codes_o))
    want = factors.reshape(N // 16, 16, -1, 2).permute(0, 2, 3, 1).reshape(N, -1)
    assert torch.equal(op_f.view(torch.int16), want.view(torch.int16))  # bits, so -0.0 and NaN count
    assert torch.equal(packed, interleave_rows16(qweight, scales, offsets)[0])


@needs_vnni
@pytest.mark.parametrize("portable", [False, True], ids=["native-bf16", "portable"])
@pytest.mark.parametrize("N,K,g", [(16, 32, 32), (48, 576, 32), (64, 8960, 32), (16, 1024, 256)])
def test_dequantized_blocks_are_exactly_the_codes_weights(N, K, g, portable):
    qweight, scales, offsets = stored(N, K, g, seed=N * K)
    packed, op_s, op_o, op_f = rows16_group_codes(qweight, scales, offsets)
    kn = torch.ops.edge_cpu_int4.rows16_dequantize(packed, op_s, op_o, g, portable, op_f)
    want = group_codes.dequantize(qweight, *group_codes.encode(scales, offsets, qweight), dtype=torch.bfloat16)
    assert torch.equal(kn, want.t())


@needs_vnni
def test_ops_name_what_is_wrong_with_codes():
    qweight, scales, offsets = stored(16, 256)
    packed, op_s, op_o, op_f = rows16_group_codes(qweight, scales, offsets)
    mm = torch.ops.edge_cpu_int4.w4a8_vnni_rows16_mm
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="must be uint8 codes"):
        mm(x, packed, scales.contiguous(), offsets.contiguous(), 32, op_f)
    with pytest.raises(RuntimeError, match="factors must be bf16"):
        mm(x, packed, op_s, op_o, 32, op_f.float())
    with pytest.raises(RuntimeError, match="superblocks dividing 8 groups"):
        mm(x, packed, op_s, op_o, 32, torch.cat([op_f, op_f, op_f], dim=1))
    with pytest.raises(RuntimeError, match="must be bf16 \\[16, 8\\]"):
        mm(x, packed, op_s, op_o, 32)  # codes without their factors
    bad = scales.clone()
    bad[2, 3] = -1
    with pytest.raises(RuntimeError, match="finite scales >= 0"):
        rows16_group_codes(qweight, bad, offsets)
