"""Build a cpu_int4 checkpoint from a bf16/fp16/fp32 Hugging Face directory or a GGUF file.

``vllm-omni-edge quantize SRC OUT [--group-size 32] [--zero-point float]`` (``main``), or
``build_cpu_int4_checkpoint(src, out)`` from Python.

Every linear layer, the output head and the input embedding are stored 4-bit
(format 3; the number format in ``int4.py``); norms and biases are copied
unchanged. A tied matrix is stored once, as ``model.embed_tokens.*``, and the
config keeps ``tie_word_embeddings: true``: the loaded head shares it and the
embedding's lookups read the head kernel's bytes (``embedding.py``). An untied
model gets ``model.embed_tokens.*`` and ``lm_head.*``. ``--embedding bf16``
writes format 2 instead: the embedding copied unchanged, a tied head given its
own 4-bit ``lm_head.*`` and ``tie_word_embeddings: false`` (vLLM's llama/qwen2
would otherwise point the head at the bf16 embedding). ``--head bf16`` keeps the output
head unquantized (``lm_head: false``; with a bf16 embedding, so a tied head is stored once,
as the embedding, and stays tied). From a GGUF, the linears and the untied head the file stores
at more bits than its main linear type (a Q4_K_M's Q6_K ``attn_v``, ``ffn_down`` and ``output``)
are stored with 6-bit codes (``int4.quantize_6bit``; ``--promoted-bits 4``: 4-bit like the rest),
and the other parts of a layer vLLM merges with one of them (q/k/v, gate/up) too, on their own
4-bit grid where they have one. The directory
appears complete or not at all, carries a size/SHA-256 manifest that loading
verifies (and lists the layers stored 4-bit and the tensor classes kept), and is
re-read and checked before it is published.

Whisper (an encoder-decoder) is taken too: every linear vLLM's Whisper builds with the
quantization config -- encoder and decoder self-attention q/k/v/out, cross-attention
q/k/v/out, fc1/fc2 -- is stored 4-bit under its Hugging Face name (vLLM's loader stacks
q/k/v into ``qkv_proj`` and the cross-attention k/v into ``kv_proj`` by output offset, as
for a llama's q/k/v). The conv front end, both positional embeddings, the layer norms,
the norms and the biases stay as stored. The token embedding is stored 4-bit by default
(format 3, ``"embedding": "int4"``, ``model.decoder.embed_tokens.*``) and the output head
stays tied to it: patch ``whisper_int4_vocab`` builds vLLM's Whisper embedding with the
quantization config, and the head shares its one 4-bit copy. ``--embedding int8`` stores
int8 rows and gives the head its own 4-bit ``proj_out.*`` (the patch loads it);
``--embedding bf16`` keeps the embedding as stored with the head tied to it (format 2, the
first Whisper build, which still loads). Whisper's k projections have no bias; vLLM adds
a zero one only for a ``k_proj.weight`` it reads, so the builder writes zero
``k_proj.bias`` tensors beside the 4-bit k projections (vLLM's fused q/k/v bias would
otherwise hold uninitialised memory in the k rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_omni_edge.atomic import atomic_directory
from vllm_omni_edge.log import get_logger
from vllm_omni_edge.models.gguf_to_hf import (
    UnsupportedCheckpointError,
    bits_per_weight,
    convert_gguf_to_hf,
    main_linear_type,
    read_grid_types,
)
from vllm_omni_edge.models.tokenizer_config import add_added_tokens
from vllm_omni_edge.quantization.int4 import (
    BITS,
    DEFAULT_EMBEDDING,
    ENCODER_DECODER_MODEL_TYPES,
    TIED_HEAD_EMBEDDING,
    EMBEDDING_FORMATS,
    SCALE_DTYPE,
    SUPPORTED_GROUP_SIZES,
    SUPPORTED_WEIGHT_DTYPES,
    Int4FormatError,
    DEFAULT_GROUP_SIZE,
    DEFAULT_ZERO_POINT,
    ZERO_POINT_MODES,
    check_embedding_format,
    check_group_size,
    check_triple,
    check_zero_point,
    dequantize,
    dequantize_rows_int8,
    format_version_for,
    group_size_for,
    quantize,
    quantize_6bit,
    quantize_on_grid,
    quantize_rows_int8,
)
from vllm_omni_edge.quantization.manifest import MANIFEST_NAME, verify_manifest, write_manifest

logger = get_logger("quantize")

QUANT_METHOD = "cpu_int4"
# Architectures whose tensor names the classifiers below know: llama-style decoders, and
# Whisper's encoder-decoder. Run end to end: llama (SmolLM2), qwen2 (Qwen2.5-Coder), whisper.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "whisper")
LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
# Whisper: the linears vLLM's WhisperAttention / WhisperCrossAttention / WhisperMLP build
# with the quantization config (encoder and decoder).
WHISPER_LINEAR_WEIGHT = re.compile(
    r"^model\.(encoder|decoder)\.layers\.\d+\.((self_attn|encoder_attn)\.(q|k|v|out)_proj|fc1|fc2)\.weight$"
)
WHISPER_K_PROJ = re.compile(r"\.(self_attn|encoder_attn)\.k_proj$")
WHISPER_EMBEDDING = "model.decoder.embed_tokens.weight"
WHISPER_HEAD = "proj_out.weight"  # tied to WHISPER_EMBEDDING; vLLM's loader drops it
WHISPER_EMBEDDING_PREFIX = WHISPER_EMBEDDING.removesuffix(".weight")
WHISPER_HEAD_PREFIX = WHISPER_HEAD.removesuffix(".weight")
EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
OUTPUT_WEIGHTS = "model.safetensors"
# Beside the bf16 conversion of a GGUF source (not inside it): its 4-bit weights' own grids.
GGUF_GRIDS = "gguf-grids.safetensors"
# Source files never copied: weights (rewritten), config (rewritten), manifests
# that describe the source rather than the result.
_NOT_COPIED_NAMES = {"config.json", "model.safetensors.index.json", "edge-manifest.json", MANIFEST_NAME}
_NOT_COPIED_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt"}

# Byte-table rows.
LINEAR_4BIT, HEAD_4BIT, EMBEDDING_ROW, NORMS, BIASES, OTHER = (
    "linear 4-bit", "head 4-bit", "embedding", "norms", "biases", "other",
)
EMBEDDING_4BIT, TIED_4BIT = "embedding 4-bit", "emb+head 4-bit"  # the latter: one tied matrix
EMBEDDING_INT8 = "embedding int8"
LINEAR_6BIT, HEAD_6BIT = "linear 6-bit", "head 6-bit"
# Bits for the tensors a GGUF stores at more bits than its main linear type: 6 keeps most of the
# precision the file gave them (a Q6_K's, at about its bytes), 4 stores them like the rest.
PROMOTED_BITS = (6, 4)
DEFAULT_PROMOTED_BITS = 6
# Layers vLLM loads as one (llama-style decoders): a 6-bit part makes the merged layer 6-bit.
MERGED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
HEAD_BF16 = "head bf16"
CONV, POSITIONS, ZERO_K_BIAS = "conv", "positions", "k bias (zero)"  # Whisper's kept tensors
WHISPER_KEPT = (
    (re.compile(r"^model\.encoder\.conv[12]\.weight$"), CONV),
    (re.compile(r"^model\.(encoder|decoder)\.embed_positions\.weight$"), POSITIONS),
    (re.compile(rf"^{re.escape(WHISPER_EMBEDDING)}$"), EMBEDDING_ROW),
)
HEAD_FORMATS = ("int4", "bf16")
DEFAULT_HEAD = "int4"
# GGUF input with a tied head: the one head/embedding matrix is kept bf16. Re-quantizing it to 4 bits was
# the largest loss measured, far beyond the run-to-run noise, for the cost of one matrix. An untied head
# stays 4-bit: keeping it bf16 costs two matrices (the loader then needs the embedding bf16 too) for a
# smaller gain (docs/edge/gguf.md, "Re-quantization").
GGUF_TIED_HEAD = "bf16"
GGUF_UNTIED_HEAD = "int4"
EMBEDDING_PREFIX = EMBEDDING.removesuffix(".weight")


class CheckpointBuildError(RuntimeError):
    """The written checkpoint failed the builder's own check; nothing was published."""


@dataclass
class BuildReport:
    out: Path
    group_size: int
    zero_point: str = DEFAULT_ZERO_POINT
    embedding: str = DEFAULT_EMBEDDING
    head: str = DEFAULT_HEAD
    # prefix -> group size, for layers whose K the requested size does not divide.
    group_size_fallbacks: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    source_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    written_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Layers stored with 6-bit codes (qweight_high beside qweight).
    six_bit: list[str] = field(default_factory=list)
    # Tensors per class stored on their GGUF 4-bit grid (the file's codes kept), not re-quantized.
    on_gguf_grid: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Relative RMS error ||W - dequant(W)|| / ||W|| over all tensors of a class.
    _sq_err: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _sq_ref: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def relative_rms_error(self, row: str) -> float | None:
        return (self._sq_err[row] / self._sq_ref[row]) ** 0.5 if self._sq_ref.get(row) else None

    def table(self) -> str:
        order = (LINEAR_4BIT, LINEAR_6BIT, HEAD_4BIT, HEAD_6BIT, HEAD_BF16, EMBEDDING_4BIT, TIED_4BIT, EMBEDDING_INT8, EMBEDDING_ROW, NORMS,
                 BIASES, ZERO_K_BIAS, CONV, POSITIONS, OTHER)
        rows = [r for r in order if self.tensors.get(r)]
        header = ("tensor class", "tensors", "source MiB", "written MiB", "rel. RMS err")
        lines = ["{:<14} {:>7} {:>11} {:>12} {:>13}".format(*header)]
        for r in rows:
            err = self.relative_rms_error(r)
            lines.append(
                f"{r:<14} {self.tensors[r]:>7} {self.source_bytes[r] / 2**20:>11.2f} "
                f"{self.written_bytes[r] / 2**20:>12.2f} {f'{err:.4f}' if err is not None else '-':>13}"
            )
        lines.append(
            f"{'total':<14} {sum(self.tensors.values()):>7} {sum(self.source_bytes.values()) / 2**20:>11.2f} "
            f"{sum(self.written_bytes.values()) / 2**20:>12.2f}"
        )
        if self.on_gguf_grid:
            lines.append(
                f"{sum(self.on_gguf_grid.values())} 4-bit tensors stored on their GGUF grid (the file's Q4_0/Q4_1/Q4_K "
                "codes, scale and offset rounded to bf16); the rest quantized from the file's dequantized weights"
            )
        if self.group_size_fallbacks:
            by_size: dict[int, int] = defaultdict(int)
            for g in self.group_size_fallbacks.values():
                by_size[g] += 1
            lines.append(
                f"group size {self.group_size} does not divide K for "
                + ", ".join(f"{n} layers (stored with group {g})" for g, n in sorted(by_size.items()))
            )
        return "\n".join(lines)


def build_cpu_int4_checkpoint(
    src: Path | str,
    out: Path | str,
    group_size: int = DEFAULT_GROUP_SIZE,
    progress: bool = True,
    overwrite: bool = False,
    zero_point: str = DEFAULT_ZERO_POINT,
    embedding: str | None = None,
    head: str | None = None,
    grids: Path | str | None = None,
    promoted_bits: int = DEFAULT_PROMOTED_BITS,
) -> BuildReport:
    """Quantize ``src`` (HF directory or ``.gguf``) into a cpu_int4 checkpoint at ``out``.

    A ``.gguf`` source's 4-bit weights (Q4_0, Q4_1, Q4_K) keep the file's codes: they are stored
    on their own grid, not re-quantized (group 32, float offsets). ``grids`` gives the same
    for a directory converted from a GGUF (``gguf_to_hf.write_gguf_grids``).

    ``embedding="int4"`` writes format 3 (input embedding 4-bit), ``"bf16"`` format 2.
    ``head="bf16"`` leaves the output head unquantized; it needs ``embedding="bf16"``.
    Left as None, both follow the source (:func:`default_formats`). ``promoted_bits``: 6 stores
    the tensors a GGUF keeps at more bits than its main type with 6-bit codes (its types come from
    the file, or from ``grids``), 4 like the rest.
    """
    src, out = Path(src).expanduser(), Path(out).expanduser()
    embedding, head = build_formats(src, embedding, head)
    check_group_size(group_size)
    check_zero_point(zero_point)
    check_embedding_format(embedding)
    check_head_format(head, embedding)
    if promoted_bits not in PROMOTED_BITS:
        raise ValueError(f"promoted_bits must be one of {PROMOTED_BITS}, got {promoted_bits!r}")
    if not src.exists():
        raise FileNotFoundError(f"source checkpoint not found: {src}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True / --overwrite to replace it)")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise ValueError(f"output {out} must not be the source or inside it")
    if grids is not None and not Path(grids).expanduser().is_file():
        raise FileNotFoundError(f"GGUF grids file not found: {grids}")
    if src.is_file():
        if grids is not None:
            raise ValueError("grids are read from a .gguf source itself; pass them only for a checkpoint directory")
        if src.suffix != ".gguf":
            raise UnsupportedCheckpointError(
                f"{src} is a file but not a .gguf; pass a Hugging Face checkpoint directory or a GGUF file"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        # Beside the output, not in /tmp: the bf16 copy can be large and /tmp may be RAM.
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.gguf-", dir=out.parent) as tmp:
            step = (lambda msg: logger.info("gguf: %s", msg)) if progress else None
            grid_file = Path(tmp) / GGUF_GRIDS
            hf_dir = convert_gguf_to_hf(src, Path(tmp) / "bf16", progress=step, grids_out=grid_file)
            return _build_from_hf_dir(hf_dir, out, group_size, progress, zero_point, embedding, head,
                                      grids=grid_file if grid_file.exists() else None,
                                      promoted_bits=promoted_bits)
    return _build_from_hf_dir(src, out, group_size, progress, zero_point, embedding, head,
                              grids=Path(grids).expanduser() if grids is not None else None,
                              promoted_bits=promoted_bits)


def six_bit_modules(types: dict[str, str] | None, promoted_bits: int = DEFAULT_PROMOTED_BITS) -> set[str]:
    """Module names to store 6-bit, from a GGUF's weight types by Hugging Face name: the linears and
    the head the file stores at more bits than its main linear type (the most common one), with the
    other parts of a merged layer (``MERGED_PARTS``). Empty for 4-bit promotions or no types."""
    if promoted_bits != 6 or not types:
        return set()
    linears = {n: t for n, t in types.items() if LINEAR_WEIGHT.match(n)}
    if not linears:
        return set()
    main_bits = bits_per_weight(main_linear_type(linears))
    candidates = {**linears, HEAD: types[HEAD]} if HEAD in types else linears
    promoted = {n.removesuffix(".weight") for n, t in candidates.items() if bits_per_weight(t) > main_bits}
    for name in list(promoted):
        parent, _, part = name.rpartition(".")
        for group in MERGED_PARTS:
            if part in group:
                promoted.update(f"{parent}.{p}" for p in group if f"{parent}.{p}.weight" in types)
    return promoted


def gguf_ties_head(path: Path) -> bool:
    """Whether a GGUF's head is its embedding matrix (no ``output.weight``, as the converter reads it)."""
    from vllm_omni_edge.models.gguf_to_hf import _open_reader

    return not any(t.name == "output.weight" for t in _open_reader(Path(path)).tensors)


def default_formats(gguf_tied: bool | None, embedding: str | None, head: str | None,
                    tied_head: bool = False) -> tuple[str, str]:
    """(embedding, head) for a build: what was asked, else the default for the source.

    ``gguf_tied`` is None for a Hugging Face directory (int4 head; the embedding int4, or
    ``TIED_HEAD_EMBEDDING`` when ``tied_head``), else whether the GGUF ties its head to the
    embedding: ``GGUF_TIED_HEAD`` or ``GGUF_UNTIED_HEAD``, with the bf16 embedding a bf16 head
    needs, unless an int4/int8 embedding was asked for (then a 4-bit head).
    """
    if head is None:
        gguf_head = None if gguf_tied is None else (GGUF_TIED_HEAD if gguf_tied else GGUF_UNTIED_HEAD)
        head = gguf_head if gguf_head and embedding in (None, "bf16") else DEFAULT_HEAD
    if embedding is None:
        embedding = "bf16" if head == "bf16" else TIED_HEAD_EMBEDDING if tied_head else DEFAULT_EMBEDDING
    return embedding, head


def stale_gguf_build(manifest: dict) -> str | None:
    """Why a checkpoint built from a GGUF (its manifest) is older than what the builder writes now,
    or None if it is current."""
    if "gguf_grid_tensors" not in manifest:
        return "the builder now keeps the GGUF's 4-bit codes"
    if "six_bit_layers" not in manifest:
        return "the builder now keeps the GGUF's higher-precision tensors at 6 bits"
    return None


def built_formats(out: Path) -> tuple[str, str]:
    """(embedding, head) of a built checkpoint, read from its quantization config."""
    config = json.loads((Path(out) / "config.json").read_text())["quantization_config"]
    version = config.get("format_version")
    embedding = config.get("embedding", DEFAULT_EMBEDDING) if version and version >= 3 else "bf16"
    return embedding, "int4" if config.get("lm_head", True) else "bf16"


def source_ties_head(src: Path) -> bool:
    """Whether a Hugging Face checkpoint directory ties its head to its embedding (as read when building)."""
    try:
        config = json.loads((Path(src) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # refused later, with the reason
    return isinstance(config, dict) and bool(config.get("tie_word_embeddings", True))


def build_formats(src: Path, embedding: str | None, head: str | None) -> tuple[str, str]:
    """(embedding, head) a build of ``src`` writes: what was asked, else the source's defaults."""
    if src.suffix == ".gguf" and src.is_file():
        return default_formats(gguf_ties_head(src), embedding, head)
    if _source_model_type(src) in ENCODER_DECODER_MODEL_TYPES:
        return encoder_decoder_formats(_source_model_type(src), embedding, head)
    return default_formats(None, embedding, head, tied_head=source_ties_head(src))


def default_build_formats(src: Path) -> tuple[str, str]:
    """(embedding, head) that :func:`build_cpu_int4_checkpoint` chooses for ``src`` when asked nothing."""
    return build_formats(Path(src).expanduser(), None, None)


def _source_model_type(src: Path) -> str | None:
    """``model_type`` of a Hugging Face directory, or None (not one, unreadable: refused later)."""
    try:
        return json.loads((src / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def encoder_decoder_formats(model_type: str, embedding: str | None, head: str | None) -> tuple[str, str]:
    """(embedding, head) for a Whisper build.

    The token embedding 4-bit by default, the head tied to it (one copy); ``int8`` rows with a
    4-bit head of its own; ``bf16`` keeps the embedding as stored ("bf16" names that) with the
    head tied to it, unquantized. The head follows the embedding: a 4-bit head beside an
    embedding kept as stored is not offered.
    """
    embedding = DEFAULT_EMBEDDING if embedding is None else embedding
    check_embedding_format(embedding)
    follows = "bf16" if embedding == "bf16" else "int4"
    if head not in (None, follows):
        raise Int4FormatError(
            f"--head {head} with --embedding {embedding}: a {model_type} checkpoint's output head follows its "
            f"token embedding ({follows} here: tied to the embedding as stored with --embedding bf16, 4-bit "
            "otherwise); leave --head unset"
        )
    return embedding, follows


def check_head_format(head: str, embedding: str) -> None:
    if head not in HEAD_FORMATS:
        raise Int4FormatError(f"head {head!r} is not supported (supported: {', '.join(HEAD_FORMATS)})")
    if head == "bf16" and embedding != "bf16":
        raise Int4FormatError(
            f"a bf16 head needs a bf16 input embedding (got embedding {embedding!r}): the loader quantizes "
            "the embedding only together with a 4-bit head"
        )


def _read_source_config(src: Path) -> dict:
    config_path = src / "config.json"
    if not config_path.is_file():
        raise UnsupportedCheckpointError(f"{src} is not a Hugging Face checkpoint: no config.json")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedCheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedCheckpointError(
            f"model_type {model_type!r} is not supported by the cpu_int4 builder "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise UnsupportedCheckpointError(
            f"{src} is already quantized ({method}); start from bf16/fp16/fp32 weights"
        )
    return config


def _open_source_tensors(src: Path, stack: contextlib.ExitStack) -> dict[str, object]:
    """tensor name -> open safetensors handle holding it (closed with ``stack``)."""
    from safetensors import safe_open

    files = sorted(src.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in src.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {', '.join(other)}; only safetensors are read)" if other else ""
        raise UnsupportedCheckpointError(f"{src} has no *.safetensors weights{hint}")
    where: dict[str, object] = {}
    for path in files:
        try:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
        except Exception as exc:  # safetensors raises its own error types on bad headers
            raise UnsupportedCheckpointError(
                f"cannot read {path} (truncated or not safetensors?): {exc}"
            ) from exc
        for name in handle.keys():
            where[name] = handle
    return where


def _classify_kept(name: str, tensor: torch.Tensor) -> str:
    if name == EMBEDDING:
        return EMBEDDING_ROW
    if tensor.dim() == 1 and name.endswith("norm.weight"):
        return NORMS
    if tensor.dim() == 1 and name.endswith(".bias"):
        return BIASES
    if tensor.dim() >= 2:
        raise UnsupportedCheckpointError(
            f"tensor {name} {tuple(tensor.shape)} is neither a known linear layer nor the "
            "embedding; refusing to leave it unquantized silently"
        )
    return OTHER


def _build_from_hf_dir(src: Path, out: Path, group_size: int, progress: bool,
                       zero_point: str, embedding: str = DEFAULT_EMBEDDING, head: str = DEFAULT_HEAD,
                       grids: Path | None = None, promoted_bits: int = DEFAULT_PROMOTED_BITS) -> BuildReport:
    """``grids``: the source GGUF's grids file (``convert_gguf_to_hf(grids_out=...)``), if any."""
    config = _read_source_config(src)
    if config["model_type"] in ENCODER_DECODER_MODEL_TYPES:
        with contextlib.ExitStack() as stack:
            report, written, quantized_prefixes = _quantize_whisper_tensors(
                src, out, _open_source_tensors(src, stack), group_size, progress, zero_point, embedding
            )
        tied = embedding != "int8"  # int8: the head has its own 4-bit proj_out.*
        _write_checkpoint(src, out, config, group_size, zero_point, written, quantized_prefixes, embedding,
                          tied=tied, head=head, report=report)
        logger.info("wrote cpu_int4 checkpoint %s (%s; group size %d, %s zero points; %d linears 4-bit, "
                    "token embedding %s, head %s)", out, config["model_type"], group_size, zero_point,
                    report.tensors[LINEAR_4BIT], "as stored" if embedding == "bf16" else embedding,
                    "4-bit of its own" if not tied else "tied to it")
        return report
    with contextlib.ExitStack() as stack:
        grid_file = None
        if grids is not None:
            from safetensors import safe_open

            grid_file = stack.enter_context(safe_open(str(grids), framework="pt"))
        six_bit = set()
        if zero_point == "float" and group_size == DEFAULT_GROUP_SIZE:  # what the 6-bit kernels read
            six_bit = six_bit_modules(read_grid_types(grids) if grids is not None else None, promoted_bits)
        report, written, quantized_prefixes = _quantize_tensors(
            src, out, _open_source_tensors(src, stack), config, group_size, progress, zero_point, embedding, head,
            grid_file, six_bit=six_bit
        )
    if head == "bf16":
        tied = HEAD not in written  # the head is the stored embedding
    else:
        tied = embedding == "int4" and report.tensors.get(TIED_4BIT, 0) > 0
    _write_checkpoint(src, out, config, group_size, zero_point, written, quantized_prefixes, embedding, tied, head,
                      report=report)
    logger.info("wrote cpu_int4 checkpoint %s (group size %d, %s zero points, %s embedding, %s head%s; %d layers "
                "6-bit)", out, group_size, zero_point, embedding, head, ", tied" if tied else "",
                len(report.six_bit))
    return report


def _quantize_tensors(
    src: Path, out: Path, where: dict, config: dict, group_size: int, progress: bool,
    zero_point: str = DEFAULT_ZERO_POINT,
    embedding: str = DEFAULT_EMBEDDING,
    head: str = DEFAULT_HEAD,
    grids=None,
    six_bit: set[str] | frozenset[str] = frozenset(),
):
    """All output tensors in memory, and the report of what was done to each class.

    ``grids``: an open safetensors file of GGUF 4-bit grids by source tensor name, or None;
    ``six_bit``: module names to store with 6-bit codes (:func:`six_bit_modules`).
    """
    from tqdm import tqdm

    if HEAD in where:
        head_source = HEAD
    elif EMBEDDING in where and config.get("tie_word_embeddings", True):
        head_source = EMBEDDING  # tied: the head is the embedding matrix
    else:
        raise UnsupportedCheckpointError(
            f"{src} has no {HEAD} and does not tie it to {EMBEDDING}; cannot build the output head"
        )

    report = BuildReport(out=out, group_size=group_size, zero_point=zero_point, embedding=embedding, head=head)
    # Format 3: the embedding 4-bit; a tied matrix once, as the embedding (the head shares it at load).
    tied_int4 = embedding == "int4" and head_source == EMBEDDING
    written: dict[str, torch.Tensor] = {}
    quantized_prefixes: list[str] = []

    grid_names = set(grids.keys()) if grids is not None else set()

    def store_quantized(prefix: str, weight: torch.Tensor, row: str, source: str) -> None:
        grid = None
        if f"{source}.scale" in grid_names:
            grid = grids.get_tensor(f"{source}.scale"), grids.get_tensor(f"{source}.offset")
        _store_quantized(report, written, quantized_prefixes, prefix, weight, row, group_size, zero_point, grid,
                    six_bit=prefix in six_bit)

    names = sorted(n for n in where if n != HEAD)
    for name in tqdm(names, desc="cpu_int4 quantize", unit="tensor", disable=not progress):
        tensor = where[name].get_tensor(name)
        if LINEAR_WEIGHT.match(name) and tensor.dim() == 2:
            prefix = name.removesuffix(".weight")
            store_quantized(prefix, tensor, LINEAR_6BIT if prefix in six_bit else LINEAR_4BIT, name)
            continue
        if name == EMBEDDING and embedding == "int4":
            store_quantized(EMBEDDING_PREFIX, tensor, TIED_4BIT if tied_int4 else EMBEDDING_4BIT, name)
            continue
        if name == EMBEDDING and embedding == "int8":
            _store_int8_rows(report, written, EMBEDDING_PREFIX, tensor)
            continue
        if tensor.dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise Int4FormatError(f"{name}: dtype {tensor.dtype} is not supported (bf16, fp16, fp32)")
        row = _classify_kept(name, tensor)
        written[name] = tensor.contiguous()
        size = tensor.numel() * tensor.element_size()
        report.tensors[row] += 1
        report.source_bytes[row] += size
        report.written_bytes[row] += size
    if head == "bf16":
        if head_source == HEAD:  # untied: its own matrix, unchanged; tied: it is the stored embedding
            tensor = where[HEAD].get_tensor(HEAD)
            if tensor.dtype not in SUPPORTED_WEIGHT_DTYPES:
                raise Int4FormatError(f"{HEAD}: dtype {tensor.dtype} is not supported (bf16, fp16, fp32)")
            written[HEAD] = tensor.contiguous()
            report.tensors[HEAD_BF16] += 1
            report.source_bytes[HEAD_BF16] += tensor.numel() * tensor.element_size()
            report.written_bytes[HEAD_BF16] += tensor.numel() * tensor.element_size()
    elif not tied_int4:
        six_bit = six_bit if head_source == HEAD else six_bit - {"lm_head"}  # a copy of the embedding: 4-bit
        store_quantized("lm_head", where[head_source].get_tensor(head_source),
                   HEAD_6BIT if "lm_head" in six_bit else HEAD_4BIT, head_source)
    if head_source == EMBEDDING and not tied_int4 and head != "bf16":
        report.source_bytes[HEAD_4BIT] = 0  # tied: no separate bf16 head existed
    if not (report.tensors.get(LINEAR_4BIT) or report.tensors.get(LINEAR_6BIT)):
        raise UnsupportedCheckpointError(
            f"{src} has no tensors named like linear layers ({LINEAR_WEIGHT.pattern})"
        )
    return report, written, quantized_prefixes


def _store_quantized(report: BuildReport, written: dict, quantized_prefixes: list[str], prefix: str,
                weight: torch.Tensor, row: str, group_size: int, zero_point: str,
                grid: tuple[torch.Tensor, torch.Tensor] | None = None, six_bit: bool = False) -> None:
    """``grid``: the weight's own GGUF 4-bit grid (scale, offset per 32), used when it is this
    build's format (float offsets, groups of 32); the weight is then not re-quantized.
    ``six_bit``: a 6-bit layer (``int4.quantize_6bit``, a ``qweight_high`` plane beside the nibbles);
    a weight on its own 4-bit grid (the other parts of a merged layer) keeps the file's codes, their
    top bits 0."""
    g = group_size_for(weight.shape[1], group_size, what=prefix)
    if g != group_size:
        report.group_size_fallbacks[prefix] = g
    qweight_high = None
    if grid is not None and zero_point == "float" and g * grid[0].shape[-1] == weight.shape[1]:
        qweight, scales, zeros = quantize_on_grid(weight, *grid, what=prefix)
        if six_bit:
            qweight_high = torch.zeros(weight.shape[0], weight.shape[1] // 4, dtype=torch.uint8)
        report.on_gguf_grid[row] += 1
    elif six_bit:
        qweight, qweight_high, scales, zeros = quantize_6bit(weight, g, what=prefix)
    else:
        qweight, scales, zeros = quantize(weight, g, what=prefix, zero_point=zero_point)
    ref = weight.float()
    report._sq_err[row] += float((dequantize(qweight, scales, zeros, qweight_high=qweight_high) - ref).square().sum())
    report._sq_ref[row] += float(ref.square().sum())
    stored = {"qweight": qweight, "qweight_high": qweight_high, "scales": scales, "zeros": zeros}
    for suffix, t in stored.items():
        if t is not None:
            written[f"{prefix}.{suffix}"] = t
            report.written_bytes[row] += t.numel() * t.element_size()
    report.tensors[row] += 1
    report.source_bytes[row] += weight.numel() * weight.element_size()
    if six_bit:
        report.six_bit.append(prefix)
    quantized_prefixes.append(prefix)


def _store_int8_rows(report: BuildReport, written: dict, prefix: str, tensor: torch.Tensor) -> None:
    q, scales = quantize_rows_int8(tensor)
    ref = tensor.float()
    report._sq_err[EMBEDDING_INT8] += float((dequantize_rows_int8(q, scales) - ref).square().sum())
    report._sq_ref[EMBEDDING_INT8] += float(ref.square().sum())
    written[f"{prefix}.qweight"], written[f"{prefix}.scales"] = q, scales
    report.tensors[EMBEDDING_INT8] += 1
    report.source_bytes[EMBEDDING_INT8] += tensor.numel() * tensor.element_size()
    report.written_bytes[EMBEDDING_INT8] += q.numel() + scales.numel() * scales.element_size()


def _keep(report: BuildReport, written: dict, name: str, tensor: torch.Tensor, row: str) -> None:
    if tensor.dtype not in SUPPORTED_WEIGHT_DTYPES:
        raise Int4FormatError(f"{name}: dtype {tensor.dtype} is not supported (bf16, fp16, fp32)")
    written[name] = tensor.contiguous()
    size = tensor.numel() * tensor.element_size()
    report.tensors[row] += 1
    report.source_bytes[row] += size
    report.written_bytes[row] += size


def _quantize_whisper_tensors(src: Path, out: Path, where: dict, group_size: int, progress: bool,
                              zero_point: str = DEFAULT_ZERO_POINT, embedding: str = DEFAULT_EMBEDDING):
    """Whisper: its linears and (unless ``embedding`` is bf16) its token embedding quantized, the rest as
    stored, a zero bias beside each k projection; with int8 rows, a 4-bit head of its own."""
    from tqdm import tqdm

    head = "bf16" if embedding == "bf16" else "int4"
    report = BuildReport(out=out, group_size=group_size, zero_point=zero_point, embedding=embedding, head=head)
    written: dict[str, torch.Tensor] = {}
    quantized_prefixes: list[str] = []
    if WHISPER_EMBEDDING not in where:
        raise UnsupportedCheckpointError(f"{src} has no {WHISPER_EMBEDDING}; not a Whisper checkpoint")
    names = sorted(where)
    for name in tqdm(names, desc="cpu_int4 quantize", unit="tensor", disable=not progress):
        tensor = where[name].get_tensor(name)
        if name == WHISPER_HEAD:
            embedding = where[WHISPER_EMBEDDING].get_tensor(WHISPER_EMBEDDING)
            if not torch.equal(tensor, embedding):
                raise UnsupportedCheckpointError(
                    f"{src}: {WHISPER_HEAD} differs from {WHISPER_EMBEDDING}; vLLM's Whisper ties its head to "
                    "the token embedding and cannot load an untied one"
                )
            continue  # the tied copy: vLLM's loader drops it
        if WHISPER_LINEAR_WEIGHT.match(name) and tensor.dim() == 2:
            if tensor.dtype not in SUPPORTED_WEIGHT_DTYPES:
                raise Int4FormatError(f"{name}: dtype {tensor.dtype} is not supported (bf16, fp16, fp32)")
            prefix = name.removesuffix(".weight")
            _store_quantized(report, written, quantized_prefixes, prefix, tensor, LINEAR_4BIT, group_size, zero_point)
            if WHISPER_K_PROJ.search(prefix) and f"{prefix}.bias" not in where:
                bias = torch.zeros(tensor.shape[0], dtype=tensor.dtype)
                written[f"{prefix}.bias"] = bias
                report.tensors[ZERO_K_BIAS] += 1
                report.written_bytes[ZERO_K_BIAS] += bias.numel() * bias.element_size()
            continue
        if name == WHISPER_EMBEDDING and embedding != "bf16":
            if tensor.dtype not in SUPPORTED_WEIGHT_DTYPES:
                raise Int4FormatError(f"{name}: dtype {tensor.dtype} is not supported (bf16, fp16, fp32)")
            if embedding == "int4":  # one matrix: the head shares it at load
                _store_quantized(report, written, quantized_prefixes, WHISPER_EMBEDDING_PREFIX, tensor, TIED_4BIT,
                            group_size, zero_point)
            else:
                _store_int8_rows(report, written, WHISPER_EMBEDDING_PREFIX, tensor)
                _store_quantized(report, written, quantized_prefixes, WHISPER_HEAD_PREFIX, tensor, HEAD_4BIT,
                            group_size, zero_point)
                report.source_bytes[HEAD_4BIT] = 0  # tied in the source: no separate matrix existed
            continue
        row = next((r for pattern, r in WHISPER_KEPT if pattern.match(name)), None)
        _keep(report, written, name, tensor, row or _classify_kept(name, tensor))
    if not report.tensors.get(LINEAR_4BIT):
        raise UnsupportedCheckpointError(
            f"{src} has no tensors named like Whisper's linear layers ({WHISPER_LINEAR_WEIGHT.pattern})"
        )
    return report, written, quantized_prefixes


def _write_checkpoint(
    src: Path,
    out: Path,
    config: dict,
    group_size: int,
    zero_point: str,
    written: dict[str, torch.Tensor],
    quantized_prefixes: list[str],
    embedding: str = DEFAULT_EMBEDDING,
    tied: bool = False,
    head: str = DEFAULT_HEAD,
    report: BuildReport | None = None,
) -> None:
    from safetensors.torch import save_file

    version = format_version_for(embedding)
    out_config = dict(config)
    # Tied (format 3): the head shares the stored embedding. Otherwise vLLM's llama/qwen2
    # must build a head of its own and load lm_head.*.
    out_config["tie_word_embeddings"] = tied
    out_config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "bits": BITS,
        "group_size": group_size,
        "format_version": version,
        "lm_head": head == "int4",
        "zero_point": zero_point,
    }
    if version >= 3:
        out_config["quantization_config"]["embedding"] = embedding
    six_bit = sorted(report.six_bit) if report is not None else []
    if six_bit:
        out_config["quantization_config"]["six_bit"] = six_bit
    with atomic_directory(out) as tmp:
        save_file(
            written,
            str(tmp / OUTPUT_WEIGHTS),
            metadata={"format": "pt", "quant_method": QUANT_METHOD,
                      "format_version": str(version)},
        )
        (tmp / OUTPUT_WEIGHTS).chmod(0o644)  # safetensors creates it 0600
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2, sort_keys=True) + "\n")
        for path in sorted(src.iterdir()):
            if _is_copied_metadata(path):
                shutil.copy2(path, tmp / path.name)
        add_added_tokens(tmp)
        encoder_decoder = config.get("model_type") in ENCODER_DECODER_MODEL_TYPES
        info = {"quant_method": QUANT_METHOD, "format_version": version, "group_size": group_size,
                "zero_point": zero_point, "embedding": embedding, "head": head,
                "model_type": config.get("model_type"),
                "quantized_layers": sorted(quantized_prefixes)}
        if encoder_decoder and embedding == "bf16":
            info["embedding"] = "as stored"
            info["head"] = "tied to the token embedding, as stored"
        elif encoder_decoder:
            info["head"] = "int4, tied to the token embedding (one copy)" if tied else "int4, its own proj_out"
        if report is not None:
            info["gguf_grid_tensors"] = sum(report.on_gguf_grid.values())
            info["six_bit_layers"] = six_bit
            info["kept_unquantized"] = {row: n for row, n in sorted(report.tensors.items())
                                        if n and row not in (LINEAR_4BIT, HEAD_4BIT, EMBEDDING_4BIT, TIED_4BIT,
                                                             EMBEDDING_INT8)}
        write_manifest(tmp, [OUTPUT_WEIGHTS, "config.json"], info)
        _verify_written(tmp, quantized_prefixes, embedding, tied, head, six_bit=six_bit,
                        linear_pattern=WHISPER_LINEAR_WEIGHT if encoder_decoder else LINEAR_WEIGHT,
                        zero_k_bias=encoder_decoder,
                        embedding_prefix=WHISPER_EMBEDDING_PREFIX if encoder_decoder else EMBEDDING_PREFIX,
                        head_prefix=WHISPER_HEAD_PREFIX if encoder_decoder else "lm_head")


def _is_copied_metadata(path: Path) -> bool:
    """Tokenizer, chat template, generation config and the like."""
    return (
        path.is_file()
        and path.name not in _NOT_COPIED_NAMES
        and path.suffix not in _NOT_COPIED_SUFFIXES
    )


def _verify_written(directory: Path, quantized_prefixes: list[str], embedding: str = DEFAULT_EMBEDDING,
                    tied: bool = False, head: str = DEFAULT_HEAD, linear_pattern: re.Pattern = LINEAR_WEIGHT,
                    zero_k_bias: bool = False, embedding_prefix: str = EMBEDDING_PREFIX,
                    head_prefix: str = "lm_head", six_bit: list[str] = ()) -> None:
    """Re-read what was written: every linear layer, the head and (format 3) the embedding must be 4-bit
    (``six_bit`` layers: 6-bit, their top-bits plane [N, K/4] present)."""
    head_weight = f"{head_prefix}.weight"
    from safetensors import safe_open

    verify_manifest(directory)
    with safe_open(str(directory / OUTPUT_WEIGHTS), framework="pt") as f:
        names = set(f.keys())
        problems = []
        for prefix in quantized_prefixes:
            parts = [f"{prefix}.{s}" for s in ("qweight", "scales", "zeros")]
            if not all(p in names for p in parts):
                problems.append(f"{prefix}: missing {[p for p in parts if p not in names]}")
                continue
            if f"{prefix}.weight" in names:
                problems.append(f"{prefix}: a full-precision .weight is still present")
            qweight, scales, zeros = (f.get_tensor(p) for p in parts)
            try:
                check_triple(qweight, scales, zeros, prefix)
            except Int4FormatError as exc:
                problems.append(str(exc))
            if scales.dtype != SCALE_DTYPE:
                problems.append(f"{prefix}: scales are {scales.dtype}, expected {SCALE_DTYPE}")
            high = f"{prefix}.qweight_high"
            if (high in names) != (prefix in six_bit):
                problems.append(f"{prefix}: {'no' if prefix in six_bit else 'an unlisted'} top-bits plane")
            elif high in names and tuple(f.get_slice(high).get_shape()) != (qweight.shape[0], qweight.shape[1] // 2):
                problems.append(f"{prefix}: top-bits plane {f.get_slice(high).get_shape()} does not fit "
                                f"qweight {tuple(qweight.shape)}")
            if zero_k_bias and WHISPER_K_PROJ.search(prefix) and f"{prefix}.bias" not in names:
                problems.append(f"{prefix}: no bias (vLLM's fused projection would read uninitialised memory)")
        if tied:
            if any(n.startswith(f"{head_prefix}.") for n in names):
                problems.append(f"a tied head is stored as the embedding, but {head_prefix}.* tensors were written")
        elif head == "bf16":
            if head_weight not in names or f"{head_prefix}.qweight" in names:
                problems.append(f"the output head {head_prefix} is not stored bf16")
        elif f"{head_prefix}.qweight" not in names:
            problems.append(f"the output head {head_prefix} is not stored 4-bit")
        if embedding != "bf16" and (f"{embedding_prefix}.weight" in names
                                    or f"{embedding_prefix}.qweight" not in names):
            problems.append(f"the input embedding is not stored {embedding}")
        leftovers = [n for n in names if linear_pattern.match(n) or (n == head_weight and head != "bf16")]
        if leftovers:
            problems.append(f"full-precision linear weights left: {sorted(leftovers)[:5]}")
    if problems:
        raise CheckpointBuildError("the written checkpoint is not fully 4-bit: " + "; ".join(problems))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("src", help="bf16/fp16/fp32 Hugging Face checkpoint directory (a llama, mistral, qwen2/3 "
                        "or whisper model), or a .gguf file")
    parser.add_argument("out", help="directory to write (appears only when complete)")
    parser.add_argument(
        "--group-size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        choices=SUPPORTED_GROUP_SIZES,
        help="inputs per scale/zero point (default %(default)s; 128 saves 0.75 bit per weight "
        "at about twice the weight error; a layer whose K it does not divide uses the largest "
        "smaller size that does)",
    )
    parser.add_argument(
        "--zero-point",
        default=DEFAULT_ZERO_POINT,
        choices=ZERO_POINT_MODES,
        help="float: a bf16 offset per group (the group minimum, as GGUF Q4_1/Q4_K; near-lossless "
        "for weights that came from such a GGUF with --group-size 32); int: a 4-bit zero point "
        "(AWQ/GPTQ; needed by the W4A8 AMX kernel). Default: %(default)s",
    )
    parser.add_argument(
        "--embedding",
        default=None,
        choices=EMBEDDING_FORMATS,
        help="int4: the input embedding 4-bit too, a tied head sharing it (format 3); int8: int8 rows "
        "with a scale per row, a tied head given its own 4-bit copy (format 3); bf16: copied unchanged, "
        "a tied head given its own 4-bit copy (format 2). Default: int4, bf16 for a GGUF whose head is "
        "kept bf16; for a Whisper checkpoint int4 too (its head tied to it), bf16 keeping it as stored",
    )
    parser.add_argument(
        "--head",
        default=None,
        choices=HEAD_FORMATS,
        help="int4: the output head 4-bit; bf16: left unquantized (needs --embedding bf16; a tied head "
        f"stays tied to the bf16 embedding). Default: int4; {GGUF_TIED_HEAD} for a GGUF whose head is its "
        "embedding (unless --embedding int4/int8); a Whisper checkpoint's head follows its embedding",
    )
    parser.add_argument(
        "--promoted-bits",
        type=int,
        default=DEFAULT_PROMOTED_BITS,
        choices=PROMOTED_BITS,
        help="from a GGUF: 6 stores the linears and untied head the file keeps at more bits than its "
        "main type (a Q4_K_M's Q6_K attn_v, ffn_down, output) with 6-bit codes, 7 bits a weight instead of 4.6 "
        "for them, the rest of a merged q/k/v or gate/up layer too (with float zero points and group 32); "
        "4 stores them 4-bit like the rest. Default: %(default)s",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        report = build_cpu_int4_checkpoint(
            args.src, args.out, args.group_size, progress=not args.no_progress, overwrite=args.overwrite,
            zero_point=args.zero_point, embedding=args.embedding, head=args.head,
            promoted_bits=args.promoted_bits,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    print(report.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-omni-edge quantize",
        description="Write a cpu_int4 (4-bit weights) checkpoint that vLLM loads with no extra flags.",
    )
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
