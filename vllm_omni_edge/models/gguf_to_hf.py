"""Convert a GGUF file into a bf16 Hugging Face checkpoint directory.

Our own reader, not transformers' ``from_pretrained(gguf_file=...)`` (on a gemma3
GGUF that llama.cpp answers correctly, transformers 5.14 built a checkpoint whose
greedy output was " 1 1 1 ..."). The ``gguf`` package reads the file and
dequantizes every tensor; this module undoes, per architecture, what llama.cpp's
``convert_hf_to_gguf.py`` did to the Hugging Face tensors, and writes the config
llama.cpp's ``llama-model.cpp`` implies for that architecture:

- names: GGUF names come from gguf's own ``TENSOR_NAMES``/``MODEL_TENSORS``; the
  Hugging Face side is one table per architecture (``_HF_NAMES``), which the tests
  check against gguf's ``TensorNameMap`` (the map llama.cpp's converter used);
- llama (and Mistral-style models stored as llama): Q/K rows were permuted from
  rotate-half pairs into llama.cpp's adjacent pairs (``LlamaModel.permute``); we
  permute back. qwen2/qwen3/gemma2/gemma3/phi3 use NEOX rope: nothing was permuted;
- gemma2/gemma3: every RMSNorm weight was stored as ``1 + w``; we subtract 1.
  The embedding's sqrt(hidden) scale is applied at run time by both sides;
- phi3: fused ``qkv_proj`` and ``gate_up_proj`` (gate first) are kept fused;
  separate Q/K/V or gate/up tensors are fused;
- RoPE: base, linear scaling, llama3's ``rope_freqs`` (fitted back to its four
  parameters), phi3's long/short factors (``longrope``), gemma3's per-layer-type
  bases (10000 on local layers, as llama.cpp hard-codes);
- sliding windows: gemma2 alternates local/global (local first), gemma3 has five
  local layers per global one; phi3's window is off, as in llama.cpp;
- tied heads: no ``output.weight`` means the head is the embedding.

The tokenizer and chat template come from the GGUF metadata (transformers builds a
fast tokenizer from ``tokenizer.ggml.*``; ``tokenizer.chat_template`` is copied).
Anything we do not know -- an architecture, a tensor, a tensor type, a RoPE
scaling -- is refused by name rather than guessed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from vllm_omni_edge.atomic import atomic_directory, atomic_file
from vllm_omni_edge.log import get_logger
from vllm_omni_edge.models.tokenizer_config import add_added_tokens

logger = get_logger("convert")


class UnsupportedCheckpointError(ValueError):
    """The input is not a checkpoint this tool can convert."""


# ---------------------------------------------------------------------------
# Per-architecture tables

# Hugging Face names by gguf MODEL_TENSOR name (the enum member's name, so this
# module imports without gguf). ``{bid}`` is the block index.
_BASE = {
    "TOKEN_EMBD": "model.embed_tokens",
    "OUTPUT_NORM": "model.norm",
    "OUTPUT": "lm_head",
    "ATTN_NORM": "model.layers.{bid}.input_layernorm",
    "ATTN_Q": "model.layers.{bid}.self_attn.q_proj",
    "ATTN_K": "model.layers.{bid}.self_attn.k_proj",
    "ATTN_V": "model.layers.{bid}.self_attn.v_proj",
    "ATTN_OUT": "model.layers.{bid}.self_attn.o_proj",
    "FFN_NORM": "model.layers.{bid}.post_attention_layernorm",
    "FFN_GATE": "model.layers.{bid}.mlp.gate_proj",
    "FFN_UP": "model.layers.{bid}.mlp.up_proj",
    "FFN_DOWN": "model.layers.{bid}.mlp.down_proj",
}
_QK_NORM = {
    "ATTN_Q_NORM": "model.layers.{bid}.self_attn.q_norm",
    "ATTN_K_NORM": "model.layers.{bid}.self_attn.k_norm",
}
_GEMMA = {
    **{k: v for k, v in _BASE.items() if k != "FFN_NORM"},
    "ATTN_POST_NORM": "model.layers.{bid}.post_attention_layernorm",
    "FFN_PRE_NORM": "model.layers.{bid}.pre_feedforward_layernorm",
    "FFN_POST_NORM": "model.layers.{bid}.post_feedforward_layernorm",
}
_PHI3 = {
    **{k: v for k, v in _BASE.items() if k not in ("ATTN_Q", "ATTN_K", "ATTN_V", "FFN_GATE")},
    "ATTN_QKV": "model.layers.{bid}.self_attn.qkv_proj",
    "FFN_UP": "model.layers.{bid}.mlp.gate_up_proj",
}
_HF_NAMES: dict[str, dict[str, str]] = {
    "llama": _BASE,
    "qwen2": _BASE,
    "qwen3": {**_BASE, **_QK_NORM},
    "gemma2": _GEMMA,
    "gemma3": {**_GEMMA, **_QK_NORM},
    "phi3": _PHI3,
}
# GGUF tensors that carry hyper-parameters, not weights; read into the config.
_CONFIG_TENSORS = {
    "llama": ("ROPE_FREQS",),
    "phi3": ("ROPE_FACTORS_LONG", "ROPE_FACTORS_SHORT"),
}
# RMSNorm weights llama.cpp's converter stored as 1 + w (Gemma's RMSNorm multiplies by 1 + w).
_NORMS = ("ATTN_NORM", "ATTN_POST_NORM", "FFN_NORM", "FFN_PRE_NORM", "FFN_POST_NORM", "OUTPUT_NORM", "ATTN_Q_NORM", "ATTN_K_NORM")


@dataclass(frozen=True)
class ArchSpec:
    gguf_arch: str
    hf_architecture: str
    model_type: str
    permute_qk: bool = False  # llama.cpp's converter permuted Q/K rows (rope NORM)
    norm_shift: float = 0.0  # stored norm = w + norm_shift
    qkv_bias: bool = False  # Hugging Face module has Q/K/V biases (zeros if the GGUF has none)


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", "qwen3"),
    "gemma2": ArchSpec("gemma2", "Gemma2ForCausalLM", "gemma2", norm_shift=1.0),
    "gemma3": ArchSpec("gemma3", "Gemma3ForCausalLM", "gemma3_text", norm_shift=1.0),
    "phi3": ArchSpec("phi3", "Phi3ForCausalLM", "phi3"),
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(ARCHS)

# Tensor types whose dequantization we have compared with llama.cpp (docs/edge/gguf.md).
# gguf dequantizes more (IQ*, TQ*, MXFP4); those are refused until compared too.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# The grids file's metadata key: each weight's GGUF type by its Hugging Face name (JSON).
GRID_TYPES_KEY = "gguf_types"


# ---------------------------------------------------------------------------
# Reading


def _open_reader(gguf_path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(gguf_path))
    except Exception as exc:  # gguf raises bare ValueError/struct errors
        raise UnsupportedCheckpointError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc


def _metadata(reader) -> dict[str, Any]:
    out = {}
    for key, fld in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.model" and key != "tokenizer.ggml.pre" \
                and not key.endswith("_id") and not key.startswith("tokenizer.ggml.add_"):
            continue  # vocabularies: large, and read by the tokenizer builder
        try:
            out[key] = fld.contents()
        except Exception:  # noqa: BLE001 - a field gguf cannot decode is not one we use
            continue
    return out


def read_gguf_architecture(gguf_path: Path) -> str:
    reader = _open_reader(Path(gguf_path))
    fld = reader.fields.get("general.architecture")
    if fld is None:
        raise UnsupportedCheckpointError(f"{gguf_path} has no general.architecture field")
    return fld.contents()


@dataclass
class _Meta:
    arch: str
    values: dict[str, Any]

    def get(self, key: str, default=None):
        return self.values.get(f"{self.arch}.{key}", default)

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise UnsupportedCheckpointError(f"GGUF metadata {self.arch}.{key} is missing")
        return value

    def uniform(self, key: str, default=None):
        """A per-model integer that some files store per layer; refused unless all layers agree."""
        value = self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise UnsupportedCheckpointError(
                    f"{self.arch}.{key} differs between layers ({sorted(set(value))}); not supported")
            value = value[0]
        return value


def _tensor_kinds(arch: str, n_blocks: int) -> dict[str, tuple[str, int | None]]:
    """GGUF base name (no .weight/.bias) -> (MODEL_TENSOR name, block index) for the architecture."""
    import gguf

    arch_enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    kinds = {}
    for tensor in gguf.MODEL_TENSORS[arch_enum]:
        template = gguf.TENSOR_NAMES[tensor]
        if "{bid}" in template:
            for bid in range(n_blocks):
                kinds[template.format(bid=bid)] = (tensor.name, bid)
        else:
            kinds[template] = (tensor.name, None)
    return kinds


def _dequantize(tensor) -> np.ndarray:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    qtype = T(tensor.tensor_type)
    if qtype.name not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedCheckpointError(
            f"tensor {tensor.name} is {qtype.name}, a tensor type we do not convert "
            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    if qtype in (T.F32, T.F16):
        data = np.asarray(tensor.data, dtype=np.float32)
    else:
        data = dequantize(tensor.data, qtype).astype(np.float32, copy=False)
    # numpy shape is GGUF's ne reversed: (rows, columns) = (out_features, in_features).
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return data.reshape(shape)


# 4-bit GGUF types whose blocks of 32 are a float-offset grid, w = q * scale + offset with q in
# 0..15: cpu_int4's own format at group 32 (Q4_K: scale d * sc, offset -dmin * m per 32).
GRID_TYPES = ("Q4_0", "Q4_1", "Q4_K")
GRID_BLOCK = 32


def grid_of(tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """A 4-bit tensor's own grid: float32 (scale, offset) [rows, columns / 32], scales >= 0.

    None for other types. The file's 4-bit codes lie on it: ``(w - offset) / scale`` is
    their value 0..15 for every weight ``w`` of the GGUF's own dequantization.
    """
    from gguf import GGMLQuantizationType as T
    from gguf.quants import Q4_K

    qtype = T(tensor.tensor_type)
    if qtype.name not in GRID_TYPES:
        return None
    rows, columns = (int(n) for n in reversed(tensor.shape.tolist()))
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1)

    def half(blocks: np.ndarray, at: int) -> np.ndarray:
        return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)

    if qtype == T.Q4_0:  # 32 weights: d, 16 bytes; w = d * (q - 8)
        blocks = raw.reshape(-1, 18)
        scale = half(blocks, 0)
        offset = -8.0 * scale
    elif qtype == T.Q4_1:  # 32 weights: d, m, 16 bytes; w = d * q + m
        blocks = raw.reshape(-1, 20)
        scale, offset = half(blocks, 0), half(blocks, 2)
    else:  # Q4_K, 256 weights: d, dmin, 12 bytes of 6-bit (sc, m) per 32, 128 bytes
        blocks = raw.reshape(-1, 144)
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        scale = half(blocks, 0) * sc.astype(np.float32)
        offset = -half(blocks, 2) * m.astype(np.float32)
    scale = scale.reshape(rows, columns // GRID_BLOCK)
    offset = offset.reshape(rows, columns // GRID_BLOCK)
    # A negative scale (Q4_0's d takes the sign of the largest weight) is the same grid read from
    # the other end: q' = 15 - q, scale' = -scale, offset' = offset + 15 * scale.
    negative = scale < 0
    offset = np.where(negative, offset + 15.0 * scale, offset)
    return np.abs(scale), offset


def unpermute_llama_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``LlamaModel.permute``: adjacent rotary pairs (2i, 2i+1) -> rotate-half (i, i+d/2)."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise UnsupportedCheckpointError(f"{rows} rows do not split into {n_head} heads of rotary pairs")
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------------------
# Config


@dataclass
class _Plan:
    """What the reader found: the config to write and the tensors' fate."""

    spec: ArchSpec
    config: Any  # a transformers PretrainedConfig
    n_head: int
    n_head_kv: int
    head_dim: int
    tied: bool
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # config tensors by MODEL_TENSOR name


def _rope_parameters(meta: _Meta, base: float, *, rope_freqs: np.ndarray | None, head_dim: int,
                     n_rot: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(base)}
    kind = meta.get("rope.scaling.type")
    factor = meta.get("rope.scaling.factor")
    if kind in (None, "none") and factor not in (None, 0.0, 1.0):
        kind = "linear"  # older files wrote only the factor
    if kind == "linear":
        if factor not in (None, 0.0, 1.0):
            params.update(rope_type="linear", factor=float(factor))
    elif kind not in (None, "none"):
        raise UnsupportedCheckpointError(f"RoPE scaling {kind!r} is not supported (supported: linear, llama3)")
    if rope_freqs is not None:
        if params["rope_type"] != "default":
            raise UnsupportedCheckpointError("rope_freqs together with another RoPE scaling is not supported")
        params.update(_fit_llama3_rope(rope_freqs, base, n_rot))
    return params


def _llama3_factors(base: float, dim: int, factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))


def _fit_llama3_rope(rope_freqs: np.ndarray, base: float, dim: int) -> dict[str, Any]:
    """llama3 RoPE scaling from the per-frequency factors llama.cpp's converter stored (``rope_freqs``).

    The file keeps the factors, not the four numbers that made them; the numbers Meta's
    models use are tried and kept only if they reproduce every factor.
    """
    factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    factor = float(factors.max())
    for old_ctx in (8192, 4096, 16384, 32768, 2048, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 8.0)):
            want = _llama3_factors(base, dim, factor, low, high, old_ctx)
            if want.shape == factors.shape and np.allclose(want, factors, rtol=1e-4, atol=1e-5):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": old_ctx}
    raise UnsupportedCheckpointError(
        "rope_freqs does not match llama3 RoPE scaling with any known parameters; not supported")


def _token_id(meta: dict[str, Any], name: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(value)


def _plan(reader, meta_values: dict[str, Any], gguf_path: Path) -> _Plan:
    from transformers import AutoConfig

    arch = meta_values.get("general.architecture")
    if arch not in ARCHS:
        raise UnsupportedCheckpointError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
    spec = ARCHS[arch]
    meta = _Meta(arch, meta_values)
    names = {t.name for t in reader.tensors}
    if meta.get("expert_count"):
        raise UnsupportedCheckpointError(f"{gguf_path}: mixture-of-experts {arch} files are not supported")

    hidden = int(meta.need("embedding_length"))
    n_layer = int(meta.need("block_count"))
    n_head = int(meta.uniform("attention.head_count"))
    n_head_kv = int(meta.uniform("attention.head_count_kv", n_head))
    head_dim = int(meta.get("attention.key_length") or hidden // n_head)
    if int(meta.get("attention.value_length") or head_dim) != head_dim:
        raise UnsupportedCheckpointError(f"{arch}: key and value head sizes differ; not supported")
    n_rot = int(meta.get("rope.dimension_count") or head_dim)
    ffn = int(meta.uniform("feed_forward_length"))
    eps = float(meta.need("attention.layer_norm_rms_epsilon"))
    ctx = int(meta.get("context_length") or 4096)
    base = float(meta.get("rope.freq_base") or 10000.0)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(embd.shape[1])
    tied = "output.weight" not in names

    extra = {}
    for kind in _CONFIG_TENSORS.get(arch, ()):
        import gguf

        gname = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]] + ".weight"
        tensor = next((t for t in reader.tensors if t.name == gname), None)
        if tensor is not None:
            extra[kind] = _dequantize(tensor).reshape(-1)
    if n_rot != head_dim and arch != "phi3":
        raise UnsupportedCheckpointError(f"{arch}: partial rotary ({n_rot} of {head_dim} dims) is not supported")

    rope = _rope_parameters(meta, base, rope_freqs=extra.get("ROPE_FREQS"), head_dim=head_dim, n_rot=n_rot)
    eos = _token_id(meta_values, "eos")
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=n_layer,
        num_attention_heads=n_head, num_key_value_heads=n_head_kv, max_position_embeddings=ctx,
        rms_norm_eps=eps, tie_word_embeddings=tied, bos_token_id=_token_id(meta_values, "bos"),
        eos_token_id=eos, pad_token_id=_token_id(meta_values, "padding"),
        architectures=[spec.hf_architecture], dtype="bfloat16",
    )
    if arch == "llama":
        kw = dict(head_dim=head_dim, rope_parameters=rope,
                  attention_bias="blk.0.attn_q.bias" in names, mlp_bias="blk.0.ffn_up.bias" in names)
    elif arch == "qwen2":
        kw = dict(rope_parameters=rope, use_sliding_window=False, sliding_window=None)
        if head_dim != hidden // n_head:
            raise UnsupportedCheckpointError("qwen2 with head size other than hidden/heads is not supported")
    elif arch == "qwen3":
        kw = dict(head_dim=head_dim, rope_parameters=rope, attention_bias="blk.0.attn_q.bias" in names,
                  use_sliding_window=False, sliding_window=None)
    elif arch in ("gemma2", "gemma3"):
        if not tied:
            raise UnsupportedCheckpointError(f"{arch} with an output head apart from the embedding is not supported")
        # llama.cpp: queries scaled by 1/sqrt(hidden/heads) on the 27B models (known by layer count),
        # 1/sqrt(head size) otherwise (llama-model.cpp, after gemma_pytorch's config).
        big = n_layer == (46 if arch == "gemma2" else 62)
        scalar = hidden // n_head if big else head_dim
        if arch == "gemma2":
            window = int(meta.get("attention.sliding_window") or 4096)
            kw = dict(head_dim=head_dim, query_pre_attn_scalar=scalar, sliding_window=window,
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)],
                      attn_logit_softcapping=float(meta.get("attn_logit_softcapping") or 50.0),
                      final_logit_softcapping=float(meta.get("final_logit_softcapping") or 30.0),
                      hidden_activation="gelu_pytorch_tanh", rope_parameters=rope)
        else:
            window = meta.get("attention.sliding_window")
            final_cap = meta.get("final_logit_softcapping")
            if window:
                layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layer)]
            else:
                layer_types = ["full_attention"] * n_layer
            # llama.cpp: local layers rotate with base 10000 and no scaling; global ones with the file's.
            kw = dict(head_dim=head_dim, query_pre_attn_scalar=scalar, sliding_window=int(window) if window else None,
                      layer_types=layer_types, final_logit_softcapping=float(final_cap) if final_cap else None,
                      attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh",
                      rope_parameters={"full_attention": rope,
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    elif arch == "phi3":
        orig = int(meta.get("rope.scaling.original_context_length") or ctx)
        rope_p = dict(rope)
        if n_rot != head_dim:
            rope_p["partial_rotary_factor"] = n_rot / head_dim
        if "ROPE_FACTORS_LONG" in extra or "ROPE_FACTORS_SHORT" in extra:
            if rope["rope_type"] != "default":
                raise UnsupportedCheckpointError("phi3 rope factors together with another RoPE scaling")
            long_f = extra.get("ROPE_FACTORS_LONG", extra.get("ROPE_FACTORS_SHORT"))
            short_f = extra.get("ROPE_FACTORS_SHORT", long_f)
            rope_p.update(rope_type="longrope", long_factor=[float(x) for x in long_f],
                          short_factor=[float(x) for x in short_f], original_max_position_embeddings=orig)
            attn_factor = meta.get("rope.scaling.attn_factor")
            if attn_factor is not None:
                rope_p["attention_factor"] = float(attn_factor)
        # llama.cpp turns phi3's sliding window off ("Phi SWA is currently disabled"); so do we.
        kw = dict(rope_parameters=rope_p, original_max_position_embeddings=orig, sliding_window=None)
        if head_dim != hidden // n_head:
            raise UnsupportedCheckpointError("phi3 with head size other than hidden/heads is not supported")
    config = AutoConfig.for_model(spec.model_type, **common, **kw)
    config.pad_token_id = common["pad_token_id"]  # some classes put their own default in for None
    return _Plan(spec=spec, config=config, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                 tied=tied, extra=extra)


# ---------------------------------------------------------------------------
# Tensors


def iter_hf_tensors(reader, plan: _Plan, *, progress: Callable[[int, int], None] | None = None,
                    grids: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                    types: dict[str, str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array) for every weight of the model, GGUF conventions undone.

    ``grids``, if given, receives each 4-bit weight's own grid (:func:`grid_of`) under its
    Hugging Face name, its rows in the yielded order (tensors phi3 fuses get none); ``types``
    each weight's GGUF type name (not for fused tensors).
    """
    spec, cfg = plan.spec, plan.config
    arch = spec.gguf_arch
    hf_names = _HF_NAMES[arch]
    kinds = _tensor_kinds(arch, cfg.num_hidden_layers)
    pending: dict[tuple[int, str], np.ndarray] = {}  # phi3 pieces waiting to be fused
    seen: set[str] = set()
    total = len(reader.tensors)
    for i, tensor in enumerate(reader.tensors):
        if progress:
            progress(i, total)
        base, _, suffix = tensor.name.rpartition(".")
        if suffix not in ("weight", "bias") or base not in kinds:
            raise UnsupportedCheckpointError(f"tensor {tensor.name!r} is not one we know for {arch}")
        kind, bid = kinds[base]
        if kind in _CONFIG_TENSORS.get(arch, ()):
            continue  # read into the config
        data = _dequantize(tensor)
        grid = grid_of(tensor) if grids is not None and suffix == "weight" else None
        if spec.norm_shift and kind in _NORMS:
            data = data - spec.norm_shift
        if spec.permute_qk and kind in ("ATTN_Q", "ATTN_K"):
            heads = plan.n_head if kind == "ATTN_Q" else plan.n_head_kv
            data = unpermute_llama_qk(data, heads)
            if grid is not None:
                grid = tuple(unpermute_llama_qk(part, heads) for part in grid)
        if arch == "phi3" and kind in ("ATTN_Q", "ATTN_K", "ATTN_V", "FFN_GATE") or \
                (arch == "phi3" and kind == "FFN_UP" and f"blk.{bid}.ffn_gate.{suffix}" in _names(reader)):
            pending[(bid, f"{kind}.{suffix}")] = data
            fused = _fuse_phi3(pending, bid, suffix)
            if fused is not None:
                name, value = fused
                seen.add(name)
                yield name, value
            continue
        if kind not in hf_names:
            raise UnsupportedCheckpointError(f"tensor {tensor.name!r} ({kind}) is not supported for {arch}")
        name = hf_names[kind].format(bid=bid) + "." + suffix
        seen.add(name)
        if grid is not None:
            grids[name] = grid
        if types is not None and suffix == "weight":
            types[name] = tensor.tensor_type.name
        yield name, data
    if pending:
        raise UnsupportedCheckpointError(f"incomplete fused tensors for phi3: {sorted(k[1] for k in pending)}")
    if spec.qkv_bias:
        for bid in range(cfg.num_hidden_layers):
            for proj, rows in (("q", plan.n_head), ("k", plan.n_head_kv), ("v", plan.n_head_kv)):
                name = f"model.layers.{bid}.self_attn.{proj}_proj.bias"
                if name not in seen:
                    yield name, np.zeros(rows * plan.head_dim, dtype=np.float32)
    if progress:
        progress(total, total)


def _names(reader) -> set[str]:
    cached = getattr(reader, "_edge_names", None)
    if cached is None:
        cached = {t.name for t in reader.tensors}
        reader._edge_names = cached
    return cached


def _fuse_phi3(pending: dict, bid: int, suffix: str):
    qkv = [pending.get((bid, f"{k}.{suffix}")) for k in ("ATTN_Q", "ATTN_K", "ATTN_V")]
    if all(x is not None for x in qkv):
        for k in ("ATTN_Q", "ATTN_K", "ATTN_V"):
            del pending[(bid, f"{k}.{suffix}")]
        return f"model.layers.{bid}.self_attn.qkv_proj.{suffix}", np.concatenate(qkv, axis=0)
    gate, up = pending.get((bid, f"FFN_GATE.{suffix}")), pending.get((bid, f"FFN_UP.{suffix}"))
    if gate is not None and up is not None:
        del pending[(bid, f"FFN_GATE.{suffix}")], pending[(bid, f"FFN_UP.{suffix}")]
        return f"model.layers.{bid}.mlp.gate_up_proj.{suffix}", np.concatenate([gate, up], axis=0)
    return None


# ---------------------------------------------------------------------------
# Tokenizer and generation config


# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _field(reader, key: str, default=None):
    fld = reader.fields.get(key)
    return default if fld is None else fld.contents()


# The tokenizer's named special tokens and the metadata keys of their ids.
SPECIAL_TOKEN_IDS = (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))
# Those set on a tokenizer transformers built from a gpt2 (BPE) GGUF, whose converter can name
# another token than the metadata does (SmolLM2: eos <|im_start|> for the file's <|im_end|>). Not
# bos: llama.cpp's files name one (Qwen2.5: <|endoftext|>) where the Hugging Face tokenizer has none.
BPE_NAMED_FROM_METADATA = (("eos_token", "eos"), ("pad_token", "padding"))


def named_special_tokens(reader, tokens: list[str], names=SPECIAL_TOKEN_IDS) -> dict[str, str]:
    """The special tokens the metadata names by id (``tokenizer.ggml.<key>_token_id``), as strings."""
    named = {}
    for name, key in names:
        tid = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= tid < len(tokens):
            named[name] = tokens[tid]
    return named


def spm_tokenizer(reader):
    """A fast tokenizer equal to llama.cpp's SentencePiece one (``tokenizer.ggml.model == "llama"``).

    llama.cpp merges, again and again, the adjacent pair whose concatenation is the
    highest-scored piece of the vocabulary; a BPE whose merges are ranked by the
    merged piece's score does the same. Spaces become "\u2581" (with one in front
    when ``add_space_prefix``), unknown characters fall back to byte pieces, and
    control/user-defined pieces are matched as added tokens. transformers' own GGUF
    converters get this wrong for gemma (no merges) and phi3 (spaces dropped).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    tokens = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = _field(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = [i for i, ty in enumerate(types) if ty in (_NORMAL, _USER_DEFINED, _UNUSED)]
    merges = []
    for i in sorted(mergeable, key=lambda i: (-scores[i], i)):
        piece = tokens[i]
        splits = [(vocab[piece[:k]], vocab[piece[k:]]) for k in range(1, len(piece))
                  if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend((tokens[a], tokens[b]) for a, b in sorted(splits))
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    norm = [normalizers.Replace(" ", "\u2581")]
    if prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                        if ty == _USER_DEFINED])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                                if ty == _CONTROL])
    named = named_special_tokens(reader, tokens, SPECIAL_TOKEN_IDS)
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", True))
    if add_bos and "bos_token" in named:
        from tokenizers import processors

        bos = named["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **named)
    return tok


def _tokenizer(gguf_path: Path, meta: dict[str, Any], reader):
    from transformers import AutoTokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    try:
        if kind == "llama":
            tokenizer = spm_tokenizer(reader)
        elif kind == "gpt2":
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                      local_files_only=True)
            tokens = _field(reader, "tokenizer.ggml.tokens")
            for name, token in named_special_tokens(reader, tokens, BPE_NAMED_FROM_METADATA).items():
                setattr(tokenizer, name, token)
        else:
            raise UnsupportedCheckpointError(
                f"{gguf_path}: tokenizer model {kind!r} is not supported (supported: llama, gpt2)")
    except UnsupportedCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise UnsupportedCheckpointError(f"{gguf_path}: cannot build a tokenizer from its metadata: {exc}") from exc
    fld = reader.fields.get("tokenizer.chat_template")
    template = fld.contents() if fld is not None else None
    if template:
        tokenizer.chat_template = template
    else:  # a base model: completions work; a chat request gets vLLM's own "no chat template" error
        logger.warning("%s carries no chat template (tokenizer.chat_template): a base model, "
                       "served for completions", gguf_path)
    return tokenizer


def _generation_config(config, meta: dict[str, Any]):
    from transformers import GenerationConfig

    eos = []
    for name in ("eos", "eot", "eom"):
        tid = _token_id(meta, name)
        if tid is not None and tid not in eos:
            eos.append(tid)
    return GenerationConfig(bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
                            eos_token_id=eos[0] if len(eos) == 1 else (eos or None))


# ---------------------------------------------------------------------------
# The whole conversion


def _save_grids(grids: dict[str, tuple[np.ndarray, np.ndarray]], out: Path, types: dict[str, str]) -> None:
    import torch
    from safetensors.torch import save_file

    with atomic_file(out) as partial:  # complete or absent
        save_file({f"{name}.{part}": torch.from_numpy(np.ascontiguousarray(value))
                   for name, grid in grids.items() for part, value in zip(("scale", "offset"), grid)}, str(partial),
                  metadata={GRID_TYPES_KEY: json.dumps(types, sort_keys=True)})


def bits_per_weight(type_name: str) -> float:
    """Stored bits a weight of a GGML tensor type takes, block scales included (gguf's block sizes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType[type_name]
    except KeyError as exc:
        raise UnsupportedCheckpointError(f"unknown GGML tensor type {type_name!r}") from exc
    block, nbytes = GGML_QUANT_SIZES[qtype]
    return nbytes * 8 / block


def main_linear_type(types: dict[str, str]) -> str:
    """The type most of the given layer weights are stored in (ties: the fewer bits)."""
    counts: dict[str, int] = {}
    for type_name in types.values():
        counts[type_name] = counts.get(type_name, 0) + 1
    if not counts:
        raise UnsupportedCheckpointError("no layer weights among the tensors")
    return min(counts, key=lambda t: (-counts[t], bits_per_weight(t)))


def read_grid_types(path: Path) -> dict[str, str] | None:
    """The GGUF types a grids file records by Hugging Face weight name; None if it records none
    (written before it did)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(GRID_TYPES_KEY)
    return json.loads(raw) if raw is not None else None


def write_gguf_grids(gguf_path: Path, out: Path) -> Path:
    """The grids file ``convert_gguf_to_hf(grids_out=out)`` writes, without the conversion
    (for a checkpoint converted before)."""
    reader = _open_reader(Path(gguf_path))
    plan = _plan(reader, _metadata(reader), Path(gguf_path))
    grids: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    types: dict[str, str] = {}
    for _ in iter_hf_tensors(reader, plan, grids=grids, types=types):
        pass
    _save_grids(grids, Path(out), types)
    return Path(out)


def convert_gguf_to_hf(
    gguf_path: Path, out_dir: Path, *, progress=None, manifest: dict | None = None,
    grids_out: Path | None = None,
) -> Path:
    """Write a bf16 safetensors checkpoint + config + tokenizer to ``out_dir``.

    The directory appears only when complete (atomic rename). ``progress`` is an
    optional callable taking a step description, used for the CLI progress bar.
    ``manifest``, if given, is written as ``edge-manifest.json`` inside the same
    atomic write, so a directory with a manifest is always complete.
    ``grids_out``, if given, gets the 4-bit weights' own grids (:func:`grid_of`) as float32
    ``<name>.scale`` / ``<name>.offset`` safetensors, outside the checkpoint (a loader would
    take a file inside it for weights), and every weight's GGUF type in its metadata
    (:func:`read_grid_types`).
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    reader = _open_reader(gguf_path)
    if "general.architecture" not in reader.fields:
        raise UnsupportedCheckpointError(f"{gguf_path} has no general.architecture field")
    meta = _metadata(reader)
    plan = _plan(reader, meta, gguf_path)

    import torch
    from safetensors.torch import save_file

    step = progress or (lambda _msg: None)
    step("reading the tokenizer and chat template")
    tokenizer = _tokenizer(gguf_path, meta, reader)

    step("dequantizing GGUF to bf16")
    grids: dict[str, tuple[np.ndarray, np.ndarray]] | None = {} if grids_out is not None else None
    types: dict[str, str] = {}
    state = {name: torch.from_numpy(np.array(value, dtype=np.float32, copy=True)).to(torch.bfloat16)
             for name, value in iter_hf_tensors(reader, plan, grids=grids, types=types)}
    if grids_out is not None:
        _save_grids(grids, Path(grids_out), types)
        del grids
    with atomic_directory(Path(out_dir)) as tmp:
        step("writing safetensors")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)  # safetensors creates it 0600
        del state

        step("writing config and tokenizer")
        config = plan.config.to_dict()
        config.pop("quantization_config", None)
        config["torch_dtype"] = "bfloat16"
        config.pop("dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        _generation_config(plan.config, meta).to_json_file(str(tmp / "generation_config.json"))
        tokenizer.save_pretrained(str(tmp))
        add_added_tokens(tmp)
        if manifest is not None:
            (tmp / "edge-manifest.json").write_text(json.dumps(manifest, indent=2))
    logger.info("converted %s (%s) to %s", gguf_path, plan.spec.gguf_arch, out_dir)
    return Path(out_dir)
