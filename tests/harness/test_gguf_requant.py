"""The pieces of the GGUF re-quantization measurement (harness/gguf_requant.py), on tiny GGUFs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from tests.gguf_tiny import SPECS, quantized_copy, write_tiny_gguf
from vllm_omni_edge_bench.harness import gguf_requant as gr
from vllm_omni_edge_bench.harness.fidelity import PositionLogprobs


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    root = tmp_path_factory.mktemp("requant")
    # Tied, as SmolLM2: the builder's GGUF default keeps such a head bf16.
    src = write_tiny_gguf(root / "llama.gguf", dataclasses.replace(SPECS["llama"], n_layer=2, tied=True))
    return quantized_copy(src, "q4_k_m")


def test_gguf_names_map_to_the_modules_the_builder_quantizes():
    assert gr.hf_module_name("blk.3.attn_v.weight") == "model.layers.3.self_attn.v_proj"
    assert gr.hf_module_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj"
    assert gr.hf_module_name("token_embd.weight") == "model.embed_tokens"
    assert gr.hf_module_name("output.weight") == "lm_head"
    assert gr.hf_module_name("blk.0.attn_norm.weight") is None
    assert gr.hf_module_name("blk.0.attn_q.bias") is None


def test_bits_per_weight_of_ggml_types():
    assert gr.bits_per_weight("Q4_K") == 4.5
    assert gr.bits_per_weight("Q6_K") == 6.5625
    assert gr.bits_per_weight("Q8_0") == 8.5
    assert gr.bits_per_weight("F32") == 32
    with pytest.raises(gr.RequantError, match="unknown GGML tensor type 'Q9_X'"):
        gr.bits_per_weight("Q9_X")


def test_promoted_tensors_are_those_above_the_main_layer_type():
    types = {"model.layers.0.self_attn.q_proj": "Q4_K", "model.layers.0.self_attn.v_proj": "Q6_K",
             "model.layers.0.mlp.down_proj": "Q4_K", "model.layers.1.mlp.down_proj": "Q6_K",
             "model.layers.1.self_attn.q_proj": "Q4_K", "model.embed_tokens": "Q4_K", "lm_head": "Q6_K"}
    assert gr.main_linear_type(types) == "Q4_K"
    assert gr.promoted_tensors(types) == ["lm_head", "model.layers.0.self_attn.v_proj",
                                          "model.layers.1.mlp.down_proj"]
    variant = gr.VARIANTS["keep-promoted-linear"]
    assert gr.kept_modules(variant, types, tied=False) == ["model.layers.0.self_attn.v_proj",
                                                           "model.layers.1.mlp.down_proj"]
    # Tied: the head is the embedding matrix, so keeping the head keeps the embedding.
    tied = {k: v for k, v in types.items() if k != "lm_head"} | {"model.embed_tokens": "Q6_K"}
    assert "model.embed_tokens" in gr.kept_modules(gr.VARIANTS["keep-promoted"], tied, tied=True)
    assert gr.kept_modules(gr.VARIANTS["keep-head"], types, tied=False) == ["lm_head"]


def test_tiny_q4_k_m_reports_its_promoted_tensors(tiny_q4_k_m):
    types = gr.gguf_tensor_types(tiny_q4_k_m)
    assert len(types) == 2 * 7 + 1  # two layers of seven matrices and the embedding (the tied head)
    assert "lm_head" not in types
    promoted = gr.promoted_tensors(types)
    assert promoted, types
    assert all(gr.bits_per_weight(types[n]) > gr.bits_per_weight(gr.main_linear_type(types)) for n in promoted)


def test_dequantized_checkpoint_holds_the_stored_weights(tiny_q4_k_m, tmp_path):
    from safetensors.torch import load_file

    from vllm_omni_edge.models.gguf_to_hf import convert_gguf_to_hf
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint
    from vllm_omni_edge.quantization.int4 import dequantize

    ref = convert_gguf_to_hf(tiny_q4_k_m, tmp_path / "ref")
    int4 = tmp_path / "int4"
    build_cpu_int4_checkpoint(tiny_q4_k_m, int4, progress=False)
    keep = ["model.layers.0.mlp.down_proj"]
    sizes = gr.dequantize_cpu_int4(int4, tmp_path / "dq", keep_from=ref, keep=keep)
    stored = load_file(str(int4 / "model.safetensors"))
    out = load_file(str(tmp_path / "dq" / "model.safetensors"))
    refw = load_file(str(ref / "model.safetensors"))
    config = json.loads((tmp_path / "dq" / "config.json").read_text())
    assert "quantization_config" not in config
    assert not any(k.endswith((".qweight", ".qweight_high", ".scales", ".zeros")) for k in out)
    p = "model.layers.1.self_attn.v_proj"  # Q6_K in the file: stored with 6-bit codes
    expect = dequantize(stored[f"{p}.qweight"], stored[f"{p}.scales"], stored[f"{p}.zeros"],
                        qweight_high=stored[f"{p}.qweight_high"]).to(torch.bfloat16)
    assert torch.equal(out[f"{p}.weight"], expect)
    assert not torch.equal(out[f"{p}.weight"], refw[f"{p}.weight"])  # 4-bit, not the reference
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight"], refw["model.layers.0.mlp.down_proj.weight"])
    assert sizes["stored"] == (int4 / "model.safetensors").stat().st_size - _header_bytes(int4 / "model.safetensors")
    kept = refw["model.layers.0.mlp.down_proj.weight"]
    four_bit = sum(stored[f"model.layers.0.mlp.down_proj.{s}"].numel() * stored[
        f"model.layers.0.mlp.down_proj.{s}"].element_size() for s in ("qweight", "qweight_high", "scales", "zeros")
        if f"model.layers.0.mlp.down_proj.{s}" in stored)
    assert sizes["with_kept"] == sizes["stored"] + kept.numel() * 2 - four_bit


def _header_bytes(path):
    with open(path, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def test_dequantize_refuses_what_it_cannot_do(tiny_q4_k_m, tmp_path):
    from vllm_omni_edge.models.gguf_to_hf import convert_gguf_to_hf
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint

    ref = convert_gguf_to_hf(tiny_q4_k_m, tmp_path / "ref")
    with pytest.raises(gr.RequantError, match="not a cpu_int4 checkpoint"):
        gr.dequantize_cpu_int4(ref, tmp_path / "x")
    int4 = tmp_path / "int4"
    build_cpu_int4_checkpoint(tiny_q4_k_m, int4, progress=False)
    with pytest.raises(gr.RequantError, match="needs keep_from"):
        gr.dequantize_cpu_int4(int4, tmp_path / "y", keep=["lm_head"])
    with pytest.raises(gr.RequantError, match="does not store"):
        gr.dequantize_cpu_int4(int4, tmp_path / "z", keep_from=ref, keep=["model.layers.9.mlp.up_proj"])


def _dense(rows):
    lp = np.log(np.asarray(rows, dtype=np.float64))
    return PositionLogprobs.from_dense(lp, [0] * len(rows))


def test_paired_difference_and_verdict():
    ref = _dense([[0.7, 0.2, 0.1]] * 4)
    near = _dense([[0.69, 0.21, 0.1]] * 4)
    far = _dense([[0.4, 0.4, 0.2]] * 4)
    d = gr.paired_difference(ref, far, near)
    assert d["mean"] < 0 and d["positions"] == 4
    assert gr.verdict(d, noise=0.0) == "helps"
    assert gr.verdict(gr.paired_difference(ref, near, far), noise=0.0) == "hurts"
    assert gr.verdict(d, noise=abs(d["mean"]) * 2) == "within noise"
    assert gr.verdict(gr.paired_difference(ref, near, near), noise=0.0) == "within noise"


def test_variant_list_must_start_with_a_build():
    assert [v.name for v in gr.parse_variants("int4,keep-head")] == ["int4", "keep-head"]
    for bad in ("keep-head,int4", "again,int4"):
        with pytest.raises(gr.RequantError, match="first variant must be a build"):
            gr.parse_variants(bad)
    with pytest.raises(gr.RequantError, match="unknown variant"):
        gr.parse_variants("int4,int3")
    with pytest.raises(gr.RequantError, match="listed twice"):
        gr.parse_variants("int4,again,again")


def test_cli_refuses_a_missing_file(tmp_path, capsys):
    assert gr.main([str(tmp_path / "nope.gguf"), "--label", "x", "--out", str(tmp_path / "out")]) == 2
    assert "GGUF file not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_measure_file_on_a_tiny_q4_k_m(tiny_q4_k_m, tmp_path):
    variants = gr.parse_variants("int4,again,default,keep-promoted,requantized,six-bit")
    r = gr.measure_file(tiny_q4_k_m, tmp_path, variants, tokens=96, window=64, stride=32, llamacpp=False)
    rows = r["variants"]
    assert r["positions"] > 0 and r["promoted"]
    assert rows["int4"]["kld_form"] == "exact"
    assert rows["int4"]["kld_mean"] > 0  # re-quantizing Q4_K/Q6_K to cpu_int4 loses something
    # Two identical builds score identically.
    assert rows["again"]["kld_mean"] == rows["int4"]["kld_mean"]
    assert r["identical_run_noise"] == 0.0
    # The GGUF default keeps a tied head bf16: more bytes than all-int4, and other weights.
    assert rows["default"]["weights_bytes"] > rows["int4"]["weights_bytes"]
    assert rows["default"]["kld_mean"] != rows["int4"]["kld_mean"]
    # Putting back the reference's weights for some tensors costs bytes and changes what is scored.
    assert rows["keep-promoted"]["weights_bytes"] > rows["int4"]["weights_bytes"]
    assert rows["keep-promoted"]["kld_mean"] != rows["int4"]["kld_mean"]
    # The same formats with the file's Q4_K weights re-quantized instead of kept on their grid: worse.
    assert rows["requantized"]["weights_bytes"] == rows["int4"]["weights_bytes"]
    assert rows["requantized"]["kld_mean"] > rows["int4"]["kld_mean"]
    # The promoted tensors with 6-bit codes: more bytes than all-4-bit, closer to the file.
    assert rows["six-bit"]["weights_bytes"] > rows["int4"]["weights_bytes"]
    assert rows["six-bit"]["kld_mean"] < rows["int4"]["kld_mean"]
    report = gr.render_report("tiny", [r], "test box", "cmd")
    assert "| keep-promoted |" in report and "test box" in report
