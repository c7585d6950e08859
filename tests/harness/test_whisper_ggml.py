"""baselines/whisper_ggml.py: a transformers Whisper checkpoint written as whisper.cpp's model file.

A tiny random Whisper (1 layer each side, d_model 64, the real vocabulary size so whisper.cpp
places its special tokens as for whisper-base) is written, read back field by field, and loaded
and run by whisper.cpp itself (pywhispercpp) in a child process, since a file it refuses can
also crash it.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vllm_omni_edge_bench.baselines import whisper_ggml as wg

N_BPE = 50257  # whisper-base: BPE tokens 0..50256, <|endoftext|> 50257


def _tiny_checkpoint(path: Path) -> Path:
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=51865, d_model=64, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=256,
                           decoder_ffn_dim=256, num_mel_bins=80, max_source_positions=1500,
                           max_target_positions=448)
    WhisperForConditionalGeneration(config).to(torch.float16).save_pretrained(path, safe_serialization=True)
    alphabet = sorted(wg._byte_decoder(), key=wg._byte_decoder().get)  # byte b is token b
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({f"tok{i}": i for i in range(256, N_BPE)})
    vocab["<|endoftext|>"] = N_BPE
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": N_BPE, "content": "<|endoftext|>"}]}))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ckpt = _tiny_checkpoint(tmp_path_factory.mktemp("tiny-whisper"))
    return ckpt, wg.write_ggml(ckpt, ckpt / "ggml-f16.bin")


def read_ggml(path: Path) -> dict:
    data = Path(path).read_bytes()
    pos = 0

    def ints(n, fmt="i"):
        nonlocal pos
        out = struct.unpack_from(f"<{n}{fmt}", data, pos)
        pos += 4 * n
        return out

    magic, *hparams = ints(12)
    n_mel, n_freq = ints(2)
    filters = np.frombuffer(data, "<f4", n_mel * n_freq, pos).reshape(n_mel, n_freq)
    pos += 4 * n_mel * n_freq
    (n_tokens,) = ints(1)
    tokens = []
    for _ in range(n_tokens):
        (length,) = ints(1, "I")
        tokens.append(data[pos:pos + length])
        pos += length
    tensors = {}
    while pos < len(data):
        n_dims, name_len, ttype = ints(3)
        dims = ints(n_dims)
        name = data[pos:pos + name_len].decode()
        pos += name_len
        size = int(np.prod(dims)) * (2 if ttype == wg.F16 else 4)
        tensors[name] = (ttype, tuple(reversed(dims)), np.frombuffer(data, "<f2" if ttype == wg.F16 else "<f4",
                                                                      int(np.prod(dims)), pos))
        pos += size
    return {"magic": magic, "hparams": hparams, "filters": filters, "tokens": tokens, "tensors": tensors}


def test_header_filters_tokens_and_tensors(tiny):
    ckpt, path = tiny
    f = read_ggml(path)
    assert f["magic"] == wg.GGML_MAGIC
    assert f["hparams"] == [51865, 1500, 64, 2, 1, 448, 64, 2, 1, 80, wg.F16]
    assert f["filters"].shape == (80, 201) and f["filters"].max() > 0
    assert len(f["tokens"]) == N_BPE and f["tokens"][ord("A")] == b"A" and f["tokens"][ord(" ")] == b" " and f["tokens"][300] == b"tok300"
    assert set(f["tensors"]) == wg.expected_tensors({"encoder_layers": 1, "decoder_layers": 1})
    t = f["tensors"]
    assert t["encoder.conv1.weight"][:2] == (wg.F16, (64, 80, 3))
    assert t["encoder.conv1.bias"][:2] == (wg.F32, (64, 1))
    assert t["encoder.positional_embedding"][:2] == (wg.F32, (1500, 64))
    assert t["decoder.token_embedding.weight"][:2] == (wg.F16, (51865, 64))
    assert t["decoder.blocks.0.cross_attn.query.bias"][:2] == (wg.F32, (64,))
    assert "decoder.blocks.0.attn.key.bias" not in t  # Whisper's key projections have no bias


def test_values_are_the_checkpoints(tiny):
    from safetensors.numpy import load_file

    ckpt, path = tiny
    weights = load_file(str(ckpt / "model.safetensors"))
    t = read_ggml(path)["tensors"]
    np.testing.assert_array_equal(t["decoder.blocks.0.mlp.2.weight"][2],
                                  weights["model.decoder.layers.0.fc2.weight"].ravel())
    np.testing.assert_array_equal(t["encoder.blocks.0.attn.value.bias"][2],
                                  weights["model.encoder.layers.0.self_attn.v_proj.bias"].astype(np.float32))


@pytest.mark.parametrize("hf, ggml", [
    ("model.encoder.layers.3.self_attn.k_proj.weight", "encoder.blocks.3.attn.key.weight"),
    ("model.decoder.layers.0.encoder_attn.k_proj.weight", "decoder.blocks.0.cross_attn.key.weight"),
    ("model.decoder.layers.5.encoder_attn_layer_norm.bias", "decoder.blocks.5.cross_attn_ln.bias"),
    ("model.decoder.layers.1.fc2.bias", "decoder.blocks.1.mlp.2.bias"),
    ("model.encoder.layer_norm.weight", "encoder.ln_post.weight"),
    ("model.decoder.embed_tokens.weight", "decoder.token_embedding.weight"),
    ("proj_out.weight", None),
])
def test_names(hf, ggml):
    assert wg.ggml_name(hf) == ggml


def test_an_unknown_tensor_is_refused_by_name():
    with pytest.raises(wg.GgmlConversionError, match="model.encoder.layers.0.adapter.weight"):
        wg.ggml_name("model.encoder.layers.0.adapter.weight")


def test_a_checkpoint_missing_a_tensor_is_refused(tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    ckpt, _ = tiny
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "vocab.json", "tokenizer.json"):
        (broken / name).write_bytes((ckpt / name).read_bytes())
    weights = load_file(str(ckpt / "model.safetensors"))
    del weights["model.decoder.layers.0.encoder_attn.v_proj.bias"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(wg.GgmlConversionError, match="missing .*decoder.blocks.0.cross_attn.value.bias"):
        wg.write_ggml(broken, tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()


def test_a_feed_forward_width_whisper_cpp_cannot_build_is_refused(tiny, tmp_path):
    ckpt, _ = tiny
    config = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(wg.GgmlConversionError, match="decoder_ffn_dim is 128; whisper.cpp takes only 4 \\* d_model"):
        wg._hparams({**config, "decoder_ffn_dim": 128})


def test_not_a_whisper_directory_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        wg.write_ggml(tmp_path, tmp_path / "out.bin")


def test_the_cache_is_keyed_by_the_weights(tiny, tmp_path):
    ckpt, _ = tiny
    first = wg.ensure_ggml(ckpt, tmp_path)
    assert wg.ensure_ggml(ckpt, tmp_path) == first
    assert wg.ensure_ggml(ckpt, tmp_path, ftype=wg.F32) != first


def test_whisper_cpp_loads_and_runs_the_file(tiny, tmp_path):
    pytest.importorskip("pywhispercpp")
    _, path = tiny
    log = tmp_path / "whisper.log"
    script = f"""
import numpy as np, _pywhispercpp as pw
from pywhispercpp.model import Model
m = Model({str(path)!r}, redirect_whispercpp_logs_to={str(log)!r}, n_threads=1, language="en", max_tokens=4,
          print_progress=False, print_realtime=False)
print(pw.whisper_model_n_vocab(m._ctx), pw.whisper_model_n_audio_layer(m._ctx), pw.whisper_model_ftype(m._ctx))
m.transcribe(np.zeros(16000, np.float32))
print("ran")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    text = log.read_text(errors="replace") if log.exists() else ""
    assert done.returncode == 0, (done.stdout, done.stderr[-2000:], text[-2000:])
    assert done.stdout.split() == ["51865", "1", "1", "ran"], done.stdout
    assert "ERROR" not in text and "failed" not in text, text[-2000:]
