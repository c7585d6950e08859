"""The 4-bit input embedding (format 3): lookup, builder output, one copy for a tied head, old formats."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.quantization.conftest import save_tiny_llama
from tests.quantization.helpers import resident_dequantize
from vllm_omni_edge.quantization import builder, evidence, int4
from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint
from vllm_omni_edge.quantization.embedding import LAYOUT_ROWS8, LAYOUT_ROWS16, LAYOUT_STORED, lookup

BF16 = torch.bfloat16
IDS = torch.tensor([[0, 5, 17, 319], [16, 15, 31, 5]])  # tile edges, repeats, the last row


def triple(n=320, k=128, g=32, zero_point="float", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return int4.quantize(torch.randn(n, k, generator=gen) * 0.05, g, zero_point=zero_point)


def rows16_op():
    return interleave_op(LAYOUT_ROWS16)


def interleave_op(layout):
    from vllm_omni_edge.quantization.kernels import native

    loaded, why = native.load_library()
    if not loaded:
        pytest.skip(f"the C++ ops (interleave_{layout}) are unavailable: {why}")
    from vllm_omni_edge.quantization.kernels.w4a8_avx2 import interleave_rows8
    from vllm_omni_edge.quantization.kernels.w4a8_avx512 import interleave_rows16

    return {LAYOUT_ROWS8: interleave_rows8, LAYOUT_ROWS16: interleave_rows16}[layout]


@pytest.mark.parametrize("zero_point", ["float", "int"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("g", [32, 64])
def test_lookup_on_the_stored_layout_is_dequantize_of_the_rows(zero_point, dtype, g):
    t = triple(g=g, zero_point=zero_point)
    out = lookup(IDS, *t, LAYOUT_STORED, dtype)
    assert out.shape == (2, 4, 128) and out.dtype == dtype
    assert torch.equal(out, int4.dequantize(*t, dtype=dtype)[IDS])


@pytest.mark.parametrize("layout", [LAYOUT_ROWS16, LAYOUT_ROWS8])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_lookup_on_an_interleaved_layout_is_dequantize_of_the_stored_rows(dtype, layout):
    t = triple()
    packed = interleave_op(layout)(*t)
    assert not torch.equal(packed[0], t[0])  # really another layout
    assert torch.equal(lookup(IDS, *packed, layout, dtype), int4.dequantize(*t, dtype=dtype)[IDS])
    every = torch.arange(320)
    assert torch.equal(lookup(every, *packed, layout, BF16), int4.dequantize(*t, dtype=BF16))


def test_lookup_traces_with_dynamic_token_counts():
    """vLLM compiles the lookup inside the model graph with a symbolic token count."""
    packed = rows16_op()(*triple())
    ref = int4.dequantize(*triple(), dtype=BF16)
    fn = torch.compile(lambda ids: lookup(ids, *packed, LAYOUT_ROWS16, BF16), backend="aot_eager",
                       dynamic=True, fullgraph=True)
    for n in (1, 3, 7):
        ids = torch.arange(n) * 37 % 320
        assert torch.equal(fn(ids), ref[ids])


@pytest.mark.slow
def test_lookup_under_inductor_is_exact():
    packed = rows16_op()(*triple())
    ref = int4.dequantize(*triple(), dtype=BF16)
    fn = torch.compile(lambda ids: lookup(ids, *packed, LAYOUT_ROWS16, BF16), dynamic=True, fullgraph=True)
    for n in (1, 5):
        ids = torch.arange(n) * 53 % 320
        assert torch.equal(fn(ids), ref[ids])


# --- builder ------------------------------------------------------------------------------------


def test_builder_stores_a_tied_matrix_once_as_the_4bit_embedding(tiny_llama, tmp_path):
    out = tmp_path / "v3"
    report = build_cpu_int4_checkpoint(tiny_llama, out, group_size=32, progress=False, embedding="int4")
    tensors = load_file(str(out / "model.safetensors"))
    assert "model.embed_tokens.weight" not in tensors
    assert not [n for n in tensors if n.startswith("lm_head.")]
    emb = [tensors[f"model.embed_tokens.{s}"] for s in ("qweight", "scales", "zeros")]
    assert int4.check_triple(*emb, "embed") == 32
    source = load_file(str(tiny_llama / "model.safetensors"))["model.embed_tokens.weight"].float()
    assert float((int4.dequantize(*emb) - source).norm() / source.norm()) < 0.12
    assert not [n for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2]  # no bf16 matrix left
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["quantization_config"]["format_version"] == int4.FORMAT_VERSION == 3
    assert config["quantization_config"]["embedding"] == "int4"
    assert report.tensors[builder.TIED_4BIT] == 1 and not report.tensors.get(builder.HEAD_4BIT)


def test_builder_stores_an_untied_embedding_and_head_each_4bit(tmp_path):
    src = save_tiny_llama(tmp_path / "untied", tie_word_embeddings=False)
    report = build_cpu_int4_checkpoint(src, tmp_path / "out", group_size=32, progress=False)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "model.embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    assert {"model.embed_tokens.qweight", "lm_head.qweight"} <= tensors.keys()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["format_version"] == 3
    assert report.tensors[builder.EMBEDDING_4BIT] == 1 and report.tensors[builder.HEAD_4BIT] == 1


def test_builder_embedding_bf16_writes_format_2(tiny_llama, tmp_path):
    out = tmp_path / "v2"
    build_cpu_int4_checkpoint(tiny_llama, out, group_size=32, progress=False, embedding="bf16")
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].dtype == BF16 and "lm_head.qweight" in tensors
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["quantization_config"]["format_version"] == 2
    assert "embedding" not in config["quantization_config"]


# --- in vLLM layers -----------------------------------------------------------------------------


def _embed_and_tied_head(cfg, vocab=320, hidden=128):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embed = VocabParallelEmbedding(vocab, hidden, params_dtype=BF16, quant_config=cfg, prefix="model.embed_tokens")
    head = ParallelLMHead(vocab, hidden, params_dtype=BF16, quant_config=cfg, prefix="lm_head")
    return embed, head.tie_weights(embed)


def _unique_bytes(*modules):
    seen, total = set(), 0
    for m in modules:
        for p in m.parameters():
            if p.untyped_storage().data_ptr() not in seen:
                seen.add(p.untyped_storage().data_ptr())
                total += p.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("forced", [None, "avx2_w4a8_rows8"], ids=["routed", "rows8"])
@pytest.mark.parametrize("order", ["embedding_first", "head_first"])
def test_prequantized_tied_head_and_embedding_share_one_copy(vllm_single_process, order, forced, monkeypatch):
    from vllm_omni_edge.quantization.config import CpuInt4Config
    from vllm_omni_edge.quantization.embedding import CpuInt4EmbeddingMethod, KERNEL_LAYOUTS
    from vllm_omni_edge.quantization.kernels import KERNEL_ENV

    if forced:
        interleave_op(LAYOUT_ROWS8)  # skips where the C++ ops are not built
        monkeypatch.setenv(KERNEL_ENV, forced)
    cfg = CpuInt4Config.from_config({"quant_method": "cpu_int4", "bits": 4, "group_size": 32,
                                     "format_version": 3, "zero_point": "float", "embedding": "int4"})
    embed, head = _embed_and_tied_head(cfg)
    assert isinstance(embed.quant_method, CpuInt4EmbeddingMethod)
    assert head.qweight is embed.qweight  # loaded once, by the embedding's name
    t = triple()
    for name, tensor in zip(("qweight", "scales", "zeros"), t):
        param = getattr(embed, name)
        param.weight_loader(param, tensor)
    layers = [embed, head] if order == "embedding_first" else [head, embed]
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)

    kernel = head.int4_kernel.name
    assert kernel == (forced or kernel)
    exact = resident_dequantize(head, *t, dtype=BF16)  # the head's weights, which the lookup shares
    assert torch.equal(embed(IDS), exact[IDS])
    logits = head.quant_method.apply(head, torch.randn(2, 128).to(BF16))
    assert logits.shape == (2, 320)
    if kernel in KERNEL_LAYOUTS:
        for name, _ in head.named_parameters():
            assert getattr(embed, name) is getattr(head, name)
        assert embed.int4_embed_layout == KERNEL_LAYOUTS[kernel]
        assert _unique_bytes(embed, head) == sum(p.numel() * p.element_size() for p in head.parameters())
        assert _unique_bytes(embed, head) <= sum(x.numel() * x.element_size() for x in t)
    assert evidence.kernel_counts()[f"embedding:gather_{embed.int4_embed_layout}"] == 1


def test_online_tied_embedding_is_quantized_once_and_the_bf16_table_dropped(vllm_single_process):
    from vllm_omni_edge.quantization.config import CpuInt4Config
    from vllm_omni_edge.quantization.embedding import KERNEL_LAYOUTS

    embed, head = _embed_and_tied_head(CpuInt4Config())  # LLM(model=bf16_dir, quantization="cpu_int4")
    assert head.weight is embed.weight
    table = (torch.randn(320, 128) * 0.05).to(BF16)
    embed.weight.weight_loader(embed.weight, table)
    assert torch.equal(embed(IDS), table[IDS])  # before processing: the bf16 table
    embed.quant_method.process_weights_after_loading(embed)
    head.quant_method.process_weights_after_loading(head)
    assert "weight" not in dict(embed.named_parameters()) and "weight" not in dict(head.named_parameters())
    assert not [p for p in list(embed.parameters()) + list(head.parameters()) if p.dtype == BF16 and p.dim() == 2
                and p.shape[1] == 128]
    t = int4.quantize(table, 32)
    assert torch.equal(embed(IDS), resident_dequantize(head, *t, dtype=BF16)[IDS])
    if head.int4_kernel.name in KERNEL_LAYOUTS:
        assert embed.qweight is head.qweight


def test_online_untied_embedding_keeps_its_own_4bit_rows(vllm_single_process):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from vllm_omni_edge.quantization.config import CpuInt4Config

    embed = VocabParallelEmbedding(320, 128, params_dtype=BF16, quant_config=CpuInt4Config())
    table = (torch.randn(320, 128) * 0.05).to(BF16)
    embed.weight.weight_loader(embed.weight, table)
    embed.quant_method.process_weights_after_loading(embed)
    assert set(dict(embed.named_parameters())) == {"qweight", "scales", "zeros"}
    assert torch.equal(embed(IDS), int4.dequantize(*int4.quantize(table, 32), dtype=BF16)[IDS])
    assert evidence.kernel_counts()["embedding:gather_stored"] == 1


@pytest.mark.parametrize("version", [1, 2])
def test_old_formats_keep_a_bf16_embedding_and_their_own_head(vllm_single_process, version):
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_omni_edge.quantization.config import CpuInt4Config

    cfg = CpuInt4Config.from_config({"quant_method": "cpu_int4", "bits": 4, "group_size": 32,
                                     "format_version": version, "zero_point": True if version == 1 else "float"})
    assert cfg.embedding == "bf16"
    embed, head = _embed_and_tied_head(cfg)
    assert isinstance(embed.quant_method, UnquantizedEmbeddingMethod)
    assert head.qweight is not None and "weight" in dict(embed.named_parameters())
    assert head.qweight is not getattr(embed, "qweight", None)


def test_online_embedding_bf16_setting_keeps_the_old_behaviour(vllm_single_process):
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_omni_edge.quantization.config import CpuInt4Config

    cfg = CpuInt4Config.from_config_dict_json('{"embedding": "bf16"}')
    embed, head = _embed_and_tied_head(cfg)
    assert isinstance(embed.quant_method, UnquantizedEmbeddingMethod) and head.weight is embed.weight


def test_format_3_without_int4_embedding_is_refused():
    from vllm_omni_edge.quantization.config import CpuInt4Config

    with pytest.raises(int4.Int4FormatError, match="embedding"):
        CpuInt4Config.from_config({"quant_method": "cpu_int4", "bits": 4, "group_size": 32,
                                   "format_version": 3, "zero_point": "float", "embedding": "bf16"})


# --- int8 rows (the embedding format for when 4-bit costs quality) ------------------------------


def test_int8_rows_lookup_is_dequantize_of_the_rows():
    from vllm_omni_edge.quantization.embedding import lookup_int8

    w = torch.randn(320, 128) * 0.05
    q, s = int4.quantize_rows_int8(w)
    assert q.dtype == torch.int8 and s.shape == (320, 1) and int(q.abs().max()) <= 127
    assert float((int4.dequantize_rows_int8(q, s) - w).abs().max()) <= float(s.float().max()) / 2 + 1e-6
    assert torch.equal(lookup_int8(IDS, q, s, BF16), int4.dequantize_rows_int8(q, s, dtype=BF16)[IDS])


def test_builder_int8_embedding_and_a_tied_head_of_its_own(tiny_llama, tmp_path):
    out = tmp_path / "int8"
    report = build_cpu_int4_checkpoint(tiny_llama, out, group_size=32, progress=False, embedding="int8")
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.embed_tokens.qweight"].dtype == torch.int8 and "model.embed_tokens.weight" not in tensors
    assert "lm_head.qweight" in tensors
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert (config["quantization_config"]["format_version"], config["quantization_config"]["embedding"]) == (3, "int8")
    assert report.tensors[builder.EMBEDDING_INT8] == 1


def test_prequantized_int8_embedding_loads_and_looks_up(vllm_single_process):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from vllm_omni_edge.quantization.config import CpuInt4Config

    cfg = CpuInt4Config.from_config({"quant_method": "cpu_int4", "bits": 4, "group_size": 32,
                                     "format_version": 3, "zero_point": "float", "embedding": "int8"})
    embed = VocabParallelEmbedding(300, 128, params_dtype=BF16, quant_config=cfg)
    q, s = int4.quantize_rows_int8(torch.randn(300, 128) * 0.05)
    for name, t in (("qweight", q), ("scales", s)):
        getattr(embed, name).weight_loader(getattr(embed, name), t)
    embed.quant_method.process_weights_after_loading(embed)
    ids = IDS % 300
    assert torch.equal(embed(ids), int4.dequantize_rows_int8(q, s, dtype=BF16)[ids])
    assert evidence.kernel_counts()["embedding:gather_int8"] == 1


def test_a_tied_head_gets_int8_rows_and_its_own_4bit_copy_by_default(tiny_llama, tmp_path):
    out = tmp_path / "default"
    report = build_cpu_int4_checkpoint(tiny_llama, out, group_size=32, progress=False)
    tensors = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["embedding"] == "int8" == int4.TIED_HEAD_EMBEDDING
    assert tensors["model.embed_tokens.qweight"].dtype == torch.int8
    assert int4.check_triple(*(tensors[f"lm_head.{s}"] for s in ("qweight", "scales", "zeros")), "head") == 32
    assert builder.built_formats(out) == builder.default_build_formats(tiny_llama) == ("int8", "int4")
    assert report.embedding == "int8"


def test_an_untied_source_keeps_the_4bit_embedding_by_default(tmp_path):
    src = save_tiny_llama(tmp_path / "untied-default", tie_word_embeddings=False)
    out = tmp_path / "out-default"
    build_cpu_int4_checkpoint(src, out, group_size=32, progress=False)
    assert builder.built_formats(out) == builder.default_build_formats(src) == ("int4", "int4")


def test_online_quantization_chooses_the_embedding_as_the_builder_does():
    from types import SimpleNamespace

    from vllm_omni_edge.quantization.config import CpuInt4Config

    tied, untied = SimpleNamespace(tie_word_embeddings=True), SimpleNamespace(tie_word_embeddings=False)
    for hf_config, expected in ((tied, int4.TIED_HEAD_EMBEDDING), (untied, "int4")):
        config = CpuInt4Config()
        config.maybe_update_config("/nonexistent", hf_config=hf_config)
        assert config.embedding == expected
    asked = CpuInt4Config.from_config_dict_json('{"embedding": "int4"}')
    asked.maybe_update_config("/nonexistent", hf_config=tied)
    assert asked.embedding == "int4"
