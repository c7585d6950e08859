"""``CpuInt4Config``: what a cpu_int4 checkpoint (or request) says, and which layers it covers.

Read from ``config.json``::

    "quantization_config": {"quant_method": "cpu_int4", "bits": 4, "group_size": 32,
                            "format_version": 3, "lm_head": true, "zero_point": "float",
                            "embedding": "int4"}

``"six_bit": [module names]`` (optional, float offsets) lists the layers stored with 6-bit
codes (``int4.quantize_6bit``: a GGUF's tensors kept at more bits than its main type); a
merged layer (q/k/v, gate/up) is 6-bit when any of its parts is listed, and the builder lists
all of them. Format 3 stores the input embedding 4-bit (``embedding.py``); format 2 checkpoints
keep it bf16 and format 1 ones (``"zero_point": true``) hold integer zero points;
both still load. With no ``quantization_config`` and ``quantization="cpu_int4"``,
vLLM builds ``CpuInt4Config()`` and the bf16 weights are quantized at load (group
32, float zero points, head and input embedding included: what format 3 stores).
Other online settings go through
``hf_overrides={"quantization_config_dict_json": '{"group_size": 128, "embedding": "bf16"}'}``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from vllm_omni_edge.log import get_logger
from vllm_omni_edge.quantization import evidence
from vllm_omni_edge.quantization.int4 import (
    BITS,
    DEFAULT_EMBEDDING,
    ENCODER_DECODER_MODEL_TYPES,
    TIED_HEAD_EMBEDDING,
    DEFAULT_GROUP_SIZE,
    DEFAULT_ZERO_POINT,
    READABLE_FORMAT_VERSIONS,
    ZERO_POINT_MODES,
    Int4FormatError,
    check_embedding_format,
    check_group_size,
    check_zero_point,
    group_size_for,
)
from vllm_omni_edge.quantization.embedding import CpuInt4EmbeddingMethod
from vllm_omni_edge.quantization.linear import CpuInt4LinearMethod
from vllm_omni_edge.quantization.manifest import MANIFEST_NAME, verify_manifest

QUANT_METHOD = "cpu_int4"
logger = get_logger("cpu_int4")


@register_quantization_config(QUANT_METHOD)
class CpuInt4Config(QuantizationConfig):
    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE, lm_head: bool = True, prequantized: bool = False,
                 zero_point: str = DEFAULT_ZERO_POINT, embedding: str | None = None,
                 six_bit: tuple[str, ...] = ()):
        super().__init__()
        check_group_size(group_size)
        check_zero_point(zero_point)
        # Online and not asked: chosen from the model's config (maybe_update_config), as the builder does.
        self.embedding_asked = embedding is not None
        embedding = DEFAULT_EMBEDDING if embedding is None else embedding
        check_embedding_format(embedding)
        self.group_size = group_size
        self.zero_point = zero_point
        self.lm_head = lm_head
        # The input embedding: "int4" (format 3, online default), "int8" (format 3) or "bf16" (formats 1-2).
        self.embedding = embedding
        # True when the checkpoint already holds qweight/scales/zeros.
        self.prequantized = prequantized
        if six_bit and (not prequantized or zero_point != "float"):
            raise Int4FormatError("quantization_config six_bit: 6-bit layers are stored pre-quantized "
                                  "with float offsets")
        self.six_bit = frozenset(six_bit)  # module names as stored ("model.layers.0.mlp.down_proj")

    def __repr__(self) -> str:
        return (
            f"CpuInt4Config(group_size={self.group_size}, lm_head={self.lm_head}, "
            f"prequantized={self.prequantized}, zero_point={self.zero_point!r}, embedding={self.embedding!r}, "
            f"six_bit={len(self.six_bit)} layers)"
        )

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # The dequant fallback runs any float dtype; tinygemm takes all three.
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1  # CPU: vLLM skips the check (no device capability)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # an empty list makes vLLM call CpuInt4Config() for online use

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CpuInt4Config":
        def bad(msg: str) -> Int4FormatError:
            return Int4FormatError(f"quantization_config for {QUANT_METHOD}: {msg}")

        if config.get("quant_method") != QUANT_METHOD:
            raise bad(f"quant_method is {config.get('quant_method')!r}")
        if config.get("bits", BITS) != BITS:
            raise bad(f"bits={config.get('bits')} (only {BITS} is supported)")
        version = config.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS:
            raise bad(
                f"format_version={version!r}; this plugin reads versions "
                f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}. Rebuild the checkpoint with "
                "`vllm-omni-edge quantize`."
            )
        zero_point = config.get("zero_point", True if version == 1 else None)
        if version == 1:
            if zero_point is not True:
                raise bad("format_version 1 stores integer zero points: zero_point must be true")
            zero_point = "int"
        elif zero_point not in ZERO_POINT_MODES:
            raise bad(f"zero_point={zero_point!r}; expected one of {', '.join(ZERO_POINT_MODES)}")
        if "group_size" not in config:
            raise bad("group_size is missing")
        embedding = config.get("embedding", "int4") if version >= 3 else "bf16"
        if version >= 3 and embedding not in ("int4", "int8"):
            raise bad(f"embedding={embedding!r}; format_version {version} stores it int4 or int8")
        six_bit = config.get("six_bit", [])
        if not isinstance(six_bit, list) or not all(isinstance(n, str) and n for n in six_bit):
            raise bad(f"six_bit must be a list of module names, got {six_bit!r}")
        if six_bit and zero_point != "float":
            raise bad("six_bit layers need float offsets (zero_point: float)")
        return cls(int(config["group_size"]), bool(config.get("lm_head", True)), prequantized=True,
                   zero_point=zero_point, embedding=embedding, six_bit=tuple(six_bit))

    @classmethod
    def from_config_dict_json(cls, config_json: str) -> "CpuInt4Config":
        """Online quantization settings from ``hf_overrides``."""
        settings = json.loads(config_json)
        return cls(int(settings.get("group_size", DEFAULT_GROUP_SIZE)), bool(settings.get("lm_head", True)),
                   zero_point=settings.get("zero_point", DEFAULT_ZERO_POINT),
                   embedding=settings.get("embedding"))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        if hf_quant_cfg.get("quant_method") == QUANT_METHOD and user_quant in (None, QUANT_METHOD):
            return QUANT_METHOD
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None):
        # Runs once, in the front end, before any worker reads the weights.
        if not self.prequantized:
            text_config = getattr(hf_config, "get_text_config", lambda: hf_config)() if hf_config else None
            if (not self.embedding_asked and text_config is not None and self.lm_head
                    and getattr(text_config, "tie_word_embeddings", False)
                    and getattr(hf_config, "model_type", None) not in ENCODER_DECODER_MODEL_TYPES):
                self.embedding = TIED_HEAD_EMBEDDING  # the builder's default for a tied head
            return
        if not os.path.isdir(model_name):
            return
        if verify_manifest(model_name) is None:
            logger.warning(
                "cpu_int4 checkpoint %s has no %s; its files cannot be checked for "
                "truncation or modification",
                model_name,
                MANIFEST_NAME,
            )

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, ParallelLMHead):
            if not self.lm_head:
                return None  # vLLM's unquantized head
            kind, in_features = "lm_head", layer.embedding_dim
        elif isinstance(layer, VocabParallelEmbedding):
            # The input embedding. 4-bit only with a 4-bit head: a tied bf16 head needs the bf16 table.
            if self.embedding == "bf16" or not self.lm_head:
                return None
            kind, in_features = "embedding", layer.embedding_dim
            prefix = prefix or "embed_tokens"  # llama builds it without a prefix
        elif isinstance(layer, LinearBase):
            kind, in_features = "linear", layer.input_size
        else:
            return None  # attention, MoE: unquantized
        if not self.prequantized:
            try:
                group_size_for(in_features, self.group_size, what=prefix)
            except Int4FormatError as exc:
                logger.warning("cpu_int4: leaving %s unquantized: %s", prefix, exc)
                evidence.record(
                    evidence.LayerChoice(prefix, kind, "unquantized", str(exc), in_features, -1, None)
                )
                return UnquantizedLinearMethod() if kind == "linear" else None
        evidence.expect(prefix)
        if kind == "embedding":
            return CpuInt4EmbeddingMethod(self.group_size, self.prequantized, prefix, self.zero_point,
                                          fmt=self.embedding)
        return CpuInt4LinearMethod(self.group_size, self.prequantized, kind, prefix, self.zero_point,
                                   six_bit=self.is_six_bit(prefix))

    def is_six_bit(self, prefix: str) -> bool:
        """Whether the checkpoint stores the layer at ``prefix`` 6-bit: its own name listed, or for a
        merged layer (vLLM's ``packed_modules_mapping``, e.g. qkv_proj: q/k/v_proj) any part's."""
        if not self.six_bit:
            return False
        parent, _, name = prefix.rpartition(".")
        parts = (getattr(self, "packed_modules_mapping", None) or {}).get(name, [name])
        return prefix in self.six_bit or any((f"{parent}.{part}" if parent else part) in self.six_bit
                                             for part in parts)
