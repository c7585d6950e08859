"""Whisper's vocabulary matrix in cpu_int4: a quantized token embedding, the tied head reading it.

What: wraps ``WhisperDecoder.__init__`` so that, when the model's quantization config is
cpu_int4 with a quantized input embedding (``"embedding": "int4"`` or ``"int8"``, format 3,
and a 4-bit head), ``embed_tokens`` is a ``VocabParallelEmbedding`` built with that config
(``CpuInt4EmbeddingMethod``) instead of vLLM's plain ``nn.Embedding``. vLLM's own
``WhisperForConditionalGeneration.__init__`` then ties ``proj_out`` to it through
``ParallelLMHead.tie_weights`` -> ``CpuInt4LinearMethod.tie_weights``: with an int4
embedding the head shares its triple, its kernel repacks it once and the lookup reads the
repacked bytes, so the matrix is resident once, 4-bit. With an int8 embedding the head keeps
its own 4-bit ``proj_out.*``, which vLLM's loader would drop (its name mapper maps
``proj_out.`` to nothing): the wrapped ``load_weights`` loads those tensors into the head
itself. Any other config (a float checkpoint, cpu_int4 format 2 with the embedding as
stored, another method) leaves Whisper exactly as vLLM builds it.
Why: vLLM's Whisper builds ``embed_tokens`` as a plain ``nn.Embedding`` no quantization
config sees, so a cpu_int4 Whisper kept the vocabulary matrix float (float32 on a CPU
without float16 arithmetic) and its tied head ran it through vLLM's unquantized path,
which on CPU prepacks a second float copy for oneDNN. The head is the largest matmul of a
decode step.
Verified by: tests/quantization/test_whisper_int4.py (a tiny random Whisper built by vLLM's
own classes, from a format-3 build and quantized at load: the embedding and head are the
cpu_int4 modules sharing one copy, lookups and logits equal the dequantized matrix's; the int8
build's own proj_out loaded; float and format-2 configs untouched; idempotent);
tests/e2e/test_whisper_int4_serve.py (whisper-base served: the fixtures within the float
bound, no float vocabulary matrix in the worker's evidence); docs/edge/speech.md.
Remove when: vLLM's Whisper builds its token embedding with the quantization config and
loads an untied ``proj_out`` when the config asks for one.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.model_executor.models.whisper"
HEAD_PREFIX = "proj_out."
MARKER = "__edge_whisper_int4_vocab__"

RECORD = PatchRecord(
    name="whisper_int4_vocab",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.WhisperDecoder.__init__, "
    f"{TARGET_MODULE}.WhisperForConditionalGeneration.load_weights",
    process=Process.WORKER,
    why="vLLM's Whisper builds its token embedding as a plain nn.Embedding no quantization "
    "config sees and drops proj_out.*, so a cpu_int4 Whisper kept its vocabulary matrix "
    "float, resident twice (the embedding and the tied head's oneDNN copy).",
    verified_by="tests/quantization/test_whisper_int4.py (tiny random Whisper through vLLM's "
    "classes: one 4-bit copy, logits equal the dequantized reference); "
    "tests/e2e/test_whisper_int4_serve.py; whisper-base cpu_int4 served on a 2-core Zen 4 "
    "EPYC, 2026-12-04 (ad hoc, niced, shared box; docs/edge/speech.md): worker weights 142 -> 52 MB, "
    "tree PSS 1,052-1,053 -> 853-872 MiB idle after the fixtures, the same transcripts; speech "
    "grid results/2026-12-04-speech-whisper-base-int4-epyc (quiet box): 1.30x / 1.24x "
    "faster-whisper int8 RTF at 1 / 4 streams, WER 7.5 %, 1,020 MiB.",
    remove_when="vLLM's Whisper builds embed_tokens with its quant_config (a "
    "VocabParallelEmbedding) and loads proj_out when it is not tied.",
    upstream="none found",
)


def quantized_vocab(quant_config) -> bool:
    """Whether this config stores Whisper's token embedding quantized (cpu_int4 format 3, a 4-bit head)."""
    from vllm_omni_edge.quantization.config import CpuInt4Config

    return (isinstance(quant_config, CpuInt4Config) and quant_config.embedding in ("int4", "int8")
            and quant_config.lm_head)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "cpu_int4 Whisper: quantized token embedding, head tied to it" + ("" if now else " (on import)")


def _wrap(module) -> None:
    wrap_method_once(module.WhisperDecoder, "__init__", _make_decoder_init, marker=MARKER)
    wrap_method_once(module.WhisperForConditionalGeneration, "load_weights", _make_load_weights, marker=MARKER)


def _make_decoder_init(original):
    def __init__(self, *, vllm_config, prefix: str = ""):
        original(self, vllm_config=vllm_config, prefix=prefix)
        quant_config = vllm_config.quant_config
        if not quantized_vocab(quant_config):
            return
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        config = vllm_config.model_config.hf_config
        # Replaces vLLM's nn.Embedding (lookups only; its padding_idx matters only to training).
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.d_model, quant_config=quant_config,
            prefix=f"{prefix}.embed_tokens",  # as vLLM names the decoder's other layers
        )

    return __init__


def _own_quantized_head(model) -> bool:
    """A cpu_int4 head with tensors of its own (not tied to a 4-bit embedding): it loads ``proj_out.*``."""
    from vllm_omni_edge.quantization.linear import CpuInt4LinearMethod

    method = getattr(getattr(model, "proj_out", None), "quant_method", None)
    return (isinstance(method, CpuInt4LinearMethod) and method.prequantized
            and method.tied_embedding is None and "qweight" in model.proj_out._parameters)


def _make_load_weights(original):
    def load_weights(self, weights):
        if not _own_quantized_head(self):
            return original(self, weights)
        head = self.proj_out
        params = dict(head.named_parameters())
        loaded: set[str] = set()

        def the_rest():
            for name, tensor in weights:
                if not name.startswith(HEAD_PREFIX):
                    yield name, tensor
                    continue
                local = name.removeprefix(HEAD_PREFIX)
                if local not in params:
                    raise KeyError(f"{name}: the cpu_int4 head {HEAD_PREFIX.rstrip('.')} has no parameter "
                                   f"{local!r} (it has {sorted(params)})")
                param = params[local]
                param.weight_loader(param, tensor)
                loaded.add(name)

        return set(original(self, the_rest())) | loaded

    return load_weights
