"""The Hugging Face processors vLLM builds share one tokenizer instead of loading their own.

What: wraps transformers' ``ProcessorMixin._load_tokenizer_from_pretrained`` (the step of
``ProcessorMixin.from_pretrained`` that loads a processor's tokenizer). For a processor's
primary tokenizer it returns the tokenizer the caller passed as ``tokenizer=``; when none was
passed, the one a processor of the same directory (path, subfolder, revision) already got in
this process, or the tokenizer vLLM itself loaded from that directory (``CachedHfTokenizer.
from_pretrained`` is wrapped to note it). So a directory's tokenizer is read once. Other
sub-tokenizers (``decoder_tokenizer``, ...) load as before.
Why: vLLM caches every processor it builds (``cached_get_processor``) and builds some without
a tokenizer: the one that finds a processor's dynamic kwargs, the chat template's. Each of those
read the tokenizer files again and kept its copy: a Whisper server held three tokenizers besides
vLLM's own. Where vLLM does pass its tokenizer, transformers uses it but first loads another and
drops it.
Flag: ``VLLM_OMNI_EDGE_PROCESSOR_TOKENIZER=0`` keeps transformers' loading (the A/B arm).
Verified by: tests/test_processor_tokenizer.py (a processor gets the tokenizer passed in; a
second processor of the directory gets the first one's; other directories and sub-tokenizers
load their own; the flag; idempotent); evidence ``processor_tokenizers`` (tokenizers loaded
and reused by processors) in the process record; the speech grid's PSS.
Remove when: vLLM builds every processor with its tokenizer and transformers stops loading one
it was given.
"""

from __future__ import annotations

import threading

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_classmethod_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "transformers.processing_utils"
VLLM_TOKENIZERS = "vllm.tokenizers.hf"
METHOD = "_load_tokenizer_from_pretrained"
MARKER = "__edge_processor_tokenizer__"

RECORD = PatchRecord(
    name="processor_tokenizer",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.ProcessorMixin.{METHOD} (called by ProcessorMixin.from_pretrained); "
    f"{VLLM_TOKENIZERS}.CachedHfTokenizer.from_pretrained",
    process=Process.FRONTEND,  # processors live where requests are rendered: LLM(), the API server
    why="vLLM caches every HF processor it builds and builds some without its tokenizer, so each "
    "of those loads and keeps a tokenizer copy (and a passed one is loaded in vain first).",
    verified_by="tests/test_processor_tokenizer.py; evidence processor_tokenizers; the speech grid's PSS.",
    remove_when="vLLM builds every processor with its tokenizer and transformers stops loading "
    "one it was given.",
    upstream="none found",
)

_lock = threading.Lock()
# (path, subfolder, revision) -> the tokenizer processors of that directory share.
_shared: dict[tuple[str, str, str | None], object] = {}
# Evidence: tokenizers processors loaded from files, and loads answered with a tokenizer
# already in memory (passed in, or an earlier processor's).
counts = {"loaded": 0, "passed_in": 0, "reused": 0}


def record() -> dict[str, int]:
    return dict(counts)


def _key(path, subfolder, revision) -> tuple[str, str, str]:
    # vLLM's processor loader passes revision "main" where its tokenizer loader passes None.
    return str(path), str(subfolder or ""), revision or "main"


def _note_vllm_tokenizer(path, revision, tokenizer) -> None:
    with _lock:
        _shared.setdefault(_key(path, "", revision), tokenizer)


def _wrap_vllm(module) -> None:
    def make(load):
        def from_pretrained(cls, path_or_repo_id, *args, revision=None, **kwargs):
            tokenizer = load(cls, path_or_repo_id, *args, revision=revision, **kwargs)
            if not args and not kwargs.get("subfolder"):
                _note_vllm_tokenizer(path_or_repo_id, revision, tokenizer)
            return tokenizer

        return from_pretrained

    wrap_classmethod_once(module.CachedHfTokenizer, "from_pretrained", make, MARKER)


def _wrap(module) -> None:
    def make(load):
        def _load_tokenizer_from_pretrained(cls, sub_processor_type, pretrained_model_name_or_path,
                                            subfolder="", **kwargs):
            if sub_processor_type != "tokenizer":
                return load(cls, sub_processor_type, pretrained_model_name_or_path, subfolder, **kwargs)
            from transformers import PreTrainedTokenizerBase

            key = _key(pretrained_model_name_or_path, subfolder, kwargs.get("revision"))
            given = kwargs.get("tokenizer")
            with _lock:
                if isinstance(given, PreTrainedTokenizerBase):
                    _shared.setdefault(key, given)
                    counts["passed_in"] += 1
                    return given
                if key in _shared:
                    counts["reused"] += 1
                    return _shared[key]
            tokenizer = load(cls, sub_processor_type, pretrained_model_name_or_path, subfolder, **kwargs)
            with _lock:
                counts["loaded"] += 1
                return _shared.setdefault(key, tokenizer)

        return _load_tokenizer_from_pretrained

    try:
        wrap_classmethod_once(module.ProcessorMixin, METHOD, make, MARKER)
    except TypeError as exc:
        from vllm_omni_edge.log import get_logger

        get_logger("processor_tokenizer").warning("%s: processors load their own tokenizers", exc)


def apply() -> str:
    from vllm_omni_edge.levers import processor_tokenizer_shared

    if not processor_tokenizer_shared():
        return "VLLM_OMNI_EDGE_PROCESSOR_TOKENIZER=0: transformers loads each processor's tokenizer"
    now = when_imported(TARGET_MODULE, _wrap)
    when_imported(VLLM_TOKENIZERS, _wrap_vllm)
    return "processors share the tokenizer vLLM passes them" + ("" if now else " (on import)")
