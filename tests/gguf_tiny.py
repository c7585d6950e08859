"""Tiny random-weight GGUF files, one per architecture, written with gguf's GGUFWriter.

Each is laid out as llama.cpp's own converter would write that architecture
(llama's Q/K in llama.cpp's rotary order, gemma's norms as 1 + w, phi3's fused
qkv and gate_up...), with a small trained vocabulary of the tokenizer kind real
files of that architecture carry (GPT-2 BPE or SentencePiece) and a chat
template. llama.cpp runs any of them, so our conversion can be compared with it.

Weights are random but not bland: norms vary around 1, the output head is scaled
so that next-token distributions are peaked (a wrong convention then moves the
top token, not only the tail).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

TEXT = Path(__file__).resolve().parents[1] / "vllm_omni_edge_bench" / "harness" / "texts" / "alice.txt"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant'"
                  " else m['role']) + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
PHI3_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


@dataclass(frozen=True)
class TinySpec:
    arch: str
    n_layer: int = 2
    hidden: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    ffn: int = 512
    ctx: int = 4096
    rope_base: float = 10000.0
    n_rot: int | None = None  # rotary dims (phi3 partial rotary); None: the head size
    sliding_window: int | None = None
    tied: bool = False
    rope_scaling_linear: float | None = None  # gemma3: linear factor on global layers
    llama3_rope: bool = False  # llama: rope_freqs from llama3 scaling (8, 1, 4, 8192)
    longrope_orig: int | None = None  # phi3: rope factors with this original context
    seed: int = 0
    chat_template: bool = True  # False: a base model's file, with no tokenizer.chat_template
    extra: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head


# One file per architecture, as edge users meet them; gemma3 needs 6 layers for one global layer.
SPECS = {
    "llama": TinySpec("llama", rope_base=100000.0),
    "llama3": TinySpec("llama", ctx=131072, rope_base=500000.0, llama3_rope=True, tied=True, seed=7),
    "qwen2": TinySpec("qwen2", rope_base=1000000.0, tied=True, seed=1),
    "qwen3": TinySpec("qwen3", rope_base=1000000.0, seed=2),
    "gemma2": TinySpec("gemma2", sliding_window=16, tied=True, seed=3),
    "gemma3": TinySpec("gemma3", n_layer=6, sliding_window=16, tied=True, rope_base=1000000.0,
                       rope_scaling_linear=8.0, seed=4),
    "phi3": TinySpec("phi3", n_rot=48, longrope_orig=512, seed=5),
}


# ---------------------------------------------------------------------------
# Vocabularies


@functools.lru_cache(maxsize=None)
def _bpe_vocab(size: int = 512):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([TEXT.read_text()], vocab_size=size, min_frequency=2,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json

    model = json.loads(tok._tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


@functools.lru_cache(maxsize=None)
def _spm_vocab(specials: tuple[str, ...], size: int = 512):
    """SentencePiece-style vocabulary: specials, 256 byte pieces, then pieces by merge rank (score -rank)."""
    from tokenizers import SentencePieceBPETokenizer

    tok = SentencePieceBPETokenizer(add_prefix_space=True)
    tok.train_from_iterator([TEXT.read_text()], vocab_size=size, min_frequency=2, show_progress=False)
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]) if t not in specials]
    if "\u2581" not in pieces:  # the word-start piece on its own, which real SentencePiece vocabularies have
        pieces.insert(0, "\u2581")
    tokens = list(specials) + [f"<0x{b:02X}>" for b in range(256)]
    types = [3] * len(specials) + [6] * 256  # CONTROL, BYTE
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    return tokens, types, scores


def _add_vocab(writer, spec: TinySpec) -> int:
    if spec.arch in ("gemma2", "gemma3"):
        specials = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
        tokens, types, scores = _spm_vocab(specials)
        types = [2 if t == "<unk>" else ty for t, ty in zip(tokens, types)]
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(scores)
        writer.add_pad_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_bos_token_id(2)
        writer.add_unk_token_id(3)
        writer.add_eot_token_id(5)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
        if spec.chat_template:
            writer.add_chat_template(GEMMA_TEMPLATE)
    elif spec.arch == "phi3":
        specials = ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>")
        tokens, types, scores = _spm_vocab(specials)
        types = [2 if t == "<unk>" else ty for t, ty in zip(tokens, types)]
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(6)  # <|end|>
        writer.add_pad_token_id(3)  # <|endoftext|>
        writer.add_add_bos_token(False)
        if spec.chat_template:
            writer.add_chat_template(PHI3_TEMPLATE)
    else:
        tokens, merges = _bpe_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if spec.arch.startswith("qwen") else "smollm")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1 if spec.arch == "llama" else 0)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        if spec.chat_template:
            writer.add_chat_template(CHATML)
    return len(tokens)


# ---------------------------------------------------------------------------
# Weights


def _llama3_rope_freqs(base: float, dim: int) -> np.ndarray:
    factor, low, high, old = 8.0, 1.0, 4.0, 8192
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_tiny_gguf(path: Path, spec: TinySpec | str) -> Path:
    """Write the tiny model of ``spec`` (a TinySpec or a key of SPECS) as an F32 GGUF at ``path``."""
    import gguf

    if isinstance(spec, str):
        spec = SPECS[spec]
    rng = np.random.default_rng(spec.seed)
    arch = spec.arch
    h, hd, nh, nkv, ff = spec.hidden, spec.head_dim, spec.n_head, spec.n_head_kv, spec.ffn
    gemma = arch in ("gemma2", "gemma3")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    vocab = _add_vocab(writer, spec)
    writer.add_context_length(spec.ctx)
    writer.add_embedding_length(h)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(nh)
    writer.add_head_count_kv(nkv)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_layer_norm_rms_eps(1e-6 if gemma else 1e-5)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_rope_dimension_count(spec.n_rot or hd)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if spec.sliding_window:
        writer.add_sliding_window(spec.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    if spec.rope_scaling_linear:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope_scaling_linear)
    if arch == "phi3":
        writer.add_sliding_window(0)
        if spec.longrope_orig:
            writer.add_rope_scaling_orig_ctx_len(spec.longrope_orig)
            scale = spec.ctx / spec.longrope_orig
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(spec.longrope_orig)))

    def lin(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols)) * gain / math.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    # Gemma multiplies the (tied) embedding by sqrt(hidden) on the way in: kept small so the
    # layers, not the input token, decide; the final norm's large weight sharpens the logits.
    tensors = {"token_embd.weight": (rng.standard_normal((vocab, h)) * (0.5 / math.sqrt(h) if gemma else 1.0))
               .astype(np.float32)}
    for b in range(spec.n_layer):
        p = f"blk.{b}."
        tensors[p + "attn_norm.weight"] = norm(h)
        q, k, v = lin(nh * hd, h), lin(nkv * hd, h), lin(nkv * hd, h)
        if arch == "phi3":
            tensors[p + "attn_qkv.weight"] = np.concatenate([q, k, v])
        else:
            tensors[p + "attn_q.weight"], tensors[p + "attn_k.weight"], tensors[p + "attn_v.weight"] = q, k, v
        if arch == "qwen2":
            tensors[p + "attn_q.bias"] = (0.5 * rng.standard_normal(nh * hd)).astype(np.float32)
            tensors[p + "attn_k.bias"] = (0.5 * rng.standard_normal(nkv * hd)).astype(np.float32)
            tensors[p + "attn_v.bias"] = (0.5 * rng.standard_normal(nkv * hd)).astype(np.float32)
        if arch in ("qwen3", "gemma3"):
            tensors[p + "attn_q_norm.weight"] = norm(hd)
            tensors[p + "attn_k_norm.weight"] = norm(hd)
        tensors[p + "attn_output.weight"] = lin(h, nh * hd)
        tensors[p + "ffn_norm.weight"] = norm(h)
        if gemma:
            tensors[p + "post_attention_norm.weight"] = norm(h)
            tensors[p + "post_ffw_norm.weight"] = norm(h)
        if arch == "phi3":
            tensors[p + "ffn_up.weight"] = lin(2 * ff, h)
        else:
            tensors[p + "ffn_gate.weight"], tensors[p + "ffn_up.weight"] = lin(ff, h), lin(ff, h)
        tensors[p + "ffn_down.weight"] = lin(h, ff)
    tensors["output_norm.weight"] = norm(h) * (8.0 if gemma else 1.0)
    if not spec.tied:
        tensors["output.weight"] = lin(vocab, h, gain=6.0)
    elif not gemma:
        tensors["token_embd.weight"] *= 6.0 / math.sqrt(h)
    if spec.llama3_rope:
        tensors["rope_freqs.weight"] = _llama3_rope_freqs(spec.rope_base, spec.n_rot or hd)
    if arch == "phi3" and spec.longrope_orig:
        half = (spec.n_rot or hd) // 2
        tensors["rope_factors_long.weight"] = np.linspace(1.0, 16.0, half, dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.linspace(1.0, 1.5, half, dtype=np.float32)
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantized_copy(src: Path, qtype: str, out: Path | None = None) -> Path:
    """llama.cpp's own quantization (``llama_model_quantize``) of ``src`` to ``qtype`` (q8_0, q4_k_m, ...)."""
    from vllm_omni_edge_bench.baselines.llamacpp_quantize import quantize

    out = out or src.with_name(f"{src.stem}.{qtype}.gguf")
    quantize(src, out, qtype, threads=2)
    return out
