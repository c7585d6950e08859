"""A CTranslate2 Whisper model (``model.bin``) read by us and written as a Hugging Face checkpoint.

faster-whisper's models are CTranslate2 conversions of OpenAI Whisper. We read CTranslate2's
binary format ourselves (no ctranslate2 import) and map its variables back to transformers'
``WhisperForConditionalGeneration`` names, so vLLM and transformers load the result.

The format (CTranslate2's ``python/ctranslate2/specs/model_spec.py`` writes it, its
``src/models/model.cc`` reads it), little-endian::

    u32 binary_version                      # 1..6; we read 2..6
    str spec_name, u32 spec_revision        # binary_version >= 2
    u32 n_variables, then n_variables times:
        str name, u8 rank, u32 dims[rank]
        u8 dtype_id, u32 n_bytes            # binary_version >= 4
        (u8 item_size, u32 n_items)         # binary_version < 4
        n_bytes of row-major data
    u32 n_aliases, then (str alias, str target) times   # binary_version >= 3
    str: u16 length including a trailing NUL, then the bytes

dtype ids are CTranslate2's ``DataType`` order: float32, int8, int16, int32, float16, bfloat16.
A quantized weight ``W`` has a sibling ``W_scale``: int8 rows are ``q / scale[row]``, int16 is
``q / scale`` (one scalar). ``W_zero`` siblings (AWQ) are refused.

The mapping is the reverse of CTranslate2's ``WhisperLoader`` (converters/transformers.py):
fused ``q|k|v`` self-attention and ``k|v`` cross-attention projections are split again
(Whisper's ``k_proj`` has no bias, so the converter filled zeros there; we check they are
zero), the decoder projection is an alias of the token embedding (HF ties ``proj_out``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vllm_omni_edge.atomic import atomic_directory

CT2_DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
_NUMPY = {"float32": np.float32, "int8": np.int8, "int16": np.int16, "int32": np.int32,
          "float16": np.float16, "bfloat16": np.uint16}  # bfloat16 kept as raw uint16 bits
_ITEM_SIZE_DTYPES = {4: "float32", 2: "int16", 1: "int8"}  # binary_version < 4
SUPPORTED_BINARY_VERSIONS = (2, 3, 4, 5, 6)
WHISPER_SPEC = "WhisperSpec"
# Revision 3 renumbered the activations (GELU variants); earlier files mean other codes.
SUPPORTED_WHISPER_REVISIONS = (3,)
CT2_GELU = 3  # common_spec.Activation.GELU at revision 3


class Ct2FormatError(ValueError):
    """The file is not a CTranslate2 model we can read, or holds something we do not map."""


@dataclass
class Ct2Variable:
    dtype: str  # one of CT2_DTYPES
    array: np.ndarray  # as stored; bfloat16 as uint16 bits


@dataclass
class Ct2Model:
    binary_version: int
    spec: str
    revision: int
    variables: dict[str, Ct2Variable]
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> variable name

    def resolve(self, name: str) -> str:
        return self.aliases.get(name, name)


class _Reader:
    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = memoryview(data), 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise Ct2FormatError(
                f"{self.path}: truncated at byte {self.pos} (wanted {n} more, file has {len(self.data)})"
            )
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.u("H")
        if n == 0:
            raise Ct2FormatError(f"{self.path}: empty string at byte {self.pos - 2}")
        raw = bytes(self.take(n))
        if raw[-1:] != b"\0":
            raise Ct2FormatError(f"{self.path}: string at byte {self.pos - n} is not NUL-terminated")
        return raw[:-1].decode("utf-8")


def read_ct2_model(path: Path) -> Ct2Model:
    """Parse ``model.bin``. Arrays are views of the file's bytes (read once)."""
    path = Path(path)
    data = path.read_bytes()
    r = _Reader(data, path)
    version = r.u("I")
    if version not in SUPPORTED_BINARY_VERSIONS:
        raise Ct2FormatError(
            f"{path}: CTranslate2 binary version {version} is not supported "
            f"(supported: {', '.join(map(str, SUPPORTED_BINARY_VERSIONS))}); is this a model.bin?"
        )
    spec, revision = r.string(), r.u("I")
    variables: dict[str, Ct2Variable] = {}
    for _ in range(r.u("I")):
        name = r.string()
        shape = tuple(r.u("I") for _ in range(r.u("B")))
        if version >= 4:
            type_id, n_bytes = r.u("B"), r.u("I")
            if type_id >= len(CT2_DTYPES):
                raise Ct2FormatError(f"{path}: variable {name!r} has unknown dtype id {type_id}")
            dtype = CT2_DTYPES[type_id]
        else:
            item_size, n_items = r.u("B"), r.u("I")
            if item_size not in _ITEM_SIZE_DTYPES:
                raise Ct2FormatError(f"{path}: variable {name!r} has unknown item size {item_size}")
            dtype, n_bytes = _ITEM_SIZE_DTYPES[item_size], n_items * item_size
        np_dtype = np.dtype(_NUMPY[dtype])
        expected = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
        if n_bytes != expected:
            raise Ct2FormatError(
                f"{path}: variable {name!r} {dtype}{list(shape)} should have {expected} bytes, has {n_bytes}"
            )
        array = np.frombuffer(r.take(n_bytes), dtype=np_dtype).reshape(shape)
        variables[name] = Ct2Variable(dtype, array)
    aliases = {}
    if version >= 3:
        for _ in range(r.u("I")):
            alias, target = r.string(), r.string()
            if target not in variables:
                raise Ct2FormatError(f"{path}: alias {alias!r} names a missing variable {target!r}")
            aliases[alias] = target
    if r.pos != len(data):
        raise Ct2FormatError(f"{path}: {len(data) - r.pos} unexpected trailing bytes")
    return Ct2Model(version, spec, revision, variables, aliases)


def _to_float32(name: str, var: Ct2Variable) -> np.ndarray:
    if var.dtype in ("float32", "float16"):
        return var.array.astype(np.float32)
    if var.dtype == "bfloat16":
        return (var.array.astype(np.uint32) << 16).view(np.float32)
    raise Ct2FormatError(f"variable {name!r} is {var.dtype} with no {name}_scale; cannot make it a float weight")


def float_weights(model: Ct2Model) -> dict[str, np.ndarray]:
    """Every non-scalar variable as float32, dequantized. Scalars (flags, head counts) are left out."""
    out = {}
    for name, var in model.variables.items():
        if name.endswith("_scale") and name[: -len("_scale")] in model.variables:
            continue
        if name.endswith("_zero"):
            raise Ct2FormatError(f"variable {name!r}: zero-point (AWQ) quantization is not supported")
        if var.array.ndim == 0:
            continue
        scale = model.variables.get(f"{name}_scale")
        if var.dtype in ("int8", "int16") and scale is not None:
            s = _to_float32(f"{name}_scale", scale)
            q = var.array.astype(np.float32)
            if var.dtype == "int8":  # one scale per output row (conv weights: per out channel)
                s = s.reshape((-1,) + (1,) * (q.ndim - 1))
            out[name] = q / s
        elif var.dtype in ("int8", "int16", "int32"):
            raise Ct2FormatError(f"variable {name!r} is {var.dtype} with no {name}_scale; not a weight we can map")
        else:
            out[name] = _to_float32(name, var)
    return out


def scalar(model: Ct2Model, name: str):
    var = model.variables.get(name)
    return None if var is None or var.array.ndim != 0 else var.array.item()


def _count_layers(weights: dict[str, np.ndarray], prefix: str) -> int:
    n = 0
    while any(k.startswith(f"{prefix}/layer_{n}/") for k in weights):
        n += 1
    return n


def whisper_state_dict(model: Ct2Model) -> tuple[dict[str, np.ndarray], dict]:
    """transformers' state dict (float32, ``proj_out`` left tied) and the dimensions it implies."""
    if model.spec != WHISPER_SPEC:
        raise Ct2FormatError(f"spec {model.spec!r} is not {WHISPER_SPEC}")
    if model.revision not in SUPPORTED_WHISPER_REVISIONS:
        raise Ct2FormatError(
            f"{WHISPER_SPEC} revision {model.revision} is not supported "
            f"(supported: {', '.join(map(str, SUPPORTED_WHISPER_REVISIONS))})"
        )
    expect = {"decoder/activation": CT2_GELU, "decoder/pre_norm": 1, "decoder/scale_embeddings": 0,
              "decoder/alibi": 0, "decoder/start_from_zero_embedding": 0}
    for name, want in expect.items():
        got = scalar(model, name)
        if got is not None and got != want:
            raise Ct2FormatError(f"{name} = {got}; Whisper as transformers runs it needs {want}")
    w = float_weights(model)
    used: set[str] = set()
    sd: dict[str, np.ndarray] = {}

    def take(ct2: str) -> np.ndarray:
        if ct2 not in w:
            raise Ct2FormatError(f"missing variable {ct2!r}")
        used.add(ct2)
        return w[ct2]

    def linear(hf: str, ct2: str, bias: bool = True):
        sd[f"{hf}.weight"] = take(f"{ct2}/weight")
        if bias:
            sd[f"{hf}.bias"] = take(f"{ct2}/bias")

    def norm(hf: str, ct2: str):
        sd[f"{hf}.weight"], sd[f"{hf}.bias"] = take(f"{ct2}/gamma"), take(f"{ct2}/beta")

    def split(hf_prefix: str, ct2: str, names: tuple[str, ...]):
        weight, bias = take(f"{ct2}/weight"), take(f"{ct2}/bias")
        for i, (name, wpart, bpart) in enumerate(
            zip(names, np.split(weight, len(names)), np.split(bias, len(names)))
        ):
            sd[f"{hf_prefix}.{name}.weight"] = wpart
            if name == "k_proj":  # no bias in Whisper; the converter wrote zeros
                if np.any(bpart != 0):
                    raise Ct2FormatError(f"{ct2}/bias: the k part (block {i}) is not zero; Whisper's k_proj has no bias")
            else:
                sd[f"{hf_prefix}.{name}.bias"] = bpart

    n_enc, n_dec = _count_layers(w, "encoder"), _count_layers(w, "decoder")
    e, d = "model.encoder", "model.decoder"
    for conv in ("conv1", "conv2"):
        linear(f"{e}.{conv}", f"encoder/{conv}")
    sd[f"{e}.embed_positions.weight"] = take("encoder/position_encodings/encodings")
    for i in range(n_enc):
        hf, ct = f"{e}.layers.{i}", f"encoder/layer_{i}"
        split(f"{hf}.self_attn", f"{ct}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
        linear(f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1")
        norm(f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm")
        linear(f"{hf}.fc1", f"{ct}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct}/ffn/linear_1")
        norm(f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm")
    norm(f"{e}.layer_norm", "encoder/layer_norm")

    sd[f"{d}.embed_tokens.weight"] = take("decoder/embeddings/weight")
    sd[f"{d}.embed_positions.weight"] = take("decoder/position_encodings/encodings")
    for i in range(n_dec):
        hf, ct = f"{d}.layers.{i}", f"decoder/layer_{i}"
        split(f"{hf}.self_attn", f"{ct}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
        linear(f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1")
        norm(f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm")
        linear(f"{hf}.encoder_attn.q_proj", f"{ct}/attention/linear_0")
        split(f"{hf}.encoder_attn", f"{ct}/attention/linear_1", ("k_proj", "v_proj"))
        linear(f"{hf}.encoder_attn.out_proj", f"{ct}/attention/linear_2")
        norm(f"{hf}.encoder_attn_layer_norm", f"{ct}/attention/layer_norm")
        linear(f"{hf}.fc1", f"{ct}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct}/ffn/linear_1")
        norm(f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm")
    norm(f"{d}.layer_norm", "decoder/layer_norm")

    # The output projection: HF ties it to the token embedding; refuse a separate one.
    proj = "decoder/projection/weight"
    if model.resolve(proj) != "decoder/embeddings/weight":
        raise Ct2FormatError(f"{proj} is not an alias of decoder/embeddings/weight (untied heads are not mapped)")
    if f"decoder/projection/bias" in w:
        raise Ct2FormatError("decoder/projection/bias is not supported (Whisper's proj_out has no bias)")

    left = sorted(set(w) - used)
    if left:
        raise Ct2FormatError(f"unsupported variables (not mapped to transformers' Whisper): {', '.join(left)}")

    emb = sd[f"{d}.embed_tokens.weight"]
    dims = {
        "vocab_size": emb.shape[0],
        "d_model": emb.shape[1],
        "encoder_layers": n_enc,
        "decoder_layers": n_dec,
        "encoder_attention_heads": int(scalar(model, "encoder/num_heads")),
        "decoder_attention_heads": int(scalar(model, "decoder/num_heads")),
        "encoder_ffn_dim": sd[f"{e}.layers.0.fc1.weight"].shape[0],
        "decoder_ffn_dim": sd[f"{d}.layers.0.fc1.weight"].shape[0],
        "num_mel_bins": sd[f"{e}.conv1.weight"].shape[1],
        "max_source_positions": sd[f"{e}.embed_positions.weight"].shape[0],
        "max_target_positions": sd[f"{d}.embed_positions.weight"].shape[0],
    }
    return sd, dims


# Whisper's special tokens by their text (OpenAI's tokenizer.py names them so).
EOT, SOT, SOT_PREV = "<|endoftext|>", "<|startoftranscript|>", "<|startofprev|>"
TRANSCRIBE, TRANSLATE, NO_TIMESTAMPS = "<|transcribe|>", "<|translate|>", "<|notimestamps|>"
# OpenAI's decoding default max_initial_timestamp = 1.0 s, in 0.02 s timestamp steps.
MAX_INITIAL_TIMESTAMP_INDEX = 50


def _token_ids(tokenizer_json: dict) -> dict[str, int]:
    ids = dict(tokenizer_json["model"]["vocab"])
    ids.update({t["content"]: t["id"] for t in tokenizer_json.get("added_tokens", [])})
    return ids


def hf_config_and_generation(dims: dict, ct2_config: dict, tokenizer_json: dict) -> tuple[dict, dict]:
    """transformers' WhisperConfig and GenerationConfig, from the weights, config.json and tokenizer."""
    from transformers import GenerationConfig, WhisperConfig

    ids = _token_ids(tokenizer_json)
    try:
        eot, sot = ids[EOT], ids[SOT]
        task_to_id = {"transcribe": ids[TRANSCRIBE], "translate": ids[TRANSLATE]}
        no_ts, prev = ids[NO_TIMESTAMPS], ids[SOT_PREV]
    except KeyError as exc:
        raise Ct2FormatError(f"tokenizer.json has no special token {exc.args[0]}") from None
    by_id = {v: k for k, v in ids.items()}
    lang_ids = ct2_config.get("lang_ids") or []
    missing = [i for i in lang_ids if i not in by_id]
    if missing:
        raise Ct2FormatError(f"config.json lang_ids {missing} are not in tokenizer.json")
    lang_to_id = {by_id[i]: i for i in lang_ids}
    suppress = list(ct2_config.get("suppress_ids") or [])
    begin_suppress = list(ct2_config.get("suppress_ids_begin") or [])
    config = WhisperConfig(
        **dims,
        num_hidden_layers=dims["encoder_layers"],
        activation_function="gelu",
        scale_embedding=False,
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, decoder_start_token_id=sot,
        suppress_tokens=suppress, begin_suppress_tokens=begin_suppress,
        tie_word_embeddings=True,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    config_dict = config.to_dict()
    config_dict["torch_dtype"] = "float16"  # what the weights are stored as (the source's own)
    config_dict.pop("dtype", None)
    generation = GenerationConfig(
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, decoder_start_token_id=sot,
        max_length=dims["max_target_positions"],
        suppress_tokens=suppress, begin_suppress_tokens=begin_suppress,
        alignment_heads=[list(h) for h in ct2_config.get("alignment_heads") or []],
        lang_to_id=lang_to_id, task_to_id=task_to_id, is_multilingual=bool(lang_to_id),
        no_timestamps_token_id=no_ts, prev_sot_token_id=prev,
        max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX, return_timestamps=False,
    )
    return config_dict, generation.to_dict()


def hf_tokenizer_files(tokenizer_json: dict, vocabulary: list[str], vocab_size: int) -> dict[str, str]:
    """tokenizer.json (timestamp tokens added from vocabulary.txt), its config, vocab.json, merges.txt."""
    tok = json.loads(json.dumps(tokenizer_json))  # a deep copy
    ids = _token_ids(tok)
    if len(vocabulary) != vocab_size:
        raise Ct2FormatError(f"vocabulary.txt has {len(vocabulary)} tokens, the embedding {vocab_size}")
    # CTranslate2's Whisper vocabulary names the rows after the tokenizer's: <|0.00|>... .
    known = set(ids.values())
    for i, text in enumerate(vocabulary):
        if i in known:
            if ids.get(text) != i:
                raise Ct2FormatError(f"vocabulary.txt row {i} {text!r} disagrees with tokenizer.json")
            continue
        tok["added_tokens"].append({"id": i, "content": text, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    tok["added_tokens"].sort(key=lambda t: t["id"])
    special = [t["content"] for t in tok["added_tokens"] if t["special"]]
    tokenizer_config = {
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": EOT,
        "additional_special_tokens": [t for t in special if t != EOT],
        "add_prefix_space": False,
        "model_max_length": 1024,  # as openai/whisper-* publish it
        "errors": "replace",
    }
    merges = tok["model"]["merges"]
    merges_txt = "#version: 0.2\n" + "".join(
        (m if isinstance(m, str) else " ".join(m)) + "\n" for m in merges)
    return {
        "tokenizer.json": json.dumps(tok, ensure_ascii=False),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False),
        "vocab.json": json.dumps(tok["model"]["vocab"], ensure_ascii=False),
        "merges.txt": merges_txt,
    }


def preprocessor_config(num_mel_bins: int, max_source_positions: int) -> dict:
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=num_mel_bins)
    # The encoder sees 2 * max_source_positions mel frames (conv2 has stride 2).
    if fe.nb_max_frames != 2 * max_source_positions:
        raise Ct2FormatError(
            f"feature extractor gives {fe.nb_max_frames} frames per window, the encoder takes "
            f"{2 * max_source_positions}"
        )
    out = fe.to_dict()
    out.pop("mel_filters", None)
    out["processor_class"] = "WhisperProcessor"
    return out


REQUIRED_CT2_FILES = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")
HF_FILES = ("config.json", "generation_config.json", "preprocessor_config.json", "model.safetensors",
            "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def convert_ct2_whisper(ct2_dir: Path, out_dir: Path, *, progress=None, manifest: dict | None = None) -> Path:
    """Write a transformers Whisper checkpoint (float16 safetensors, as stored) to ``out_dir``, atomically."""
    from safetensors.numpy import save_file

    step = progress or (lambda _msg: None)
    ct2_dir = Path(ct2_dir)
    for name in REQUIRED_CT2_FILES:
        if not (ct2_dir / name).is_file():
            raise FileNotFoundError(f"{ct2_dir} has no {name}")
    step("reading model.bin")
    model = read_ct2_model(ct2_dir / "model.bin")
    sd, dims = whisper_state_dict(model)
    ct2_config = json.loads((ct2_dir / "config.json").read_text())
    tokenizer_json = json.loads((ct2_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocabulary = (ct2_dir / "vocabulary.txt").read_text(encoding="utf-8").splitlines()
    config, generation = hf_config_and_generation(dims, ct2_config, tokenizer_json)
    tokenizer_files = hf_tokenizer_files(tokenizer_json, vocabulary, dims["vocab_size"])
    preprocessor = preprocessor_config(dims["num_mel_bins"], dims["max_source_positions"])
    # Stored as the source's own float16 when that is what it holds (exact); anything else
    # (float32, bfloat16, dequantized int8/int16) as float32.
    source_dtypes = {v.dtype for v in model.variables.values() if v.array.ndim}
    store = np.float16 if source_dtypes == {"float16"} else np.float32
    if store is np.float32:
        config["torch_dtype"] = "float32"
    with atomic_directory(Path(out_dir)) as tmp:
        step("writing safetensors")
        save_file({k: np.ascontiguousarray(v.astype(store)) for k, v in sd.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
        step("writing config, tokenizer, preprocessor")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True))
        (tmp / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2, sort_keys=True))
        for name, text in tokenizer_files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if manifest is not None:
            (tmp / "edge-manifest.json").write_text(json.dumps(manifest, indent=2))
    return Path(out_dir)
