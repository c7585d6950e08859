"""The cpu_int4 builder on a tiny random Whisper, and vLLM's Whisper loading what it writes.

The default build stores the token embedding 4-bit, the head tied to it (format 3); ``--embedding
int8`` stores int8 rows and a 4-bit head of its own; ``--embedding bf16`` keeps the embedding as
stored (format 2, the first Whisper build). Patch ``whisper_int4_vocab`` makes vLLM's Whisper load
the first two; the last, and a float checkpoint, load exactly as vLLM builds them.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.quantization.helpers import relative_error, resident_dequantize
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


@pytest.fixture(scope="module")
def tiny_whisper_int4_stored(tiny_whisper, tmp_path_factory):
    """The first Whisper build: the token embedding as stored (format 2)."""
    out = tmp_path_factory.mktemp("whisper-int4-stored") / "tiny-whisper-cpu_int4"
    report = build_cpu_int4_checkpoint(tiny_whisper, out, progress=False, embedding="bf16")
    return out, report


@pytest.fixture(scope="module")
def tiny_whisper_int4_int8(tiny_whisper, tmp_path_factory):
    out = tmp_path_factory.mktemp("whisper-int4-int8") / "tiny-whisper-cpu_int4"
    report = build_cpu_int4_checkpoint(tiny_whisper, out, progress=False, embedding="int8")
    return out, report


EMBED = "model.decoder.embed_tokens"


def linear_prefixes() -> list[str]:
    return sorted([f"model.encoder.layers.{i}.{p}" for i in range(2) for p in ENCODER_PROJ]
                  + [f"model.decoder.layers.{i}.{p}" for i in range(2) for p in DECODER_PROJ])


def test_every_whisper_linear_is_4bit_and_the_rest_is_as_stored(tiny_whisper, tiny_whisper_int4_stored):
    out, report = tiny_whisper_int4_stored
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


def test_the_default_stores_the_token_embedding_4bit_once(tiny_whisper, tiny_whisper_int4):
    out, report = tiny_whisper_int4
    source = load_file(str(tiny_whisper / "model.safetensors"))
    tensors = load_file(str(out / "model.safetensors"))
    assert f"{EMBED}.weight" not in tensors and not any(n.startswith("proj_out.") for n in tensors)
    triple = [tensors[f"{EMBED}.{s}"] for s in ("qweight", "scales", "zeros")]
    int4.check_triple(*triple, EMBED)
    ref = source[f"{EMBED}.weight"].float()
    assert triple[0].shape == (ref.shape[0], D_MODEL // 2)
    assert float((int4.dequantize(*triple) - ref).norm() / ref.norm()) < 0.12
    quantized = {n for n in tensors if n.endswith((".qweight", ".scales", ".zeros"))}
    assert len(quantized) == 3 * (len(linear_prefixes()) + 1)
    for name, t in source.items():  # conv, positions, norms, biases: byte for byte
        prefix = name.removesuffix(".weight")
        if prefix not in linear_prefixes() and prefix != EMBED:
            assert torch.equal(tensors[name], t), name
    assert report.tensors[builder.TIED_4BIT] == 1 and builder.EMBEDDING_ROW not in report.tensors


def test_int8_rows_give_the_head_its_own_4bit_copy(tiny_whisper, tiny_whisper_int4_int8):
    out, report = tiny_whisper_int4_int8
    source = load_file(str(tiny_whisper / "model.safetensors"))
    tensors = load_file(str(out / "model.safetensors"))
    ref = source[f"{EMBED}.weight"].float()
    q, scales = tensors[f"{EMBED}.qweight"], tensors[f"{EMBED}.scales"]
    assert q.dtype == torch.int8 and q.shape == ref.shape and f"{EMBED}.zeros" not in tensors
    assert float((int4.dequantize_rows_int8(q, scales) - ref).norm() / ref.norm()) < 0.02
    head = [tensors[f"proj_out.{s}"] for s in ("qweight", "scales", "zeros")]
    int4.check_triple(*head, "proj_out")
    assert float((int4.dequantize(*head) - ref).norm() / ref.norm()) < 0.12
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["format_version"], config["embedding"], config["lm_head"]) == (3, "int8", True)
    assert verify_manifest(out)["head"] == "int4, its own proj_out"
    assert report.tensors[builder.EMBEDDING_INT8] == 1 and report.tensors[builder.HEAD_4BIT] == 1


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
    assert config["quantization_config"] == {
        "quant_method": "cpu_int4", "bits": 4, "group_size": int4.DEFAULT_GROUP_SIZE, "format_version": 3,
        "lm_head": True, "zero_point": "float", "embedding": "int4",
    }
    assert config["tie_word_embeddings"] is True
    manifest = verify_manifest(out)
    assert manifest["format_version"] == 3 and manifest["embedding"] == "int4"
    assert manifest["head"] == "int4, tied to the token embedding (one copy)"
    assert manifest["quantized_layers"] == sorted(linear_prefixes() + [EMBED])
    assert "embedding" not in manifest["kept_unquantized"]


def test_config_and_manifest_of_the_embedding_as_stored(tiny_whisper_int4_stored):
    out, _ = tiny_whisper_int4_stored
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


@pytest.mark.parametrize("option", [{"head": "bf16"}, {"embedding": "int8", "head": "bf16"},
                                    {"embedding": "bf16", "head": "int4"}])
def test_a_head_apart_from_its_embedding_is_refused_by_name(tiny_whisper, tmp_path, option):
    with pytest.raises(Int4FormatError, match=rf"--head {option['head']} .*whisper checkpoint's output head follows"):
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
    real = builder._store_quantized

    def skip_fc2(report, written, prefixes, prefix, weight, row, g, zp):
        if prefix.endswith("layers.1.fc2"):
            written[f"{prefix}.weight"] = weight
            prefixes.append(prefix)
            return
        real(report, written, prefixes, prefix, weight, row, g, zp)

    monkeypatch.setattr(builder, "_store_quantized", skip_fc2)
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
    assert verify_manifest(out)["quantized_layers"] == sorted(linear_prefixes() + [EMBED])
    argv = edge_serve_argv(["whisper-base:cpu_int4", "--port", "8001"])
    assert argv[:3] == ["vllm", "serve", str(out)]
    assert argv[argv.index("--served-model-name") + 1] == "whisper-base:cpu_int4"


@pytest.fixture
def load_vllm_whisper(_vllm_process_groups):
    """vLLM's WhisperForConditionalGeneration built and loaded by vLLM's loader from a directory
    (float32, as the server runs whisper-base on this CPU), with patch whisper_int4_vocab applied."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    from vllm_omni_edge.patches.base import apply_patch_module
    from vllm_omni_edge.quantization import register_cpu_int4

    register_cpu_int4()
    assert apply_patch_module("vllm_omni_edge.patches.worker.whisper_int4_vocab").status == "applied"

    def load(path, quantization=None):
        evidence.reset()
        model_config = ModelConfig(model=str(path), dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
                                   quantization=quantization)
        vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(),
                                 device_config=DeviceConfig("cpu"))
        with set_current_vllm_config(vllm_config):
            return get_model(vllm_config=vllm_config)

    yield load
    evidence.reset()


def _storages(model) -> dict[int, torch.Tensor]:
    return {t.untyped_storage().data_ptr(): t for t in list(model.parameters()) + list(model.buffers())}


def _decoder_hidden(vocab: int):
    torch.manual_seed(2)
    ids = torch.tensor([0, 5, vocab - 1, 90, 91, 5])
    return ids, torch.randn(3, D_MODEL)  # three decode rows


def test_vllm_whisper_reads_one_4bit_vocab_matrix_for_lookups_and_logits(tiny_whisper_int4, load_vllm_whisper):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from tests.quantization.test_vllm_layers import kernel_tolerance
    from vllm_omni_edge.quantization.embedding import KERNEL_LAYOUTS, CpuInt4EmbeddingMethod
    from vllm_omni_edge.quantization.linear import CpuInt4LinearMethod

    out, _ = tiny_whisper_int4
    model = load_vllm_whisper(out)
    embed, head = model.model.decoder.embed_tokens, model.proj_out
    assert isinstance(embed, VocabParallelEmbedding) and isinstance(embed.quant_method, CpuInt4EmbeddingMethod)
    assert isinstance(head.quant_method, CpuInt4LinearMethod) and head.quant_method.tied_embedding is embed
    # One copy: the embedding reads the head kernel's tensors; no float matrix of the vocabulary anywhere.
    layout = embed.int4_embed_layout
    counts = evidence.kernel_counts()
    assert counts[f"embedding:gather_{layout}"] == 1, counts
    assert counts[f"lm_head:{head.int4_kernel.name}"] == 1 and counts["fallback"] == 0, counts
    if head.int4_kernel.name in KERNEL_LAYOUTS:
        assert layout == KERNEL_LAYOUTS[head.int4_kernel.name]
        for name, _ in head.named_parameters():
            assert getattr(embed, name).untyped_storage().data_ptr() == getattr(head, name).untyped_storage().data_ptr()
    vocab = model.config.vocab_size
    float_vocab = [t.shape for t in _storages(model).values()
                   if t.is_floating_point() and t.dim() == 2 and t.shape[0] in (vocab, embed.num_embeddings_padded)
                   and t.shape[1] == D_MODEL]
    assert float_vocab == [], float_vocab
    assert not hasattr(head, "cpu_linear") and "weight" not in embed._parameters

    tensors = load_file(str(out / "model.safetensors"))
    exact = resident_dequantize(head, *(tensors[f"{EMBED}.{s}"] for s in ("qweight", "scales", "zeros")))
    ids, hidden = _decoder_hidden(vocab)
    assert torch.equal(model.embed_input_ids(ids), exact[ids])  # lookups: bit for bit
    logits = model.compute_logits(hidden)
    assert logits.shape == (3, vocab)
    assert relative_error(logits, F.linear(hidden, exact)) < kernel_tolerance()


def test_vllm_whisper_quantized_at_load_shares_one_4bit_matrix(tiny_whisper, load_vllm_whisper):
    """A float checkpoint with quantization="cpu_int4": the embedding quantized once, the head on it."""
    from tests.quantization.test_vllm_layers import kernel_tolerance
    from vllm_omni_edge.quantization.embedding import CpuInt4EmbeddingMethod

    model = load_vllm_whisper(tiny_whisper, quantization="cpu_int4")
    embed, head = model.model.decoder.embed_tokens, model.proj_out
    assert isinstance(embed.quant_method, CpuInt4EmbeddingMethod) and head.quant_method.tied_embedding is embed
    assert "weight" not in embed._parameters and "weight" not in head._parameters
    assert embed.qweight.untyped_storage().data_ptr() == head.qweight.untyped_storage().data_ptr()
    source = load_file(str(tiny_whisper / "model.safetensors"))[f"{EMBED}.weight"].float()
    # rows quantize independently; the lookup reads the head's resident weights
    exact = resident_dequantize(head, *int4.quantize(source, int4.DEFAULT_GROUP_SIZE))
    ids, hidden = _decoder_hidden(model.config.vocab_size)
    assert torch.equal(model.embed_input_ids(ids), exact[ids])
    assert relative_error(model.compute_logits(hidden), F.linear(hidden, exact)) < kernel_tolerance()


def test_vllm_whisper_int8_rows_and_its_own_4bit_head(tiny_whisper_int4_int8, load_vllm_whisper):
    from tests.quantization.test_vllm_layers import kernel_tolerance
    from vllm_omni_edge.quantization.embedding import CpuInt4EmbeddingMethod

    out, _ = tiny_whisper_int4_int8
    model = load_vllm_whisper(out)
    embed, head = model.model.decoder.embed_tokens, model.proj_out
    assert isinstance(embed.quant_method, CpuInt4EmbeddingMethod) and embed.quant_method.fmt == "int8"
    assert head.quant_method.tied_embedding is None
    tensors = load_file(str(out / "model.safetensors"))
    rows = int4.dequantize_rows_int8(tensors[f"{EMBED}.qweight"], tensors[f"{EMBED}.scales"])
    head_exact = int4.dequantize(*(tensors[f"proj_out.{s}"] for s in ("qweight", "scales", "zeros")))
    vocab = model.config.vocab_size
    ids, hidden = _decoder_hidden(vocab)
    assert torch.equal(model.embed_input_ids(ids), rows[ids])
    # The head computes with what proj_out.* holds (loaded by the patch; vLLM's mapper drops it).
    assert relative_error(model.compute_logits(hidden), F.linear(hidden, head_exact)) < kernel_tolerance()


@pytest.mark.parametrize("which", ["float", "embedding as stored"])
def test_vllm_whisper_without_a_quantized_vocab_is_built_as_vllm_builds_it(
        tiny_whisper, tiny_whisper_int4_stored, load_vllm_whisper, which):
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    model = load_vllm_whisper(tiny_whisper if which == "float" else tiny_whisper_int4_stored[0])
    embed, head = model.model.decoder.embed_tokens, model.proj_out
    assert type(embed) is torch.nn.Embedding and embed.padding_idx == 90
    assert isinstance(head.quant_method, UnquantizedEmbeddingMethod) and head.weight is embed.weight
    source = load_file(str(tiny_whisper / "model.safetensors"))[f"{EMBED}.weight"].float()
    assert torch.equal(embed.weight, source)
    ids, hidden = _decoder_hidden(model.config.vocab_size)
    assert torch.equal(model.embed_input_ids(ids), source[ids])
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, source))


def test_the_whisper_vocab_patch_is_idempotent(load_vllm_whisper):
    from vllm.model_executor.models import whisper

    from vllm_omni_edge.patches.worker import whisper_int4_vocab

    init, load = whisper.WhisperDecoder.__init__, whisper.WhisperForConditionalGeneration.load_weights
    whisper_int4_vocab._wrap(whisper)
    assert whisper.WhisperDecoder.__init__ is init
    assert whisper.WhisperForConditionalGeneration.load_weights is load
    assert not getattr(init.__wrapped__, whisper_int4_vocab.MARKER, False)
