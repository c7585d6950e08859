"""A Hugging Face Whisper checkpoint written as a whisper.cpp model file (its legacy ``ggml`` format).

whisper.cpp (and so pywhispercpp) loads Whisper from one binary file, not GGUF. We write it
from the checkpoint ``vllm-omni-edge models pull whisper-base`` converts from the CTranslate2
``model.bin`` (models/whisper_ct2.py), so all three speech arms run the same weights. No hub,
no PyTorch: safetensors read with numpy.

The file, as whisper.cpp's loader (``src/whisper.cpp``, ``whisper_model_load``) reads it,
int32 little-endian throughout::

    magic 0x67676d6c
    n_vocab n_audio_ctx n_audio_state n_audio_head n_audio_layer
    n_text_ctx n_text_state n_text_head n_text_layer n_mels ftype     # ftype 1: F16 matrices
    n_mel n_freq, then n_mel * n_freq float32                          # the log-mel filter bank
    n_tokens, then per token: u32 length, bytes                        # the BPE tokens, id order
    per tensor: n_dims, name length, type (0 F32, 1 F16),
                dims innermost first, name, data

Tensors carry OpenAI's names (``encoder.blocks.0.attn.query.weight``...). The loader creates
each with a fixed type and refuses a file whose tensor sizes differ: 2-D weights and the conv
kernels F16 (F32 for an ``ftype`` 0 file), positional embeddings, biases and norms F32, conv
biases as ``[n, 1]``. The key projections have no bias; ``proj_out`` is not written (it is the
token embedding). The loader adds the special tokens after the BPE ones itself, by id.

The mel filter bank is transformers' WhisperFeatureExtractor's (slaney mel scale and norm,
201 frequency bins), the same filters OpenAI's ``mel_filters.npz`` holds.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

GGML_MAGIC = 0x67676D6C
F32, F16 = 0, 1
FORMAT_VERSION = 1  # of this writer; part of the cached file's key

# transformers' per-layer module -> whisper.cpp's (the decoder's encoder_attn is its cross_attn).
_LAYER_NAMES = {
    "self_attn.q_proj": "attn.query", "self_attn.k_proj": "attn.key", "self_attn.v_proj": "attn.value",
    "self_attn.out_proj": "attn.out", "self_attn_layer_norm": "attn_ln",
    "encoder_attn.q_proj": "cross_attn.query", "encoder_attn.k_proj": "cross_attn.key",
    "encoder_attn.v_proj": "cross_attn.value", "encoder_attn.out_proj": "cross_attn.out",
    "encoder_attn_layer_norm": "cross_attn_ln",
    "fc1": "mlp.0", "fc2": "mlp.2", "final_layer_norm": "mlp_ln",
}
_TOP_NAMES = {
    "encoder.conv1": "encoder.conv1", "encoder.conv2": "encoder.conv2",
    "encoder.embed_positions.weight": "encoder.positional_embedding",
    "encoder.layer_norm": "encoder.ln_post",
    "decoder.embed_positions.weight": "decoder.positional_embedding",
    "decoder.embed_tokens.weight": "decoder.token_embedding.weight",
    "decoder.layer_norm": "decoder.ln",
}
# Tensors whisper.cpp creates as F32 whatever the file's ftype (besides every 1-D one).
_ALWAYS_F32 = ("encoder.positional_embedding", "decoder.positional_embedding",
               "encoder.conv1.bias", "encoder.conv2.bias")


class GgmlConversionError(ValueError):
    """The checkpoint is not a Whisper model this writer maps to whisper.cpp's names."""


def ggml_name(hf_name: str) -> str | None:
    """whisper.cpp's name for a transformers Whisper tensor; None for ``proj_out`` (tied)."""
    name = hf_name.removeprefix("model.")
    if name == "proj_out.weight":
        return None
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] in ("encoder", "decoder") and parts[1] == "layers":
        module, leaf = ".".join(parts[3:-1]), parts[-1]
        if module not in _LAYER_NAMES:
            raise GgmlConversionError(f"{hf_name}: no whisper.cpp name for layer module {module!r}")
        return f"{parts[0]}.blocks.{parts[2]}.{_LAYER_NAMES[module]}.{leaf}"
    for prefix, mapped in _TOP_NAMES.items():
        if name == prefix:
            return mapped
        if name.startswith(prefix + "."):
            return mapped + name[len(prefix):]
    raise GgmlConversionError(f"{hf_name}: not a transformers Whisper tensor whisper.cpp knows")


def tensor_record(name: str, array: np.ndarray, ftype: int) -> tuple[int, np.ndarray]:
    """(type, data) as whisper.cpp's loader expects this tensor in a file of this ftype."""
    data = np.asarray(array)
    if name in ("encoder.conv1.bias", "encoder.conv2.bias"):
        data = data.reshape(-1, 1)
    if ftype == F16 and data.ndim >= 2 and name not in _ALWAYS_F32:
        return F16, np.ascontiguousarray(data, dtype="<f2")
    return F32, np.ascontiguousarray(data, dtype="<f4")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet reversed: the printable stand-in of each byte -> the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def bpe_token_bytes(vocab: dict[str, int], eot_id: int) -> list[bytes]:
    """The raw bytes of tokens 0 .. eot_id-1 (the BPE vocabulary before the special tokens)."""
    by_id = {i: text for text, i in vocab.items() if i < eot_id}
    missing = [i for i in range(eot_id) if i not in by_id]
    if missing:
        raise GgmlConversionError(f"vocab.json has no token for ids {missing[:5]}{'...' if len(missing) > 5 else ''}")
    decoder = _byte_decoder()
    out = []
    for i in range(eot_id):
        try:
            out.append(bytes(decoder[ch] for ch in by_id[i]))
        except KeyError as exc:
            raise GgmlConversionError(f"token {i} {by_id[i]!r}: {exc.args[0]!r} is not a byte-level BPE character") from None
    return out


def mel_filters(num_mel_bins: int) -> np.ndarray:
    """[n_mel, n_freq] float32: Whisper's filter bank (16 kHz, n_fft 400)."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=num_mel_bins)
    return np.ascontiguousarray(np.asarray(fe.mel_filters, dtype=np.float32).T)


def _hparams(config: dict) -> list[int]:
    if config.get("model_type") != "whisper":
        raise GgmlConversionError(f"config.json model_type is {config.get('model_type')!r}, not 'whisper'")
    for side in ("encoder", "decoder"):  # whisper.cpp has no field for it: it builds 4 * d_model
        if config[f"{side}_ffn_dim"] != 4 * config["d_model"]:
            raise GgmlConversionError(f"{side}_ffn_dim is {config[f'{side}_ffn_dim']}; whisper.cpp takes only "
                                      f"4 * d_model ({4 * config['d_model']})")
    return [config["vocab_size"], config["max_source_positions"], config["d_model"],
            config["encoder_attention_heads"], config["encoder_layers"], config["max_target_positions"],
            config["d_model"], config["decoder_attention_heads"], config["decoder_layers"],
            config["num_mel_bins"]]


def expected_tensors(config: dict) -> set[str]:
    """Every tensor name whisper.cpp's loader creates for these dimensions (it needs all of them)."""
    names = {"encoder.positional_embedding", "encoder.conv1.weight", "encoder.conv1.bias",
             "encoder.conv2.weight", "encoder.conv2.bias", "encoder.ln_post.weight", "encoder.ln_post.bias",
             "decoder.positional_embedding", "decoder.token_embedding.weight", "decoder.ln.weight",
             "decoder.ln.bias"}
    per_layer = ["mlp_ln.weight", "mlp_ln.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias",
                 "attn_ln.weight", "attn_ln.bias", "attn.query.weight", "attn.query.bias", "attn.key.weight",
                 "attn.value.weight", "attn.value.bias", "attn.out.weight", "attn.out.bias"]
    for i in range(config["encoder_layers"]):
        names |= {f"encoder.blocks.{i}.{n}" for n in per_layer}
    for i in range(config["decoder_layers"]):
        names |= {f"decoder.blocks.{i}.{n}" for n in per_layer}
        names |= {f"decoder.blocks.{i}.cross_{n}" for n in per_layer if n.startswith("attn")}
    return names


def write_ggml(hf_dir: Path, out_path: Path, ftype: int = F16) -> Path:
    """Write ``hf_dir`` (transformers Whisper: config.json, vocab.json, model.safetensors) to ``out_path``, atomically."""
    from safetensors.numpy import load_file

    from vllm_omni_edge.atomic import atomic_write_bytes

    if ftype not in (F32, F16):
        raise ValueError(f"ftype {ftype}: 0 (float32) or 1 (float16)")
    hf_dir = Path(hf_dir)
    for name in ("config.json", "vocab.json", "model.safetensors", "tokenizer.json"):
        if not (hf_dir / name).is_file():
            raise FileNotFoundError(f"{hf_dir} has no {name}; is it a transformers Whisper checkpoint?")
    config = json.loads((hf_dir / "config.json").read_text())
    hparams = _hparams(config)
    vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
    added = {t["content"]: t["id"] for t in json.loads((hf_dir / "tokenizer.json").read_text(
        encoding="utf-8")).get("added_tokens", [])}
    eot_id = added.get("<|endoftext|>", vocab.get("<|endoftext|>"))
    if eot_id is None:
        raise GgmlConversionError(f"{hf_dir}: no <|endoftext|> token")
    tokens = bpe_token_bytes(vocab, eot_id)
    weights = load_file(str(hf_dir / "model.safetensors"))

    tensors: dict[str, tuple[int, np.ndarray]] = {}
    for hf_name in sorted(weights):
        name = ggml_name(hf_name)
        if name is None:
            continue
        tensors[name] = tensor_record(name, weights[hf_name], ftype)
    want = expected_tensors(config)
    if set(tensors) != want:
        missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
        raise GgmlConversionError(f"{hf_dir}: tensors do not match whisper.cpp's model: "
                                  f"missing {missing[:5]}, unexpected {extra[:5]}")

    filters = mel_filters(config["num_mel_bins"])
    parts = [struct.pack("<i", GGML_MAGIC), struct.pack("<11i", *hparams, ftype),
             struct.pack("<2i", *filters.shape), filters.astype("<f4").tobytes(),
             struct.pack("<i", len(tokens))]
    for token in tokens:
        parts += [struct.pack("<I", len(token)), token]
    for name, (ttype, data) in tensors.items():
        encoded = name.encode("utf-8")
        parts.append(struct.pack("<3i", data.ndim, len(encoded), ttype))
        parts.append(struct.pack(f"<{data.ndim}i", *reversed(data.shape)))
        parts += [encoded, data.tobytes()]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_path, b"".join(parts))
    return out_path


def source_key(hf_dir: Path, ftype: int) -> str:
    """A short hash of what the file is made from: the checkpoint's config and weights, ftype, this writer."""
    digest = hashlib.sha256(f"whisper_ggml v{FORMAT_VERSION} ftype {ftype}\n".encode())
    for name in ("config.json", "vocab.json", "model.safetensors"):
        with open(Path(hf_dir) / name, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def ensure_ggml(hf_dir: Path, cache_dir: Path | None = None, ftype: int = F16) -> Path:
    """The whisper.cpp file for ``hf_dir``, written once under the user cache's ``ggml/``."""
    from vllm_omni_edge.models.default_model import cache_root

    hf_dir = Path(hf_dir)
    key = source_key(hf_dir, ftype)
    out = Path(cache_dir or cache_root() / "ggml") / f"{hf_dir.name}-{'f16' if ftype == F16 else 'f32'}-{key}.bin"
    if not out.is_file():
        write_ggml(hf_dir, out, ftype)
    return out
