"""6-bit layers: the GGUF tensors a file keeps at more bits than its main type, stored with 6-bit
codes (``int4.quantize_6bit``: the nibbles as ``qweight``, the top two bits as ``qweight_high``)
and run by the rows16 ops with their ``high_bits`` plane.

References, as for the 4-bit ops (test_w4a8_ops): the op against a PyTorch model of what it
computes (int8 activations per 32, the 6-bit codes), to float rounding; against the exact product,
within the activation rounding; the dequantization paths bit for bit against ``int4.dequantize``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import vllm_env
from tests.quantization.helpers import relative_error, w4a8_activations
from tests.quantization.test_bf16_prefill import PACKED_OK
from tests.quantization.test_w4a8_ops import EXACT_TOLERANCE, MODEL_TOLERANCE, needs_vnni
from vllm_omni_edge.quantization import int4
from vllm_omni_edge.quantization.kernels import Avx512VnniRows16W4A8Kernel, native
from vllm_omni_edge.quantization.kernels.w4a8_avx512 import silu_mlp

REPO = Path(__file__).resolve().parents[2]
LOADED, WHY = native.load_library()
OPS = torch.ops.edge_cpu_int4


def six_bit_layer(N: int, K: int, act_dtype=torch.float32, seed: int = 0):
    """(layer holding a stored 6-bit layer, the fp32 weights it stores, the stored tensors)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(N, K, generator=gen) * 0.05
    stored = int4.quantize_6bit(weight, 32)
    layer = torch.nn.Module()
    for name, t in zip(("qweight", "qweight_high", "scales", "zeros"), stored):
        layer.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    layer.int4_in_features, layer.int4_group_size, layer.int4_act_dtype = K, 32, act_dtype
    qweight, high, scales, zeros = stored
    return layer, int4.dequantize(qweight, scales, zeros, qweight_high=high), stored


def codes_of(qweight: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    return (int4.unpack_nibbles(qweight) | (int4.unpack_high_bits(high) << 4)).float()


def model_of_op(x: torch.Tensor, qweight, high, scales, offsets) -> torch.Tensor:
    """What the rows16 op computes for a 6-bit layer: int8 activations per block of 32 times the
    6-bit codes, the scale per group; the offset term on the exact activations."""
    M, K = x.shape
    xq = w4a8_activations(x)
    n, groups = scales.shape
    q = codes_of(qweight, high).reshape(n, groups, -1)
    scale_part = xq @ (q * scales.float().unsqueeze(-1)).reshape(n, K).t()
    offset_part = x.float().reshape(M, groups, -1).sum(-1) @ offsets.float().t()
    return scale_part + offset_part


# ---------------------------------------------------------------------------
# The number format


def test_quantize_6bit_codes_span_each_group_within_half_a_step():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 256, generator=gen) * 0.1
    weight[3, 32:64] = 0.25  # a constant group
    qweight, high, scales, offsets = int4.quantize_6bit(weight, 32)
    assert qweight.shape == (40, 128) and high.shape == (40, 64)
    assert qweight.dtype == high.dtype == torch.uint8 and scales.dtype == offsets.dtype == torch.bfloat16
    codes = codes_of(qweight, high)
    assert codes.max() == 63 and codes.min() == 0
    back = int4.dequantize(qweight, scales, offsets, qweight_high=high)
    step = scales.float().repeat_interleave(32, dim=1)
    offset_rounding = (offsets.float() - weight.reshape(40, -1, 32).amin(-1)).abs().repeat_interleave(32, dim=1)
    assert ((back - weight).abs() <= step / 2 + offset_rounding + 1e-7).all()
    assert torch.equal(back[3, 32:64], torch.full((32,), 0.25).to(torch.bfloat16).float())
    # A quarter of the 4-bit error, about: four times the levels.
    four = int4.dequantize(*int4.quantize(weight, 32))
    assert relative_error(back, weight) < relative_error(four, weight) / 3


def test_high_bits_pack_in_k_order_and_round_trip():
    top = torch.randint(0, 4, (5, 64), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    packed = int4.pack_high_bits(top)
    assert packed.shape == (5, 16)
    assert int(packed[0, 0]) == sum(int(top[0, i]) << (2 * i) for i in range(4))
    assert torch.equal(int4.unpack_high_bits(packed), top)
    with pytest.raises(int4.Int4FormatError, match="multiple of 4"):
        int4.pack_high_bits(top[:, :6])


def test_bad_6bit_input_is_named():
    with pytest.raises(int4.Int4FormatError, match="w: contains NaN"):
        int4.quantize_6bit(torch.full((2, 32), float("nan")), 32, what="w")
    with pytest.raises(int4.Int4FormatError, match="does not divide"):
        int4.quantize_6bit(torch.zeros(2, 48), 32)
    qweight, high, scales, offsets = int4.quantize_6bit(torch.randn(4, 64), 32)
    with pytest.raises(int4.Int4FormatError, match="does not fit"):
        int4.dequantize(qweight, scales, offsets, qweight_high=high[:, :8])


# ---------------------------------------------------------------------------
# The ops


def interleave_high_by_permute(high: torch.Tensor) -> torch.Tensor:
    """The top-bits plane in the 16-row layout, by tensor ops: row j, k = 32b + 8c + 4h + i of a
    tile -> byte 4 (j mod 8) + i of chunk c of block b, field 2h + j // 8."""
    N, K = high.shape[0], high.shape[1] * 4
    top = int4.unpack_high_bits(high).reshape(N // 16, 2, 8, K // 32, 4, 2, 4)  # t, jh, jl, b, c, h, i
    fields = top.permute(0, 3, 4, 2, 6, 5, 1).reshape(N // 16, K // 32, 4, 32, 4)  # t, b, c, p, f=2h+jh
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    return (fields << shifts).sum(-1).to(torch.uint8).reshape(N, K // 4)


@pytest.mark.skipif(not LOADED, reason=WHY)
@pytest.mark.parametrize("N,K", [(16, 32), (32, 576), (48, 1536)])
def test_high_bits_interleave_in_place_is_the_permutation(N, K):
    high = torch.randint(0, 256, (N, K // 4), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    want = interleave_high_by_permute(high)
    ptr = high.data_ptr()
    OPS.interleave_rows16_high_bits_inplace(high)
    assert high.data_ptr() == ptr and torch.equal(high, want)


@pytest.mark.skipif(not LOADED, reason=WHY)
def test_high_bits_interleave_refuses_bad_shapes_by_name():
    with pytest.raises(RuntimeError, match="N must be a multiple of 16"):
        OPS.interleave_rows16_high_bits_inplace(torch.zeros(8, 8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        OPS.interleave_rows16_high_bits_inplace(torch.zeros(16, 4, dtype=torch.uint8))


@needs_vnni
@pytest.mark.parametrize("N,K", [(16, 32), (48, 576), (32, 1536), (16, 8960)])
@pytest.mark.parametrize("M", [1, 3, 9])
def test_rows16_op_on_a_6bit_layer_matches_the_model_of_op_and_the_exact_product(N, K, M):
    layer, weight, stored = six_bit_layer(N, K)
    kernel = Avx512VnniRows16W4A8Kernel()
    kernel.process_weights(layer)
    assert "group_factors" not in layer._parameters  # 6-bit layers keep the stored pairs
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(4))
    out = kernel.apply(layer, x, None)
    assert relative_error(out, model_of_op(x, *stored)) < MODEL_TOLERANCE
    assert relative_error(out, F.linear(x, weight)) < EXACT_TOLERANCE
    # Without its top bits the same layer is far off: the plane is read.
    without = OPS.w4a8_vnni_rows16_mm(x, layer.qweight, layer.scales, layer.zeros, 32, None, None)
    assert relative_error(without, F.linear(x, weight)) > 0.5


@needs_vnni
@pytest.mark.parametrize("portable", [False, True])
def test_rows16_dequantize_reads_the_top_bits_exactly(portable):
    layer, weight, _ = six_bit_layer(48, 576)
    Avx512VnniRows16W4A8Kernel().process_weights(layer)
    kn = OPS.rows16_dequantize(layer.qweight, layer.scales, layer.zeros, 32, portable, None, layer.qweight_high)
    assert torch.equal(kn.t(), weight.to(torch.bfloat16))


@needs_vnni
@pytest.mark.parametrize("gemm", [0, 1], ids=["onednn", "amx-tiles"])
def test_bf16_prefill_path_on_a_6bit_layer(monkeypatch, gemm):
    from vllm_omni_edge.quantization.kernels.w4a8_avx512 import amx_bf16_usable, configure_prefill

    if gemm and not amx_bf16_usable():
        pytest.skip("AMX BF16 tiles are not usable on this CPU")
    layer, weight, _ = six_bit_layer(64, 1024, act_dtype=torch.bfloat16)
    kernel = Avx512VnniRows16W4A8Kernel()
    kernel.process_weights(layer)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    before = OPS.rows16_path_counts()
    OPS.set_bf16_prefill(32, 2 << 20, gemm)
    try:
        out = kernel.apply(layer, x, None)
    finally:
        configure_prefill()
    after = OPS.rows16_path_counts()
    assert after[1] == before[1] + 1
    if gemm == 0 and PACKED_OK:
        assert after[3] == before[3] + 1  # 64 rows, 1,024 features: one block in oneDNN's own layout, top bits included
    want = F.linear(x.float(), weight.to(torch.bfloat16).float())
    assert relative_error(out, want) < 8e-3  # bf16 output rounding only


@needs_vnni
def test_fused_mlp_reads_both_top_bits_planes():
    gate_up, gu_weight, _ = six_bit_layer(2 * 96, 128, seed=6)
    down, down_weight, _ = six_bit_layer(128, 96, seed=7)
    for layer in (gate_up, down):
        Avx512VnniRows16W4A8Kernel().process_weights(layer)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(8))
    gu = F.linear(x, gu_weight)
    want = F.linear(F.silu(gu[:, :96]) * gu[:, 96:], down_weight)
    assert relative_error(silu_mlp(gate_up, down, x), want) < 2 * EXACT_TOLERANCE


@pytest.mark.skipif(not LOADED, reason=WHY)
def test_ops_refuse_a_top_bits_plane_that_does_not_fit():
    layer, _, _ = six_bit_layer(16, 64)
    with pytest.raises(RuntimeError, match=r"high_bits must be uint8 \[16, 16\]"):
        OPS.rows16_dequantize(layer.qweight, layer.scales.to(torch.bfloat16), layer.zeros.to(torch.bfloat16), 32,
                              False, None, layer.qweight_high[:, :8].contiguous())


# ---------------------------------------------------------------------------
# Loading: the config, the method, a kernel without 6-bit codes


def test_config_lists_6bit_layers_and_merged_layers_follow_their_parts():
    from vllm_omni_edge.quantization.config import CpuInt4Config

    base = {"quant_method": "cpu_int4", "bits": 4, "group_size": 32, "format_version": 3, "zero_point": "float"}
    config = CpuInt4Config.from_config({**base, "six_bit": ["model.layers.1.self_attn.v_proj", "lm_head"]})
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert config.is_six_bit("model.layers.1.self_attn.qkv_proj")
    assert config.is_six_bit("lm_head")
    assert not config.is_six_bit("model.layers.0.self_attn.qkv_proj")
    assert not config.is_six_bit("model.layers.1.mlp.gate_up_proj")
    for bad, message in ((["x", 3], "list of module names"), ("lm_head", "list of module names")):
        with pytest.raises(int4.Int4FormatError, match=message):
            CpuInt4Config.from_config({**base, "six_bit": bad})
    with pytest.raises(int4.Int4FormatError, match="float offsets"):
        CpuInt4Config.from_config({**base, "format_version": 1, "zero_point": True, "six_bit": ["lm_head"]})


def test_a_kernel_without_6bit_codes_gets_the_layer_requantized_to_4_bits(monkeypatch):
    from vllm_omni_edge.quantization import evidence
    from vllm_omni_edge.quantization.kernels import KERNEL_ENV
    from vllm_omni_edge.quantization.linear import CpuInt4LinearMethod

    from vllm_omni_edge.quantization import linear

    monkeypatch.setenv(KERNEL_ENV, "dequant")
    monkeypatch.setattr(linear, "FOLD_ROWS", 8)  # folded a block of rows at a time: 4 blocks here
    evidence.reset()
    method = CpuInt4LinearMethod(32, True, "linear", "model.layers.0.mlp.down_proj", six_bit=True)
    layer, weight, _ = six_bit_layer(32, 128)
    method.process_weights_after_loading(layer)
    assert "qweight_high" not in layer._parameters
    assert evidence.kernel_counts()["six_bit"] == 0
    # The 4-bit triple of the weights the 6-bit layer stored, as one quantize() of them gives.
    for got, want in zip((layer.qweight, layer.scales, layer.zeros), int4.quantize(weight, 32)):
        assert torch.equal(got.data, want)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(9))
    four_bit = int4.dequantize(*int4.quantize(weight, 32))
    assert torch.allclose(method.apply(layer, x), F.linear(x, four_bit), rtol=1e-4, atol=1e-5)
    with pytest.raises(int4.Int4FormatError, match="pre-quantized with float offsets"):
        CpuInt4LinearMethod(32, False, "linear", "p", six_bit=True)
    evidence.reset()


def random_six_bit(N: int, K: int, group: int, seed: int):
    """Stored 6-bit tensors with arbitrary codes, bf16 scales and offsets (not from quantize_6bit),
    some groups constant (zero scale) and one group all of one code."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (N, K), generator=gen, dtype=torch.uint8)
    codes[0, :group] = 37
    qweight, high = int4.pack_nibbles(codes & 0x0F), int4.pack_high_bits(codes >> 4)
    groups = K // group
    scales = (torch.rand(N, groups, generator=gen) * 10 ** torch.randint(-4, 1, (N, groups), generator=gen)
              ).to(torch.bfloat16)
    scales[1 % N, 0] = 0
    offsets = (torch.randn(N, groups, generator=gen) * 0.05).to(torch.bfloat16)
    return qweight, high, scales, offsets


@pytest.mark.skipif(not LOADED, reason=WHY)
@pytest.mark.parametrize("N,K,group", [(3, 64, 32), (40, 256, 64), (17, 1536, 128), (64, 512, 256), (33, 96, 32)])
def test_the_fold_op_gives_the_references_4bit_triple_bit_for_bit(N, K, group):
    from vllm_omni_edge.quantization.linear import fold_6bit, fold_6bit_reference

    for seed in range(3):
        stored = random_six_bit(N, K, group, seed)
        want = fold_6bit_reference(*stored, group, "w")
        got = fold_6bit(*stored, group, "w")
        for name, a, b in zip(("qweight", "scales", "offsets"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), (name, (a != b).sum().item())
    layer_weights = int4.quantize_6bit(torch.randn(24, 256, generator=torch.Generator().manual_seed(5)), 32)
    for a, b in zip(fold_6bit(*layer_weights, 32, "w"), fold_6bit_reference(*layer_weights, 32, "w")):
        assert torch.equal(a, b)


@pytest.mark.skipif(not LOADED, reason=WHY)
def test_the_fold_names_a_layer_with_non_finite_weights_and_refuses_bad_shapes():
    from vllm_omni_edge.quantization.linear import fold_6bit

    qweight, high, scales, offsets = random_six_bit(4, 64, 32, 0)
    scales[2, 1] = float("inf")
    with pytest.raises(int4.Int4FormatError, match="model.layers.3.mlp.down_proj: contains NaN or infinite"):
        fold_6bit(qweight, high, scales, offsets, 32, "model.layers.3.mlp.down_proj")
    op = torch.ops.edge_cpu.fold_6bit_to_4bit
    with pytest.raises(RuntimeError, match="qweight_high must be uint8"):
        op(qweight, high[:, :4], scales, offsets)
    with pytest.raises(RuntimeError, match="scales and offsets must be bf16"):
        op(qweight, high, scales.float(), offsets)


# ---------------------------------------------------------------------------
# The builder: which tensors a GGUF promotes


def test_bits_per_weight_and_the_main_type_come_from_ggufs_block_sizes():
    from vllm_omni_edge.models import gguf_to_hf

    assert gguf_to_hf.bits_per_weight("Q6_K") == 6.5625 and gguf_to_hf.bits_per_weight("Q4_K") == 4.5
    assert gguf_to_hf.main_linear_type({"a": "Q4_K", "b": "Q6_K", "c": "Q4_K"}) == "Q4_K"
    assert gguf_to_hf.main_linear_type({"a": "Q6_K", "b": "Q4_K"}) == "Q4_K"  # a tie: the fewer bits
    with pytest.raises(gguf_to_hf.UnsupportedCheckpointError, match="unknown GGML tensor type 'Q9_X'"):
        gguf_to_hf.bits_per_weight("Q9_X")


def test_six_bit_modules_are_the_promoted_tensors_and_their_merged_parts():
    from vllm_omni_edge.quantization.builder import six_bit_modules

    types = {f"model.layers.{i}.{m}.weight": "Q4_K" for i in range(3) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    types.update({"model.layers.1.self_attn.v_proj.weight": "Q6_K", "model.layers.2.mlp.down_proj.weight": "Q6_K",
                  "lm_head.weight": "Q6_K", "model.embed_tokens.weight": "Q6_K", "model.norm.weight": "F32"})
    assert six_bit_modules(types) == {
        "lm_head", "model.layers.2.mlp.down_proj",
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"}
    assert six_bit_modules(types, promoted_bits=4) == set()
    assert six_bit_modules(None) == set()
    # A uniform file (its head at the same bits) promotes nothing.
    assert six_bit_modules({n: "Q8_0" for n in types if n.endswith("proj.weight")} | {"lm_head.weight": "Q8_0"}) == set()


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    from tests.gguf_tiny import quantized_copy, write_tiny_gguf

    root = tmp_path_factory.mktemp("six-bit")
    return quantized_copy(write_tiny_gguf(root / "llama.gguf", "llama"), "q4_k_m")


def test_a_q4_k_m_build_stores_its_q6_k_tensors_6bit(tiny_q4_k_m, tmp_path):
    from safetensors import safe_open

    from vllm_omni_edge.models import gguf_to_hf
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint
    from vllm_omni_edge.quantization.manifest import verify_manifest

    reader = gguf_to_hf._open_reader(tiny_q4_k_m)
    q6 = {t.name for t in reader.tensors if t.tensor_type.name == "Q6_K"}
    assert "output.weight" in q6 and any(".ffn_down." in n for n in q6)
    report = build_cpu_int4_checkpoint(tiny_q4_k_m, tmp_path / "six", progress=False)
    listed = json.loads((tmp_path / "six" / "config.json").read_text())["quantization_config"]["six_bit"]
    assert "lm_head" in listed and listed == sorted(report.six_bit)
    assert verify_manifest(tmp_path / "six")["six_bit_layers"] == listed
    with safe_open(str(tmp_path / "six" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for prefix in listed:
            assert f.get_tensor(f"{prefix}.qweight_high").shape[1] * 2 == f.get_tensor(f"{prefix}.qweight").shape[1]
        assert {n.removesuffix(".qweight_high") for n in names if n.endswith(".qweight_high")} == set(listed)
        # A merged part on its file's 4-bit grid: its top bits are 0 (the file's codes kept).
        peers = [p for p in listed if p.endswith("q_proj")]
        assert peers and all(not f.get_tensor(f"{p}.qweight_high").any() for p in peers)
    assert "linear 6-bit" in report.table() and "head 6-bit" in report.table()
    four = build_cpu_int4_checkpoint(tiny_q4_k_m, tmp_path / "four", progress=False, promoted_bits=4)
    assert not four.six_bit
    assert "six_bit" not in json.loads((tmp_path / "four" / "config.json").read_text())["quantization_config"]
    with pytest.raises(ValueError, match=r"promoted_bits must be one of \(6, 4\)"):
        build_cpu_int4_checkpoint(tiny_q4_k_m, tmp_path / "five", progress=False, promoted_bits=5)


CHILD = """
import json, sys
from vllm import LLM, SamplingParams
from vllm_omni_edge.quantization import evidence
llm = LLM(model=sys.argv[1], max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=16 << 20)
ids = list(range(3, 3 + 96))
out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
rows = [{str(k): v.logprob for k, v in p.items()} for p in out[0].prompt_logprobs[1:]]
print("RESULT " + json.dumps({"rows": rows, "counts": evidence.kernel_counts()}))
"""


def _served(model_dir: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_dir)], env=vllm_env(), cwd=str(REPO),
                          capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def _top1_gap(reference: list[dict], candidate: list[dict]) -> float:
    """Mean |logprob difference| of the reference's top token, over positions both rank it in their top 5."""
    gaps = []
    for ref, cand in zip(reference, candidate):
        token = max(ref, key=ref.get)
        if token in cand:
            gaps.append(abs(ref[token] - cand[token]))
    assert len(gaps) > len(reference) // 2
    return sum(gaps) / len(gaps)


@needs_vnni
@pytest.mark.e2e
def test_vllm_runs_the_6bit_layers_closer_to_the_file_than_4bit(tiny_q4_k_m, tmp_path):
    from vllm_omni_edge.models.gguf_to_hf import convert_gguf_to_hf
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint

    reference = convert_gguf_to_hf(tiny_q4_k_m, tmp_path / "bf16")  # the file's own dequantization
    six = build_cpu_int4_checkpoint(tiny_q4_k_m, tmp_path / "six", progress=False)
    build_cpu_int4_checkpoint(tiny_q4_k_m, tmp_path / "four", progress=False, promoted_bits=4)
    ref, got6, got4 = (_served(d) for d in (reference, tmp_path / "six", tmp_path / "four"))
    assert got6["counts"]["six_bit"] == len(six.six_bit) - sum(p.endswith(("k_proj", "v_proj", "up_proj")) for p in six.six_bit)
    assert got4["counts"]["six_bit"] == 0
    assert _top1_gap(ref["rows"], got6["rows"]) < 0.7 * _top1_gap(ref["rows"], got4["rows"])
