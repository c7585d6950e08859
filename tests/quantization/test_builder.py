"""The checkpoint builder on a tiny random llama: what it writes, and how it fails."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.quantization.conftest import save_tiny_llama
from vllm_omni_edge.models.gguf_to_hf import UnsupportedCheckpointError
from vllm_omni_edge.quantization import builder, int4
from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint
from vllm_omni_edge.quantization.manifest import (
    MANIFEST_NAME,
    CheckpointIntegrityError,
    verify_manifest,
)

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_every_linear_and_the_tied_head_are_4bit(tiny_llama, tiny_llama_int4):
    tensors = load_file(str(tiny_llama_int4 / "model.safetensors"))
    source = load_file(str(tiny_llama / "model.safetensors"))
    for layer in range(2):
        for proj in PROJ:
            prefix = f"model.layers.{layer}.{proj}"
            assert f"{prefix}.weight" not in tensors
            triple = [tensors[f"{prefix}.{s}"] for s in ("qweight", "scales", "zeros")]
            int4.check_triple(*triple, prefix)
    # down_proj has K=192: group 128 does not divide it, so it is stored with 64.
    assert tensors["model.layers.0.mlp.down_proj.scales"].shape == (128, 3)
    assert tensors["model.layers.0.mlp.up_proj.scales"].shape == (192, 1)

    # The tied head and the embedding: one 4-bit matrix, stored as the embedding (format 3;
    # tests/quantization/test_embedding_int4.py has the rest, and format 2's bf16 embedding).
    assert "lm_head.weight" not in tensors and "lm_head.qweight" not in tensors
    assert "model.embed_tokens.weight" not in tensors
    emb = source["model.embed_tokens.weight"].float()
    stored = int4.dequantize(*(tensors[f"model.embed_tokens.{s}"] for s in ("qweight", "scales", "zeros")))
    assert float((stored - emb).norm() / emb.norm()) < 0.12

    config = json.loads((tiny_llama_int4 / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["quantization_config"] == {
        "quant_method": "cpu_int4", "bits": 4, "group_size": 128,
        "format_version": 3, "lm_head": True, "zero_point": "float", "embedding": "int4",
    }
    assert (tiny_llama_int4 / "generation_config.json").is_file()
    assert verify_manifest(tiny_llama_int4)["group_size"] == 128


def test_untied_head_is_quantized_from_lm_head(tmp_path):
    src = save_tiny_llama(tmp_path / "untied", tie_word_embeddings=False, dtype=torch.float16)
    report = build_cpu_int4_checkpoint(src, tmp_path / "out", group_size=64, progress=False)
    source = load_file(str(src / "model.safetensors"))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        head = int4.dequantize(*(f.get_tensor(f"lm_head.{s}") for s in ("qweight", "scales", "zeros")))
    ref = source["lm_head.weight"].float()
    assert float((head - ref).norm() / ref.norm()) < 0.12
    assert report.tensors[builder.HEAD_4BIT] == 1
    assert report.source_bytes[builder.HEAD_4BIT] == ref.numel() * 2  # fp16 source head


def test_bf16_head_tied_is_stored_once_as_the_embedding(tiny_llama, tmp_path):
    report = build_cpu_int4_checkpoint(tiny_llama, tmp_path / "out", group_size=64, progress=False,
                                       embedding="bf16", head="bf16")
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    source = load_file(str(tiny_llama / "model.safetensors"))
    assert not any(n.startswith("lm_head.") for n in tensors)
    assert torch.equal(tensors["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    assert "model.layers.0.mlp.up_proj.qweight" in tensors
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["quantization_config"]["lm_head"] is False
    assert config["quantization_config"]["format_version"] == 2
    assert verify_manifest(tmp_path / "out")["head"] == "bf16"
    assert report.tensors.get(builder.HEAD_4BIT, 0) == 0 and report.tensors.get(builder.HEAD_BF16, 0) == 0


def test_bf16_head_untied_is_copied_unchanged(tmp_path):
    src = save_tiny_llama(tmp_path / "untied", tie_word_embeddings=False)
    report = build_cpu_int4_checkpoint(src, tmp_path / "out", group_size=64, progress=False,
                                       embedding="bf16", head="bf16")
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    source = load_file(str(src / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], source["lm_head.weight"])
    assert "lm_head.qweight" not in tensors
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["lm_head"] is False
    assert report.tensors[builder.HEAD_BF16] == 1


def test_default_formats_follow_the_source():
    assert builder.default_formats(None, None, None) == ("int4", "int4")
    assert builder.default_formats(True, None, None) == ("bf16", "bf16")  # a tied GGUF head
    assert builder.default_formats(False, None, None) == ("int4", "int4")  # an untied one
    # An explicit 4-bit/int8 embedding on a GGUF gets a 4-bit head; explicit values are kept.
    assert builder.default_formats(True, "int8", None) == ("int8", "int4")
    assert builder.default_formats(True, "int4", "int4") == ("int4", "int4")
    assert builder.default_formats(None, "bf16", "bf16") == ("bf16", "bf16")


def test_gguf_ties_head_reads_the_file(tmp_path):
    from tests.gguf_tiny import write_tiny_gguf

    assert builder.gguf_ties_head(write_tiny_gguf(tmp_path / "q.gguf", "qwen2")) is True
    assert builder.gguf_ties_head(write_tiny_gguf(tmp_path / "l.gguf", "llama")) is False


def test_bf16_head_needs_a_bf16_embedding(tiny_llama, tmp_path):
    with pytest.raises(int4.Int4FormatError, match="a bf16 head needs a bf16 input embedding"):
        build_cpu_int4_checkpoint(tiny_llama, tmp_path / "out", progress=False, embedding="int4", head="bf16")
    with pytest.raises(int4.Int4FormatError, match="head 'int8' is not supported"):
        build_cpu_int4_checkpoint(tiny_llama, tmp_path / "out2", progress=False, embedding="bf16", head="int8")
    assert not (tmp_path / "out").exists()


def test_report_table_counts_bytes_by_class(tiny_llama, tmp_path):
    report = build_cpu_int4_checkpoint(tiny_llama, tmp_path / "out", group_size=128, progress=False,
                                       embedding="int4")
    assert report.tensors[builder.LINEAR_4BIT] == 14
    assert report.tensors[builder.TIED_4BIT] == 1  # the tied embedding/head, once
    assert report.tensors[builder.NORMS] == 5
    assert report.written_bytes[builder.LINEAR_4BIT] < report.source_bytes[builder.LINEAR_4BIT] / 3
    assert report.written_bytes[builder.TIED_4BIT] < report.source_bytes[builder.TIED_4BIT] / 3
    assert report.group_size_fallbacks == {f"model.layers.{i}.mlp.down_proj": 64 for i in range(2)}
    table = report.table()
    for row in ("linear 4-bit", "emb+head 4-bit", "norms", "total", "stored with group 64"):
        assert row in table


def test_failure_leaves_nothing_behind(tiny_llama, tmp_path, monkeypatch):
    def broken(*_a, **_k):
        raise builder.CheckpointBuildError("injected")

    monkeypatch.setattr(builder, "_verify_written", broken)
    out = tmp_path / "out"
    with pytest.raises(builder.CheckpointBuildError, match="injected"):
        build_cpu_int4_checkpoint(tiny_llama, out, progress=False)
    assert os.listdir(tmp_path) == []  # no OUT, no .partial directory


def test_failed_rebuild_keeps_the_previous_checkpoint(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "out"
    build_cpu_int4_checkpoint(tiny_llama, out, progress=False)
    before = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(builder, "quantize", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        build_cpu_int4_checkpoint(tiny_llama, out, progress=False, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_truncated_and_modified_weights_are_detected(tiny_llama_int4, tmp_path):
    import shutil

    for damage, message in (("truncate", "bytes, the manifest says"), ("flip", "SHA-256")):
        copy = tmp_path / damage
        shutil.copytree(tiny_llama_int4, copy)
        weights = copy / "model.safetensors"
        data = bytearray(weights.read_bytes())
        if damage == "truncate":
            data = data[: len(data) - 100]
        else:
            data[-50] ^= 0xFF
        weights.write_bytes(bytes(data))
        with pytest.raises(CheckpointIntegrityError, match=message):
            verify_manifest(copy)


def test_writes_only_metadata_files_it_should(tiny_llama_int4):
    names = sorted(os.listdir(tiny_llama_int4))
    assert names == sorted(["config.json", "generation_config.json", "model.safetensors", MANIFEST_NAME])


# --- bad input -------------------------------------------------------------


def test_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="source checkpoint not found"):
        build_cpu_int4_checkpoint(tmp_path / "nope", tmp_path / "out", progress=False)


def test_directory_without_config(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(UnsupportedCheckpointError, match="no config.json"):
        build_cpu_int4_checkpoint(tmp_path / "src", tmp_path / "out", progress=False)


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedCheckpointError, match="not a .gguf"):
        build_cpu_int4_checkpoint(tmp_path / "model.bin", tmp_path / "out", progress=False)


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedCheckpointError, match="architecture 'gpt2' is not supported"):
        build_cpu_int4_checkpoint(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _tiny_checkpoint(path, tensors, **config):
    path.mkdir()
    config = {"model_type": "llama", "tie_word_embeddings": True, **config}
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_unsupported_dtype(tmp_path):
    src = _tiny_checkpoint(tmp_path / "src", {
        "model.embed_tokens.weight": torch.zeros(64, 64),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(64, 64, dtype=torch.float64),
    })
    with pytest.raises(int4.Int4FormatError, match="dtype torch.float64 is not supported"):
        build_cpu_int4_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_k_no_group_size_divides(tmp_path):
    src = _tiny_checkpoint(tmp_path / "src", {
        "model.embed_tokens.weight": torch.zeros(64, 64),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 40),
    })
    with pytest.raises(int4.Int4FormatError, match="down_proj: in_features K=40"):
        build_cpu_int4_checkpoint(src, tmp_path / "out", progress=False)


def test_unknown_2d_tensor_is_not_left_unquantized_silently(tmp_path):
    src = _tiny_checkpoint(tmp_path / "src", {
        "model.embed_tokens.weight": torch.zeros(64, 64),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(64, 64),
        "model.layers.0.adapter.weight": torch.zeros(64, 64),
    })
    with pytest.raises(UnsupportedCheckpointError, match="adapter.weight"):
        build_cpu_int4_checkpoint(src, tmp_path / "out", progress=False)


def test_already_quantized_and_unknown_architecture(tmp_path):
    tensors = {"model.embed_tokens.weight": torch.zeros(64, 64)}
    src = _tiny_checkpoint(tmp_path / "q", tensors, quantization_config={"quant_method": "awq"})
    with pytest.raises(UnsupportedCheckpointError, match="already quantized"):
        build_cpu_int4_checkpoint(src, tmp_path / "out", progress=False)
    src = _tiny_checkpoint(tmp_path / "t5", tensors, model_type="t5")
    with pytest.raises(UnsupportedCheckpointError, match="model_type 't5' is not supported"):
        build_cpu_int4_checkpoint(src, tmp_path / "out", progress=False)


def test_truncated_source_safetensors(tiny_llama, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(UnsupportedCheckpointError, match="cannot read"):
        build_cpu_int4_checkpoint(src, tmp_path / "out", progress=False)


def test_existing_output_needs_overwrite(tiny_llama, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="--overwrite"):
        build_cpu_int4_checkpoint(tiny_llama, tmp_path / "out", progress=False)


def test_cli_main(tiny_llama, tmp_path, capsys):
    assert builder.main([str(tiny_llama), str(tmp_path / "out"), "--group-size", "64", "--no-progress"]) == 0
    assert "linear 4-bit" in capsys.readouterr().out
    assert builder.main([str(tmp_path / "missing"), str(tmp_path / "out2"), "--no-progress"]) == 2
    assert "error: source checkpoint not found" in capsys.readouterr().err
