"""llama.cpp's files made from the same bf16 checkpoint our cpu_int4 is made from.

    python -m vllm_omni_edge_bench.baselines.llamacpp_quantize --model default --types bf16 q4_0 q4_k_m [--out-dir DIR]

1. :func:`convert_hf_to_gguf`: a bf16 Hugging Face directory (llama or qwen2
   architecture) -> a BF16 (or F16) GGUF, written with ``gguf.GGUFWriter`` and
   gguf's tensor name map. llama.cpp's own ``convert_hf_to_gguf.py`` is not in
   the llama-cpp-python wheel; this does the part these two architectures need:
   hyper-parameters, tensors (llama's Q/K rows permuted into llama.cpp's rotary
   layout, tied output left to ``token_embd``), and the GPT-2 BPE tokenizer.
   The result is checked by loading its vocabulary in llama.cpp and comparing
   its tokenization of a sample with the HF tokenizer's.
2. :func:`quantize`: that GGUF -> Q4_0 / Q4_K_M / ... through llama.cpp's own
   ``llama_model_quantize`` (what ``llama-quantize`` runs), default settings.

Every file is written to a temporary sibling and renamed when complete. A
``<name>.manifest.json`` next to the files records inputs, outputs and hashes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from vllm_omni_edge.models.default_model import sha256_of

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# llama.cpp ftype for each output type (llama.h: enum llama_ftype).
FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k_m": 15, "q4_k_s": 14, "q5_k_m": 17, "q6_k": 18}
FLOAT_TYPES = ("bf16", "f16")
# Pre-tokenizer names llama.cpp knows, by model_type, where the architecture implies it.
KNOWN_PRE_BY_MODEL_TYPE = {"qwen2": "qwen2"}
# Plain text only: special tokens written as text are split differently on purpose (HF
# matches them, llama.cpp does not unless asked), which is not a vocabulary difference.
TOKENIZER_CHECK_TEXT = ("The quick brown fox jumps over the lazy dog. 1234567 tokens, don't stop!\n"
                        "  Indented line\twith tab: café, naïve, 東京, emoji 🙂 and   spaces.")


class ConversionError(ValueError):
    """The checkpoint cannot be converted, or the result would not mean the same as its source."""


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


# ---------------------------------------------------------------------------
# Names and layouts


def gguf_tensor_name(hf_name: str, architecture: str, n_blocks: int) -> str | None:
    """The GGUF name of an HF tensor (``model.layers.0.self_attn.q_proj.weight`` -> ``blk.0.attn_q.weight``).

    None for tensors llama.cpp does not load (rotary ``inv_freq`` buffers).
    Raises ConversionError for a tensor gguf's name map does not know.
    """
    import gguf

    if hf_name.endswith(".rotary_emb.inv_freq"):
        return None
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[architecture]
    name = gguf.get_tensor_name_map(arch, n_blocks).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ConversionError(f"no GGUF name for tensor {hf_name!r} ({architecture})")
    return name


def permute_for_llama_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF llama Q/K rows (rotate-half pairs i, i + d/2) -> llama.cpp's adjacent pairs (2i, 2i + 1), per head."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ConversionError(f"{rows} rows do not split into {n_head} heads of rotary pairs")
    head_dim = rows // n_head
    return weight.reshape(n_head, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_llama_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_for_llama_rope` (for tests and checks)."""
    rows = weight.shape[0]
    head_dim = rows // n_head
    return weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------------------
# Tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _source_gguf_pre(model_dir: Path) -> str | None:
    """The pre-tokenizer of the GGUF this directory was made from, if it is an embedded model's."""
    manifest = _read_json(model_dir / "edge-manifest.json")
    if not manifest:
        return None
    from vllm_omni_edge.models import default_model

    for model in getattr(default_model, "EMBEDDED_MODELS", {"default": default_model.DEFAULT_MODEL}).values():
        if model.gguf_sha256 == manifest.get("gguf_sha256"):
            path = (default_model.gguf_path(model) if hasattr(default_model, "gguf_path")
                    else default_model.default_gguf_path())
            if path.is_file():
                return read_gguf_string(path, "tokenizer.ggml.pre")
    return None


def read_gguf_string(path: Path, key: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def tokenizer_pre(model_dir: Path, config: dict[str, Any], explicit: str | None) -> tuple[str, str]:
    """llama.cpp's pre-tokenizer name for this tokenizer, and where it came from."""
    if explicit:
        return explicit, "given"
    pre = _source_gguf_pre(model_dir)
    if pre:
        return pre, "the source GGUF named in edge-manifest.json"
    pre = KNOWN_PRE_BY_MODEL_TYPE.get(config.get("model_type", ""))
    if pre:
        return pre, f"model_type {config['model_type']}"
    raise ConversionError(f"{model_dir}: cannot tell llama.cpp's pre-tokenizer for this tokenizer; "
                          "pass --tokenizer-pre (e.g. smollm, llama-bpe, qwen2)")


def tokenizer_metadata(model_dir: Path, vocab_size: int) -> dict[str, Any]:
    """Tokens, token types and merges of a GPT-2-style BPE ``tokenizer.json``, padded to ``vocab_size``."""
    import gguf

    data = _read_json(model_dir / "tokenizer.json")
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ConversionError(f"{model_dir}/tokenizer.json: only BPE tokenizers are supported, got {model.get('type')!r}")
    by_id: dict[int, tuple[str, int]] = {int(i): (tok, gguf.TokenType.NORMAL) for tok, i in model["vocab"].items()}
    for added in data.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[int(added["id"])] = (added["content"], kind)
    if max(by_id) >= vocab_size:
        raise ConversionError(f"tokenizer has id {max(by_id)} but the model's vocab_size is {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        tok, kind = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(tok)
        types.append(kind)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]
    return {"tokens": tokens, "types": types, "merges": merges}


def special_token_ids(model_dir: Path) -> dict[str, int]:
    """bos/eos/pad/unk ids: the model's config and generation config win over tokenizer_config.

    (transformers' GGUF export can write an eos_token into tokenizer_config.json that
    is not the one generation stops at; config.json/generation_config.json say what is.)
    """
    import gguf

    special = gguf.SpecialVocab(model_dir, load_merges=False)
    ids = {k: int(v) for k, v in special.special_token_ids.items() if v is not None}
    for source in ("config.json", "generation_config.json"):
        config = _read_json(model_dir / source)
        for key in ("bos", "eos", "pad", "unk"):
            value = config.get(f"{key}_token_id")
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, int):
                ids[key] = value
    return ids


# ---------------------------------------------------------------------------
# HF -> GGUF


def _hparams(config: dict[str, Any]) -> dict[str, Any]:
    def need(key: str):
        if key not in config:
            raise ConversionError(f"config.json has no {key}")
        return config[key]

    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    scaling = rope.get("rope_type", rope.get("type", "default"))
    if scaling not in (None, "default"):
        raise ConversionError(f"rope scaling {scaling!r} is not supported by this converter")
    n_head = need("num_attention_heads")
    hidden = need("hidden_size")
    return {
        "n_blocks": need("num_hidden_layers"),
        "hidden": hidden,
        "ffn": need("intermediate_size"),
        "n_head": n_head,
        "n_head_kv": config.get("num_key_value_heads", n_head),
        "head_dim": config.get("head_dim") or hidden // n_head,
        "context": need("max_position_embeddings"),
        "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        "rms_eps": need("rms_norm_eps"),
        "vocab_size": need("vocab_size"),
        "tied": bool(config.get("tie_word_embeddings", False)),
    }


def _iter_tensors(model_dir: Path) -> Iterable[tuple[str, Any]]:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{model_dir}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def convert_hf_to_gguf(model_dir: Path | str, out_path: Path | str, *, outtype: str = "bf16",
                       tokenizer_pre_name: str | None = None, check_tokenizer: bool = True) -> dict[str, Any]:
    """Write ``out_path`` (a BF16/F16 GGUF) from the HF checkpoint ``model_dir``; return what was done."""
    import gguf
    import torch

    model_dir, out_path = Path(model_dir), Path(out_path)
    if outtype not in FLOAT_TYPES:
        raise ConversionError(f"outtype must be one of {', '.join(FLOAT_TYPES)}, got {outtype!r}")
    config = _read_json(model_dir / "config.json")
    if not config:
        raise ConversionError(f"{model_dir}: no config.json")
    architecture = config.get("model_type")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"{model_dir}: model_type {architecture!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    hp = _hparams(config)
    pre, pre_source = tokenizer_pre(model_dir, config, tokenizer_pre_name)
    vocab = tokenizer_metadata(model_dir, hp["vocab_size"])
    specials = special_token_ids(model_dir)
    float_type = gguf.GGMLQuantizationType.BF16 if outtype == "bf16" else gguf.GGMLQuantizationType.F16
    file_type = gguf.LlamaFileType.MOSTLY_BF16 if outtype == "bf16" else gguf.LlamaFileType.MOSTLY_F16

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(out_path)
    writer = gguf.GGUFWriter(str(tmp), architecture)
    try:
        writer.add_name(config.get("_model_name_or_path") or model_dir.name)
        writer.add_context_length(hp["context"])
        writer.add_embedding_length(hp["hidden"])
        writer.add_block_count(hp["n_blocks"])
        writer.add_feed_forward_length(hp["ffn"])
        writer.add_head_count(hp["n_head"])
        writer.add_head_count_kv(hp["n_head_kv"])
        writer.add_rope_freq_base(float(hp["rope_theta"]))
        writer.add_layer_norm_rms_eps(float(hp["rms_eps"]))
        writer.add_vocab_size(hp["vocab_size"])
        if hp["head_dim"] != hp["hidden"] // hp["n_head"]:
            writer.add_key_length(hp["head_dim"])
            writer.add_value_length(hp["head_dim"])
        if architecture == "llama":
            writer.add_rope_dimension_count(hp["head_dim"])
        writer.add_file_type(file_type)

        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(vocab["tokens"])
        writer.add_token_types(vocab["types"])
        writer.add_token_merges(vocab["merges"])
        setters = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
                   "pad": writer.add_pad_token_id, "unk": writer.add_unk_token_id}
        for key, token_id in specials.items():
            if key in setters:
                setters[key](token_id)
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
        template = tok_config.get("chat_template")
        jinja = model_dir / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        if template:
            writer.add_chat_template(template)

        names = []
        for hf_name, tensor in _iter_tensors(model_dir):
            if hf_name == "lm_head.weight" and hp["tied"]:
                continue  # llama.cpp uses token_embd as the output when output.weight is absent
            name = gguf_tensor_name(hf_name, architecture, hp["n_blocks"])
            if name is None:
                continue
            data = tensor.to(torch.float32).numpy()
            if architecture == "llama" and name.endswith("attn_q.weight"):
                data = permute_for_llama_rope(data, hp["n_head"])
            elif architecture == "llama" and name.endswith("attn_k.weight"):
                data = permute_for_llama_rope(data, hp["n_head_kv"])
            if data.ndim == 1:
                writer.add_tensor(name, data.astype(np.float32))  # norms and biases stay f32, as llama.cpp wants
            else:
                writer.add_tensor(name, gguf.quants.quantize(data, float_type), raw_dtype=float_type)
            names.append(name)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if check_tokenizer:
            check_tokenizer_agrees(tmp, model_dir)
        tmp.replace(out_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return {"architecture": architecture, "outtype": outtype, "tensors": len(names), "tokenizer_pre": pre,
            "tokenizer_pre_source": pre_source, "special_token_ids": specials, "tied_embeddings": hp["tied"]}


def check_tokenizer_agrees(gguf_file: Path, model_dir: Path, text: str = TOKENIZER_CHECK_TEXT) -> None:
    """Load only the GGUF's vocabulary in llama.cpp; its ids for ``text`` must be the HF tokenizer's."""
    from tokenizers import Tokenizer

    from vllm_omni_edge_bench.baselines.llamacpp import vocab_tokens

    try:
        ours = vocab_tokens(gguf_file, text)
    except RuntimeError as exc:
        raise ConversionError(f"{gguf_file}: the written vocabulary: {exc}") from exc
    theirs = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    if ours != theirs:
        raise ConversionError(f"{gguf_file}: llama.cpp tokenizes the check text differently from {model_dir} "
                              f"(first difference at token {next(i for i, (a, b) in enumerate(zip(ours + [-1], theirs + [-1])) if a != b)}); "
                              "the pre-tokenizer name is probably wrong")


# ---------------------------------------------------------------------------
# GGUF -> quantized GGUF


def quantize(source: Path | str, out_path: Path | str, qtype: str, *, threads: int | None = None) -> None:
    """llama.cpp's ``llama_model_quantize`` with its default parameters, to ``qtype`` (e.g. q4_0, q4_k_m)."""
    if qtype not in FTYPES:
        raise ValueError(f"unknown quantization {qtype!r}; choose one of {', '.join(FTYPES)}")
    source, out_path = Path(source), Path(out_path)
    if not source.is_file():
        raise FileNotFoundError(f"source GGUF not found: {source}")
    import llama_cpp as L

    from vllm_omni_edge_bench.baselines.llamacpp import LlamaLog, set_field

    LlamaLog(echo=False).install()
    params = L.llama_model_quantize_default_params()
    set_field(params, "ftype", FTYPES[qtype])
    set_field(params, "nthread", threads or 0)
    tmp = _partial(out_path)
    try:
        status = L.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if status != 0:
            raise ConversionError(f"llama_model_quantize({source.name} -> {qtype}) returned {status}")
        tmp.replace(out_path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------
# The whole recipe


def build(model: str, types: Iterable[str], out_dir: Path | None = None, *, tokenizer_pre_name: str | None = None,
          threads: int | None = None, log=print) -> dict[str, Any]:
    """HF bf16 reference -> BF16 GGUF -> each quantized type. Returns (and writes) the manifest."""
    from vllm_omni_edge_bench.harness.grid import resolve_model

    model_dir = Path(resolve_model(model))
    if not (model_dir / "config.json").is_file():
        raise ConversionError(f"{model_dir}: not a checkpoint directory (no config.json)")
    types = [t.lower() for t in types]
    unknown = [t for t in types if t not in FTYPES and t not in FLOAT_TYPES]
    if unknown:
        raise ValueError(f"unknown types {', '.join(unknown)}; choose from {', '.join(FLOAT_TYPES + tuple(FTYPES))}")
    if out_dir is None:
        from vllm_omni_edge.models.default_model import cache_root

        out_dir = cache_root() / "gguf" / "built" / model_dir.name
    out_dir = Path(out_dir)
    base = out_dir / f"{model_dir.name}.BF16.gguf"
    log(f"converting {model_dir} -> {base}")
    conversion = convert_hf_to_gguf(model_dir, base, outtype="bf16", tokenizer_pre_name=tokenizer_pre_name)
    files = {"bf16": {"path": str(base), "made_by": "vllm_omni_edge_bench.baselines.llamacpp_quantize.convert_hf_to_gguf (bf16, lossless)"}}
    for qtype in types:
        if qtype == "bf16":
            continue
        if qtype == "f16":
            target = out_dir / f"{model_dir.name}.F16.gguf"
            convert_hf_to_gguf(model_dir, target, outtype="f16", tokenizer_pre_name=tokenizer_pre_name)
            files["f16"] = {"path": str(target), "made_by": "convert_hf_to_gguf (f16)"}
            continue
        target = out_dir / f"{model_dir.name}.{qtype.upper()}.gguf"
        log(f"quantizing {base.name} -> {target.name}")
        quantize(base, target, qtype, threads=threads)
        files[qtype] = {"path": str(target), "made_by": f"llama_model_quantize(BF16 GGUF, ftype={qtype.upper()}), "
                                                        "default params (no imatrix)"}
    import llama_cpp

    for entry in files.values():
        entry["sha256"] = sha256_of(Path(entry["path"]))
        entry["bytes"] = Path(entry["path"]).stat().st_size
    manifest = {
        "source": {"dir": str(model_dir), "config_sha256": sha256_of(model_dir / "config.json"),
                   "weights_sha256": {p.name: sha256_of(p) for p in sorted(model_dir.glob("*.safetensors"))},
                   "edge_manifest": _read_json(model_dir / "edge-manifest.json")},
        "conversion": conversion,
        "files": files,
        "versions": {"llama_cpp_python": llama_cpp.__version__, "gguf": _version("gguf")},
    }
    from vllm_omni_edge.atomic import atomic_write_bytes

    atomic_write_bytes(out_dir / f"{model_dir.name}.manifest.json", json.dumps(manifest, indent=2).encode())
    return manifest


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="bf16 HF checkpoint dir, or an embedded model name")
    parser.add_argument("--types", nargs="+", default=["q4_0", "q4_k_m"],
                        help=f"outputs besides the BF16 GGUF: {', '.join(FLOAT_TYPES + tuple(FTYPES))}")
    parser.add_argument("--out-dir", type=Path, default=None, help="[user cache/gguf/built/<model>]")
    parser.add_argument("--tokenizer-pre", default=None, help="llama.cpp pre-tokenizer name if it cannot be inferred")
    parser.add_argument("--threads", type=int, default=None, help="quantization threads [all]")
    args = parser.parse_args(argv)
    try:
        manifest = build(args.model, args.types, args.out_dir, tokenizer_pre_name=args.tokenizer_pre,
                         threads=args.threads, log=lambda line: print(line, file=sys.stderr))
    except (ConversionError, FileNotFoundError, ValueError) as error:
        print(f"llamacpp_quantize: {error}", file=sys.stderr)
        return 2
    for name, entry in manifest["files"].items():
        print(f"{name}: {entry['path']} ({entry['bytes']:,} bytes, sha256 {entry['sha256'][:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
