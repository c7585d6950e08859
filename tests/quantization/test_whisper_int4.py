"""The cpu_int4 builder on a tiny random Whisper, and vLLM's Whisper layers loading what it writes."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.quantization.helpers import relative_error
from vllm_omni_edge.models.gguf_to_hf import UnsupportedCheckpointError
from vllm_omni_edge.quantization import builder, evidence, int4
from vllm_omni_edge.quantization.builder import CheckpointBuildError, build_cpu_int4_checkpoint
from vllm_omni_edge.quantization.int4 import Int4FormatError
from vllm_omni_edge.quantization.manifest import verify_manifest

D_MODEL, FFN, HEADS = 64, 128, 2
ENCODER_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2")
DECODER_PROJ = ENCODER_PROJ + ("encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj",
                               "encoder_attn.out_proj")


def save_tiny_whisper(path, dtype=torch.float16):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=96, d_model=D_MODEL, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                           decoder_ffn_dim=FFN, num_mel_bins=80, max_source_positions=1500,
                           max_target_positions=32, pad_token_id=90, bos_token_id=90, eos_token_id=90,
                           decoder_start_token_id=91)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # non-zero biases and norms, so a bias put on the wrong shard shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.normal_(0, 0.5)
    model.to(dtype).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    return save_tiny_whisper(tmp_path_factory.mktemp("whisper") / "tiny-whisper")


@pytest.fixture(scope="module")
def tiny_whisper_int4(tiny_whisper, tmp_path_factory):
    out = tmp_path_factory.mktemp("whisper-int4") / "tiny-whisper-cpu_int4"
    report = build_cpu_int4_checkpoint(tiny_whisper, out, progress=False)
    return out, report


def linear_prefixes() -> list[str]:
    return sorted([f"model.encoder.layers.{i}.{p}" for i in range(2) for p in ENCODER_PROJ]
                  + [f"model.decoder.layers.{i}.{p}" for i in range(2) for p in DECODER_PROJ])


def test_every_whisper_linear_is_4bit_and_the_rest_is_as_stored(tiny_whisper, tiny_whisper_int4):
    out, report = tiny_whisper_int4
    source = load_file(str(tiny_whisper / "model.safetensors"))
    tensors = load_file(str(out / "model.safetensors"))
    for prefix in linear_prefixes():
        assert f"{prefix}.weight" not in tensors, prefix
        triple = [tensors[f"{prefix}.{s}"] for s in ("qweight", "scales", "zeros")]
        int4.check_triple(*triple, prefix)
        ref = source[f"{prefix}.weight"].float()
        assert float((int4.dequantize(*triple) - ref).norm() / ref.norm()) < 0.12, prefix
    quantized = {n for n in tensors if n.endswith((".qweight", ".scales", ".zeros"))}
    assert len(quantized) == 3 * len(linear_prefixes())
    # Everything else -- conv, positional and token embeddings, norms, biases -- byte for byte.
    for name, t in source.items():
        if not name.endswith(".weight") or name.removesuffix(".weight") not in linear_prefixes():
            assert torch.equal(tensors[name], t), name
    assert tensors["model.encoder.conv1.weight"].dtype == torch.float16
    assert "proj_out.weight" not in tensors
    assert report.tensors[builder.LINEAR_4BIT] == len(linear_prefixes())
    assert report.tensors[builder.CONV] == 2 and report.tensors[builder.POSITIONS] == 2
    assert report.tensors[builder.EMBEDDING_ROW] == 1


def test_k_projections_get_a_zero_bias_of_their_own(tiny_whisper, tiny_whisper_int4):
    out, report = tiny_whisper_int4
    source = load_file(str(tiny_whisper / "model.safetensors"))
    tensors = load_file(str(out / "model.safetensors"))
    k_projs = [p for p in linear_prefixes() if p.endswith("k_proj")]
    assert len(k_projs) == 6 and report.tensors[builder.ZERO_K_BIAS] == 6
    for prefix in k_projs:
        assert f"{prefix}.bias" not in source  # Whisper's k projections have none
        bias = tensors[f"{prefix}.bias"]
        assert bias.shape == (D_MODEL,) and bias.dtype == torch.float16 and not bias.any()


def test_config_and_manifest_say_what_was_quantized(tiny_whisper_int4):
    out, _ = tiny_whisper_int4
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "whisper"
    assert config["quantization_config"] == {
        "quant_method": "cpu_int4", "bits": 4, "group_size": int4.DEFAULT_GROUP_SIZE, "format_version": 2,
        "lm_head": False, "zero_point": "float",
    }
    manifest = verify_manifest(out)
    assert manifest["model_type"] == "whisper"
    assert manifest["quantized_layers"] == linear_prefixes()
    # Norms: 2 per encoder layer, 3 per decoder layer, 1 after each stack. Biases: the norms',
    # the convs', and every linear's but the k projections'.
    assert manifest["kept_unquantized"] == {"biases": 12 + 2 + 2 * 5 + 2 * 8, "conv": 2, "embedding": 1,
                                            "k bias (zero)": 6, "norms": 12, "positions": 2}
    assert "as stored" in manifest["embedding"] and "tied" in manifest["head"]
    assert (out / "generation_config.json").is_file()


@pytest.mark.parametrize("option", [{"embedding": "int4"}, {"embedding": "int8"}, {"head": "int4"}])
def test_a_4bit_embedding_or_head_is_refused_by_name(tiny_whisper, tmp_path, option):
    with pytest.raises(Int4FormatError, match=rf"--{next(iter(option))} .*whisper checkpoint keeps its token"):
        build_cpu_int4_checkpoint(tiny_whisper, tmp_path / "out", progress=False, **option)
    assert not (tmp_path / "out").exists()


def test_an_untied_head_is_refused(tiny_whisper, tmp_path):
    src = tmp_path / "untied"
    src.mkdir()
    for f in tiny_whisper.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tiny_whisper / "model.safetensors"))
    tensors["proj_out.weight"] = torch.randn_like(tensors["model.decoder.embed_tokens.weight"].float()).half()
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpointError, match="proj_out.weight differs from model.decoder.embed_tokens"):
        build_cpu_int4_checkpoint(src, tmp_path / "out", progress=False)
    # A tied copy stored beside the embedding is dropped, as vLLM's loader drops it.
    tensors["proj_out.weight"] = tensors["model.decoder.embed_tokens.weight"]
    save_file({k: v.clone() for k, v in tensors.items()}, str(src / "model.safetensors"))
    build_cpu_int4_checkpoint(src, tmp_path / "out", progress=False)
    assert "proj_out.weight" not in load_file(str(tmp_path / "out" / "model.safetensors"))


def test_a_linear_left_full_precision_fails_the_check(tiny_whisper, tmp_path, monkeypatch):
    real = builder._store_4bit

    def skip_fc2(report, written, prefixes, prefix, weight, row, g, zp):
        if prefix.endswith("layers.1.fc2"):
            written[f"{prefix}.weight"] = weight
            prefixes.append(prefix)
            return
        real(report, written, prefixes, prefix, weight, row, g, zp)

    monkeypatch.setattr(builder, "_store_4bit", skip_fc2)
    with pytest.raises(CheckpointBuildError, match=r"layers\.1\.fc2"):
        build_cpu_int4_checkpoint(tiny_whisper, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _vllm_whisper_layers():
    """vLLM's own Whisper attention and MLP modules, named as its model names them."""
    from vllm.model_executor.models.whisper import (
        AttentionType,
        WhisperAttention,
        WhisperCrossAttention,
        WhisperMLP,
    )

    from vllm_omni_edge.quantization.config import CpuInt4Config

    cfg = CpuInt4Config(group_size=int4.DEFAULT_GROUP_SIZE, lm_head=False, prequantized=True, embedding="bf16")
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    for side in ("encoder", "decoder"):
        stack = torch.nn.Module()
        stack.layers = torch.nn.ModuleList()
        for i in range(2):
            prefix = f"model.{side}.layers.{i}"
            layer = torch.nn.Module()
            kind = AttentionType.ENCODER if side == "encoder" else AttentionType.DECODER
            layer.self_attn = WhisperAttention(D_MODEL, HEADS, attn_type=kind, quant_config=cfg,
                                               prefix=f"{prefix}.self_attn")
            if side == "decoder":
                layer.encoder_attn = WhisperCrossAttention(D_MODEL, HEADS, quant_config=cfg,
                                                           prefix=f"{prefix}.encoder_attn")
            layer.mlp = WhisperMLP(D_MODEL, FFN, "gelu", quant_config=cfg, prefix=f"{prefix}.mlp")
            stack.layers.append(layer)
        setattr(root.model, side, stack)
    return root


def test_vllm_whisper_layers_load_it_and_run_on_cpu_int4(tiny_whisper, tiny_whisper_int4, vllm_single_process):
    """Through vLLM's Whisper weight loader (its name mapper: q/k/v stacked into qkv_proj, the
    cross-attention k/v into kv_proj): every linear takes the cpu_int4 method and computes the
    stored weights' product, with the source's biases and a zero k bias on the right rows."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.models.whisper import WhisperForConditionalGeneration

    from tests.quantization.test_vllm_layers import kernel_tolerance
    from vllm_omni_edge.quantization.linear import CpuInt4LinearMethod

    out, _ = tiny_whisper_int4
    root = _vllm_whisper_layers()
    root.hf_to_vllm_mapper = WhisperForConditionalGeneration.hf_to_vllm_mapper  # its load_weights reads it
    tensors = load_file(str(out / "model.safetensors"))
    ours = re.compile(r"layers\.\d+\.((self_attn|encoder_attn)\.\w+_proj|fc[12])\.(qweight|scales|zeros|bias)$")
    loaded = WhisperForConditionalGeneration.load_weights(
        root, ((n, t) for n, t in tensors.items() if ours.search(n)))
    linears = {n: m for n, m in root.named_modules() if isinstance(m, LinearBase)}
    assert len(linears) == 2 * 4 + 2 * 7  # encoder: qkv, out, fc1, fc2; decoder: + q, kv, out
    assert all(isinstance(m.quant_method, CpuInt4LinearMethod) for m in linears.values())
    assert {n.rsplit(".", 1)[0] for n in loaded} == set(linears)
    for m in linears.values():
        m.quant_method.process_weights_after_loading(m)
    counts = evidence.kernel_counts()
    assert sum(v for k, v in counts.items() if k.startswith("linear:")) == len(linears), counts
    assert counts["fallback"] == 0, counts

    source = {n: t.float() for n, t in load_file(str(tiny_whisper / "model.safetensors")).items()}
    exact = {p: int4.dequantize(*(tensors[f"{p}.{s}"] for s in ("qweight", "scales", "zeros")))
             for p in linear_prefixes()}

    def bias(p):
        return source.get(f"{p}.bias", torch.zeros(exact[p].shape[0]))

    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "encoder_attn.kv_proj": ("encoder_attn.k_proj", "encoder_attn.v_proj"),
             "mlp.fc1": ("fc1",), "mlp.fc2": ("fc2",)}
    torch.manual_seed(1)
    for name, m in linears.items():
        layer_prefix, local = name.split(".", 4)[:4], name.split(".", 4)[4]
        parts = [f"{'.'.join(layer_prefix)}.{p}" for p in fused.get(local, (local,))]
        rows = 1500 if ".encoder." in name else 1  # the encoder's input rows; a decode step
        x = torch.randn(rows, m.input_size)
        ref = F.linear(x, torch.cat([exact[p] for p in parts]), torch.cat([bias(p) for p in parts]))
        got, out_bias = m(x)
        got = got if out_bias is None else got + out_bias
        assert relative_error(got, ref) < kernel_tolerance(), name


def test_models_pull_cpu_int4_builds_a_speech_model_and_serve_names_it(tiny_whisper, isolated_cache, monkeypatch):
    from vllm_omni_edge.cli.serve import ModelNotFoundError, edge_serve_argv
    from vllm_omni_edge.models import default_model as dm

    with pytest.raises(ModelNotFoundError, match=r"models pull whisper-base --cpu-int4"):
        edge_serve_argv(["whisper-base:cpu_int4"])
    monkeypatch.setattr(dm, "pull_model", lambda model, **_: tiny_whisper)
    out = dm.pull_cpu_int4_model(dm.WHISPER_BASE)
    assert out == isolated_cache / "models" / "whisper-base-cpu_int4"
    assert verify_manifest(out)["quantized_layers"] == linear_prefixes()
    argv = edge_serve_argv(["whisper-base:cpu_int4", "--port", "8001"])
    assert argv[:3] == ["vllm", "serve", str(out)]
    assert argv[argv.index("--served-model-name") + 1] == "whisper-base:cpu_int4"
